"""`pipeline-prepare SRC DST` on real files: generated odd JPEGs and other files, the embedded
synthetic dataset, and real ImageNet photos (skipped where the sample is absent).

What must hold: DST has SRC's layout (folder tree or list file), every sound JPEG rewritten with
a restart marker per MCU and decoding (PIL, djpeg) to exactly the source's pixels with its APPn
and COM segments kept, every other file byte for byte; corrupt JPEGs are reported and give exit
status 1; SRC is never modified; the server's dataset scan of DST equals SRC's; a rerun skips
what is done and redoes what changed; a run killed with SIGKILL resumes to a complete DST with
no temporaries; bad invocations exit 2 before doing anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_transcode as jt
from batchwire.pipeline.checksums import checksum, keyed_name
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import SyntheticSpec, ensure_dataset
from batchwire.prepare.checksum_manifest import LOCK_NAME, MANIFEST_NAME, REPORT_NAME, TMP_PREFIX
from batchwire.prepare.cli import main
from batchwire.prepare.progress import Progress
from jpegchecks import (
    HAS_DJPEG,
    assert_restart_layout,
    djpeg_pixels,
    parse_jpeg,
    pil_jpeg,
    pil_pixels,
)
from oddfiles import (
    corrupt_jpeg,
    exif_orientation_block,
    huge_header_jpeg,
    png_bytes,
    smooth_image,
)

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
CONSOLE_SCRIPT = Path(sys.executable).parent / "pipeline-prepare"
CORRUPT = {"banana/truncated.jpg", "banana/zeroed.jpg"}

# Prepare rewrites JPEGs with the transcoder (as test_jpeg_transcode, whose skip this module
# shared while it imported its helpers from there).
if not jt.transcode_available():
    pytest.skip(
        "the JPEG transcoder does not build here (libjpeg62-turbo-dev missing?); see the "
        "logged build error",
        allow_module_level=True,
    )


def sample_files(n: int) -> list[Path]:
    if not SAMPLE_DIR.is_dir():
        pytest.skip(f"real-photo sample {SAMPLE_DIR} not present on this machine")
    return sorted(SAMPLE_DIR.iterdir())[:n]


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def odd_tree(root: Path) -> Path:
    """An ImageFolder tree of odd files: every JPEG kind, non-JPEGs, corrupt JPEGs, an empty
    class, a nested folder, a hidden file, content that disagrees with the extension."""
    pixels = smooth_image(61, 83, seed=1)
    good = pil_jpeg(pixels)
    files = {
        "apple/progressive.jpg": pil_jpeg(pixels, progressive=True),
        "apple/grey.jpg": pil_jpeg(pixels, mode="L"),
        "apple/444.jpg": pil_jpeg(pixels, subsampling=0),
        "apple/422.jpg": pil_jpeg(pixels, subsampling=1),
        "apple/odd_17x33.jpg": pil_jpeg(smooth_image(33, 17, seed=2), subsampling=2),
        "apple/exif.jpg": pil_jpeg(pixels, exif=exif_orientation_block(6)),
        "apple/cmyk.jpg": pil_jpeg(pixels, mode="CMYK"),
        "apple/deeper/nested.jpeg": good,
        "apple/jpeg_named.png": good,
        "banana/image.png": png_bytes(pixels),
        "banana/png_named.jpg": png_bytes(pixels),
        "banana/notes.txt": b"not an image\n",
        "banana/.DS_Store": b"\0\0\0\1Bud1",
        "banana/truncated.jpg": good[: len(good) * 2 // 3],
        "banana/zeroed.jpg": corrupt_jpeg("middle_zeroed", pil_jpeg(smooth_image(96, 128))),
    }
    for rel, data in files.items():
        write(root / rel, data)
    (root / "cherry_empty").mkdir()
    os.chmod(root / "apple/grey.jpg", 0o640)
    return root


def files_under(root: Path) -> dict[str, bytes]:
    """Relative path -> contents of every file under root (symlinks followed), prepare's own
    hidden files left out."""
    out = {}
    for folder, _dirs, names in os.walk(root, followlinks=True):
        for name in names:
            if name.startswith(".batchwire-prepare"):
                continue
            path = Path(folder, name)
            out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(files_under(root).items()):
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for folder, dirs, _names in sorted(os.walk(root, followlinks=True)):
        h.update(f"{Path(folder).relative_to(root)}:{sorted(dirs)}".encode())
    return h.hexdigest()


def _is_interval_index(segment: tuple[int, bytes]) -> bool:
    """An APP9 segment with the interval index's signature (native/csrc/jpeg_index.h)."""
    marker, payload = segment
    return marker == 0xE9 and payload.startswith(b"batchwire-intervals\0")


