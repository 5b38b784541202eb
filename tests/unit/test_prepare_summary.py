"""prepare/summary.py in-process: counts over every file of SRC (earlier runs' too), speeds over
this run's work only, the exit status from the outcomes, problem files (sorted, each saying what
DST holds), the mirror's lists, text that lists at most TEXT_PROBLEMS per list while the JSON
report lists all, and JSON that survives a round trip. Records come from a real manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from batchwire.prepare.checksum_manifest import (
    CHECKSUMMED,
    COPIED,
    CORRUPT,
    FAILED,
    REWRITTEN,
    TOO_LARGE,
    UNVERIFIED,
    Header,
    Record,
    Writer,
    load,
)
from batchwire.prepare.mirror import Mirror
from batchwire.prepare.restarts import AUTO, AUTO_MOST
from batchwire.prepare.summary import (
    EXIT_CORRUPT,
    EXIT_INCOMPLETE,
    EXIT_OK,
    TEXT_PROBLEMS,
    Summary,
    interval_text,
    is_problem,
    problem_line,
)


def rec(path: str, outcome: str, bytes_in: int = 100, bytes_out: int = 100, **kw) -> Record:
    return Record(path, bytes_in, 1, outcome, bytes_in, bytes_out, 8, **kw)


def summary(*records: tuple[Record, bool], **kw) -> Summary:
    s = Summary("src", "dst", 8, jobs=4, **kw)
    for r, skipped in records:
        s.add(r, skipped)
    return s


def test_counts_bytes_and_speed_from_a_real_manifest(tmp_path: Path) -> None:
    """A rerun: records read back from a real manifest count as skipped, not as this run's."""
    path = tmp_path / "m.jsonl"
    writer = Writer(path, Header("tree", ("a",)))
    earlier = [rec("a/1.jpg", REWRITTEN, 1000, 1010), rec("a/2.png", COPIED, 50, 50)]
    for r in earlier:
        writer.append(r)
    writer.close()
    s = Summary("src", "dst", 8, jobs=4, cores=2, seconds=2.0)
    for r in load(path).records.values():
        s.add(r, True)
    s.add(rec("a/3.jpg", REWRITTEN, 3000, 2990), False)
    s.add(rec("a/4.jpg", REWRITTEN, 1000, 1000), False)
    assert s.counts[REWRITTEN] == 3 and s.counts[COPIED] == 1 and s.skipped == 2
    assert s.jpeg_bytes() == (5000, 5000)
    assert s.speed() == (2, 1.0, 0.5)  # this run's 2 files in 2 s on 2 cores
    doc = s.to_json()
    assert doc["files_seen"] == 4 and doc["files_worked"] == 2 and doc["skipped"] == 2
    assert doc["jpeg_bytes_change_percent"] == 0.0 and doc["exit_status"] == EXIT_OK
    assert json.loads(json.dumps(doc)) == doc


def test_no_time_and_no_jpegs_divide_by_nothing() -> None:
    s = summary((rec("x.bin", COPIED), False))
    assert s.speed() == (1, 0.0, 0.0)
    doc = s.to_json()
    assert doc["jpeg_bytes_change_percent"] is None and doc["files_per_s"] == 0.0
    assert "rewritten JPEG bytes    0.0 MB -> 0.0 MB\n" in s.text() + "\n"
    s.cores = 0
    assert s.speed() == (1, 0.0, 0.0)


@pytest.mark.parametrize(
    ("outcomes", "interrupted", "status"),
    [
        ([REWRITTEN, COPIED, UNVERIFIED, TOO_LARGE], False, EXIT_OK),
        ([REWRITTEN, CORRUPT], False, EXIT_CORRUPT),
        ([CORRUPT, FAILED], False, EXIT_INCOMPLETE),
        ([REWRITTEN], True, EXIT_INCOMPLETE),
        ([CHECKSUMMED], False, EXIT_OK),
    ],
)
def test_exit_status(outcomes: list[str], interrupted: bool, status: int) -> None:
    s = summary(*[(rec(f"{i}.jpg", o), False) for i, o in enumerate(outcomes)])
    s.interrupted = interrupted
    assert s.exit_status == status == s.to_json()["exit_status"]


def test_checksums_only_a_refused_jpeg_is_a_corrupt_exit() -> None:
    s = summary(
        (rec("ok.jpg", CHECKSUMMED, intact=True, checksum="xxh3_64:00"), False),
        (rec("bad.jpg", CHECKSUMMED, intact=False, error="not intact: bad Huffman code"), False),
        (rec("note.txt", CHECKSUMMED, intact=False), False),  # not a JPEG: no problem
        checksums_only=True,
    )
    assert s.not_intact == 1 and s.exit_status == EXIT_CORRUPT
    doc = s.to_json()
    assert doc["checksummed"] == 3 and doc["intact"] == 1
    assert doc["problems"] == [
        {"path": "bad.jpg", "outcome": CHECKSUMMED, "error": "not intact: bad Huffman code"}
    ]
    text = s.text()
    assert text.startswith("pipeline-prepare --checksums-only: src -> dst")
    assert "  corrupt JPEGs                   1" in text
    assert "JPEGs rewritten" not in text


