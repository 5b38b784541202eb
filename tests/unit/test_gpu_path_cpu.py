"""The GPU path's per-image CPU work, made cheaper (issue 30 item 6), answers as before.

- `read_header`'s fast path (`jpeg_roi.jpeg_header`: libjpeg's header parse on a handle kept per
  thread, and exif.py's walk ported to C++) must give what TurboJPEG's header call and exif.py
  give wherever it answers, and leave everything else to them: held to both on PIL and cjpeg
  files of every sampling, colour space and EXIF orientation, real photos, 600 damaged headers
  and 600 random EXIF structures.
- `crop_bitstream` now writes the small JPEG straight into the `bytes` it returns: its bytes are
  held to a Python assembly of the same intervals from the file's own bytes (the original's
  header segments but APPn other than JFIF/Adobe and COM, the frame's size rewritten, the
  intervals renumbered RST0..RST7, EOI) over 4:4:4, 4:2:2, 4:2:0, greyscale, 4:4:0, 4:1:1,
  intervals of one and several MCUs, with and without the interval index, and regions inside,
  across and along the edges of the image.
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
from batchwire.native.jpeg_transcode import transcode_restart
from batchwire.pipeline.decode import read_header
from batchwire.pipeline.decode.backends import TJCS_CMYK, TJCS_YCCK, turbo
from batchwire.pipeline.decode.exif import read_orientation
from oddfiles import exif_orientation_block, pil_jpeg, smooth_image
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)
if turbo() is None:
    pytest.skip("TurboJPEG is the reference here and is not installed", allow_module_level=True)

HAVE_CJPEG = shutil.which("cjpeg") is not None


def cjpeg(pixels: np.ndarray, sample: str, *options: str) -> bytes:
    """cjpeg's JPEG of `pixels` with the sampling factors `sample` (e.g. "1x2,1x1,1x1")."""
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    args = ["cjpeg", "-sample", sample, "-quality", "80", *options]
    return subprocess.run(args, input=ppm.getvalue(), capture_output=True, check=True).stdout