def assert_prepared(src: Path, dst: Path, corrupt: set[str] = frozenset()) -> int:
    """DST holds SRC's files: sound JPEGs rewritten losslessly, everything else verbatim.
    Returns how many were rewritten."""
    before, after = files_under(src), files_under(dst)
    assert sorted(after) == sorted(before)
    rewritten = 0
    for rel, original in before.items():
        if not original.startswith(b"\xff\xd8\xff") or rel in corrupt:
            assert after[rel] == original, rel
            continue
        layout = assert_restart_layout(after[rel], interval=None)
        # The original's APPn and COM segments, plus one: the interval index (APP9) prepare adds.
        kept = [seg for seg in layout.app_and_com() if not _is_interval_index(seg)]
        assert kept == parse_jpeg(original).app_and_com(), rel
        assert len(layout.app_and_com()) == len(kept) + 1, f"{rel}: no interval index"
        np.testing.assert_array_equal(pil_pixels(after[rel]), pil_pixels(original), rel)
        rewritten += 1
    assert not [p for p in dst.rglob(f"{TMP_PREFIX}*")], "temporaries left in DST"
    return rewritten


def assert_same_dataset(src: Path, dst: Path, cache: Path) -> None:
    a, b = open_dataset(src, cache_dir=cache), open_dataset(dst, cache_dir=cache)
    rel = [os.path.relpath(p, a.root) for p in a.paths]
    assert rel == [os.path.relpath(p, b.root) for p in b.paths]
    assert a.classes == b.classes
    np.testing.assert_array_equal(a.labels, b.labels)


def test_tree_of_odd_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = odd_tree(tmp_path / "src")
    photos = sorted(SAMPLE_DIR.iterdir())[:3] if SAMPLE_DIR.is_dir() else []
    links = [src / "banana" / f"photo{k}.JPEG" for k in range(len(photos))]
    for photo, link in zip(photos, links, strict=True):
        os.symlink(photo, link)
    before = digest(src)
    dst, report = tmp_path / "out" / "dst", tmp_path / "report.json"
    assert main([str(src), str(dst), "--jobs", "2", "--quiet", "--report", str(report)]) == 1
    assert digest(src) == before
    assert all(link.is_symlink() for link in links)
    rewritten = assert_prepared(src, dst, CORRUPT)
    assert (dst / "cherry_empty").is_dir() and (dst / "apple/deeper").is_dir()
    assert (dst / "apple/grey.jpg").stat().st_mode & 0o777 == 0o640
    if HAS_DJPEG:
        for rel in ("apple/progressive.jpg", "apple/grey.jpg", "apple/exif.jpg"):
            assert djpeg_pixels((dst / rel).read_bytes()) == djpeg_pixels((src / rel).read_bytes())
    data = json.loads(report.read_text())
    assert data == json.loads((dst / REPORT_NAME).read_text())
    assert data["rewritten"] == rewritten == 9 + len(photos)
    assert (data["copied"], data["corrupt"], data["unverified"], data["failed"]) == (4, 2, 0, 0)
    assert {p["path"] for p in data["problems"]} == CORRUPT
    assert all(p["outcome"] == "corrupt" and p["error"] for p in data["problems"])
    assert data["jpeg_bytes_after"] > 0 and data["exit_status"] == 1
    out = capsys.readouterr().out
    assert "corrupt: banana/truncated.jpg: Premature end of JPEG file" in out
    assert_same_dataset(src, dst, tmp_path / "cache")


