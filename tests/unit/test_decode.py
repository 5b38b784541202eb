"""Decoding against PIL on real photos and on generated odd files; bad files -> DecodeError."""

from __future__ import annotations

import io
import resource
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire.pipeline.decode import (
    BatchDecoder,
    CpuBatchDecoder,
    DecodeError,
    DecodeRequest,
    ImageTooLarge,
    ImplausibleHeader,
    choose_dct_scale,
    decode_for_crop,
    decode_full,
    read_header,
)
from jpegchecks import SAMPLE_DIR, pil_rgb
from oddfiles import (
    BAD_KINDS,
    GOOD_KINDS,
    exif_jpeg,
    exif_orientation_block,
    huge_header_jpeg,
    jpeg_bytes,
    odd_file_bytes,
    smooth_image,
)
from PIL import Image, ImageOps

# libjpeg versions (PIL's bundled one vs the system libturbojpeg) may round a few pixels
# differently; on this machine they agree exactly, the bounds leave room for other versions.
MEAN_TOL = 0.5
MAX_TOL = 8


def sample_files(n: int) -> list[Path]:
    if not SAMPLE_DIR.is_dir():
        pytest.skip(f"real-photo sample {SAMPLE_DIR} not present on this machine")
    files = sorted(p for p in SAMPLE_DIR.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
    if not files:
        pytest.skip(f"no JPEGs in {SAMPLE_DIR}")
    return files[:n]


def assert_close(got: np.ndarray, expected: np.ndarray, mean_tol=MEAN_TOL, max_tol=MAX_TOL):
    assert got.shape == expected.shape
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert diff.mean() <= mean_tol and diff.max() <= max_tol, (diff.mean(), diff.max())


def test_imagenet_sample_matches_pil() -> None:
    rotated = SAMPLE_DIR / "n02951585_can_opener.JPEG"  # the sample's one EXIF-rotated photo
    extra = [rotated] if rotated.exists() else []
    for path in sample_files(50) + extra:
        data = path.read_bytes()
        header = read_header(data)
        expected = pil_rgb(data)
        assert (header.height, header.width) == expected.shape[:2], path.name
        assert_close(decode_full(data), expected)


@pytest.mark.parametrize("denom", [2, 4])
def test_dct_scaled_decode_matches_pil_draft(denom: int) -> None:
    """A crop that needs only 1/denom of the resolution decodes at 1/denom, like PIL's draft."""
    for path in sample_files(20):
        data = path.read_bytes()
        header = read_header(data)
        expected = pil_rgb(data, reduce=denom)
        # A full-image box with an output exactly 1/denom the size selects scale 1/denom.
        out_hw = (header.height // denom, header.width // denom)
        box = (0.0, 0.0, float(header.height), float(header.width))
        assert choose_dct_scale(header.height, header.width, *out_hw) == (1, denom)
        decoded = decode_for_crop(data, header, box, out_hw)
        assert_close(decoded.pixels, expected)
        h, w = decoded.pixels.shape[:2]
        assert decoded.box == pytest.approx((0.0, 0.0, h, w))


def test_choose_dct_scale() -> None:
    assert choose_dct_scale(2000, 2000, 224, 224) == (1, 8)
    assert choose_dct_scale(1000, 900, 224, 224) == (1, 4)
    assert choose_dct_scale(1000, 447, 224, 224) == (1, 1)  # width only 1.99x the output
    assert choose_dct_scale(448, 448, 224, 224) == (1, 2)
    assert choose_dct_scale(100, 100, 224, 224) == (1, 1)  # enlargement: never reduce


def test_crop_box_maps_into_scaled_oriented_image() -> None:
    """An EXIF-rotated JPEG cropped at a DCT scale: the box lands on the same content."""
    pixels = smooth_image(400, 640, seed=3)
    data = exif_jpeg(pixels, 6)
    header = read_header(data)
    assert (header.height, header.width, header.orientation) == (640, 400, 6)
    full = pil_rgb(data)
    box = (100.0, 40.0, 600.0, 360.0)  # 500 x 320 in the displayed image
    decoded = decode_for_crop(data, header, box, (112, 80), roi=False)  # the whole image
    assert decoded.pixels.shape[:2] == (160, 100)  # 1/4 scale
    assert decoded.box == pytest.approx((25.0, 10.0, 150.0, 90.0))
    y0, x0, y1, x1 = (int(v) for v in decoded.box)
    small = decoded.pixels[y0:y1, x0:x1].astype(np.float64).mean(axis=(0, 1))
    big = full[100:600, 40:360].astype(np.float64).mean(axis=(0, 1))
    np.testing.assert_allclose(small, big, atol=2.0)


@pytest.mark.parametrize("kind", GOOD_KINDS)
def test_odd_but_readable_files_match_pil(kind: str) -> None:
    data = odd_file_bytes(kind, height=72, width=104)
    header = read_header(data)
    assert (header.height, header.width) == (72, 104)
    assert header.kind == ("jpeg" if kind in ("rgb", "progressive", "grey") else "other")
    got = decode_full(data)
    # PIL's CMYK->RGB rounds differently from libjpeg's/OpenCV's: off by one everywhere.
    tol = (1.0, 1) if kind == "cmyk" else (MEAN_TOL, MAX_TOL)
    assert_close(got, pil_rgb(data), *tol)
    if kind == "grey":
        assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all()


@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_match_pil(orientation: int, big_endian: bool) -> None:
    data = exif_jpeg(smooth_image(48, 80, seed=orientation), orientation, big_endian)
    header = read_header(data)
    expected = pil_rgb(data)
    assert (header.height, header.width) == expected.shape[:2]
    assert_close(decode_full(data), expected)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_files_raise_decode_error(kind: str) -> None:
    data = odd_file_bytes(kind)
    with pytest.raises(DecodeError):
        decode_full(data)
    with pytest.raises(Exception) as pil_error:  # PIL rejects them too
        pil_rgb(data)
    assert not isinstance(pil_error.value, AssertionError)


def test_huge_header_rejected_before_decoding() -> None:
    data = huge_header_jpeg(smooth_image(32, 32))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ImageTooLarge, match="60000x60000"):
        read_header(data)
    with pytest.raises(ImageTooLarge):
        decode_full(data)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 100  # 60000 x 60000 x 3 would be 10 GB
    # The size comes from the header alone: with the limit off, a claim the file's size
    # could hold parses, and one it could not is still refused (ImplausibleHeader).
    with pytest.raises(ImplausibleHeader, match="60000x60000"):
        read_header(data, max_pixels=None)
    plausible = huge_header_jpeg(smooth_image(32, 32), height=900, width=1000)
    header = read_header(plausible, max_pixels=None)
    assert (header.height, header.width) == (900, 1000)


def test_max_pixels_is_configurable() -> None:
    data = jpeg_bytes(smooth_image(40, 50))
    assert read_header(data, max_pixels=2000).pixels == 2000
    with pytest.raises(ImageTooLarge):
        read_header(data, max_pixels=1999)
    png = odd_file_bytes("png_as_jpg", height=40, width=50)
    with pytest.raises(ImageTooLarge):
        read_header(png, max_pixels=1999)


def test_truncations_and_bit_flips_only_raise_decode_error() -> None:
    """Any damage to a JPEG gives pixels or DecodeError, never another exception type."""
    good = jpeg_bytes(smooth_image(64, 64), progressive=True)
    rng = np.random.default_rng(1)
    outcomes = {"ok": 0, "error": 0}
    cuts = list(range(0, len(good) - 2, max(1, len(good) // 60)))
    for cut in cuts:
        with pytest.raises(DecodeError):
            decode_full(good[:cut])
    for _ in range(150):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        try:
            pixels = decode_full(bytes(data))
            assert pixels.shape == (64, 64, 3)
            outcomes["ok"] += 1
        except DecodeError:
            outcomes["error"] += 1
    assert outcomes["ok"] + outcomes["error"] == 150


def _requests(datas: list[bytes], out_hw=(56, 56)) -> list[DecodeRequest]:
    reqs = []
    for i, data in enumerate(datas):
        try:
            header = read_header(data)
            box = (0.0, 0.0, float(header.height), float(header.width))
        except DecodeError:
            # A header that passed an earlier check but whose pixels are bad: fake a header
            # from a good file so the decoder itself has to notice.
            header = read_header(datas[0])
            box = (0.0, 0.0, 10.0, 10.0)
        reqs.append(DecodeRequest(i, data, header, box, out_hw))
    return reqs


def test_cpu_batch_decoder_isolates_bad_images() -> None:
    good = [odd_file_bytes(k, seed=i) for i, k in enumerate(GOOD_KINDS)]
    bad = [odd_file_bytes("truncated"), b"", b"text, not pixels"]
    datas = good[:3] + bad[:1] + good[3:] + bad[1:]
    requests = _requests(datas)
    with CpuBatchDecoder(threads=4) as dec:
        assert isinstance(dec, BatchDecoder)
        results = dec.decode_batch(requests)
    assert len(results) == len(requests)
    for req, res in zip(requests, results, strict=True):
        if req.data in bad:
            assert res.image is None and res.error
        else:
            assert res.error is None
            assert isinstance(res.image, torch.Tensor) and res.image.dtype == torch.uint8
            expected = decode_for_crop(req.data, req.header, req.box, req.out_hw)
            np.testing.assert_array_equal(res.image.numpy(), expected.pixels)
            assert res.box == pytest.approx(expected.box)


def test_cpu_batch_decoder_thread_count_does_not_change_pixels() -> None:
    datas = [odd_file_bytes(k, height=120, width=90, seed=i) for i, k in enumerate(GOOD_KINDS)]
    datas += [exif_jpeg(smooth_image(90, 120, seed=o), o) for o in range(1, 9)]
    requests = _requests(datas, out_hw=(32, 32))
    with CpuBatchDecoder(threads=1) as one, CpuBatchDecoder(threads=4) as four:
        a = one.decode_batch(requests)
        b = four.decode_batch(requests)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.image, y.image) and x.box == y.box


def test_cpu_batch_decoder_map_keeps_order_across_chunks() -> None:
    """Items travel to the threads in chunks (uneven last one here): results stay in order and
    an item's exception reaches the caller."""
    items = list(range(37))
    with CpuBatchDecoder(threads=2) as dec:
        assert dec.map(lambda v: v * v, items) == [v * v for v in items]

        def fail_on_30(v: int) -> int:
            if v == 30:
                raise ValueError("item 30")
            return v

        with pytest.raises(ValueError, match="item 30"):
            dec.map(fail_on_30, items)


def test_without_libturbojpeg_opencv_decodes_jpegs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libturbojpeg is missing, JPEGs still decode (OpenCV, header parsed by hand)."""
    import batchwire.pipeline.decode.backends as decode_module

    monkeypatch.setattr(decode_module, "_turbo_state", [None])
    for kind in ("rgb", "progressive", "grey"):
        data = odd_file_bytes(kind, height=40, width=56)
        header = read_header(data)
        assert (header.height, header.width, header.kind) == (40, 56, "other")
        assert_close(decode_full(data), pil_rgb(data))
    data = exif_jpeg(smooth_image(40, 56), 8)
    assert_close(decode_full(data), pil_rgb(data))
    assert choose_dct_scale(4000, 4000, 10, 10) == (1, 1)
    for kind in BAD_KINDS:
        with pytest.raises(DecodeError):
            decode_full(odd_file_bytes(kind))


def test_benign_libjpeg_warning_still_decodes() -> None:
    """Stray bytes before a marker make libjpeg warn, but the pixels are whole (PIL agrees)."""
    good = jpeg_bytes(smooth_image(64, 80))
    sos = good.find(b"\xff\xda")
    data = good[:sos] + b"\x12\x34" + good[sos:]
    header = read_header(data)
    assert header.kind == "jpeg"
    assert_close(decode_full(data), pil_rgb(data))


@pytest.mark.parametrize("fmt", ["BMP", "WEBP", "TIFF", "PPM"])
def test_other_formats_decode_through_opencv(fmt: str) -> None:
    out = io.BytesIO()
    options = {"lossless": True} if fmt == "WEBP" else {}
    Image.fromarray(smooth_image(30, 44)).save(out, fmt, **options)
    data = out.getvalue()
    header = read_header(data)
    assert (header.height, header.width, header.kind) == (30, 44, "other")
    assert_close(decode_full(data), pil_rgb(data))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("shape", [(1, 50), (50, 1)])
def test_thin_exif_images_decode_in_a_batch(orientation: int, shape) -> None:
    """1-pixel-thin JPEGs in every EXIF orientation decode (as PIL shows them), not raise."""
    pixels = smooth_image(*shape, seed=orientation)
    data = jpeg_bytes(pixels, exif=exif_orientation_block(orientation))
    header = read_header(data)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert (header.height, header.width) == expected.shape[:2]
    box = (0.0, 0.0, float(header.height), float(header.width))
    with CpuBatchDecoder(1) as decoder:
        (result,) = decoder.decode_batch([DecodeRequest(0, data, header, box, (8, 8))])
    assert result.error is None, result.error
    assert tuple(result.image.shape[:2]) == expected.shape[:2]
