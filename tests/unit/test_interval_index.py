"""The interval index (native/csrc/jpeg_index.h, issues 30.6 and 32.2): pipeline-prepare records
where each restart interval begins, so that the restart decode path and `crop_bitstream` find a
crop's intervals without scanning the file.

What must hold: a file with the index gives exactly the crop bytes and pixels the same file
without it gives (the scan's), over every subsampling (4:4:4, 4:2:2, 4:2:0, greyscale, and
cjpeg's 4:4:0 / 4:1:1), DCT scale and a spread of regions, for restart intervals of one MCU and
of several, and real photos; the index is really used (`index_agrees`); an
index that is damaged, truncated or inconsistent with the file (wrong count, offsets off the
data or off the markers, swapped, stale, another version) is ignored, never giving another
picture or a crash; an index that does not match the file's intervals is never trusted; a file
without one (prepared before it existed) is read by the scan as before.
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
from batchwire.native.jpeg_transcode import transcode_available, transcode_restart
from oddfiles import noise_image, pil_restart_jpeg
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
SCALES = (1, 2, 4, 8)
SIGNATURE = b"batchwire-intervals\0"

if not native.jpeg_roi_available() or not transcode_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def cjpeg_restart_jpeg(pixels: np.ndarray, sample: str) -> bytes:
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    return subprocess.run(
        ["cjpeg", "-sample", f"{sample},1x1,1x1", "-restart", "1B", "-quality", "80"],
        input=ppm.getvalue(),
        capture_output=True,
        check=True,
    ).stdout


def index_span(data: bytes) -> tuple[int, int]:
    """(start of the APP9 segment's FF, end of the segment) of the file's interval index."""
    at = data.index(SIGNATURE) - 4
    assert data[at : at + 2] == b"\xff\xe9"
    return at, at + 2 + int.from_bytes(data[at + 2 : at + 4], "big")


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varints(payload: bytes) -> list[int]:
    values, value, shift = [], 0, 0
    for byte in payload:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            values.append(value)
            value, shift = 0, 0
    return values


def with_entries(data: bytes, entries: list[int], version: int = 1, tail: bytes = b"") -> bytes:
    """`data` (indexed) with its index replaced by one of these varints (count first), then
    `tail`."""
    at, end = index_span(data)
    payload = SIGNATURE + bytes([version]) + b"".join(varint(v) for v in entries) + tail
    return data[:at] + b"\xff\xe9" + (len(payload) + 2).to_bytes(2, "big") + payload + data[end:]


def entries_of(data: bytes) -> list[int]:
    at, end = index_span(data)
    return read_varints(data[at + 4 + len(SIGNATURE) + 1 : end])


def regions_for(h: int, w: int, rng: random.Random, count: int = 12):
    """Corners, a whole row and column, and random regions of the scaled image."""
    out = [(0, 0, 1, 1), (0, w - 1, 1, w), (h - 1, 0, h, 1), (h - 1, w - 1, h, w), (0, 0, h, w)]
    out += [(h // 2, 0, h // 2 + 1, w), (0, w // 2, h, w // 2 + 1)]
    for _ in range(count):
        y0, x0 = rng.randrange(h), rng.randrange(w)
        out.append((y0, x0, rng.randint(y0 + 1, h), rng.randint(x0 + 1, w)))
    return out


def assert_same_as_without_index(plain: bytes, seed: int = 0) -> bytes:
    """Indexes `plain`, checks the index is used, and that every scale x region gives the same
    region and pixels as the plain file (and as the whole file's decode), and the same crop
    bytes. Returns the indexed file."""
    indexed = jpeg_roi.with_interval_index(plain)
    assert jpeg_roi.index_agrees(indexed) and not jpeg_roi.index_agrees(plain)
    layout, why = jpeg_roi.restart_layout(indexed)
    assert why == "" and layout == jpeg_roi.restart_layout(plain)[0], why
    rng = random.Random(seed)
    for denom in SCALES:
        h, w = -(-layout["height"] // denom), -(-layout["width"] // denom)
        for region in regions_for(h, w, rng):
            fast = jpeg_roi.decode_jpeg_roi(indexed, *region, denom)
            slow = jpeg_roi.decode_jpeg_roi(plain, *region, denom)
            whole = jpeg_roi.decode_jpeg_roi(plain, *region, denom, restarts=False)
            assert fast[1:] == slow[1:] == whole[1:], (region, denom)
            np.testing.assert_array_equal(fast[0], slow[0])
            np.testing.assert_array_equal(fast[0], whole[0])
    h, w = layout["height"], layout["width"]
    for region in regions_for(h, w, rng):
        assert jpeg_roi.crop_bitstream(indexed, *region) == jpeg_roi.crop_bitstream(plain, *region)
    return indexed


@pytest.mark.parametrize("layout", ["444", "422", "420", "grey"])
def test_index_gives_the_scans_pixels_and_crops_for_every_sampling(layout):
    """37 x 45 noise (partial MCUs at the edges), one MCU per interval; 70 x 90 rewritten with up
    to 4 MCUs per interval as pipeline-prepare does."""
    assert_same_as_without_index(pil_restart_jpeg(noise_image(37, 45, seed=1), layout), seed=1)
    rewritten = transcode_restart(
        pil_restart_jpeg(noise_image(70, 90, seed=2), layout), 4, fit_rows=True
    )
    assert jpeg_roi.restart_layout(rewritten)[0]["interval"] > 1
    assert_same_as_without_index(rewritten, seed=2)


@pytest.mark.skipif(shutil.which("cjpeg") is None, reason="needs cjpeg (libjpeg-turbo-progs)")
@pytest.mark.parametrize("sample", ["1x2", "4x1"])
def test_index_gives_the_scans_pixels_for_cjpeg_samplings(sample):
    assert_same_as_without_index(cjpeg_restart_jpeg(noise_image(41, 70, seed=3), sample), seed=3)


@pytest.mark.skipif(not SAMPLE_DIR.is_dir(), reason="needs the shared imagenet-sample")
def test_index_gives_the_scans_pixels_on_prepared_real_photos():
    """Photos spread over the sample, rewritten as pipeline-prepare's `auto` does."""
    for src in sorted(SAMPLE_DIR.glob("*.JPEG"))[::125]:
        plain = transcode_restart(src.read_bytes(), 4, fit_rows=True)
        indexed = assert_same_as_without_index(plain, seed=len(plain))
        intervals = jpeg_roi.restart_layout(plain)[0]["intervals"]
        assert len(indexed) - len(plain) <= 2 * intervals + 32  # intervals under 16 kB: 2 bytes


def test_indexing_is_idempotent_and_replaces_an_earlier_index():
    """pipeline-prepare's transcoder copies a source's APPn segments, so a prepared file
    prepared again carries the old index: it is replaced, never doubled."""
    plain = pil_restart_jpeg(noise_image(40, 48, seed=4), "420")
    indexed = jpeg_roi.with_interval_index(plain)
    assert jpeg_roi.with_interval_index(indexed) == indexed
    assert indexed.count(SIGNATURE) == 1
    stale = with_entries(indexed, [5, 100, 100, 100, 100, 100])  # an earlier, wrong index
    assert jpeg_roi.with_interval_index(stale) == indexed
    assert jpeg_roi.has_interval_index(indexed) is True
    assert jpeg_roi.has_interval_index(plain) is False
    assert jpeg_roi.has_interval_index(indexed[:30]) is None  # read more
    assert jpeg_roi.has_interval_index(b"not a jpeg") is False
    with pytest.raises(ValueError, match="no restart layout"):
        jpeg_roi.with_interval_index(jpeg_without_restarts())


def jpeg_without_restarts() -> bytes:
    out = io.BytesIO()
    Image.fromarray(noise_image(16, 16, seed=0)).save(out, "JPEG")
    return out.getvalue()


def outcome(data: bytes, region: tuple[int, int, int, int], denom: int):
    """The decode's region and pixels, or the error's type."""
    try:
        pixels, got, full = jpeg_roi.decode_jpeg_roi(data, *region, denom)
    except jpeg_roi.JpegRoiError:
        return "error"
    return got, full, pixels.tobytes()


def inconsistent_indexes(indexed: bytes) -> dict[str, bytes]:
    """Well-formed indexes that disagree with the file."""
    entries = entries_of(indexed)
    count, steps = entries[0], entries[1:]
    assert len(steps) == count
    swapped = steps.copy()
    j = next(i for i in range(1, count - 1) if steps[i] != steps[i + 1])
    swapped[j], swapped[j + 1] = swapped[j + 1], swapped[j]
    eight = steps.copy()  # interval 3 claims 8 more intervals: later boundaries shift by 8
    eight[3] += sum(steps[4:12])
    return {
        "count + 1": with_entries(indexed, [count + 1, *steps, 10]),
        "count - 1": with_entries(indexed, [count - 1, *steps[:-1]]),
        "count 0": with_entries(indexed, [0]),
        "swapped": with_entries(indexed, [count, *swapped]),
        "8 intervals on": with_entries(indexed, [count, *eight]),
        "first one byte short": with_entries(
            indexed, [count, steps[0] - 1, steps[1] + 1, *steps[2:]]
        ),
        "past the end": with_entries(indexed, [count, *steps[:-1], steps[-1] + 4]),
        "end short of EOI": with_entries(indexed, [count, *steps[:-1], steps[-1] - 1]),
        "huge offset": with_entries(indexed, [count, 2**32 - 1, *steps[1:]]),
        "version 2": with_entries(indexed, entries, version=2),
        "left over": with_entries(indexed, [*entries, 7]),
        "truncated varint": with_entries(indexed, [count, *steps[:-1]], tail=b"\x85"),
    }


def test_inconsistent_indexes_are_ignored_for_the_scan():
    """Every way a well-formed index can disagree with the file: the scan is used, so the
    layout, the pixels and the crop bytes are the plain file's."""
    plain = transcode_restart(
        pil_restart_jpeg(noise_image(64, 80, seed=5), "420"), 2, fit_rows=True
    )
    indexed = jpeg_roi.with_interval_index(plain)
    scanned, _ = jpeg_roi.restart_layout(plain)
    regions = [(0, 0, 64, 80), (10, 20, 30, 50), (40, 60, 64, 80)]
    for name, bad in inconsistent_indexes(indexed).items():
        layout, why = jpeg_roi.restart_layout(bad)
        assert layout == scanned and not jpeg_roi.index_agrees(bad), (name, why)
        for region in regions:
            assert outcome(bad, region, 1) == outcome(plain, region, 1), name
            assert jpeg_roi.crop_bitstream(bad, *region) == jpeg_roi.crop_bitstream(plain, *region)


def test_an_index_of_another_file_is_never_trusted():
    """Same frame and MCU layout, other content: the other file's interval lengths."""
    a = pil_restart_jpeg(noise_image(48, 48, seed=6), "420")
    b = pil_restart_jpeg(noise_image(48, 48, seed=7) // 2, "420")
    a_indexed, b_indexed = jpeg_roi.with_interval_index(a), jpeg_roi.with_interval_index(b)
    transplanted = with_entries(a_indexed, entries_of(b_indexed))
    assert not jpeg_roi.index_agrees(transplanted)
    assert outcome(transplanted, (0, 0, 48, 48), 1) == outcome(a, (0, 0, 48, 48), 1)


def test_random_damage_to_the_index_never_changes_the_picture():
    """Fuzz: random byte flips and truncations of the APP9 segment (payload, signature, version,
    length field, marker). Inside the payload the file stays a sound JPEG: the index is used only
    where it still agrees, so pixels and crop bytes are the intact file's. Damage to the length
    field or marker breaks the file's header: the decode may fail, but never returns other
    pixels. No crash either way."""
    plain = transcode_restart(
        pil_restart_jpeg(noise_image(56, 72, seed=8), "422"), 4, fit_rows=True
    )
    indexed = jpeg_roi.with_interval_index(plain)
    at, end = index_span(indexed)
    rng = random.Random(8)
    regions = [(0, 0, 56, 72), (20, 30, 40, 60)]
    intact = {r: outcome(plain, r, 1) for r in regions}
    crops = {r: jpeg_roi.crop_bitstream(plain, *r) for r in regions}
    used = 0  # damaged indexes the decoder took
    for trial in range(400):
        bad = bytearray(indexed)
        if trial % 4 == 3:  # truncate the payload, length field kept consistent
            cut = rng.randrange(at + 4, end)
            bad[cut:end] = b""
            bad[at + 2 : at + 4] = (cut - at - 2).to_bytes(2, "big")
            header_intact = cut - at - 2 >= 2
        else:
            for _ in range(rng.choice((1, 1, 2, 5))):
                pos = rng.randrange(at, end) if trial % 2 else rng.randrange(at + 4 + 21, end)
                bad[pos] ^= 1 << rng.randrange(8)
            header_intact = bad[at : at + 4] == indexed[at : at + 4]
        bad = bytes(bad)
        used += jpeg_roi.index_agrees(bad) and bad != indexed  # flips may cancel
        for region in regions:
            got = outcome(bad, region, 1)
            if header_intact:
                assert got == intact[region], trial
                assert jpeg_roi.crop_bitstream(bad, *region) == crops[region], trial
            else:
                assert got in ("error", intact[region]), trial
                jpeg_roi.crop_bitstream(bad, *region)  # no crash
    assert used == 0  # only the exact index agrees with the file


def test_too_many_intervals_for_one_segment_give_an_empty_index():
    """A 2048 x 2056 greyscale file with a restart after every 8 x 8 block: 65,792 intervals,
    more than one APP9 segment can list. It gets an index that records none (so a rerun of
    pipeline-prepare sees the file as done), and is read by the scan."""
    grey = np.random.default_rng(9).integers(0, 256, (2056, 2048), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(grey).save(out, "JPEG", quality=50, restart_marker_blocks=1)
    plain = out.getvalue()
    assert jpeg_roi.restart_layout(plain)[0]["intervals"] == 65792
    indexed = jpeg_roi.with_interval_index(plain)
    assert entries_of(indexed) == [0]
    assert jpeg_roi.has_interval_index(indexed) is True and not jpeg_roi.index_agrees(indexed)
    region = (1000, 700, 1100, 900)
    assert outcome(indexed, region, 2) == outcome(plain, region, 2)
    assert jpeg_roi.crop_bitstream(indexed, *region) == jpeg_roi.crop_bitstream(plain, *region)


def test_fill_bytes_before_a_marker_get_no_index():
    """0xFF fill bytes before a restart marker or EOI are legal but never written by libjpeg; the
    index would not give the scan's intervals there, so the file is refused an index rather than
    given a wrong one (and the EOI is never cut off)."""
    plain = pil_restart_jpeg(noise_image(32, 32, seed=10), "420")
    rst = plain.index(b"\xff\xd0")
    for filled in (plain[:rst] + b"\xff" + plain[rst:], plain[:-2] + b"\xff\xff\xd9"):
        assert jpeg_roi.restart_layout(filled)[0] is not None
        with pytest.raises(ValueError, match="does not read back"):
            jpeg_roi.with_interval_index(filled)