def test_rerun_skips_what_is_done_and_redoes_what_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst, report = odd_tree(tmp_path / "src"), tmp_path / "dst", tmp_path / "r.json"
    argv = [str(src), str(dst), "--quiet", "--report", str(report)]
    assert main(argv) == 1
    total = json.loads(report.read_text())["files_seen"]
    stamps = {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    assert main(argv) == 1  # the corrupt files are still reported
    data = json.loads(report.read_text())
    assert data["skipped"] == total and data["files_worked"] == 0 and data["corrupt"] == 2
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps | {
        dst / MANIFEST_NAME: (dst / MANIFEST_NAME).stat().st_mtime_ns,
        dst / REPORT_NAME: (dst / REPORT_NAME).stat().st_mtime_ns,
    }
    # A source that changed, a destination file deleted, a corrupt file repaired.
    write(src / "apple/444.jpg", pil_jpeg(smooth_image(50, 40, seed=7), subsampling=0))
    (dst / "banana/notes.txt").unlink()
    write(src / "banana/truncated.jpg", pil_jpeg(smooth_image(20, 30, seed=8)))
    assert main(argv) == 1  # zeroed.jpg is still corrupt
    data = json.loads(report.read_text())
    assert data["skipped"] == total - 3 and data["corrupt"] == 1
    assert assert_prepared(src, dst, {"banana/zeroed.jpg"}) == 10
    # Another restart interval redoes the JPEGs only.
    assert main([*argv, "--restart-interval", "4"]) == 1
    data = json.loads(report.read_text())
    assert data["skipped"] == data["copied"] == 4
    assert parse_jpeg((dst / "apple/grey.jpg").read_bytes()).restart_interval == 4
    capsys.readouterr()


def test_list_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write(data / "x/a.jpg", pil_jpeg(smooth_image(40, 30, seed=1)))
    write(data / "y/with space.jpg", pil_jpeg(smooth_image(31, 47, seed=2), progressive=True))
    write(data / "x/c.png", png_bytes(smooth_image(10, 10)))
    write(data / "x/unlisted.jpg", pil_jpeg(smooth_image(16, 16)))
    listing = "# train split\nx/a.jpg 0\n\ny/with space.jpg 2\nx/c.png 1\nx/a.jpg 0\n"
    write(data / "train.txt", listing.encode())
    before = digest(data)
    dst = tmp_path / "dst"
    assert main([str(data / "train.txt"), str(dst), "--quiet", "--fsync"]) == 0
    assert digest(data) == before
    assert (dst / "train.txt").read_bytes() == listing.encode()
    assert not (dst / "x/unlisted.jpg").exists()
    assert (dst / "x/c.png").read_bytes() == (data / "x/c.png").read_bytes()
    for rel in ("x/a.jpg", "y/with space.jpg"):
        assert_restart_layout((dst / rel).read_bytes(), interval=None)
        np.testing.assert_array_equal(
            pil_pixels((dst / rel).read_bytes()), pil_pixels((data / rel).read_bytes())
        )
    assert_same_dataset(data / "train.txt", dst / "train.txt", tmp_path / "cache")


@pytest.mark.parametrize("line", ["../outside.jpg 0", "/etc/hostname 0"])
def test_list_paths_escaping_the_folder_are_refused(tmp_path: Path, line: str) -> None:
    write(tmp_path / "outside.jpg", pil_jpeg(smooth_image(16, 16)))
    write(tmp_path / "data/ok.jpg", pil_jpeg(smooth_image(16, 16)))
    write(tmp_path / "data/list.txt", f"ok.jpg 0\n{line}\n".encode())
    dst = tmp_path / "dst"
    assert main([str(tmp_path / "data/list.txt"), str(dst), "--quiet"]) == 2
    assert not dst.exists()


def test_usage_errors_exit_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = odd_tree(tmp_path / "src")
    before = digest(src)
    (tmp_path / "outer/inner").mkdir(parents=True)
    write(tmp_path / "a_file", b"x")
    cases = {
        "does not exist": [str(tmp_path / "missing"), str(tmp_path / "d1")],
        "DST is SRC": [str(src), str(src)],
        "inside SRC": [str(src), str(src / "apple" / "prepared")],
        "inside DST": [str(tmp_path / "outer/inner"), str(tmp_path / "outer")],
        "not a folder": [str(src), str(tmp_path / "a_file")],
        "restart-interval": [str(src), str(tmp_path / "d2"), "--restart-interval", "0"],
        "--report": [str(src), str(tmp_path / "d3"), "--report", str(src / "apple/r.json")],
    }
    for words, argv in cases.items():
        assert main([*argv, "--quiet"]) == 2, words
        assert words in capsys.readouterr().err
    assert digest(src) == before
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3"))
    assert sorted(p.name for p in (tmp_path / "outer").iterdir()) == ["inner"]


def test_unreadable_entries_and_a_second_run_at_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "a/ok.jpg", pil_jpeg(smooth_image(20, 20)))
    os.mkfifo(src / "a/fifo.jpg")
    os.symlink(tmp_path / "nowhere.jpg", src / "a/broken.jpg")
    dst, report = tmp_path / "dst", tmp_path / "r.json"
    assert main([str(src), str(dst), "--quiet", "--report", str(report)]) == 3
    data = json.loads(report.read_text())
    assert (data["rewritten"], data["failed"]) == (1, 2)
    assert {p["path"]: p["error"] for p in data["problems"]} == {
        "a/fifo.jpg": "not a regular file",
        "a/broken.jpg": "a broken symlink",
    }
    assert_restart_layout((dst / "a/ok.jpg").read_bytes(), interval=None)
    with open(dst / LOCK_NAME) as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert main([str(src), str(dst), "--quiet"]) == 2


