"""Strict decoding: corrupt JPEGs with an intact end marker, and headers no file size can back.

Each corrupt file here is one that used to be served as good: TurboJPEG warned, and OpenCV
(asked next) returned the partial image; a 2 kB file claiming 9000x9000 was decoded into a
243 MB array before failing. The plausibility bound's margins are measured here too.
"""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_roi as native
from batchwire.pipeline.decode import (
    CpuBatchDecoder,
    DecodeError,
    DecodeRequest,
    ImplausibleHeader,
    decode_for_crop,
    decode_full,
    read_header,
)
from batchwire.pipeline.decode.backends import cv2_decode, turbo
from batchwire.pipeline.decode.headers import (
    JPEG_MAX_PIXELS_PER_BYTE,
    PNG_MAX_RAW_BYTES_PER_BYTE,
    _png_raw_bytes,
)
from oddfiles import (
    CORRUPT_KINDS,
    corrupt_jpeg,
    jpeg_bytes,
    odd_file_bytes,
    scan_data_span,
    small_claiming_huge,
    smooth_image,
)
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
EOI_INTACT = [k for k in CORRUPT_KINDS if k != "claims_9000"]


@pytest.mark.parametrize("kind", CORRUPT_KINDS)
def test_corrupt_files_fail_every_cpu_path(kind: str) -> None:
    data = odd_file_bytes(kind, height=240, width=320)
    with pytest.raises(DecodeError):
        decode_full(data)
    if kind == "claims_9000":
        with pytest.raises(ImplausibleHeader, match="9000x9000"):
            read_header(data)
        return
    # What used to let them through: OpenCV hands back libjpeg's partial image, no error.
    assert cv2_decode(data).shape == (240, 320, 3)
    header = read_header(data)
    box = (0.0, 0.0, 240.0, 320.0)  # reaches the damage: no decoder may hide it
    for roi in (True, False):
        with pytest.raises(DecodeError, match="corrupt JPEG"):
            decode_for_crop(data, header, box, (56, 56), roi=roi)
    with CpuBatchDecoder(threads=1) as dec:
        (result,) = dec.decode_batch([DecodeRequest(0, data, header, box, (56, 56))])
    assert result.image is None and "corrupt JPEG" in (result.error or "")
    assert not result.transient


@pytest.mark.parametrize("kind", EOI_INTACT)
def test_native_roi_decoder_is_strict_on_what_it_reads(kind: str) -> None:
    data = odd_file_bytes(kind, height=240, width=320)
    for verify in (False, True):
        with pytest.raises(native.JpegRoiError):
            native.decode_jpeg_roi(data, 200, 0, 240, 320, verify=verify)


def test_roi_verifies_the_rows_below_the_crop() -> None:
    """Issue 20: a crop wholly above the damage fails too (the rows below the crop are
    entropy decoded, `roi.ROI_VERIFY_TAIL`), as do a crop reaching it and a whole decode; with
    the tail check off (benchmarks only), the crop is the intact file's."""
    good = jpeg_bytes(smooth_image(240, 320, seed=7))
    bad = corrupt_jpeg("half_then_eoi", good)
    header = read_header(bad)
    top = (0.0, 0.0, 40.0, 320.0)
    with pytest.raises(DecodeError):
        decode_for_crop(bad, header, top, (40, 320))
    unverified = native.decode_jpeg_roi(bad, 0, 0, 40, 320, verify=False)
    intact = native.decode_jpeg_roi(good, 0, 0, 40, 320, verify=False)
    np.testing.assert_array_equal(unverified[0], intact[0])
    with pytest.raises(DecodeError):
        decode_for_crop(bad, header, (180.0, 0.0, 240.0, 320.0), (60, 320))
    with pytest.raises(DecodeError):
        decode_for_crop(bad, header, top, (40, 320), roi=False)


