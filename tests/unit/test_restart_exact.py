"""Issue 20, item 2: restart-path crops are exact on every layout, at every DCT scale.

The restart path decodes a small JPEG of the intervals under a region plus one MCU of context
(csrc/jpeg_restart.h `context_rect`); it must return the region and pixels that the same libjpeg
calls give on the whole file (`restarts=False`). Smooth images hide upsampling mistakes, so the
images here are noise (written by PIL at several qualities, and by cjpeg for 4:4:0 and 4:1:1),
swept exhaustively: every 1x1 region and every 2x3 / 5x4 region at every position of a small
image, every subsampling x DCT scale 1, 1/2, 1/4, 1/8. Real photos from the shared ImageNet
sample, given restart markers by jpegtran, get random regions plus their four corner pixels.
"""

from __future__ import annotations

import io
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from batchwire import native
from batchwire.native import jpeg_roi
from oddfiles import noise_image, pil_restart_jpeg
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
SCALES = (1, 2, 4, 8)

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def cjpeg_restart_jpeg(pixels: np.ndarray, sample: str, quality: int) -> bytes:
    """cjpeg writes the samplings PIL cannot (1x2 = 4:4:0, 4x1 = 4:1:1)."""
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    return subprocess.run(
        ["cjpeg", "-sample", f"{sample},1x1,1x1", "-restart", "1B", "-quality", str(quality)],
        input=ppm.getvalue(),
        capture_output=True,
        check=True,
    ).stdout


def mismatches(data: bytes, regions, denom: int) -> list:
    """Regions whose restart-path decode differs from the whole file's (same libjpeg calls)."""
    bad = []
    for region in regions:
        fast = jpeg_roi.decode_jpeg_roi(data, *region, denom, restarts=True)
        whole = jpeg_roi.decode_jpeg_roi(data, *region, denom, restarts=False)
        if fast[1:] != whole[1:] or not np.array_equal(fast[0], whole[0]):
            diff = (
                int(np.abs(fast[0].astype(int) - whole[0]).max())
                if fast[0].shape == whole[0].shape
                else "shape"
            )
            bad.append((region, diff))
    return bad


def every_region(height: int, width: int, sizes=((1, 1), (2, 3), (5, 4))):
    for rh, rw in sizes:
        for y in range(0, height - rh + 1):
            for x in range(0, width - rw + 1):
                yield y, x, y + rh, x + rw


LAYOUT_FILES = [
    *((layout, q) for layout in ("444", "422", "420", "grey") for q in (50, 95)),
]


@pytest.mark.parametrize(("layout", "quality"), LAYOUT_FILES)
def test_every_small_region_of_noise_matches_the_whole_file(layout, quality):
    """37 x 45: partial MCUs on the right and bottom edges, 3 x 3 MCUs at 4:2:0."""
    data = pil_restart_jpeg(noise_image(37, 45, seed=quality), layout, quality)
    assert jpeg_roi.restart_layout(data)[0]["interval"] == 1
    for denom in SCALES:
        h, w = -(-37 // denom), -(-45 // denom)
        assert mismatches(data, every_region(h, w), denom) == [], (layout, denom)


@pytest.mark.skipif(shutil.which("cjpeg") is None, reason="needs cjpeg (libjpeg-turbo-progs)")
@pytest.mark.parametrize("sample", ["1x2", "4x1", "2x2"])
def test_every_small_region_of_cjpeg_samplings_matches_the_whole_file(sample):
    data = cjpeg_restart_jpeg(noise_image(41, 70, seed=3), sample, 80)
    _layout, why = jpeg_roi.restart_layout(data)
    assert why == "", why
    for denom in SCALES:
        h, w = -(-41 // denom), -(-70 // denom)
        regions = every_region(h, w, sizes=((1, 1), (3, 2)))
        assert mismatches(data, regions, denom) == [], (sample, denom)


def test_wide_regions_and_rows_of_noise_match_the_whole_file():
    """Regions spanning several MCUs, whole rows and whole columns, on a 4:2:2 file with
    restart intervals of one MCU and one of whole MCU rows."""
    rng = random.Random(5)
    pixels = noise_image(70, 90, seed=9)
    for data in (
        pil_restart_jpeg(pixels, "422", 75),
        pil_restart_jpeg(pixels, "420", 75),
    ):
        for denom in SCALES:
            h, w = -(-70 // denom), -(-90 // denom)
            regions = [(0, x, h, x + 1) for x in range(w)] + [(y, 0, y + 1, w) for y in range(h)]
            for _ in range(60):
                y0, x0 = rng.randrange(h), rng.randrange(w)
                regions.append((y0, x0, rng.randint(y0 + 1, h), rng.randint(x0 + 1, w)))
            assert mismatches(data, regions, denom) == [], denom


@pytest.mark.skipif(shutil.which("jpegtran") is None, reason="needs jpegtran (libjpeg-turbo-progs)")
@pytest.mark.skipif(not SAMPLE_DIR.is_dir(), reason="needs the shared imagenet-sample")
def test_real_photos_corners_and_random_regions_match_the_whole_file():
    """12 photos spread over the sample (4:2:0, greyscale and odd sizes among them)."""
    rng = random.Random(20)
    for src in sorted(SAMPLE_DIR.glob("*.JPEG"))[::84]:
        data = subprocess.run(
            ["jpegtran", "-restart", "1B", "-copy", "none", str(src)],
            capture_output=True,
            check=True,
        ).stdout
        layout, why = jpeg_roi.restart_layout(data)
        assert why == "", (src.name, why)
        for denom in SCALES:
            h, w = -(-layout["height"] // denom), -(-layout["width"] // denom)
            regions = [(0, 0, 1, 1), (0, w - 1, 1, w), (h - 1, 0, h, 1), (h - 1, w - 1, h, w)]
            for _ in range(8):
                rh, rw = rng.choice((1, 3, 17)), rng.choice((1, 2, 40))
                y0, x0 = rng.randrange(max(1, h - rh)), rng.randrange(max(1, w - rw))
                regions.append((y0, x0, min(h, y0 + rh), min(w, x0 + rw)))
            assert mismatches(data, regions, denom) == [], (src.name, denom)


def test_crop_bitstream_holds_a_context_mcu_around_the_region():
    data = pil_restart_jpeg(noise_image(96, 128, seed=1), "420", 80)
    small, (top, left, bottom, right) = jpeg_roi.crop_bitstream(data, 40, 50, 41, 51)
    assert (top, left, bottom, right) == (16, 32, 64, 80)  # MCUs 1..3 x 2..4 (16 px each)
    assert small.startswith(b"\xff\xd8") and small.endswith(b"\xff\xd9")
