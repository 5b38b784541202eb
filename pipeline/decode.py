"""CPU image decoding: TurboJPEG for JPEG (at a reduced DCT scale when the crop allows), OpenCV
for everything else, EXIF orientation honoured as PIL's `ImageOps.exif_transpose` does.

Why the shape of this module:
- The header pass (`read_header`) is separate and cheap, so the augmentation plan (which needs
  the displayed size) and the pixel-limit check happen before a single pixel is decoded: a file
  claiming 60000x60000 is rejected without allocating 10 GB.
- JPEG's DCT can be inverted at 1/8..1 of the size for much less work. RandomResizedCrop throws
  most pixels away anyway, so `decode_for_crop` picks the smallest scale whose crop still covers
  the output and re-expresses the crop box in the decoded image.
- A crop of a training sample is about half the image, and the DCT scale rarely applies at
  224 px. Where the native ROI decoder is built (`batchwire.native.decode_jpeg_roi`, libjpeg-turbo
  with a crop) `decode_for_crop` decodes only the crop plus the resize filter's margin; any
  failure there retries the whole-image path, so bad files end the same way.
- Every failure of a bad file surfaces as `DecodeError`, whatever library tripped over it, so
  callers (`samples.SampleLoader`) can count and replace bad samples without a catch-all.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import cv2
import numpy as np
import torch
from batchwire.pipeline.exif import apply_orientation, read_orientation, swaps_axes

log = logging.getLogger("batchwire.pipeline")

DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS
Box = tuple[float, float, float, float]

# TurboJPEG colourspaces (TJCS_*) it cannot convert to RGB: those JPEGs go to OpenCV.
_TJCS_CMYK = 3
_TJCS_YCCK = 4
_TJPF_RGB = 0
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class DecodeError(Exception):
    """A file that cannot be decoded into an image (empty, not an image, corrupt, truncated)."""


class ImageTooLarge(DecodeError):
    """The header claims more pixels than the configured limit (decompression-bomb guard)."""


@dataclass(frozen=True)
class ImageHeader:
    """What a file's header says. `height`/`width` are as displayed (after EXIF orientation).

    `kind` is "jpeg" for JPEGs TurboJPEG decodes to RGB (the fast, DCT-scalable path) and
    "other" for everything that goes through OpenCV (PNG, CMYK/YCCK JPEG, ...).
    """

    height: int
    width: int
    orientation: int
    kind: str

    @property
    def pixels(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class DecodedImage:
    """Decoded, oriented pixels (HxWx3 uint8, C-contiguous) and the crop box in their coords."""

    pixels: np.ndarray
    box: Box


# ---------------------------------------------------------------------------------------------
# TurboJPEG access


def _load_turbojpeg():
    """A TurboJPEG whose warnings are recorded per thread instead of going to `warnings`.

    PyTurboJPEG reports libjpeg warnings through `warnings.warn` and returns the (possibly
    partial) image; "Premature end of JPEG file" is such a warning, so a truncated file would
    decode into a half-grey picture. Catching `warnings` is process-global state and not
    thread-safe, so we override its error reporter to record the message in thread-local
    storage. One instance is shared by all threads: it holds only ctypes function pointers and
    every call creates and destroys its own libjpeg handle.
    """
    try:
        from turbojpeg import TJERR_WARNING, TurboJPEG
    except ImportError as e:  # pragma: no cover - PyTurboJPEG is a hard dependency
        log.warning("PyTurboJPEG not importable (%s): decoding JPEGs with OpenCV", e)
        return None

    class _RecordingTurboJPEG(TurboJPEG):
        def __init__(self) -> None:
            super().__init__()
            self.last = threading.local()
            if not hasattr(self, "_TurboJPEG__get_error_code"):
                raise RuntimeError("unsupported PyTurboJPEG version (expected 1.x)")

        def _TurboJPEG__report_error(self, handle) -> None:
            code_fn = self._TurboJPEG__get_error_code
            message = self._TurboJPEG__get_error_string(handle)
            if code_fn is not None and code_fn(handle) == TJERR_WARNING:
                # One call may warn twice (header, then pixels): keep both.
                self.last.warnings = [*getattr(self.last, "warnings", ()), message]
                return
            raise OSError(message)

        def take_warnings(self) -> list[str]:
            """The warnings of this thread's calls since the last take (and forget them)."""
            messages = list(getattr(self.last, "warnings", ()))
            self.last.warnings = []
            return messages

    try:
        return _RecordingTurboJPEG()
    except (OSError, RuntimeError) as e:
        log.warning(
            "libturbojpeg unavailable (%s): decoding JPEGs with OpenCV, without DCT scaling; "
            "install it with `apt-get install libturbojpeg0`",
            e,
        )
        return None


