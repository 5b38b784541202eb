"""Restart-marker random access (native/csrc/jpeg_restart.cpp) and its users.

What must hold: for a JPEG whose restart intervals tile its MCU rows, `decode_jpeg_roi` (which
then decodes a small JPEG of the intervals under the region) returns exactly the region and
pixels that reading the whole file gives (`restarts=False` takes that path), at every DCT scale
(exhaustively on noise: tests/unit/test_restart_exact.py);
`crop_bitstream`'s small JPEG is a valid JPEG that an independent decoder (PIL) reads as the
file's pixels away from its cut edges; files without such a layout are named and read as
before; damage inside the crop still fails; `narrow_request` (the GPU decoders' cut) keeps the
crop's pixels for every EXIF orientation.
"""

from __future__ import annotations

import io
import random
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from batchwire import native
from batchwire.native import jpeg_roi
from batchwire.pipeline.decode import read_header
from batchwire.pipeline.decode.contract import DecodeRequest
from batchwire.pipeline.decode.region import reach_region
from batchwire.pipeline.decode.restart import narrow_request
from batchwire.pipeline.decode.whole import decode_pixels
from oddfiles import exif_orientation_block, smooth_image
from oddfiles import pil_jpeg as encode
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def rst_count(data: bytes) -> int:
    """Restart markers in a file (our own count: FF D0..D7 cannot occur stuffed)."""
    return sum(data.count(bytes((0xFF, m))) for m in range(0xD0, 0xD8))


# (subsampling or mode, MCU height, MCU width)
LAYOUTS = [(0, 8, 8), (1, 8, 16), (2, 16, 16), ("L", 8, 8)]


def layout_file(kind, height: int, width: int, seed: int = 0, **options) -> bytes:
    pixels = smooth_image(height, width, seed)
    if kind == "L":
        return encode(pixels, mode="L", **options)
    return encode(pixels, subsampling=kind, **options)


