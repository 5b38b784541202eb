"""Whole-image CPU decoding: every pixel of the file, oriented, optionally at a reduced DCT scale.

JPEG's DCT can be inverted at 1/8..1 of the size for much less work, and RandomResizedCrop throws
most pixels away anyway, so `choose_dct_scale` picks the smallest scale whose crop still covers
the output. This path is also the judge of bad files: region-of-interest decoding retries here
on any failure, so a corrupt file ends with the same `DecodeError` whichever path met it first.
"""

from __future__ import annotations

import numpy as np
from batchwire.pipeline.decode.backends import (
    check_jpeg_data,
    cv2_decode,
    dct_scales,
    jpeg_failure,
    turbo,
    turbo_decode,
)
from batchwire.pipeline.decode.contract import DecodeError
from batchwire.pipeline.decode.headers import DEFAULT_MAX_PIXELS, ImageHeader, read_header
from batchwire.pipeline.decode.orientation import apply_orientation


def choose_dct_scale(box_h: float, box_w: float, out_h: int, out_w: int) -> tuple[int, int]:
    """The smallest TurboJPEG scale (num, denom) <= 1 at which the crop still covers the output.

    Decoding below that would mean enlarging again, losing detail; above it is wasted work.
    """
    for num, denom in dct_scales():
        if box_h * num >= out_h * denom and box_w * num >= out_w * denom:
            return num, denom
    return 1, 1


def decode_pixels(data: bytes, header: ImageHeader, scale: tuple[int, int]) -> np.ndarray:
    """Oriented RGB pixels, at `scale` when the file takes the TurboJPEG route.

    Strict for JPEGs: TurboJPEG's verdict on a JPEG it reads is final. OpenCV is not asked
    after it failed: OpenCV's libjpeg ignores the warnings about corrupt data and returns the
    partial image (grey or garbage rows) as if it were whole. JPEGs that take the OpenCV route
    (CMYK/YCCK, or no libturbojpeg) are checked by `check_jpeg_data` first; PNG and the other
    formats are OpenCV's alone.
    """
    if header.kind == "jpeg" and turbo() is not None:
        try:
            raw = turbo_decode(data, scale)
        except OSError as e:
            raise DecodeError(f"{jpeg_failure(str(e))} JPEG: {e}") from None
    else:
        if data[:2] == b"\xff\xd8":
            check_jpeg_data(data)
        raw = cv2_decode(data)
    return apply_orientation(raw, header.orientation)


def decode_full(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """The whole image at full size, oriented, RGB HxWx3 uint8 (tests and benchmarks)."""
    header = read_header(data, max_pixels=max_pixels)
    pixels = decode_pixels(bytes(data), header, (1, 1))
    if pixels.shape[:2] != (header.height, header.width):
        raise DecodeError(
            f"decoded size {pixels.shape[1]}x{pixels.shape[0]} differs from the header's "
            f"{header.width}x{header.height}"
        )
    return pixels