def test_extraneous_bytes_before_eoi_are_corruption() -> None:
    """Bytes left over between the last block and EOI mean the scan did not end where the
    image did (a desynchronised, corrupt scan): refused by TurboJPEG and the native decoder.
    Stray bytes between header segments stay benign (test_decode's
    test_benign_libjpeg_warning_still_decodes)."""
    good = jpeg_bytes(smooth_image(64, 80))
    # (libjpeg's bit reader swallows the first few bytes past the last block unseen: a sloppy
    # encoder's byte or two of padding there is never reported.)
    bad = good[:-2] + b"\x12" * 16 + good[-2:]
    with pytest.raises(DecodeError, match="extraneous bytes before marker 0xd9"):
        decode_full(bad)
    with pytest.raises(native.JpegRoiError, match="extraneous"):
        native.decode_jpeg_roi(bad, 0, 0, 64, 80, verify=True)
    # Random bytes without a single 0xFF leave no marker behind: only that warning shows it.
    start, end = scan_data_span(good)
    noise = np.random.default_rng(3).integers(0, 255, (end - start) // 3, dtype=np.uint8)
    a = start + (end - start) // 3
    desync = good[:a] + noise.tobytes() + good[a + len(noise) :]
    with pytest.raises(DecodeError):
        decode_full(desync)


def test_corrupt_cmyk_jpeg_is_checked_before_opencv() -> None:
    """CMYK JPEGs decode through OpenCV, which would take a corrupt one; TurboJPEG judges it
    first (decoding to CMYK), so it fails like an RGB one, and a good one still decodes."""
    good = jpeg_bytes(smooth_image(96, 128, seed=2), mode="CMYK")
    assert read_header(good).kind == "other"
    assert decode_full(good).shape == (96, 128, 3)
    bad = corrupt_jpeg("half_then_eoi", good)
    assert cv2_decode(bad).shape == (96, 128, 3)  # OpenCV alone would serve it
    with pytest.raises(DecodeError, match="corrupt JPEG"):
        decode_full(bad)


def test_native_check_reads_cmyk_and_odd_sampling() -> None:
    """The whole-file strict check for OpenCV-bound JPEGs: PIL's CMYK files use a sampling
    TurboJPEG's header parser refuses; libjpeg reads them."""
    good = jpeg_bytes(smooth_image(96, 128, seed=4), mode="CMYK")
    native.check_jpeg(good)
    native.check_jpeg(jpeg_bytes(smooth_image(40, 56), progressive=True))
    for kind in ("half_then_eoi", "middle_zeroed"):
        with pytest.raises(native.JpegRoiError):
            native.check_jpeg(corrupt_jpeg(kind, good))
    with pytest.raises(native.JpegRoiError, match="Premature end"):
        native.check_jpeg(good[: len(good) * 2 // 3])


def test_implausible_header_is_refused_before_any_allocation() -> None:
    data = small_claiming_huge()
    assert len(data) < 2048
    tracemalloc.start()
    try:
        with pytest.raises(ImplausibleHeader):
            decode_full(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # 9000 x 9000 x 3 would be 243 MB
    # With its real size in the header, the same bytes are a fine image.
    fixed = bytearray(data)
    sof = fixed.find(b"\xff\xc0")
    fixed[sof + 5 : sof + 9] = (64).to_bytes(2, "big") * 2
    assert decode_full(bytes(fixed)).shape == (64, 64, 3)


def _pixels_per_byte(data: bytes) -> float:
    header = read_header(data, max_pixels=None)
    return header.pixels / len(data)


def test_plausibility_bound_is_far_from_real_and_flat_images() -> None:
    """The measurements behind JPEG_MAX_PIXELS_PER_BYTE (headers.py documents the full sweep):
    real photos, the embedded dataset's flat-colour shapes, and flat single-colour JPEGs at
    extreme qualities (the densest JPEGs there are) all stay well below the bound."""
    from batchwire.pipeline.synthetic import default_dataset

    flat = []
    for mode, colour in (("L", 128), ("RGB", (90, 140, 200))):
        img = Image.new(mode, (2048, 2048), colour)
        for quality in (1, 50, 100):
            for options in ({"optimize": True}, {"progressive": True, "optimize": True}, {}):
                out = io.BytesIO()
                img.save(out, "JPEG", quality=quality, **options)
                flat.append(_pixels_per_byte(out.getvalue()))
    assert max(flat) * 3 < JPEG_MAX_PIXELS_PER_BYTE, max(flat)  # measured: 255 px/B

    ds = default_dataset()
    synthetic = [
        _pixels_per_byte(p.read_bytes())
        for root in (ds.train_root, ds.val_root)
        for p in root.rglob("*")
        if p.suffix.lower() in (".jpg", ".jpeg", ".png")
    ]
    assert len(synthetic) > 100
    assert max(synthetic) * 10 < JPEG_MAX_PIXELS_PER_BYTE, max(synthetic)  # measured: 42 px/B

    if SAMPLE_DIR.is_dir():
        photos = [_pixels_per_byte(p.read_bytes()) for p in sorted(SAMPLE_DIR.iterdir())]
        assert max(photos) * 20 < JPEG_MAX_PIXELS_PER_BYTE, max(photos)  # measured: 19 px/B

    # PNG: flat 1-bit and RGB images reach deflate's 1032:1 limit, half the bound.
    for mode, size in (("1", (4000, 4000)), ("RGB", (2000, 2000))):
        out = io.BytesIO()
        Image.new(mode, size, 0).save(out, "PNG", optimize=True)
        data = out.getvalue()
        header = read_header(data, max_pixels=None)
        ratio = _png_raw_bytes(data, header.height, header.width) / len(data)
        assert ratio * 1.9 < PNG_MAX_RAW_BYTES_PER_BYTE, ratio


def test_png_claiming_more_than_deflate_can_hold_is_refused() -> None:
    out = io.BytesIO()
    Image.fromarray(smooth_image(32, 32)).save(out, "PNG")
    data = bytearray(out.getvalue())
    data[16:24] = (9000).to_bytes(4, "big") * 2  # IHDR width, height (CRC not checked here)
    with pytest.raises(ImplausibleHeader, match="9000x9000"):
        read_header(bytes(data))


def test_turbojpeg_is_present() -> None:
    """The strict checks above rely on libturbojpeg; without it only truncation is caught for
    JPEGs (test_decode's no-libturbojpeg test)."""
    assert turbo() is not None