_turbo_lock = threading.Lock()
_turbo_state: list = []


def _turbo():
    """The shared TurboJPEG instance, created on first use (None if the library is missing)."""
    if not _turbo_state:
        with _turbo_lock:
            if not _turbo_state:
                _turbo_state.append(_load_turbojpeg())
    return _turbo_state[0]


def _dct_candidates() -> list[tuple[int, int]]:
    """Scales 1/8, 1/4, 1/2 and 1, smallest first.

    libjpeg-turbo has SIMD reduced IDCTs only for 1/2, 1/4 and 1/8; the other N/8 scales use
    generic C code and measured slower than a full-size decode (one thread, 200 imagenet-sample
    files: 7/8 at 460 images/s, 3/8 at 620, against 680 at 1/1), so they are never worth it.
    """
    tj = _turbo()
    factors = tj.scaling_factors if tj is not None else {(1, 1)}
    useful = (f for f in factors if f[0] == 1 and f[1] in (1, 2, 4, 8))
    return sorted(useful, key=lambda f: f[0] / f[1])


# ---------------------------------------------------------------------------------------------
# Headers


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


def _bmp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 26:
        return None
    (dib,) = struct.unpack_from("<I", data, 14)
    if dib == 12:
        w, h = struct.unpack_from("<HH", data, 18)
    else:
        w, h = struct.unpack_from("<ii", data, 18)
    return abs(h), abs(w)


def _check_pixels(h: int, w: int, max_pixels: int | None) -> None:
    if h < 1 or w < 1:
        raise DecodeError(f"invalid image size {w}x{h} in header")
    if max_pixels is not None and h * w > max_pixels:
        raise ImageTooLarge(
            f"image of {w}x{h} = {h * w} pixels exceeds the limit of {max_pixels} pixels"
        )


