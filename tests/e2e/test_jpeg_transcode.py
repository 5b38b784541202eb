"""Lossless rewriting with restart markers (native/csrc/jpeg_transcode.cpp).

What must hold: the rewritten file decodes, with independent decoders (PIL, djpeg), to exactly
the source's pixels; it is one baseline Huffman scan with a DRI of the interval asked for and
one RSTn between every interval of MCUs (counted by this file's own parser); every APPn and COM
segment of the source is there, verbatim and in order; corrupt sources are refused as corrupt,
unsupported ones as unsupported; the comparison finds a difference of one coefficient; no error
path leaks; the GIL is released while it works.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_transcode as jt
from jpegchecks import assert_restart_layout, assert_same_pixels, parse_jpeg, pil_jpeg
from oddfiles import corrupt_jpeg, exif_orientation_block, huge_header_jpeg, smooth_image
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
HAS_JPEGTRAN = shutil.which("jpegtran") is not None

if not jt.transcode_available():
    pytest.skip(
        "the JPEG transcoder does not build here (libjpeg62-turbo-dev missing?); see the "
        "logged build error",
        allow_module_level=True,
    )


ICC = bytes(np.random.default_rng(1).integers(0, 256, 70000, dtype=np.uint8))  # two APP2 chunks
VARIANTS = {
    "420": {"subsampling": 2},
    "422": {"subsampling": 1},
    "444": {"subsampling": 0},
    "grey": {"mode": "L"},
    "progressive": {"progressive": True},
    "cmyk": {"mode": "CMYK"},
    "restarts_already": {"restart_marker_blocks": 3},
    "markers": {"exif": exif_orientation_block(6), "icc_profile": ICC, "comment": b"hello"},
}
SIZES = [(33, 17), (1, 1), (8, 8), (97, 133), (130, 259)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rewrite_is_lossless_and_restart_coded(variant: str) -> None:
    for h, w in SIZES:
        source = pil_jpeg(smooth_image(h, w, seed=h + w), **VARIANTS[variant])
        out = jt.transcode_restart(source)
        assert_same_pixels(source, out, djpeg=variant != "cmyk")  # djpeg writes no CMYK PNM
        layout = assert_restart_layout(out)
        assert layout.app_and_com() == parse_jpeg(source).app_and_com()
        assert (layout.width, layout.height) == (w, h)
        assert jt.jpeg_difference(source, out) is None


def test_markers_survive_verbatim_and_in_order() -> None:
    source = pil_jpeg(smooth_image(64, 80), **VARIANTS["markers"])
    kept = parse_jpeg(jt.transcode_restart(source)).app_and_com()
    markers = [m for m, _ in kept]
    assert markers == [0xE0, 0xE1, 0xE2, 0xE2, 0xFE]  # no second JFIF, ICC in two chunks
    assert kept[1][1] == exif_orientation_block(6)
    assert kept[2][1][:12] == b"ICC_PROFILE\0" and kept[3][1][12:14] == b"\x02\x02"
    with Image.open(io.BytesIO(jt.transcode_restart(source))) as img:
        assert img.getexif()[0x0112] == 6
        assert img.info["icc_profile"] == ICC


@pytest.mark.parametrize("interval", [2, 5, 64])
def test_other_restart_intervals(interval: int) -> None:
    source = pil_jpeg(smooth_image(97, 133, seed=3))
    out = jt.transcode_restart(source, interval)
    assert_restart_layout(out, interval)
    assert_same_pixels(source, out)


# (MCUs per row, interval chosen for at most 4): the largest divisor, so intervals tile rows.
FITTED = [(7, 1), (6, 3), (8, 4), (9, 3), (10, 2), (1, 1), (3, 3)]


@pytest.mark.parametrize(("per_row", "expected"), FITTED)
@pytest.mark.parametrize("mode", ["420", "grey"])
def test_fit_rows_takes_the_largest_interval_dividing_the_mcu_rows(per_row, expected, mode):
    mcu = 16 if mode == "420" else 8
    pixels = smooth_image(40, per_row * mcu - 3, seed=per_row)
    source = pil_jpeg(pixels, mode="L") if mode == "grey" else pil_jpeg(pixels)
    out = jt.transcode_restart(source, 4, fit_rows=True)
    layout = assert_restart_layout(out, expected)
    assert layout.mcu_grid()[1] == per_row
    assert_same_pixels(source, out)


@pytest.mark.skipif(not HAS_JPEGTRAN, reason="needs jpegtran (libjpeg-turbo-progs)")
def test_arithmetic_coded_sources_become_huffman(tmp_path: Path) -> None:
    for extra in ([], ["-progressive"]):
        plain = pil_jpeg(smooth_image(75, 61, seed=9))
        arith = subprocess.run(
            ["jpegtran", "-arithmetic", *extra], input=plain, capture_output=True, check=True
        ).stdout
        assert parse_jpeg(arith).sof in (0xC9, 0xCA)
        out = jt.transcode_restart(arith)
        assert_restart_layout(out)
        assert_same_pixels(plain, out)


def test_coarse_quantisation_is_kept_and_written_as_extended_sequential() -> None:
    """Tables with values above 255 need 16-bit DQT entries, which baseline forbids: the
    frame is then SOF1 (still sequential Huffman, still restart coded)."""
    buffer = io.BytesIO()  # no quality: PIL would scale the tables by it
    Image.fromarray(smooth_image(40, 50)).save(buffer, "JPEG", qtables=[[300] * 64, [400] * 64])
    source = buffer.getvalue()
    assert parse_jpeg(source).sof == 0xC1
    out = jt.transcode_restart(source)
    layout = parse_jpeg(out)
    assert layout.sof == 0xC1 and layout.restart_interval == 1
    assert len(layout.restarts) == layout.mcus() - 1
    assert_same_pixels(source, out)


def sample_files(n: int) -> list[Path]:
    if not SAMPLE_DIR.is_dir():
        pytest.skip(f"real-photo sample {SAMPLE_DIR} not present on this machine")
    return sorted(SAMPLE_DIR.iterdir())[:: 1000 // n][:n]


def test_real_photos() -> None:
    for path in sample_files(8):
        source = path.read_bytes()
        out = jt.transcode_restart(source)
        assert_restart_layout(out)
        assert_same_pixels(source, out)
        if HAS_JPEGTRAN:  # an independent writer of the same thing gives the same bytes
            ref = subprocess.run(
                ["jpegtran", "-restart", "1B", "-optimize", "-copy", "all", str(path)],
                capture_output=True,
                check=True,
            ).stdout
            assert out == ref, path.name


def test_optimised_tables_are_smaller() -> None:
    source = sample_files(1)[0].read_bytes()
    optimised = jt.transcode_restart(source, optimize=True)
    standard = jt.transcode_restart(source, optimize=False)
    assert len(optimised) < len(standard)
    assert_same_pixels(optimised, standard, djpeg=False)


def valid() -> bytes:
    return pil_jpeg(smooth_image(96, 128, seed=4), quality=92)


@pytest.mark.parametrize(
    "damaged",
    [
        pytest.param(lambda d: d[: len(d) * 2 // 3], id="truncated"),
        pytest.param(lambda d: corrupt_jpeg("middle_zeroed", d), id="middle_zeroed"),
        pytest.param(lambda d: corrupt_jpeg("half_then_eoi", d), id="half_then_eoi"),
        pytest.param(lambda d: d[:2] + b"\x00" * 40, id="garbage_after_soi"),
        pytest.param(lambda d: b"\xff", id="one_byte"),
        pytest.param(lambda d: b"\x89PNG\r\n\x1a\n" + d, id="not_a_jpeg"),
    ],
)
def test_corrupt_sources_are_refused_as_corrupt(damaged) -> None:
    with pytest.raises(jt.JpegCorruptError):
        jt.transcode_restart(damaged(valid()))


def test_unsupported_sources_are_refused_but_not_as_corrupt() -> None:
    lossless = bytearray(valid())
    sof = lossless.find(b"\xff\xc0")
    lossless[sof + 1] = 0xC3  # the lossless process, which libjpeg-turbo 2.x cannot read
    with pytest.raises(jt.JpegTranscodeError, match="unsupported") as info:
        jt.transcode_restart(bytes(lossless))
    assert not isinstance(info.value, jt.JpegCorruptError)
    huge = huge_header_jpeg(smooth_image(64, 64), 60000, 60000)
    with pytest.raises(jt.JpegTranscodeError, match="too large") as info:
        jt.transcode_restart(huge)
    assert not isinstance(info.value, jt.JpegCorruptError)
    assert jt.transcode_restart(valid(), max_memory=1 << 20)  # a small file fits 1 MB
    with pytest.raises(jt.JpegTranscodeError, match="too large"):
        jt.transcode_restart(valid(), max_memory=1000)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="restart_interval"):
        jt.transcode_restart(valid(), 70000)
    with pytest.raises(ValueError, match="contiguous"):
        jt.transcode_restart(np.zeros((4, 4), np.uint8))


def test_difference_finds_one_changed_block() -> None:
    pixels = smooth_image(64, 64, seed=2)
    changed = pixels.copy()
    changed[44, 20] = 255 - changed[44, 20]  # luma block row 5 (4:4:4, 8x8 blocks)
    a = pil_jpeg(pixels, quality=100, subsampling=0)
    b = pil_jpeg(changed, quality=100, subsampling=0)
    assert jt.jpeg_difference(a, a) is None
    assert jt.jpeg_difference(a, b) == "component 0: coefficients differ in block row 5"
    assert "frame differs" in jt.jpeg_difference(a, pil_jpeg(smooth_image(64, 72, seed=2)))
    assert "quantisation" in jt.jpeg_difference(a, pil_jpeg(pixels, quality=50, subsampling=0))
    with pytest.raises(jt.JpegTranscodeError):
        jt.jpeg_difference(a, a[: len(a) // 2])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_error_paths_free_their_memory() -> None:
    """Hundreds of failures late in a large file (coefficient arrays and the output buffer
    allocated), and of refusals by the memory cap, leave the process's memory where it was."""
    big = pil_jpeg(smooth_image(600, 800, seed=8))
    late_truncated = big[: len(big) * 9 // 10]
    huge = huge_header_jpeg(smooth_image(64, 64), 20000, 20000)
    for data in (late_truncated, huge, big):  # warm up allocator pools
        with contextlib.suppress(jt.JpegTranscodeError):
            jt.transcode_restart(data, max_memory=50 << 20)
    before = rss_bytes()
    for _ in range(150):
        with pytest.raises(jt.JpegCorruptError):
            jt.transcode_restart(late_truncated)
        with pytest.raises(jt.JpegTranscodeError):
            jt.transcode_restart(huge, max_memory=50 << 20)
        with pytest.raises(jt.JpegTranscodeError):
            jt.jpeg_difference(big, late_truncated)
    # A leak of the output buffer alone would be ~150 x 100 kB; of the coefficients, 150 MB.
    assert rss_bytes() - before < 8 << 20


def test_gil_is_released_while_rewriting() -> None:
    """A Python thread keeps running while another thread rewrites a large JPEG: its longest
    pause is far shorter than the rewrite (with the GIL held it would span all of it)."""
    data = pil_jpeg(np.random.default_rng(0).integers(0, 256, (1500, 2000, 3), np.uint8))
    start = time.perf_counter()
    jt.transcode_restart(data)
    one_call = time.perf_counter() - start
    stop = threading.Event()
    gaps: list[float] = []

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        for _ in range(3):
            jt.transcode_restart(data)
    finally:
        stop.set()
        thread.join()
    assert one_call > 0.05, one_call  # long enough for a held GIL to show
    assert max(gaps) < one_call / 2, (max(gaps), one_call)
