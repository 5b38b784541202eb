"""`pipeline-prepare` over odd entries test_prepare.py does not meet: an empty .jpg, a JPEG cut
inside its header, SOI alone, SOI and EOI with nothing between, a header over the pixel cap, a
small file claiming 9000 x 9000, a symlink to itself (ELOOP), links to files inside and outside
SRC, and JPEGs in every EXIF orientation.

What must hold: each problem is counted and named with its reason in the report (exit status 3:
a file could not be read), nothing else is; and DST never holds a corrupt output: every file in
it is either its source's bytes (not a JPEG, corrupt, over the cap) or a rewrite that passes the
strict full decode with its source's pixels and EXIF orientation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_transcode
from batchwire.native.jpeg_roi import check_jpeg
from batchwire.pipeline.decode import read_header
from batchwire.prepare.cli import main
from jpegchecks import pil_pixels
from oddfiles import exif_jpeg, huge_header_jpeg, pil_jpeg, small_claiming_huge, smooth_image

if not jpeg_transcode.transcode_available():
    pytest.skip("the JPEG transcoder does not build here", allow_module_level=True)


def odd_tree(src: Path, outside: Path) -> None:
    good = pil_jpeg(smooth_image(40, 56, seed=1))
    files = {
        "a/empty.jpg": b"",
        "a/header_cut.jpg": good[:30],
        "a/soi_only.jpg": b"\xff\xd8\xff",
        "a/soi_eoi.jpg": b"\xff\xd8\xff\xd9",
        "a/huge.jpg": huge_header_jpeg(smooth_image(16, 16)),
        "a/claims_9000.jpg": small_claiming_huge(),
        "a/good.jpg": good,
    }
    for o in range(1, 9):
        files[f"b/exif{o}.jpg"] = exif_jpeg(smooth_image(40, 56, seed=o), o)
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    outside.write_bytes(good)
    os.symlink("loop.jpg", src / "a/loop.jpg")
    os.symlink("good.jpg", src / "a/link_inside.jpg")
    os.symlink(outside, src / "a/link_outside.jpg")


def test_odd_entries_are_reported_and_dst_holds_no_corrupt_output(tmp_path: Path) -> None:
    src, dst, report = tmp_path / "src", tmp_path / "dst", tmp_path / "report.json"
    odd_tree(src, tmp_path / "outside.jpg")
    assert main([str(src), str(dst), "--quiet", "--report", str(report)]) == 3
    summary = json.loads(report.read_text())
    problems = {p["path"]: (p["outcome"], p["error"]) for p in summary["problems"]}
    assert problems == {
        "a/loop.jpg": ("failed", "Too many levels of symbolic links"),
        "a/header_cut.jpg": ("corrupt", "Premature end of JPEG file"),
        "a/soi_only.jpg": ("corrupt", "Premature end of JPEG file"),
        "a/soi_eoi.jpg": ("corrupt", "JPEG datastream contains no image"),
        "a/huge.jpg": ("too_large", problems["a/huge.jpg"][1]),
        "a/claims_9000.jpg": ("corrupt", problems["a/claims_9000.jpg"][1]),
    }, problems
    assert "exceeds the limit" in problems["a/huge.jpg"][1]
    assert "more than a" in problems["a/claims_9000.jpg"][1]
    # good, the two links and eight EXIF files rewritten; the empty file copied as no JPEG
    assert (summary["rewritten"], summary["copied"], summary["failed"]) == (11, 1, 1), summary
    written = sorted(p for p in dst.rglob("*.jpg"))
    assert [p.relative_to(dst).as_posix() for p in written] == sorted(
        p.relative_to(src).as_posix() for p in src.rglob("*.jpg") if p.name != "loop.jpg"
    )
    for path in written:
        rel = path.relative_to(dst).as_posix()
        out, original = path.read_bytes(), (src / rel).read_bytes()
        if out == original:
            assert rel in problems or rel == "a/empty.jpg", rel
            continue
        check_jpeg(out)
        np.testing.assert_array_equal(pil_pixels(out), pil_pixels(original), rel)
        assert read_header(out).orientation == read_header(original).orientation, rel