def test_synthetic_dataset(tmp_path: Path) -> None:
    spec = SyntheticSpec(train_per_class=3, val_per_class=1, min_side=16, max_side=160)
    root = ensure_dataset(spec, tmp_path / "cache").train_root
    dst, report = tmp_path / "dst", tmp_path / "r.json"
    assert main([str(root), str(dst), "--quiet", "--report", str(report)]) == 0
    assert assert_prepared(root, dst) == 30 == json.loads(report.read_text())["rewritten"]
    assert_same_dataset(root, dst, tmp_path / "cache")


def test_killed_run_resumes_to_a_complete_destination(tmp_path: Path) -> None:
    """SIGKILL halfway through the console script, then a rerun: everything done before is
    skipped, the rest done, nothing half-written or temporary left (a kill can also leave a
    manifest line cut short and a temporary: both are added here so the rerun must cope)."""
    photos = sample_files(200)
    src = tmp_path / "src"
    (src / "photos").mkdir(parents=True)
    for photo in photos:
        os.symlink(photo, src / "photos" / photo.name)
    dst = tmp_path / "dst"
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), str(src), str(dst), "--jobs", "1", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    manifest = dst / MANIFEST_NAME
    deadline = time.monotonic() + 60
    try:
        while not manifest.exists() or manifest.read_text().count('"path"') < 10:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no progress within 60 s"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    text = manifest.read_text()
    assert '"finished"' not in text  # killed midway, not after the end
    done_before = text.count('"path"')  # one record per file done (and the run's header)
    assert 10 <= done_before < len(photos)
    with open(manifest, "a") as f:
        f.write('{"path":"photos/n0')
    leftover = dst / "photos" / f"{TMP_PREFIX}leftover"
    leftover.write_bytes(b"half a file")
    report = tmp_path / "r.json"
    assert main([str(src), str(dst), "--quiet", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["skipped"] == done_before and data["rewritten"] == len(photos)
    assert not leftover.exists()
    assert assert_prepared(src, dst) == len(photos)
    assert manifest.read_text().endswith('{"finished": true}\n')


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_prints_lines_elsewhere() -> None:
    log, tty = io.StringIO(), Terminal()
    for stream in (log, tty):
        progress = Progress(10, out=stream, interval_s=1e-9)
        progress.update(4, 0)
        progress.note("corrupt: a.jpg: bad")
        progress.update(10, 1)
        progress.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("prepare: 4/10 files (40.0 %)") and lines[1] == "corrupt: a.jpg: bad"
    assert lines[2].startswith("prepare: 10/10 files (100.0 %)") and "1 problem files" in lines[2]
    assert "\r" not in log.getvalue()
    screen = tty.getvalue()  # a tqdm bar: each frame overwrites the last, a note gets a line
    assert "\rcorrupt: a.jpg: bad\n" in screen and screen.endswith("\n")
    frames = [frame.strip() for frame in screen.split("\r") if frame.strip()]
    assert [f.split("|")[-1].split()[0] for f in frames if f.startswith("prepare:")][-3:] == [
        "4/10",
        "10/10",
        "10/10",
    ]
    assert frames[-1].endswith("1 problem files]")
    quiet = io.StringIO()
    silent = Progress(10, out=quiet, enabled=False, interval_s=1e-9)
    silent.update(5, 0)
    silent.close()
    assert quiet.getvalue() == ""


def test_manifest_records_the_checksum_of_every_file_in_dst(tmp_path: Path) -> None:
    src, dst = odd_tree(tmp_path / "src"), tmp_path / "dst"
    assert main([str(src), str(dst), "--quiet"]) == 1
    lines = [json.loads(x) for x in (dst / MANIFEST_NAME).read_text().splitlines()]
    records = {x["path"]: x for x in lines if "path" in x}
    assert sorted(records) == sorted(files_under(dst))
    for rel, data in files_under(dst).items():
        assert records[rel]["checksum"] == checksum(data), rel
        # intact: the bytes pass the strict full decode (what lets decoders read less of them)
        assert records[rel]["intact"] is (records[rel]["outcome"] == "rewritten"), rel
    assert lines[0] == {"source": "tree", "dirs": sorted(lines[0]["dirs"])}
    assert "cherry_empty" in lines[0]["dirs"]


def test_rerun_mirrors_src_after_deletes_and_renames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files and folders deleted and renamed in SRC: the rerun leaves DST as a fresh prepare
    of SRC would be, except what prepare never wrote (kept, reported) and an output changed in
    DST since (kept, reported)."""
    src, dst, report = odd_tree(tmp_path / "src"), tmp_path / "dst", tmp_path / "r.json"
    argv = [str(src), str(dst), "--quiet", "--report", str(report)]
    assert main(argv) == 1
    (src / "apple/422.jpg").unlink()
    (src / "apple/444.jpg").rename(src / "apple/444_renamed.jpg")
    (src / "apple/deeper").rename(src / "apple/shallower")
    (src / "banana/notes.txt").unlink()
    (src / "cherry_empty").rmdir()  # an empty class folder would still take a label id
    (src / "apple/grey.jpg").unlink()
    (dst / "apple/grey.jpg").write_bytes(b"edited in DST since")  # someone else's now
    write(dst / "banana/mine.txt", b"put here by hand")
    write(dst / "extra_class/x.jpg", b"also by hand")
    assert main(argv) == 1
    data = json.loads(report.read_text())
    assert data["removed"] == [
        "apple/422.jpg",
        "apple/444.jpg",
        "apple/deeper/nested.jpeg",
        "banana/notes.txt",
    ]
    assert data["removed_dirs"] == ["apple/deeper", "cherry_empty"]
    assert data["kept_gone"] == [
        {"path": "apple/grey.jpg", "why": "changed since pipeline-prepare wrote it"}
    ]
    assert data["foreign"] == ["apple/grey.jpg", "banana/mine.txt", "extra_class/"]
    out = capsys.readouterr().out
    assert "removed from DST (SRC no longer has them) (6):" in out
    assert "in DST but never written by pipeline-prepare (kept) (3):" in out
    fresh = tmp_path / "fresh"
    assert main([str(src), str(fresh), "--quiet"]) == 1
    mine = {"apple/grey.jpg", "banana/mine.txt", "extra_class/x.jpg"}
    assert {k: v for k, v in files_under(dst).items() if k not in mine} == files_under(fresh)
    dirs = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_dir()}
    assert dirs - {"extra_class"} == {
        p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_dir()
    }
    # A third run has nothing to remove and still reports what it never wrote.
    assert main(argv) == 1
    data = json.loads(report.read_text())
    assert data["removed"] == [] and data["kept_gone"] == [] and len(data["foreign"]) == 3


def test_a_file_that_became_a_folder(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src / "a/b", pil_jpeg(smooth_image(16, 16)))
    assert main([str(src), str(dst), "--quiet"]) == 0
    (src / "a/b").unlink()
    write(src / "a/b/c.jpg", pil_jpeg(smooth_image(16, 16)))
    assert main([str(src), str(dst), "--quiet"]) == 0
    assert sorted(files_under(dst)) == ["a/b/c.jpg"]


def test_two_lists_into_one_dst_keep_each_others_files(tmp_path: Path) -> None:
    data, dst, report = tmp_path / "data", tmp_path / "dst", tmp_path / "r.json"
    write(data / "x/a.jpg", pil_jpeg(smooth_image(40, 30, seed=1)))
    write(data / "y/b.jpg", pil_jpeg(smooth_image(30, 40, seed=2)))
    write(data / "train.txt", b"x/a.jpg 0\n")
    write(data / "val.txt", b"y/b.jpg 0\n")
    for name in ("train.txt", "val.txt", "train.txt"):
        argv = [str(data / name), str(dst), "--quiet", "--report", str(report)]
        assert main(argv) == 0
    got = json.loads(report.read_text())
    assert got["removed"] == [] and got["foreign"] == ["val.txt", "y/"]
    assert sorted(files_under(dst)) == ["train.txt", "val.txt", "x/a.jpg", "y/b.jpg"]
    assert got["kept_gone"] == [
        {"path": "y/b.jpg", "why": "DST was last prepared from another source (list:val.txt)"}
    ]
    write(data / "train.txt", b"# nothing now\n")  # the same list, emptied: what it named goes
    assert main([str(data / "train.txt"), str(dst), "--quiet", "--report", str(report)]) == 0
    assert json.loads(report.read_text())["removed"] == ["x/a.jpg"]
    assert sorted(files_under(dst)) == ["train.txt", "val.txt", "y/b.jpg"]


def test_pixel_cap_copies_larger_jpegs_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst, report = tmp_path / "src", tmp_path / "dst", tmp_path / "r.json"
    big = write(src / "a/big.jpg", pil_jpeg(smooth_image(40, 30)))  # 1200 pixels
    write(src / "a/small.jpg", pil_jpeg(smooth_image(20, 20)))  # 400
    # The server's default cap (89.5 Mpx): a header claiming 16000 x 16000 is not transcoded.
    huge = write(src / "a/huge.jpg", huge_header_jpeg(smooth_image(64, 64), 16000, 16000))
    argv = [str(src), str(dst), "--quiet", "--report", str(report)]
    assert main([*argv, "--max-pixels", "1000"]) == 0
    data = json.loads(report.read_text())
    assert data["too_large"] == 2 and data["rewritten"] == 1
    assert {p["path"] for p in data["problems"]} == {"a/big.jpg", "a/huge.jpg"}
    assert (dst / "a/big.jpg").read_bytes() == big.read_bytes()
    assert (dst / "a/huge.jpg").read_bytes() == huge.read_bytes()
    assert "too_large: a/big.jpg: image of 30x40 = 1200 pixels exceeds" in capsys.readouterr().out
    assert main(argv) == 0  # the default cap: big.jpg is rewritten now, huge.jpg still not
    data = json.loads(report.read_text())
    assert data["too_large"] == 1 and data["rewritten"] == 2
    assert_restart_layout((dst / "a/big.jpg").read_bytes(), interval=None)


def _read_only_mount(folder: Path) -> list[str] | None:
    """A command prefix that runs a command with `folder` a read-only file system (as root,
    whom permission bits do not stop), or None where that cannot be done here."""
    probe = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs '{folder}'"]
    try:
        if subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
            return None
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [
        "unshare",
        "-m",
        "sh",
        "-c",
        f"mount -t tmpfs -o ro tmpfs '{folder}' && exec \"$@\"",
        "sh",
    ]


def test_read_only_dst_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src / "a/x.jpg", pil_jpeg(smooth_image(16, 16)))
    dst.mkdir()
    if os.geteuid() != 0:
        dst.chmod(0o555)
        assert main([str(src), str(dst), "--quiet"]) == 2
        assert "cannot write to DST" in capsys.readouterr().err
        return
    prefix = _read_only_mount(dst)
    if prefix is None:
        pytest.skip("running as root, and no read-only mount can be made here")
    done = subprocess.run(
        [*prefix, str(CONSOLE_SCRIPT), str(src), str(dst), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot write to DST" in done.stderr and "Read-only file system" in done.stderr
    assert list(dst.iterdir()) == []


def test_checksums_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = odd_tree(tmp_path / "src")
    before = files_under(src)
    report = tmp_path / "r.json"
    # 1: corrupt JPEGs found (the strict check runs on every JPEG; each is still checksummed)
    assert main(["--checksums-only", str(src), "--quiet", "--report", str(report)]) == 1
    assert files_under(src) == before  # only prepare's own hidden files were added
    added = sorted(p.name for p in src.iterdir() if p.name.startswith(".batchwire-prepare"))
    assert added == [
        ".batchwire-prepare-checksums-report.json",
        ".batchwire-prepare-checksums.jsonl",
        ".batchwire-prepare-checksums.lock",
    ]
    lines = (src / ".batchwire-prepare-checksums.jsonl").read_text().splitlines()
    records = {x["path"]: x for x in map(json.loads, lines) if "path" in x}
    assert {rel: records[rel]["checksum"] for rel in before} == {
        rel: checksum(data) for rel, data in before.items()
    }
    jpegs = {rel for rel, data in before.items() if data.startswith(b"\xff\xd8\xff")}
    assert {rel for rel in before if records[rel].get("intact")} == jpegs - CORRUPT
    assert all("not intact" in records[rel]["error"] for rel in CORRUPT)
    data = json.loads(report.read_text())
    assert data["checksummed"] == len(before)
    assert {p["path"] for p in data["problems"]} == CORRUPT
    assert main(["--checksums-only", str(src), "--quiet", "--report", str(report)]) == 1
    assert json.loads(report.read_text())["skipped"] == len(before)
    write(src / "apple/444.jpg", b"changed")
    assert main(["--checksums-only", str(src), "--quiet", "--report", str(report)]) == 1
    assert json.loads(report.read_text())["skipped"] == len(before) - 1
    # A manifest folder elsewhere: a file named after SRC, nothing more in SRC.
    sums = tmp_path / "sums"
    assert main(["--checksums-only", str(src), "--manifest-dir", str(sums), "--quiet"]) == 1
    assert (sums / keyed_name(src)).is_file()
    ds = open_dataset(src, cache_dir=tmp_path / "cache", checksum_dirs=[sums])
    assert ds.checksums is not None and ds.checksums.count == len(ds)
    capsys.readouterr()
    for argv in (
        ["--checksums-only", str(src), str(tmp_path / "dst")],
        ["--checksums-only", str(src), "--manifest-dir", str(src / "apple")],
        [str(src)],
        [str(src), str(tmp_path / "dst"), "--manifest-dir", str(sums)],
    ):
        assert main([*argv, "--quiet"]) == 2, argv
    assert not (tmp_path / "dst").exists()