def photos(count: int) -> list[bytes]:
    if not SAMPLE_DIR.is_dir():
        return []
    paths = sorted(SAMPLE_DIR.glob("*.JPEG"))
    return [p.read_bytes() for p in paths[:: max(1, len(paths) // count)][:count]]


# ---- read_header's fast path ------------------------------------------------------------------


def header_files() -> list[bytes]:
    pixels = smooth_image(61, 93, seed=2)
    out = [pil_jpeg(pixels, subsampling=s) for s in (0, 1, 2)]
    out += [pil_jpeg(pixels, mode="L"), pil_jpeg(pixels, progressive=True)]
    out += [pil_jpeg(pixels, mode="CMYK"), pil_jpeg(pixels, restart_marker_blocks=1)]
    out += [
        pil_jpeg(pixels, exif=exif_orientation_block(o, big_endian=big))
        for o in range(1, 9)
        for big in (False, True)
    ]
    if HAVE_CJPEG:
        samplings = ("1x1", "2x1", "2x2", "1x2", "4x1", "3x1", "1x4", "4x2")
        out += [cjpeg(pixels, f"{s},1x1,1x1") for s in samplings]
        out += [cjpeg(pixels, "2x1,2x1,1x1"), cjpeg(pixels, "2x2,1x1,2x2")]
        out += [cjpeg(pixels, "2x1,1x1,1x1", "-rgb"), cjpeg(pixels, "1x1", "-arithmetic")]
    return out + photos(60)


def turbo_answer(data: bytes) -> tuple[int, int, bool] | None:
    """(height, width, routed to "jpeg") from TurboJPEG's header call, or None when it refuses."""
    tj = turbo()
    tj.take_warnings()
    try:
        w, h, _subsample, colorspace = tj.decode_header(data)
    except OSError:
        return None
    finally:
        tj.take_warnings()
    return h, w, colorspace not in (TJCS_CMYK, TJCS_YCCK)


def assert_fast_path_agrees(data: bytes) -> bool:
    """The fast path's answer, where it gives one, is TurboJPEG's and exif.py's; True if it did."""
    found = jpeg_roi.jpeg_header(data)
    if found is None:
        return False
    height, width, orientation = found
    assert turbo_answer(data) == (height, width, True)
    assert orientation == read_orientation(data)
    return True


def test_fast_header_agrees_with_turbojpeg_and_exif_on_every_kind_of_file():
    files = header_files()
    answered = [assert_fast_path_agrees(d) for d in files]
    # Every plain colour or grey JPEG is answered; CMYK, arithmetic coding and the samplings
    # TurboJPEG has no name for (3x1, 1x4, 4x2, chroma not 1x1) are left to TurboJPEG.
    pixels = smooth_image(61, 93, seed=2)
    assert answered[:5] == [True] * 5
    assert not jpeg_roi.jpeg_header(pil_jpeg(pixels, mode="CMYK"))
    if HAVE_CJPEG:
        assert jpeg_roi.jpeg_header(cjpeg(pixels, "4x1,1x1,1x1")) is not None
        assert jpeg_roi.jpeg_header(cjpeg(pixels, "1x2,1x1,1x1")) is not None
        for odd in ("3x1,1x1,1x1", "2x1,2x1,1x1", "2x2,1x1,2x2"):
            assert jpeg_roi.jpeg_header(cjpeg(pixels, odd)) is None
        assert jpeg_roi.jpeg_header(cjpeg(pixels, "1x1", "-arithmetic")) is None


@pytest.mark.parametrize("orientation", range(1, 9))
def test_read_header_turns_exif_orientations_as_before(orientation):
    data = pil_jpeg(smooth_image(40, 70, seed=1), exif=exif_orientation_block(orientation))
    header = read_header(data)
    assert jpeg_roi.jpeg_header(data) == (40, 70, orientation)
    assert header.orientation == orientation == read_orientation(data)
    assert (header.height, header.width) == ((70, 40) if orientation >= 5 else (40, 70))
    assert header.kind == "jpeg"


def test_damaged_headers_are_answered_as_turbojpeg_or_left_to_it():
    rng = random.Random(7)
    sources = [d for d in header_files() if len(d) > 700][:30]
    answered = 0
    for _ in range(600):
        data = bytearray(rng.choice(sources))
        sos = data.find(b"\xff\xda")
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(2, sos + 12)
            data[at] = rng.choice((0x00, 0xFF, 0x01, 0xD9, 0xDA, 0xC2, rng.randrange(256)))
        if rng.random() < 0.2:
            data = data[: rng.randrange(2, len(data))]
        answered += assert_fast_path_agrees(bytes(data))
    assert answered > 100  # most single-byte damage leaves a header libjpeg still reads


def random_tiff(rng: random.Random) -> bytes:
    """A TIFF structure of a few IFD0 entries, Orientation among them or not, with the values,
    types, counts and offsets a broken writer might leave."""
    e = rng.choice("<>")
    head = b"II*\x00" if e == "<" else b"MM\x00*"
    if rng.random() < 0.05:
        head = b"II*\x01"
    entries = []
    for _ in range(rng.randint(0, 5)):
        tag = rng.choice((0x0112, 0x0112, 0x010F, 0x0110, 0x8769))
        typ = rng.choice((3, 3, 4, 1, 5))
        count = rng.choice((1, 1, 0, 2))
        value = rng.choice((*range(1, 9), 0, 9, 0x10006, 0xFFFF)) & (0xFFFF if typ == 3 else ~0)
        packed = struct.pack(e + "H", value) + b"\0\0" if typ == 3 else struct.pack(e + "I", value)
        entries.append(struct.pack(e + "HHI", tag, typ, count) + packed)
    declared = rng.choice((len(entries), len(entries), 0, 5000, len(entries) + 3))
    ifd = struct.pack(e + "H", declared & 0xFFFF) + b"".join(entries) + b"\0\0\0\0"
    offset = rng.choice((8, 8, 8, 4, 7, 1 << 31, 8 + len(ifd)))
    tiff = head + struct.pack(e + "I", offset) + ifd
    return tiff[: rng.randrange(len(tiff) + 1)] if rng.random() < 0.15 else tiff


def edge_tiffs() -> list[bytes]:
    """TIFFs exif.py refuses that a loose port would read: an IFD offset into the TIFF's own
    header (4, with an Orientation 6 entry where that IFD's second entry would be), too short."""
    into_header = b"II*\x00" + struct.pack("<I", 4) + bytes(10)
    into_header += struct.pack("<HHIH", 0x0112, 3, 1, 6) + bytes(2)
    return [into_header, b"II*\x00\x08\x00\x00", b"", b"MM\x00*"]


def test_random_exif_orientations_read_as_exif_py_reads_them():
    rng = random.Random(11)
    pixels = smooth_image(24, 32, seed=4)
    base = pil_jpeg(pixels)
    seen = set()
    edges = edge_tiffs()
    for n in range(600):
        tiff = edges[n] if n < len(edges) else random_tiff(rng)
        payload = b"Exif\x00\x00" + tiff
        app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
        if rng.random() < 0.1:  # a second APP1: only the first counts, as in PIL
            app1 += b"\xff\xe1\x00\x0cExif\x00\x00" + exif_orientation_block(6)[6:12]
        data = base[:2] + app1 + base[2:]
        assert assert_fast_path_agrees(data)
        seen.add(jpeg_roi.jpeg_header(data)[2])
    assert seen == set(range(1, 9))


# ---- crop_bitstream's bytes -------------------------------------------------------------------


def reference_cut(data: bytes, region: tuple[int, int, int, int]) -> bytes:
    """The small JPEG of the restart intervals holding `region` (stored pixels, on MCU bounds
    but at the image's right and bottom edges), assembled from the file's own bytes."""
    pos, kept, frame, interval = 2, [], None, 0
    while True:
        while data[pos] == 0xFF:
            pos += 1
        marker, length = data[pos], int.from_bytes(data[pos + 1 : pos + 3], "big")
        payload = bytearray(data[pos + 1 : pos + 1 + length])
        if marker in (0xC0, 0xC1):
            frame = payload
        if marker == 0xDD:
            interval = int.from_bytes(payload[2:4], "big")
        if (marker in (0xE0, 0xEE)) if 0xE0 <= marker <= 0xEF else marker != 0xFE:
            kept.append((marker, payload))
        pos += 1 + length
        if marker == 0xDA:
            break
    intervals, begin = [], pos
    while True:
        ff = data.index(b"\xff", pos)
        nxt = ff + 1
        while data[nxt] == 0xFF:
            nxt += 1
        if data[nxt] == 0x00:
            pos = nxt + 1
            continue
        intervals.append(data[begin:ff])
        if data[nxt] == 0xD9:
            break
        begin = pos = nxt + 1
    width = int.from_bytes(frame[5:7], "big")
    factors = [(frame[9 + 3 * i] >> 4, frame[9 + 3 * i] & 15) for i in range(frame[7])]
    mcu_w = 8 * max(f[0] for f in factors) if len(factors) > 1 else 8
    mcu_h = 8 * max(f[1] for f in factors) if len(factors) > 1 else 8
    per_row = -(-width // mcu_w) // interval
    top, left, bottom, right = region
    frame[3:7] = struct.pack(">HH", bottom - top, right - left)
    out = bytearray(b"\xff\xd8")
    for marker, payload in kept:
        out += bytes((0xFF, marker)) + payload
    chosen = [
        intervals[row * per_row + k]
        for row in range(top // mcu_h, -(-bottom // mcu_h))
        for k in range(left // mcu_w // interval, -(-right // mcu_w) // interval)
    ]
    for n, piece in enumerate(chosen):
        if n:
            out += bytes((0xFF, 0xD0 + (n - 1) % 8))
        out += piece
    return bytes(out + b"\xff\xd9")


def cut_files() -> list[bytes]:
    pixels = smooth_image(131, 197, seed=9)
    out = [pil_jpeg(pixels, restart_marker_blocks=1, subsampling=s) for s in (0, 1, 2)]
    out.append(pil_jpeg(pixels, restart_marker_blocks=1, mode="L"))
    out.append(pil_jpeg(pixels, restart_marker_blocks=1, exif=exif_orientation_block(6)))
    if HAVE_CJPEG:
        out += [cjpeg(pixels, f"{s},1x1,1x1", "-restart", "1B") for s in ("1x2", "4x1")]
    out += [transcode_restart(d, 4, fit_rows=True) for d in out[:3]]  # several MCUs each
    for photo in photos(12):
        try:
            out.append(transcode_restart(photo, 4, fit_rows=True))
        except ValueError:  # the sample's few corrupt files
            continue
    return out + [jpeg_roi.with_interval_index(d) for d in out]


def test_crop_bytes_are_the_intervals_of_the_file_assembled_as_before():
    rng = random.Random(3)
    cuts = 0
    for data in cut_files():
        layout, why = jpeg_roi.restart_layout(data)
        assert layout is not None, why
        h, w = layout["height"], layout["width"]
        regions = [(0, 0, h, w), (0, 0, 1, 1), (h - 1, w - 1, h, w), (h // 2, 0, h // 2 + 1, w)]
        for _ in range(10):
            y0, x0 = rng.randrange(h), rng.randrange(w)
            regions.append((y0, x0, rng.randint(y0 + 1, h), rng.randint(x0 + 1, w)))
        for y0, x0, y1, x1 in regions:
            small, held = jpeg_roi.crop_bitstream(data, y0, x0, y1, x1)
            assert held[0] <= y0 and held[1] <= x0 and held[2] >= y1 and held[3] >= x1
            assert type(small) is bytes
            assert small == reference_cut(data, held)
            cuts += 1
    assert cuts >= 14 * 16