def read_header(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> ImageHeader:
    """Size, orientation and decoder route of an encoded image, without decoding pixels.

    Raises `DecodeError` for empty, non-image or corrupt headers and `ImageTooLarge` (a
    `DecodeError`) when width * height exceeds `max_pixels` (None disables the check).
    """
    if not data:
        raise DecodeError("empty file")
    data = bytes(data)
    if data[:2] == b"\xff\xd8":
        h, w, kind = _jpeg_header(data)
    elif data.startswith(_PNG_MAGIC):
        h, w = _png_size(data)
        kind = "other"
    elif data[:2] == b"BM" and (size := _bmp_size(data)) is not None:
        h, w = size
        kind = "other"
    else:
        # No cheap header parser for this format: decode it (OpenCV applies its own pixel
        # limit, CV_IO_MAX_IMAGE_PIXELS) and take the size from the pixels.
        h, w = _cv2_decode(data).shape[:2]
        kind = "other"
    _check_pixels(h, w, max_pixels)
    orientation = read_orientation(data)
    if swaps_axes(orientation):
        h, w = w, h
    return ImageHeader(height=int(h), width=int(w), orientation=orientation, kind=kind)


def _jpeg_header(data: bytes) -> tuple[int, int, str]:
    tj = _turbo()
    if tj is None:
        sof = _jpeg_sof_size(data)
        if sof is None:
            raise DecodeError("corrupt JPEG: no frame header")
        return sof[0], sof[1], "other"
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
        return sof[0], sof[1], "other"
    warnings = tj.take_warnings()
    if w < 1 or h < 1:
        raise DecodeError(f"corrupt JPEG header: {'; '.join(warnings) or 'no image size'}")
    kind = "other" if colorspace in (_TJCS_CMYK, _TJCS_YCCK) else "jpeg"
    return h, w, kind


# ---------------------------------------------------------------------------------------------
# Pixels


def choose_dct_scale(box_h: float, box_w: float, out_h: int, out_w: int) -> tuple[int, int]:
    """The smallest TurboJPEG scale (num, denom) <= 1 at which the crop still covers the output.

    Decoding below that would mean enlarging again, losing detail; above it is wasted work.
    """
    for num, denom in _dct_candidates():
        if box_h * num >= out_h * denom and box_w * num >= out_w * denom:
            return num, denom
    return 1, 1


def _cv2_decode(data: bytes) -> np.ndarray:
    """Any format OpenCV reads, as RGB HxWx3 (grey expanded, alpha dropped like PIL's convert)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        img = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error as e:
        raise DecodeError(f"OpenCV cannot decode: {str(e).strip().splitlines()[-1]}") from None
    if img is None or img.ndim != 3 or img.shape[2] != 3 or img.size == 0:
        raise DecodeError("not a readable image (OpenCV could not decode it)")
    return np.ascontiguousarray(img)


# libjpeg warnings after which the decoded pixels are still the image: stray bytes between
# segments, common in files from some cameras and editors (PIL and djpeg accept them too).
_BENIGN_WARNINGS = ("extraneous bytes before marker",)


def _turbo_decode(data: bytes, scale: tuple[int, int]) -> np.ndarray:
    """RGB pixels at a DCT scale, or OSError.

    libjpeg reports a truncated or corrupt stream as a *warning* and returns a partly grey (or,
    when a later error follows, uninitialised) image, so any warning but the benign ones is an
    error here.
    """
    tj = _turbo()
    factor = None if scale == (1, 1) else scale
    tj.take_warnings()  # drop anything a failed call left behind on this thread
    pixels = tj.decode(data, pixel_format=_TJPF_RGB, scaling_factor=factor)
    bad = [w for w in tj.take_warnings() if not any(b in w for b in _BENIGN_WARNINGS)]
    if bad:
        raise OSError("; ".join(bad))
    return pixels


def _decode_pixels(data: bytes, header: ImageHeader, scale: tuple[int, int]) -> np.ndarray:
    """Oriented RGB pixels, at `scale` when the file takes the TurboJPEG route."""
    if header.kind == "jpeg" and _turbo() is not None:
        try:
            raw = _turbo_decode(data, scale)
        except OSError as e:
            # Odd JPEGs TurboJPEG refuses may still be readable by OpenCV's libjpeg (which, in
            # OpenCV 5, fails rather than returning a partial image).
            try:
                raw = _cv2_decode(data)
            except DecodeError:
                what = "truncated" if "Premature end" in str(e) else "corrupt"
                raise DecodeError(f"{what} JPEG: {e}") from None
    else:
        raw = _cv2_decode(data)
    return apply_orientation(raw, header.orientation)


# ---------------------------------------------------------------------------------------------
# Region-of-interest decoding

_ROI_SWITCH = "BATCHWIRE_JPEG_ROI"  # "0" turns ROI decoding off (benchmarks, debugging)
# Entropy-decode the rows below the crop too, so corrupt data there fails the sample as a full
# decode does. Off: those rows are never read (the crop's pixels are unaffected by them); a
# truncated file is still caught, by its missing EOI marker. Costs ~0.2 CPU ms per ImageNet file.
ROI_VERIFY_TAIL = False
_roi_lock = threading.Lock()
_roi_state: list = []

# Per EXIF orientation: (transposed, stored rows flipped, stored columns flipped), as
# `exif.apply_orientation` turns stored pixels into displayed ones.
_ORIENTATION_OPS = {
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, True, False),
    7: (True, True, True),
    8: (True, False, True),
}
Region = tuple[int, int, int, int]


def _roi_decoder() -> Callable | None:
    """`batchwire.native.decode_jpeg_roi` if enabled and built here, else None. The switch is
    read on every call (cheap; tests and benchmarks flip it), the build is tried once."""
    if os.environ.get(_ROI_SWITCH, "1").strip() == "0":
        return None
    if not _roi_state:
        with _roi_lock:
            if not _roi_state:
                from batchwire.native.jpeg_roi import decode_jpeg_roi, jpeg_roi_available

                _roi_state.append(decode_jpeg_roi if jpeg_roi_available() else None)
    return _roi_state[0]


def _flip(lo: int, hi: int, size: int) -> tuple[int, int]:
    return size - hi, size - lo


def stored_region(orientation: int, stored_hw: tuple[int, int], region: Region) -> Region:
    """The region of the stored (EXIF-unoriented) image that displays as `region`."""
    transposed, flip_rows, flip_cols = _ORIENTATION_OPS.get(orientation, _ORIENTATION_OPS[1])
    y0, x0, y1, x1 = region
    r0, r1, c0, c1 = (x0, x1, y0, y1) if transposed else (y0, y1, x0, x1)
    if flip_rows:
        r0, r1 = _flip(r0, r1, stored_hw[0])
    if flip_cols:
        c0, c1 = _flip(c0, c1, stored_hw[1])
    return r0, c0, r1, c1


def displayed_region(orientation: int, stored_hw: tuple[int, int], region: Region) -> Region:
    """The inverse of `stored_region`: where a stored region lands once oriented."""
    transposed, flip_rows, flip_cols = _ORIENTATION_OPS.get(orientation, _ORIENTATION_OPS[1])
    r0, c0, r1, c1 = region
    if flip_rows:
        r0, r1 = _flip(r0, r1, stored_hw[0])
    if flip_cols:
        c0, c1 = _flip(c0, c1, stored_hw[1])
    return (c0, r0, c1, r1) if transposed else (r0, c0, r1, c1)


def _filter_reach(b0: float, b1: float, out_size: int, size: int) -> tuple[int, int]:
    """Pixels [lo, hi) of one axis that resizing [b0, b1) to `out_size` may read, plus one.

    The antialiasing triangle reaches `max(scale, 1)` pixels beyond the box (see
    native/csrc/filter_math.h); one more pixel keeps libjpeg's crop edge, whose chroma
    upsampling lacks its outer neighbour and may differ from a full decode, out of reach.
    """
    support = math.ceil(max((b1 - b0) / out_size, 1.0)) + 1
    return max(0, math.floor(b0) - support), min(size, math.ceil(b1) + support)


def _decode_roi(
    decode: Callable,
    data: bytes,
    header: ImageHeader,
    box: Box,
    scale: tuple[int, int],
    out_hw: tuple[int, int],
) -> DecodedImage | None:
    """Decode only what the resize of `box` reads, or None when the ROI decoder fails (the
    caller then decodes the whole image, which also decides what a bad file's error is)."""
    from batchwire.native.jpeg_roi import JpegRoiError

    denom = scale[1] // scale[0]
    transposed = swaps_axes(header.orientation)
    stored_hw = (header.width, header.height) if transposed else (header.height, header.width)
    scaled_stored = (-(-stored_hw[0] // denom), -(-stored_hw[1] // denom))
    scaled_h, scaled_w = scaled_stored[::-1] if transposed else scaled_stored
    sy, sx = scaled_h / header.height, scaled_w / header.width
    y0, x0, y1, x1 = box[0] * sy, box[1] * sx, box[2] * sy, box[3] * sx
    ry0, ry1 = _filter_reach(y0, y1, out_hw[0], scaled_h)
    rx0, rx1 = _filter_reach(x0, x1, out_hw[1], scaled_w)
    want = stored_region(header.orientation, scaled_stored, (ry0, rx0, ry1, rx1))
    try:
        raw, got, full = decode(data, *want, denom, verify=ROI_VERIFY_TAIL)
    except JpegRoiError as e:
        log.debug("ROI decode failed (%s): decoding the whole image", e)
        return None
    if full != scaled_stored:
        log.debug("ROI decode size %s, header says %s: decoding it whole", full, scaled_stored)
        return None
    oy0, ox0, _, _ = displayed_region(header.orientation, scaled_stored, got)
    pixels = apply_orientation(raw, header.orientation)
    return DecodedImage(pixels=pixels, box=(y0 - oy0, x0 - ox0, y1 - oy0, x1 - ox0))


def decode_for_crop(
    data: bytes, header: ImageHeader, box: Box, out_hw: tuple[int, int], *, roi: bool = True
) -> DecodedImage:
    """Decode just enough of the image to cut `box` (full-size oriented coords) at `out_hw`.

    Returns the decoded, oriented image (possibly DCT-reduced, possibly only the region around
    the box that the resize reads) and the box re-expressed in it. `roi=False` decodes the
    whole image (benchmarks and tests compare the two).
    """
    y0, x0, y1, x1 = (float(v) for v in box)
    scale = (1, 1)
    if header.kind == "jpeg":
        scale = choose_dct_scale(y1 - y0, x1 - x0, int(out_hw[0]), int(out_hw[1]))
        decode = _roi_decoder() if roi else None
        if decode is not None:
            out = (int(out_hw[0]), int(out_hw[1]))
            decoded = _decode_roi(decode, data, header, (y0, x0, y1, x1), scale, out)
            if decoded is not None:
                return decoded
    pixels = _decode_pixels(data, header, scale)
    # Ratio of actual to header size (not num/denom): TurboJPEG rounds scaled sizes up, and
    # this maps the full image extent onto the full decoded extent either way.
    sy = pixels.shape[0] / header.height
    sx = pixels.shape[1] / header.width
    return DecodedImage(pixels=pixels, box=(y0 * sy, x0 * sx, y1 * sy, x1 * sx))


def decode_full(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """The whole image at full size, oriented, RGB HxWx3 uint8 (tests and benchmarks)."""
    header = read_header(data, max_pixels=max_pixels)
    pixels = _decode_pixels(bytes(data), header, (1, 1))
    if pixels.shape[:2] != (header.height, header.width):
        raise DecodeError(
            f"decoded size {pixels.shape[1]}x{pixels.shape[0]} differs from the header's "
            f"{header.width}x{header.height}"
        )
    return pixels


# ---------------------------------------------------------------------------------------------
# Batch decoders


@dataclass(frozen=True)
class DecodeRequest:
    """One image to decode: its bytes, its header, the crop (full-size oriented box), the output
    size it will be resized to (which bounds how far the decoder may reduce it)."""

    index: int
    data: bytes
    header: ImageHeader
    box: Box
    out_hw: tuple[int, int]


@dataclass(frozen=True)
class DecodeResult:
    """A decoded HWC uint8 image on the decoder's device and the box in its coords, or
    `image=None` and the reason in `error`."""

    image: torch.Tensor | None
    box: Box
    error: str | None = None


@runtime_checkable
class BatchDecoder(Protocol):
    """Something that decodes a list of requests; one bad image never fails the batch."""

    name: str
    device: torch.device

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]: ...


def _decode_request(req: DecodeRequest) -> DecodeResult:
    try:
        decoded = decode_for_crop(req.data, req.header, req.box, req.out_hw)
        image = torch.from_numpy(decoded.pixels)  # inside: whatever it refuses is this image's
    except DecodeError as e:
        return DecodeResult(image=None, box=req.box, error=str(e))
    except (ValueError, OSError, MemoryError, cv2.error) as e:
        return DecodeResult(image=None, box=req.box, error=f"{type(e).__name__}: {e}")
    return DecodeResult(image=image, box=decoded.box)


_CHUNKS_PER_THREAD = 4


def _map_chunk(fn: Callable, chunk: Sequence) -> list:
    return [fn(item) for item in chunk]


class CpuBatchDecoder:
    """TurboJPEG/OpenCV decoding on a thread pool (both release the GIL while decoding).

    Results come back in request order whatever the thread count, and decoding is a pure
    function of the bytes, so 1 and N threads give bit-identical images.
    """

    name = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, int(threads if threads is not None else (os.cpu_count() or 1)))
        self.device = torch.device("cpu")
        self._pool: ThreadPoolExecutor | None = None
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bw-decode")

    def map(self, fn: Callable, items: Sequence) -> list:
        """Run `fn` over `items` on the decode threads, results in order (also used for reads).

        Items go to the threads in chunks of a few (about 4 chunks per thread), not one future
        each: a future's handoff costs tens of microseconds of GIL-holding Python, a
        noticeable share of the per-image overhead, while a few chunks per thread still
        balance images of uneven decode cost.
        """
        n = len(items)
        if self._pool is None or n <= 1:
            return [fn(item) for item in items]
        size = max(1, -(-n // (self.threads * _CHUNKS_PER_THREAD)))
        if size == 1:
            return list(self._pool.map(fn, items))
        chunks = [items[i : i + size] for i in range(0, n, size)]
        out: list = []
        for part in self._pool.map(_map_chunk, [fn] * len(chunks), chunks):
            out.extend(part)
        return out

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        return self.map(_decode_request, requests)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> CpuBatchDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CpuBatchDecoder(threads={self.threads})"