def test_problems_sorted_and_saying_what_dst_holds() -> None:
    s = summary(
        (rec("z.jpg", FAILED, error="Permission denied"), False),
        (rec("b.jpg", CORRUPT, error="bad marker"), True),
        (rec("a.jpg", TOO_LARGE, error="50000x50000"), False),
        (rec("m.jpg", UNVERIFIED, error="coefficients differ"), False),
        (rec("ok.jpg", REWRITTEN), False),
        (rec("c.bin", COPIED), False),
    )
    assert [r.path for r in s.problems] == ["a.jpg", "b.jpg", "m.jpg", "z.jpg"]
    assert not is_problem(rec("ok.jpg", REWRITTEN))
    assert problem_line(rec("z.jpg", FAILED, error="EIO")) == "failed: z.jpg: EIO (not in DST)"
    assert problem_line(rec("b.jpg", CORRUPT, error="x")).endswith("(copied as it was)")
    assert "(not verified: copied as it was)" in problem_line(rec("m", UNVERIFIED))
    assert "--max-pixels" in problem_line(rec("a", TOO_LARGE))
    text = s.text()
    assert "problem files (4):\n  too_large: a.jpg: 50000x50000" in text
    assert "  failed (not in DST)             1" in text
    assert "  skipped (done before)           1" in text


def test_long_lists_are_cut_in_text_and_whole_in_json() -> None:
    n = TEXT_PROBLEMS + 7
    s = summary(*[(rec(f"bad/{i:03d}.jpg", CORRUPT, error="e"), False) for i in range(n)])
    s.mirror = Mirror(
        removed=[f"gone/{i:03d}" for i in range(n)],
        removed_dirs=["gone"],
        kept=[("kept.jpg", "changed since pipeline-prepare wrote it")],
        foreign=["mine/", "notes.txt"],
    )
    s.report_path = "dst/.batchwire-prepare-report.json"
    text = s.text()
    assert f"problem files ({n}):" in text and "  ... and 7 more" in text
    assert f"bad/{TEXT_PROBLEMS - 1:03d}.jpg" in text and f"bad/{TEXT_PROBLEMS:03d}" not in text
    assert f"removed from DST (SRC no longer has them) ({n + 1}):" in text
    assert "  ... and 8 more" in text
    assert "kept.jpg: changed since pipeline-prepare wrote it" in text
    assert "in DST but never written by pipeline-prepare (kept) (2):\n  mine/\n  notes.txt" in text
    assert text.endswith("full report: dst/.batchwire-prepare-report.json")
    doc = s.to_json()
    assert len(doc["problems"]) == n and len(doc["removed"]) == n
    assert doc["removed_dirs"] == ["gone"] and doc["foreign"] == ["mine/", "notes.txt"]
    assert doc["kept_gone"] == [
        {"path": "kept.jpg", "why": "changed since pipeline-prepare wrote it"}
    ]
    assert doc["exit_status"] == EXIT_CORRUPT  # the mirror's lists never change it


def test_empty_lists_and_flags_in_text() -> None:
    s = summary((rec("a.jpg", REWRITTEN), False), list_file_written=False)
    s.interrupted = True
    s.notes = ["SRC has no class folders"]
    text = s.text()
    assert "the list file was NOT written to DST" in text
    assert "interrupted: rerun the same command to finish" in text
    assert "  note: SRC has no class folders" in text
    assert "problem files" not in text and "removed from DST" not in text
    assert "full report" not in text
    assert summary(list_file_written=None).to_json()["list_file_written"] is None


def test_odd_paths_survive_json_and_text() -> None:
    odd = "cls/nl\nname ünï \udcff.jpg"  # a newline and an undecodable byte in a name
    s = summary((rec(odd, CORRUPT, error="bad"), False))
    doc = json.loads(json.dumps(s.to_json()))
    assert doc["problems"][0]["path"] == odd
    assert odd in s.text()


def test_interval_text() -> None:
    assert interval_text(1) == "a restart marker every 1 MCU"
    assert interval_text(8) == "a restart marker every 8 MCUs"
    assert (
        interval_text(AUTO)
        == f"a restart marker every 1 to {AUTO_MOST} MCUs, dividing each file's rows"
    )
    assert summary().text().startswith("pipeline-prepare: src -> dst (a restart marker every 8")
