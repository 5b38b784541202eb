"""Integrity checksums (pipeline/checksums.py): manifests read defensively, aligned with a
dataset's indices, found where pipeline-prepare writes them; and a bit flip that every decoder
accepts is counted bad and replaced by LocalLoader, on a prepared dataset and on a
checksums-only one (and goes unseen without the checksums: the control).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from batchwire.native.build import cache_root
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.checksums import (
    CHECKSUMS_MANIFEST,
    PREPARE_MANIFEST,
    ChecksumManifestError,
    checksum,
    keyed_name,
    load_checksums,
    parse_checksum,
    read_checksum_manifest,
    shared_folder,
)
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.samples import LoadedSample, SampleLoader
from batchwire.prepare.run import Options, run
from bitflips import clean_bit_flip, photos
from corrupt_corpus import strict_rejects
from dht_damage import dht_damaged, restart_marked


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def line(path: str, data: bytes, **extra: object) -> str:
    record = {"path": path, "bytes_out": len(data), "checksum": checksum(data), **extra}
    return json.dumps(record) + "\n"


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        write(root / rel, data)
    return root


def test_checksum_text_round_trips_and_unknown_ones_are_refused() -> None:
    text = checksum(b"abc")
    assert text.startswith("xxh3_64:") and len(text) == len("xxh3_64:") + 16
    assert parse_checksum(text) == int(text.split(":")[1], 16)
    for bad in ("crc32c:0000000000000000", "xxh3_64:xyz", "xxh3_64:00", 7, None, "", ["x"]):
        assert parse_checksum(bad) is None, bad


def test_a_hostile_or_truncated_manifest_gives_its_good_lines_only(tmp_path: Path) -> None:
    good = line("a/x.jpg", b"xx") + line("a/y.jpg", b"yyy", size=99)
    junk = [
        "not json at all\n",
        "[1, 2, 3]\n",
        '"a string"\n',
        json.dumps({"path": 5, "bytes_out": 1, "checksum": checksum(b"x")}) + "\n",
        json.dumps({"path": "b.jpg", "bytes_out": -1, "checksum": checksum(b"x")}) + "\n",
        json.dumps({"path": "c.jpg", "bytes_out": True, "checksum": checksum(b"x")}) + "\n",
        json.dumps({"path": "d.jpg", "bytes_out": 1, "checksum": "md5:abc"}) + "\n",
        json.dumps({"path": "e.jpg", "bytes_out": "1", "checksum": checksum(b"x")}) + "\n",
        "\x00\xff\xfe binary\n",
    ]
    header = json.dumps({"source": "tree", "dirs": ["a"]}) + "\n"
    no_checksum = json.dumps({"path": "f.jpg", "bytes_out": 3}) + "\n"  # an old manifest's
    text = header + good + "".join(junk) + no_checksum + '{"finished": true}\n'
    path = tmp_path / "m.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogateescape") + b'{"path":"a/z.jp')  # cut short
    got = read_checksum_manifest(path, 1 << 20)
    assert sorted(got.entries) == ["a/x.jpg", "a/y.jpg"]
    assert got.entries["a/y.jpg"].size == 3  # bytes_out (what is in the folder) wins over size
    # Skipped: what is not JSON (2 lines and the cut-short one) and the 5 broken records;
    # JSON that is no object, and a record without a checksum, are no records to check.
    assert got.skipped == 8
    with pytest.raises(ValueError, match="more than"):
        read_checksum_manifest(path, 100)


def test_open_dataset_aligns_checksums_with_indices(tmp_path: Path) -> None:
    files = {"cat/1.jpg": b"one", "cat/2.jpg": b"two!", "dog/3.jpg": b"three"}
    root = tree(tmp_path / "data", files)
    (root / PREPARE_MANIFEST).write_text(
        line("cat/1.jpg", b"one") + line("dog/3.jpg", b"THREE") + line("gone.jpg", b"x")
    )
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    assert ds.checksums is not None and ds.checksums.count == 2
    by_name = {Path(p).name: i for i, p in enumerate(ds.paths)}
    assert ds.checksum_problem(by_name["1.jpg"], b"one") is None
    assert ds.checksum_problem(by_name["2.jpg"], b"anything") is None  # not recorded
    assert "differ" in (ds.checksum_problem(by_name["3.jpg"], b"three") or "")
    assert "bytes read" in (ds.checksum_problem(by_name["1.jpg"], b"one!") or "")
    off = open_dataset(root, cache_dir=tmp_path / "cache", verify_checksums="off")
    assert off.checksums is None and off.checksum_problem(0, b"x") is None


def test_list_file_manifests_and_a_manifest_folder(tmp_path: Path) -> None:
    data = tree(tmp_path / "data", {"x/a.jpg": b"aaaa", "y/b.jpg": b"bbbb"})
    listing = write(data / "train.txt", b"x/a.jpg 0\ny/b.jpg 1\n")
    (data / CHECKSUMS_MANIFEST).write_text(line("x/a.jpg", b"aaaa"))
    ds = open_dataset(listing)
    assert ds.checksums is not None and ds.checksums.count == 1
    # A manifest in a folder given, named after the dataset, newer: it wins where both speak.
    elsewhere = tmp_path / "sums"
    write(elsewhere / keyed_name(listing), line("x/a.jpg", b"AAAA").encode())
    later = os.stat(data / CHECKSUMS_MANIFEST).st_mtime_ns + 10**9
    os.utime(elsewhere / keyed_name(listing), ns=(later, later))
    ds = open_dataset(listing, checksum_dirs=[elsewhere])
    assert ds.checksums is not None and ds.checksum_problem(0, b"aaaa") is not None
    assert ds.checksum_problem(0, b"AAAA") is None
    assert keyed_name(listing) != keyed_name(data / "val.txt")


def test_a_list_kept_apart_from_its_files_reads_the_manifest_beside_them(tmp_path: Path) -> None:
    # pipeline-prepare SRC DST, then a list file elsewhere naming DST's files (what
    # pipeline-prepare suggests for a flat folder): DST's records apply, intact ones too.
    dst = tree(tmp_path / "dst", {"a.jpg": b"aaaa", "sub/b.jpg": b"bbbb", "c.jpg": b"cccc"})
    (dst / PREPARE_MANIFEST).write_text(
        line("a.jpg", b"aaaa", intact=True) + line("sub/b.jpg", b"bbbb")
    )
    lists = tmp_path / "lists"
    names = [dst / "a.jpg", dst / "sub/b.jpg", dst / "c.jpg"]
    listing = write(lists / "train.txt", "".join(f"{p} 0\n" for p in names).encode())
    ds = open_dataset(listing, allow_outside_root=True)
    assert ds.checksums is not None and ds.checksums.count == 2
    assert ds.checksums.verdict(0, b"aaaa").intact and not ds.checksums.verdict(1, b"bbbb").intact
    assert "differ" in (ds.checksum_problem(0, b"AAAA") or "")
    assert ds.checksum_problem(2, b"anything") is None  # not recorded
    assert ds.checksums.manifests_read == [str(dst / PREPARE_MANIFEST)]
    # A record beside the list wins over the data folder's for the file both name.
    (lists / CHECKSUMS_MANIFEST).write_text(line("../dst/a.jpg", b"A2"))  # relative to its folder
    ds = open_dataset(listing, allow_outside_root=True)
    assert ds.checksum_problem(0, b"A2") is None and ds.checksum_problem(0, b"aaaa") is not None
    assert ds.checksum_problem(1, b"bbbb") is None and ds.checksums.count == 2
    assert open_dataset(listing, allow_outside_root=True, verify_checksums="off").checksums is None
    # verify="on" without any: the error names the data folder's manifests too.
    (dst / PREPARE_MANIFEST).unlink()
    (lists / CHECKSUMS_MANIFEST).unlink()
    with pytest.raises(ChecksumManifestError, match=str(dst / PREPARE_MANIFEST)):
        open_dataset(listing, allow_outside_root=True, verify_checksums="on")


def test_shared_folder_is_a_folder_every_path_lies_in() -> None:
    assert shared_folder(["/d/x/a.jpg", "/d/x/b.jpg"]) == Path("/d/x")
    assert shared_folder(["/d/x/a.jpg", "/d/xy/b.jpg"]) == Path("/d")  # not "/d/x"
    assert shared_folder(["/d/b-c.jpg", "/d/b/x.jpg", "/d/b/y.jpg"]) == Path("/d")
    assert shared_folder(["/d/x/only.jpg"]) == Path("/d/x")
    assert shared_folder(["/a.jpg", "/b/c.jpg"]) is None  # only the root in common
    assert shared_folder([]) is None


def test_unusable_manifests_warn_with_auto_and_fail_with_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tree(tmp_path / "data", {"cat/1.jpg": b"one"})
    paths, cache = [str(root / "cat/1.jpg")], tmp_path / "cache"
    assert load_checksums(paths, root, "folder") is None  # none at all: nothing to say
    with pytest.raises(ChecksumManifestError, match="--checksums-only"):
        open_dataset(root, cache_dir=cache, verify_checksums="on")
    with pytest.raises(ValueError, match="verify must be"):
        load_checksums(paths, root, "folder", verify="maybe")
    (root / PREPARE_MANIFEST).mkdir()  # unreadable as a file
    os.mkfifo(root / keyed_name(root))  # would block an open() for good
    assert load_checksums(paths, root, "folder", manifest_dirs=[root]) is None
    (root / CHECKSUMS_MANIFEST).write_bytes(b"\x00" * 64 + b"\n{{{\n")
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    assert open_dataset(root, cache_dir=cache).checksums is None
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "not used" in messages and "skipped" in messages
    with pytest.raises(ChecksumManifestError):
        open_dataset(root, cache_dir=cache, verify_checksums="on")


def bad_count(root: Path, **options: object) -> dict[str, int]:
    with LocalLoader(
        root, split="val", batch_size=2, image_size=32, threads=1, **options
    ) as loader:
        for _ in loader:
            pass
        return loader.counts()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["prepared", "checksums-only"])
def test_local_loader_catches_a_bit_flip_every_decoder_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # A private cache for the dataset's index, the suite's native builds (no 30 s rebuild).
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(cache_root()))
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    src = tree(tmp_path / "src", photos(6))
    if how == "prepared":
        root = tmp_path / "dst"
        summary = run(Options(str(src), str(root), jobs=1, quiet=True))
        assert summary.exit_status == 0
    else:
        root = src
        summary = run(Options(str(src), None, jobs=1, quiet=True, checksums_only=True))
        assert summary.exit_status == 0 and (src / CHECKSUMS_MANIFEST).is_file()
    victim = root / "class1/img3.jpg"
    victim.write_bytes(clean_bit_flip(victim.read_bytes()))
    counts = bad_count(root)
    assert counts["bad_total"] == 1 and counts["replaced_total"] == 1
    assert bad_count(root, verify_checksums="off")["bad_total"] == 0  # no decoder sees it


# -- the "verified intact" chain ---------------------------------------------------------------


def records(manifest: Path) -> dict[str, dict]:
    lines = [json.loads(text) for text in manifest.read_text().splitlines()]
    return {r["path"]: r for r in lines if "path" in r}


def restart_tree(root: Path, victim: bytes, n: int = 5) -> Path:
    """Restart-marked JPEGs in two classes (as pipeline-prepare writes them), `victim` as
    a/victim.jpg."""
    files = {f"{'ab'[k % 2]}/img{k}.jpg": restart_marked(seed=100 + k) for k in range(n)}
    return tree(root, {**files, "a/victim.jpg": victim})


def load_all(
    root: Path, cache: Path, verify: str = "auto"
) -> tuple[SampleLoader, dict[str, LoadedSample]]:
    """Every sample of the tree once (train crops, one decode thread), by file name."""
    ds = open_dataset(root, cache_dir=cache, verify_checksums=verify)
    config = AugmentConfig(image_size=(24, 24), train=True)
    with CpuBatchDecoder(threads=1) as decoder:
        loader = SampleLoader(ds, config, seed=0, decoder=decoder, retry_delays=())
        got = loader.load(0, list(range(len(ds))))
    return loader, {Path(ds.paths[s.requested]).name: s for s in got}


def test_prepare_records_which_files_passed_the_strict_full_decode(tmp_path: Path) -> None:
    intact, damaged = dht_damaged()
    src = tree(tmp_path / "src", {"a/good.jpg": intact, "a/dht.jpg": damaged, "b/note.png": b"x"})
    summary = run(Options(str(src), str(tmp_path / "dst"), jobs=1, quiet=True))
    assert summary.exit_status == 1  # a corrupt JPEG, copied as it was
    got = records(tmp_path / "dst" / PREPARE_MANIFEST)
    assert got["a/good.jpg"]["outcome"] == "rewritten" and got["a/good.jpg"]["intact"] is True
    assert got["a/dht.jpg"]["outcome"] == "corrupt" and got["a/dht.jpg"]["intact"] is False
    assert got["b/note.png"]["intact"] is False  # no JPEG: nothing to skip for it
    assert strict_rejects((tmp_path / "dst/a/good.jpg").read_bytes()) is None


def test_checksums_only_runs_the_strict_check_on_every_jpeg(tmp_path: Path) -> None:
    intact, damaged = dht_damaged()
    src = tree(tmp_path / "src", {"a/good.jpg": intact, "a/dht.jpg": damaged})
    summary = run(Options(str(src), None, jobs=1, quiet=True, checksums_only=True))
    assert summary.exit_status == 1 and [r.path for r in summary.problems] == ["a/dht.jpg"]
    got = records(src / CHECKSUMS_MANIFEST)
    assert got["a/good.jpg"]["intact"] is True and "error" not in got["a/good.jpg"]
    assert got["a/dht.jpg"]["intact"] is False and "not intact" in got["a/dht.jpg"]["error"]
    assert got["a/dht.jpg"]["checksum"] == checksum(damaged)  # still checked at every read


def test_a_rerun_judges_the_files_an_older_manifest_did_not(tmp_path: Path) -> None:
    """A manifest from before `intact` counts as not known intact; a rerun (which skips the
    files) reads each file once and records the strict check's verdict on it."""
    intact, damaged = dht_damaged()
    src = tree(tmp_path / "src", {"a/good.jpg": intact, "a/dht.jpg": damaged})
    dst = tmp_path / "dst"
    run(Options(str(src), str(dst), jobs=1, quiet=True))
    manifest = dst / PREPARE_MANIFEST
    old = [json.loads(text) for text in manifest.read_text().splitlines()]
    for record in old:
        record.pop("intact", None)
    manifest.write_text("".join(json.dumps(r) + "\n" for r in old))
    ds = open_dataset(dst, cache_dir=tmp_path / "cache")
    assert ds.checksums is not None and not ds.checksums.intact.any()
    summary = run(Options(str(src), str(dst), jobs=1, quiet=True))
    assert summary.skipped == 2
    got = records(manifest)
    assert got["a/good.jpg"]["intact"] is True and got["a/dht.jpg"]["intact"] is False


