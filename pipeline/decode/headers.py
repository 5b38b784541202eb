"""Header sniffing: an encoded image's size, orientation and decoder route, without its pixels.

The header pass is separate and cheap so that the augmentation plan (which needs the displayed
size) and the pixel-limit check happen before a single pixel is decoded: a file claiming
60000x60000 is rejected without allocating 10 GB (`ImageTooLarge`, Pillow's default limit).
Below that limit, a header that claims more pixels than its file could possibly encode (a 2 kB
JPEG claiming 9000x9000 would allocate 243 MB) is refused too (`ImplausibleHeader`, see
`JPEG_MAX_PIXELS_PER_BYTE` and `PNG_MAX_RAW_BYTES_PER_BYTE`).
JPEG sizes come from TurboJPEG (or the SOF marker without it). With TurboJPEG, the native
extension's `jpeg_header` is asked first: for the plain colour and grey JPEGs it answers at all,
it gives TurboJPEG's answer and the EXIF orientation in one call (the GPU path reads a header per
image with the GIL held: 2 us instead of 8). PNG and BMP sizes come from their fixed headers;
any other format is decoded once by OpenCV, which applies its own pixel limit.
The record it returns, `ImageHeader`, is the decoder contract's (`contract.py`), imported here.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

from batchwire.pipeline.decode.backends import TJCS_CMYK, TJCS_YCCK, cv2_decode, turbo
from batchwire.pipeline.decode.contract import DecodeError, ImageHeader
from batchwire.pipeline.decode.exif import read_orientation
from batchwire.pipeline.decode.orientation import swaps_axes

DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The most pixels a JPEG file may claim per byte of its size. Why a bound exists at all: a
# Huffman-coded JPEG spends at least one bit on every 8x8 block of every component (each block
# codes its DC difference, and a Huffman code is >= 1 bit; a baseline block also ends with an
# EOB code, >= 1 bit more), so a greyscale image needs >= 64 px / bit = 512 px per byte of
# entropy-coded data, and a colour one more bytes still. Measured minimum (ratio of file size
# to pixel count), see tests/test_bad_input_decode.py for the re-measurable part:
#   ../shared/imagenet-sample (1,000 real photos):          0.053 B/px (19 px/B)
#   the embedded synthetic dataset (flat-colour shapes):   0.024 B/px (42 px/B)
#   flat single-colour 4096x4096 JPEGs, PIL quality 1..100, grey and RGB, 4:2:0 and 4:4:4,
#   baseline/progressive, optimised tables or not:         0.0039 B/px (255 px/B), the
#   optimised-baseline greyscale floor of 2 bits per block.
# 1024 px/B is 4x below the flat-colour floor and 2x below the theoretical Huffman floor. Only
# an arithmetic-coded JPEG (practically never seen) could be that small legitimately; it is
# refused as well, as the decompression bomb it then is.
JPEG_MAX_PIXELS_PER_BYTE = 1024
# PNG: deflate expands a byte to at most 1032 bytes (a 258-byte match costs >= 2 bits), so the
# raw scanlines (filter byte + packed pixels per row) are at most 1032 x the file's size; 2x
# margin for interlacing's extra rows.
PNG_MAX_RAW_BYTES_PER_BYTE = 2 * 1032


class ImageTooLarge(DecodeError):
    """The header claims more pixels than the configured limit (decompression-bomb guard)."""


class ImplausibleHeader(DecodeError):
    """The header claims more pixels than the file's size could encode: a corrupt (or
    malicious) header, refused before any pixel memory is allocated."""


def read_header(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> ImageHeader:
    """Size, orientation and decoder route of an encoded image, without decoding pixels.

    Raises `DecodeError` for empty, non-image or corrupt headers, `ImageTooLarge` (a
    `DecodeError`) when width * height exceeds `max_pixels` (None disables the check), and
    `ImplausibleHeader` (a `DecodeError`, whatever `max_pixels` is) when a JPEG or PNG claims
    more pixels than its size could encode.
    """
    if not data:
        raise DecodeError("empty file")
    data = bytes(data)
    orientation = None
    if data[:2] == b"\xff\xd8":
        h, w, kind, orientation = _jpeg_header(data)
        _check_pixels(h, w, max_pixels)
        if h * w > JPEG_MAX_PIXELS_PER_BYTE * len(data):
            raise ImplausibleHeader(
                f"JPEG header claims {w}x{h} = {h * w} pixels, more than a {len(data)}-byte "
                f"file can encode (at most {JPEG_MAX_PIXELS_PER_BYTE} pixels per byte)"
            )
    elif data.startswith(_PNG_MAGIC):
        h, w = _png_size(data)
        kind = "other"
        _check_pixels(h, w, max_pixels)
        raw = _png_raw_bytes(data, h, w)
        if raw > PNG_MAX_RAW_BYTES_PER_BYTE * len(data):
            raise ImplausibleHeader(
                f"PNG header claims {w}x{h} pixels ({raw} bytes of scanlines), more than a "
                f"{len(data)}-byte file can encode"
            )
    elif data[:2] == b"BM" and (size := _bmp_size(data)) is not None:
        h, w = size
        kind = "other"
    else:
        # No cheap header parser for this format: decode it (OpenCV applies its own pixel
        # limit, CV_IO_MAX_IMAGE_PIXELS) and take the size from the pixels.
        h, w = cv2_decode(data).shape[:2]
        kind = "other"
    _check_pixels(h, w, max_pixels)
    if orientation is None:
        orientation = read_orientation(data)
    if swaps_axes(orientation):
        h, w = w, h
    return ImageHeader(height=int(h), width=int(w), orientation=orientation, kind=kind)


def _check_pixels(h: int, w: int, max_pixels: int | None) -> None:
    if h < 1 or w < 1:
        raise DecodeError(f"invalid image size {w}x{h} in header")
    if max_pixels is not None and h * w > max_pixels:
        raise ImageTooLarge(
            f"image of {w}x{h} = {h * w} pixels exceeds the limit of {max_pixels} pixels"
        )


@functools.cache
def _native_header() -> Callable[[bytes], tuple[int, int, int] | None] | None:
    """The extension's `jpeg_header` (`batchwire.native.jpeg_roi.jpeg_header`), looked up once
    per process, or None when the extension is unavailable."""
    from batchwire.native import jpeg_roi

    return jpeg_roi.native_function("jpeg_header")


def _jpeg_header(data: bytes) -> tuple[int, int, str, int | None]:
    """(height, width, route, EXIF orientation or None when not read yet) of a JPEG.

    With TurboJPEG, the extension's `jpeg_header` answers first where it can (one native call
    for what TurboJPEG's header call and exif.py's walk give, about 1 us against 8: the GPU
    path's per-image CPU); where it cannot (see its doc) TurboJPEG decides, as before."""
    tj = turbo()
    if tj is None:
        sof = _jpeg_sof_size(data)
        if sof is None:
            raise DecodeError("corrupt JPEG: no frame header")
        return sof[0], sof[1], "other", None
    native = _native_header()
    if native is not None and (found := native(data)) is not None:
        return found[0], found[1], "jpeg", found[2]
    tj.take_warnings()  # drop anything a failed call left behind on this thread
    try:
        w, h, _subsample, colorspace = tj.decode_header(data)
    except OSError as e:
        # TurboJPEG refuses some valid JPEGs (e.g. CMYK with unusual sampling factors); if
        # the frame header parses, let OpenCV try the pixels, else the file is bad.
        tj.take_warnings()
        sof = _jpeg_sof_size(data)
        if sof is None:
            raise DecodeError(f"corrupt JPEG header: {e}") from None
        return sof[0], sof[1], "other", None
    warnings = tj.take_warnings()
    if w < 1 or h < 1:
        raise DecodeError(f"corrupt JPEG header: {'; '.join(warnings) or 'no image size'}")
    kind = "other" if colorspace in (TJCS_CMYK, TJCS_YCCK) else "jpeg"
    return h, w, kind, None