@pytest.mark.parametrize(("kind", "mcu_h", "mcu_w"), LAYOUTS)
@pytest.mark.parametrize(("height", "width"), [(120, 200), (33, 17), (375, 500)])
def test_layout_of_files_with_a_restart_after_every_mcu(kind, mcu_h, mcu_w, height, width):
    data = layout_file(kind, height, width, restart_marker_blocks=1)
    layout, why = jpeg_roi.restart_layout(data)
    assert why == "" and layout is not None
    rows, cols = -(-height // mcu_h), -(-width // mcu_w)
    assert layout == {
        "height": height,
        "width": width,
        "mcu_height": mcu_h,
        "mcu_width": mcu_w,
        "mcu_rows": rows,
        "mcus_per_row": cols,
        "interval": 1,
        "intervals": rows * cols,
    }
    assert rst_count(data) == rows * cols - 1


def test_layouts_that_cannot_be_entered_say_why():
    pixels = smooth_image(64, 112)  # 4:2:0: 7 MCUs per row
    cases = {
        "no restart markers": encode(pixels),
        "progressive": encode(pixels, progressive=True, restart_marker_blocks=1),
        "straddle": encode(pixels, restart_marker_blocks=3),
        "not a JPEG": b"\x89PNG\r\n\x1a\n" + bytes(64),
    }
    for expected, data in cases.items():
        layout, why = jpeg_roi.restart_layout(data)
        assert layout is None and expected in why, (expected, why)
    whole_rows = encode(pixels, restart_marker_rows=1)
    layout, why = jpeg_roi.restart_layout(whole_rows)
    assert why == "" and layout["interval"] == 7 and layout["intervals"] == 4

    good = encode(pixels, restart_marker_blocks=1)
    assert jpeg_roi.restart_layout(good[: len(good) // 2])[0] is None  # truncated: no EOI
    claims = bytearray(good)  # a frame of 60000 x 60000: intervals the file cannot hold
    struct.pack_into(">HH", claims, claims.find(b"\xff\xc0") + 5, 60000, 60000)
    layout, why = jpeg_roi.restart_layout(bytes(claims))
    assert layout is None and "fewer intervals" in why
    first = good.index(b"\xff\xd0")
    swapped = bytearray(good)
    swapped[first + 1] = 0xD3
    layout, why = jpeg_roi.restart_layout(bytes(swapped))
    assert layout is None and "out of order" in why


def random_regions(rng: random.Random, height: int, width: int, count: int):
    for _ in range(count):
        h, w = rng.randint(1, height), rng.randint(1, width)
        y0, x0 = rng.randint(0, height - h), rng.randint(0, width - w)
        yield y0, x0, y0 + h, x0 + w


@pytest.mark.parametrize(("kind", "mcu_h", "mcu_w"), LAYOUTS)
def test_restart_path_returns_the_whole_files_region_and_pixels(kind, mcu_h, mcu_w):
    data = layout_file(kind, 181, 243, seed=3, restart_marker_blocks=1)
    plain = layout_file(kind, 181, 243, seed=3)  # same coefficients, no restart markers
    rng = random.Random(7)
    for denom in (1, 2, 4, 8):
        h, w = -(-181 // denom), -(-243 // denom)
        for region in random_regions(rng, h, w, 25):
            fast = jpeg_roi.decode_jpeg_roi(data, *region, denom)
            whole_file = jpeg_roi.decode_jpeg_roi(data, *region, denom, restarts=False)
            no_markers = jpeg_roi.decode_jpeg_roi(plain, *region, denom)
            for other in (whole_file, no_markers):
                assert fast[1:] == other[1:], (denom, region)
                np.testing.assert_array_equal(fast[0], other[0], err_msg=f"{denom} {region}")


def test_restart_path_on_files_restarting_every_row():
    data = layout_file(2, 150, 260, seed=5, restart_marker_rows=1)
    rng = random.Random(1)
    for region in random_regions(rng, 150, 260, 20):
        fast = jpeg_roi.decode_jpeg_roi(data, *region, 1)
        whole_file = jpeg_roi.decode_jpeg_roi(data, *region, 1, restarts=False)
        assert fast[1:] == whole_file[1:]
        np.testing.assert_array_equal(fast[0], whole_file[0])


def test_crop_bitstream_is_a_jpeg_of_the_files_pixels_for_pil():
    """An independent decoder reads the small JPEG as the file's pixels, except within
    EDGE margin of its cut edges (upsampling replicates there)."""
    data = layout_file(2, 200, 300, seed=9, restart_marker_blocks=1)
    whole = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    rng = random.Random(2)
    for y0, x0, y1, x1 in random_regions(rng, 200, 300, 30):
        small, (ty, tx, by, bx) = jpeg_roi.crop_bitstream(data, y0, x0, y1, x1)
        assert ty <= y0 and tx <= x0 and by >= y1 and bx >= x1
        assert ty % 16 == 0 and tx % 16 == 0 and len(small) <= len(data) + 16
        got = np.asarray(Image.open(io.BytesIO(small)).convert("RGB"))
        assert got.shape == (by - ty, bx - tx, 3)
        m = 2  # pixels of upsampling reach at a cut edge (none at the image's own edges)
        iy0, ix0 = (m if ty > 0 else 0), (m if tx > 0 else 0)
        iy1 = got.shape[0] - (m if by < 200 else 0)
        ix1 = got.shape[1] - (m if bx < 300 else 0)
        np.testing.assert_array_equal(
            got[iy0:iy1, ix0:ix1], whole[ty + iy0 : ty + iy1, tx + ix0 : tx + ix1]
        )
    assert jpeg_roi.crop_bitstream(layout_file(2, 64, 64), 0, 0, 8, 8) is None


def test_damage_inside_the_crop_fails_and_outside_is_not_read():
    """Strict decoding holds for what is read; what lies outside the crop is never read (the
    file's integrity is what `pipeline-prepare` checks, once)."""
    data = layout_file(2, 256, 256, seed=4, restart_marker_blocks=1)
    layout, _ = jpeg_roi.restart_layout(data)
    starts = [
        i + 2 for i in range(len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7
    ]
    per_row = layout["mcus_per_row"]
    # Interval 5 * per_row + 5 is MCU row 5, column 5: pixels (80..96, 80..96).
    target = starts[5 * per_row + 5 - 1]
    bad = bytearray(data)
    bad[target : target + 6] = b"\xaa\x55\xaa\x55\x00\x00"
    with pytest.raises(jpeg_roi.JpegRoiError):
        jpeg_roi.decode_jpeg_roi(bytes(bad), 70, 70, 110, 110, 1, verify=False)
    far = jpeg_roi.decode_jpeg_roi(bytes(bad), 200, 200, 250, 250, 1, verify=False)
    intact = jpeg_roi.decode_jpeg_roi(data, 200, 200, 250, 250, 1, verify=False)
    np.testing.assert_array_equal(far[0], intact[0])
    with pytest.raises(jpeg_roi.JpegRoiError):  # the whole-file check still sees it
        jpeg_roi.decode_jpeg_roi(bytes(bad), 200, 200, 250, 250, 1, restarts=False)
    with pytest.raises(jpeg_roi.JpegRoiError):
        jpeg_roi.check_jpeg(bytes(bad))


def test_broken_restart_structure_fails_every_crop():
    """Issue 20: markers out of order, an interval dropped or doubled, no EOI: the scan's
    structure is checked whole, so every crop fails (no silent fall-back to another read)."""
    data = layout_file(2, 128, 128, seed=6, restart_marker_blocks=1)
    starts = [i for i in range(len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]
    renumbered = bytearray(data)
    renumbered[starts[40] + 1] ^= 0x01
    dropped = data[: starts[40]] + data[starts[41] :]
    doubled = data[: starts[41]] + data[starts[40] : starts[41]] + data[starts[41] :]
    for bad in (bytes(renumbered), dropped, doubled, data[:-2]):
        with pytest.raises(jpeg_roi.JpegRoiError):
            jpeg_roi.check_jpeg(bad)
        for region in ((0, 0, 8, 8), (120, 120, 128, 128), (0, 0, 128, 128)):
            with pytest.raises(jpeg_roi.JpegRoiError, match=r"restart|EOI|Premature|Corrupt"):
                jpeg_roi.decode_jpeg_roi(bad, *region, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_narrow_request_keeps_the_crops_pixels(orientation):
    """The GPU decoders' cut, checked with the CPU's whole-image decode: the resize's reach
    holds the same pixels from the small JPEG as from the file, for every EXIF orientation."""
    pixels = smooth_image(150, 230, seed=orientation)
    data = encode(pixels, restart_marker_blocks=1, exif=exif_orientation_block(orientation))
    header = read_header(data)
    rng = random.Random(orientation)
    for _ in range(12):
        y0, x0, y1, x1 = next(random_regions(rng, header.height, header.width, 1))
        box = (y0 + 0.3, x0 + 0.6, y1 - 0.2, x1 - 0.1)
        if box[2] <= box[0] or box[3] <= box[1]:
            continue
        req = DecodeRequest(index=0, data=data, header=header, box=box, out_hw=(32, 48))
        small = narrow_request(req)
        assert small.data != data and len(small.data) < len(data) + 64
        if orientation != 1:
            assert narrow_request(req, upright_only=True) is req
        full = decode_pixels(data, header, (1, 1))  # GPU decoders decode at full size
        cut = decode_pixels(small.data, small.header, (1, 1))
        assert cut.shape == (small.header.height, small.header.width, 3)
        dy, dx = box[0] - small.box[0], box[1] - small.box[1]
        assert dy == int(dy) and dx == int(dx) and small.box[2] - small.box[0] == box[2] - box[0]
        dy, dx = int(dy), int(dx)
        ry0, rx0, ry1, rx1 = reach_region(box, req.out_hw, full.shape[:2])
        np.testing.assert_array_equal(
            cut[ry0 - dy : ry1 - dy, rx0 - dx : rx1 - dx], full[ry0:ry1, rx0:rx1]
        )


def test_narrow_request_leaves_other_files_alone():
    pixels = smooth_image(64, 64)
    for data in (encode(pixels), encode(pixels, progressive=True, restart_marker_blocks=1)):
        req = DecodeRequest(0, data, read_header(data), (1.0, 1.0, 50.0, 50.0), (16, 16))
        assert narrow_request(req) is req
    oriented = encode(pixels, restart_marker_blocks=1, exif=exif_orientation_block(6))
    req = DecodeRequest(0, oriented, read_header(oriented), (1.0, 1.0, 50.0, 50.0), (16, 16))
    assert narrow_request(req, upright_only=True) is req
    assert narrow_request(req) is not req


@pytest.mark.skipif(shutil.which("jpegtran") is None, reason="needs jpegtran (libjpeg-turbo-progs)")
@pytest.mark.skipif(not SAMPLE_DIR.is_dir(), reason="needs ../shared/imagenet-sample")
def test_real_photos_rewritten_by_jpegtran_decode_to_the_originals_regions(tmp_path):
    """jpegtran as an independent writer of restart-marker files (batchwire never runs it)."""
    rng = random.Random(11)
    for src in sorted(SAMPLE_DIR.glob("*.JPEG"))[::100]:
        original = src.read_bytes()
        rewritten = subprocess.run(
            ["jpegtran", "-restart", "1B", "-optimize", "-copy", "all", str(src)],
            capture_output=True,
            check=True,
        ).stdout
        layout, why = jpeg_roi.restart_layout(rewritten)
        assert why == "", (src.name, why)
        for denom in (1, 2, 4):
            h, w = -(-layout["height"] // denom), -(-layout["width"] // denom)
            for region in random_regions(rng, h, w, 6):
                fast = jpeg_roi.decode_jpeg_roi(rewritten, *region, denom, verify=False)
                before = jpeg_roi.decode_jpeg_roi(original, *region, denom, verify=False)
                assert fast[1:] == before[1:]
                np.testing.assert_array_equal(fast[0], before[0])


def test_restart_share_samples_files_and_never_opens_a_fifo(tmp_path):
    """The server's start-up probe: counts JPEGs with a restart layout among the sampled files;
    a FIFO named by a list file is skipped without blocking, non-JPEGs are not counted."""
    import os

    from batchwire.pipeline.decode.restart import restart_share

    pixels = smooth_image(64, 64)
    paths = []
    for name, data in {
        "marked.jpg": encode(pixels, restart_marker_blocks=1),
        "plain.jpg": encode(pixels),
        "text.jpg": b"not an image",
    }.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    os.mkfifo(tmp_path / "fifo.jpg")
    paths.append(str(tmp_path / "fifo.jpg"))
    assert restart_share(paths) == (1, 2)
    assert restart_share([]) == (0, 0)