def test_damaged_bytes_of_a_file_recorded_intact_are_a_checksum_mismatch(tmp_path: Path) -> None:
    """The restart path would decode the damaged table's crop to wrong pixels; the manifest
    recorded the intact original, so the bytes read do not match and the sample is replaced
    before any decoder sees it. The other files, recorded intact, take the restart path."""
    intact, damaged = dht_damaged()
    root = restart_tree(tmp_path / "data", intact)
    assert run(Options(str(root), None, jobs=1, quiet=True, checksums_only=True)).exit_status == 0
    assert all(r["intact"] for r in records(root / CHECKSUMS_MANIFEST).values())
    (root / "a/victim.jpg").write_bytes(damaged)
    loader, got = load_all(root, tmp_path / "cache")
    assert loader.counts()["bad_total"] == 1 and got["victim.jpg"].replaced
    assert "checksum mismatch" in next(iter(loader.known_bad.values()))
    assert {s.route for name, s in got.items() if name != "victim.jpg"} == {"restart"}


def test_a_file_recorded_not_intact_takes_the_region_path(tmp_path: Path) -> None:
    """intact false (or no verdict, as in an older manifest) for a sound file: the CPU decoder
    reads it itself, tail verified (route "region"); the damaged table recorded as it is (its
    checksum matches, `intact` false) is refused there, by the decode, and replaced."""
    _, damaged = dht_damaged()
    root = restart_tree(tmp_path / "data", damaged)
    run(Options(str(root), None, jobs=1, quiet=True, checksums_only=True))
    manifest = root / CHECKSUMS_MANIFEST
    edited = []
    for text in manifest.read_text().splitlines():
        record = json.loads(text)
        if record.get("path") == "a/img0.jpg":
            record["intact"] = False
        if record.get("path") == "b/img1.jpg":
            del record["intact"]
        edited.append(json.dumps(record) + "\n")
    manifest.write_text("".join(edited))
    loader, got = load_all(root, tmp_path / "cache")
    assert got["img0.jpg"].route == got["img1.jpg"].route == "region"
    assert {got[f"img{k}.jpg"].route for k in (2, 3, 4)} == {"restart"}
    assert got["victim.jpg"].replaced and loader.counts()["bad_total"] == 1
    reason = next(iter(loader.known_bad.values()))
    assert "checksum" not in reason and "JPEG" in reason
    _, unchecked = load_all(root, tmp_path / "cache", verify="off")  # nothing known intact
    assert {s.route for s in unchecked.values() if not s.replaced} == {"region"}