def _jpeg_sof_size(data: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) from the first SOFn marker, or None; used without TurboJPEG."""
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker in (0xD9, 0xDA):
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if pos + 10 > n:
                return None
            h, w = struct.unpack_from(">HH", data, pos + 5)
            return h, w, data[pos + 9]
        pos += 2 + length
    return None


def _png_size(data: bytes) -> tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise DecodeError("corrupt PNG: no IHDR chunk")
    w, h = struct.unpack_from(">II", data, 16)
    return h, w


# Samples per pixel of each PNG colour type: grey, RGB, palette index, grey+alpha, RGBA.
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _png_raw_bytes(data: bytes, h: int, w: int) -> int:
    """The size of a PNG's uncompressed, non-interlaced scanlines (0 when IHDR is odd: the
    decoder judges those)."""
    if len(data) < 26:
        return 0
    depth, colour = data[24], data[25]
    channels = _PNG_CHANNELS.get(colour)
    if channels is None or depth not in (1, 2, 4, 8, 16):
        return 0
    return h * (1 + (w * channels * depth + 7) // 8)


def _bmp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 26:
        return None
    (dib,) = struct.unpack_from("<I", data, 14)
    if dib == 12:
        w, h = struct.unpack_from("<HH", data, 18)
    else:
        w, h = struct.unpack_from("<ii", data, 18)
    return abs(h), abs(w)
