"""`pipeline-prepare` writes the interval index (issues 30.6, 32.2), and a rerun over a folder
prepared before the index existed gives those files one.

What must hold: every JPEG it rewrites carries an index that agrees with the file (so the
server's crops read no restart scan) and decodes to the source's pixels; a folder prepared by
the earlier version (the same bytes without the index, its manifest recording them) is brought
up to date by a rerun, each such file rewritten once and skipped afterwards; a file whose
restart intervals cannot be indexed (a fixed `--restart-interval` that does not divide its MCU
rows) is not rewritten again on every rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_roi
from batchwire.native import jpeg_transcode as jt
from batchwire.pipeline.checksums import checksum
from batchwire.prepare.checksum_manifest import MANIFEST_NAME
from batchwire.prepare.cli import main
from jpegchecks import pil_jpeg, pil_pixels
from oddfiles import smooth_image

SIGNATURE = b"batchwire-intervals\0"

if not jt.transcode_available() or not jpeg_roi.jpeg_roi_available():
    pytest.skip("the JPEG transcoder or ROI decoder does not build here", allow_module_level=True)


def jpeg_tree(root: Path) -> dict[str, bytes]:
    """Four JPEGs of several samplings and sizes, one non-JPEG, in two class folders."""
    files = {
        "a/420.jpg": pil_jpeg(smooth_image(96, 128, seed=1), subsampling=2),
        "a/444.jpg": pil_jpeg(smooth_image(50, 70, seed=2), subsampling=0),
        "b/grey.jpg": pil_jpeg(smooth_image(40, 90, seed=3), mode="L"),
        "b/422.jpg": pil_jpeg(smooth_image(33, 17, seed=4), subsampling=1),
        "b/notes.txt": b"not an image\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def without_index(data: bytes) -> bytes:
    """The file as pipeline-prepare wrote it before the index: its APP9 segment taken out."""
    at = data.index(SIGNATURE) - 4
    assert data[at : at + 2] == b"\xff\xe9"
    return data[:at] + data[at + 2 + int.from_bytes(data[at + 2 : at + 4], "big") :]


def make_old_prepared(dst: Path) -> int:
    """Turns DST into what the earlier pipeline-prepare left: rewritten files without their
    index, the manifest recording those bytes. Returns how many files it changed."""
    manifest = dst / MANIFEST_NAME
    lines = []
    changed = 0
    for line in manifest.read_text().splitlines():
        record = json.loads(line)
        if record.get("outcome") == "rewritten":
            path = dst / record["path"]
            old = without_index(path.read_bytes())
            path.write_bytes(old)
            record.update(bytes_out=len(old), checksum=checksum(old))
            changed += 1
        lines.append(json.dumps(record, separators=(",", ":")))
    manifest.write_text("\n".join(lines) + "\n")
    return changed


def run(src: Path, dst: Path, report: Path, *extra: str) -> dict:
    assert main([str(src), str(dst), "--quiet", "--report", str(report), *extra]) == 0
    return json.loads(report.read_text())


def test_prepare_indexes_every_rewritten_jpeg_and_a_rerun_indexes_an_old_folder(tmp_path):
    src, dst, report = tmp_path / "src", tmp_path / "dst", tmp_path / "r.json"
    sources = jpeg_tree(src)
    first = run(src, dst, report)
    assert first["rewritten"] == 4
    for rel, original in sources.items():
        data = (dst / rel).read_bytes()
        if rel.endswith(".txt"):
            assert data == original
            continue
        assert jpeg_roi.index_agrees(data), rel
        assert data.count(SIGNATURE) == 1
        np.testing.assert_array_equal(pil_pixels(data), pil_pixels(original), rel)

    assert make_old_prepared(dst) == 4
    assert not any(jpeg_roi.index_agrees((dst / rel).read_bytes()) for rel in sources)
    again = run(src, dst, report)
    assert again["files_worked"] == 4 and again["rewritten"] == 4 and again["skipped"] == 1
    for rel in sources:
        if not rel.endswith(".txt"):
            assert jpeg_roi.index_agrees((dst / rel).read_bytes()), rel
    assert run(src, dst, report)["skipped"] == 5  # done now: nothing rewritten again


def test_files_without_an_indexable_layout_are_not_rewritten_on_every_rerun(tmp_path):
    """--restart-interval 3: a 5-MCU-wide file's intervals straddle its MCU rows (no decoder
    enters it at its markers, nothing to index); a 6-MCU-wide one is indexed."""
    src, dst, report = tmp_path / "src", tmp_path / "dst", tmp_path / "r.json"
    (src / "a").mkdir(parents=True)
    (src / "a/five.jpg").write_bytes(pil_jpeg(smooth_image(32, 80, seed=5), subsampling=2))
    (src / "a/six.jpg").write_bytes(pil_jpeg(smooth_image(32, 96, seed=6), subsampling=2))
    assert run(src, dst, report, "--restart-interval", "3")["rewritten"] == 2
    five, six = (dst / "a/five.jpg").read_bytes(), (dst / "a/six.jpg").read_bytes()
    assert jpeg_roi.restart_layout(five)[0] is None and SIGNATURE not in five
    assert jpeg_roi.index_agrees(six)
    again = run(src, dst, report, "--restart-interval", "3")
    assert again["skipped"] == 2 and again["files_worked"] == 0
