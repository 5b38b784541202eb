"""EXIF orientation parsing and application, against PIL's ImageOps.exif_transpose."""

from __future__ import annotations

import io

import numpy as np
import pytest
from batchwire.pipeline.decode.exif import orientation_from_tiff, read_orientation
from batchwire.pipeline.decode.orientation import apply_orientation
from oddfiles import exif_jpeg, exif_orientation_block, jpeg_bytes, smooth_image
from PIL import Image, ImageOps


@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_read_orientation_both_byte_orders(orientation: int, big_endian: bool) -> None:
    data = exif_jpeg(smooth_image(24, 32), orientation, big_endian)
    assert read_orientation(data) == orientation
    # PIL agrees on what the file says.
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == orientation


def test_no_exif_is_orientation_1() -> None:
    assert read_orientation(jpeg_bytes(smooth_image(24, 32))) == 1
    assert read_orientation(b"") == 1
    assert read_orientation(b"not an image at all") == 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_orientation_matches_pil_exif_transpose(orientation: int) -> None:
    pixels = smooth_image(30, 50, seed=orientation)
    img = Image.fromarray(pixels)
    img.getexif()[0x0112] = orientation
    expected = np.asarray(ImageOps.exif_transpose(img))
    assert expected.shape[:2] == (pixels.shape[:2] if orientation < 5 else pixels.shape[1::-1])
    got = apply_orientation(pixels, orientation)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)


def test_out_of_range_orientation_is_identity() -> None:
    pixels = smooth_image(8, 12)
    for value in (0, 9, 65535):
        assert apply_orientation(pixels, value) is pixels
        tiff = exif_orientation_block(1)[6:]
        patched = bytearray(tiff)
        patched[18:20] = value.to_bytes(2, "little")  # the SHORT value of the only entry
        assert orientation_from_tiff(bytes(patched)) == 1


def test_png_exif_chunk() -> None:
    img = Image.fromarray(smooth_image(20, 36))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    img.save(out, "PNG", exif=exif.tobytes())
    assert read_orientation(out.getvalue()) == 6


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_webp_exif_chunk_is_applied_as_pil_does(orientation: int) -> None:
    from batchwire.pipeline.decode import decode_full, read_header

    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    Image.fromarray(smooth_image(40, 70, seed=2)).save(
        out, "WEBP", lossless=True, exif=exif.tobytes()
    )
    data = out.getvalue()
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    header = read_header(data)
    assert header.orientation == orientation
    assert (header.height, header.width) == expected.shape[:2]
    np.testing.assert_array_equal(decode_full(data), expected)


@pytest.mark.parametrize("shape", [(1, 50), (50, 1), (1, 1)])
def test_one_pixel_thin_images_turn_into_torch_friendly_arrays(shape) -> None:
    """A flip of a size-1 axis is a view numpy calls contiguous but with a negative stride,
    which torch refuses: every orientation must come back as a plain array."""
    import torch

    pixels = smooth_image(*shape, seed=5)
    for orientation in range(2, 9):
        out = apply_orientation(pixels, orientation)
        assert all(st >= 0 for st in out.strides), (orientation, out.strides)
        torch.from_numpy(out)


def test_garbage_exif_never_raises() -> None:
    """Mutated EXIF segments, truncated files and absurd IFD counts all read as 1..8, no error."""
    base = exif_jpeg(smooth_image(24, 32), 6, big_endian=True)
    app1 = base.find(b"Exif\x00\x00")
    rng = np.random.default_rng(0)
    for trial in range(400):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 6))):
            pos = app1 + int(rng.integers(0, 40))
            data[pos] = int(rng.integers(0, 256))
        if trial % 3 == 0:
            data = data[: app1 + int(rng.integers(0, 40))]
        assert 1 <= read_orientation(bytes(data)) <= 8
    huge_count = bytearray(exif_orientation_block(3))
    huge_count[14:16] = b"\xff\xff"  # IFD0 entry count
    assert orientation_from_tiff(bytes(huge_count[6:])) == 3
    assert orientation_from_tiff(b"II*\x00\xff\xff\xff\xff") == 1
    assert orientation_from_tiff(b"MM") == 1
