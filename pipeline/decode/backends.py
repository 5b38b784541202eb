"""The two libraries behind every CPU decode, with their quirks turned into plain errors.

TurboJPEG decodes JPEGs, at a reduced DCT scale when asked; OpenCV decodes everything else (and
the JPEGs TurboJPEG refuses). Both release the GIL while decoding, which is what lets
`CpuBatchDecoder` use threads. What this module hides:
- PyTurboJPEG reports libjpeg warnings through `warnings.warn` and returns the (possibly partial)
  image; "Premature end of JPEG file" is such a warning, so a truncated file would decode into a
  half-grey picture. Decoding is strict: `turbo_decode` treats every warning but the benign one
  (`benign_warning`) as an error. TurboJPEG keeps only the *first* warning's text, so a benign
  first one hides everything after it: a file with any warning at all is judged again by the
  native strict check, which sees every warning (TJFLAG_STOPONWARNING would stop at the benign
  one too). Arithmetic-coded frames are refused before decoding (`arithmetic_frame`), as the
  native decoder refuses them: libjpeg decodes a Huffman file whose SOF0 became SOF9 into noise
  without a warning.
- OpenCV's libjpeg ignores those warnings and returns the partial image, so OpenCV never judges
  a JPEG's data: `check_jpeg_data` does, strictly, for the JPEGs OpenCV decodes.
- libturbojpeg may be missing: `turbo()` is then None and JPEGs go to OpenCV, without DCT scaling.
- OpenCV signals failure by returning None or raising `cv2.error`; `cv2_decode` raises
  `DecodeError` either way.
"""

from __future__ import annotations

import logging
import re
import threading

import cv2
import numpy as np
from batchwire.pipeline.decode.contract import DecodeError

log = logging.getLogger("batchwire.pipeline")

# TurboJPEG colourspaces (TJCS_*) it cannot convert to RGB: those JPEGs go to OpenCV.
TJCS_CMYK = 3
TJCS_YCCK = 4
_TJPF_RGB = 0

_TJPF_CMYK = 11

# The one libjpeg warning after which the decoded pixels are still the image: stray bytes
# between header segments, common in files from some cameras and editors (PIL and djpeg accept
# them too). The same warning before EOI (0xd9) or a restart marker (0xd0-0xd7) means the
# entropy-coded data did not end where the image did: a corrupt scan, refused.
_EXTRANEOUS = re.compile(r"extraneous bytes before marker 0x([0-9a-fA-F]{2})")


def _load_turbojpeg():
    """A TurboJPEG whose warnings are recorded per thread instead of going to `warnings`.

    Catching `warnings` is process-global state and not thread-safe, so we override its error
    reporter to record the message in thread-local storage. One instance is shared by all
    threads: it holds only ctypes function pointers and every call creates and destroys its own
    libjpeg handle.
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


def turbo():
    """The shared TurboJPEG instance, created on first use (None if the library is missing)."""
    if not _turbo_state:
        with _turbo_lock:
            if not _turbo_state:
                _turbo_state.append(_load_turbojpeg())
    return _turbo_state[0]


def dct_scales() -> list[tuple[int, int]]:
    """The DCT scales worth decoding at: 1/8, 1/4, 1/2 and 1, smallest first (only 1 without
    TurboJPEG).

    libjpeg-turbo has SIMD reduced IDCTs only for 1/2, 1/4 and 1/8; the other N/8 scales use
    generic C code and measured slower than a full-size decode (one thread, 200 imagenet-sample
    files: 7/8 at 460 images/s, 3/8 at 620, against 680 at 1/1), so they are never worth it.
    """
    tj = turbo()
    factors = tj.scaling_factors if tj is not None else {(1, 1)}
    useful = (f for f in factors if f[0] == 1 and f[1] in (1, 2, 4, 8))
    return sorted(useful, key=lambda f: f[0] / f[1])


def benign_warning(message: str) -> bool:
    """True for the one libjpeg warning that leaves the pixels whole (see `_EXTRANEOUS`)."""
    m = _EXTRANEOUS.search(message)
    if m is None:
        return False
    marker = int(m.group(1), 16)
    return marker != 0xD9 and not 0xD0 <= marker <= 0xD7


def turbo_decode(data: bytes, scale: tuple[int, int], *, pixel_format: int = _TJPF_RGB):
    """Pixels (RGB unless asked otherwise) at a DCT scale, or OSError.

    libjpeg reports a truncated or corrupt stream as a *warning* and returns a partly grey (or,
    when a later error follows, uninitialised) image, so any warning but the benign one is an
    error here. TurboJPEG reports only the first warning of a decode, so when that one was
    benign, `_after_benign_warning` judges the file with a decoder that sees them all. A file
    with no warning costs nothing extra.
    """
    tj = turbo()
    if arithmetic_frame(data):
        raise OSError("arithmetic-coded JPEG (SOF9..SOF15): not decoded here")
    factor = None if scale == (1, 1) else scale
    tj.take_warnings()  # drop anything a failed call left behind on this thread
    try:
        pixels = tj.decode(data, pixel_format=pixel_format, scaling_factor=factor)
    finally:
        warnings = tj.take_warnings()
    bad = [w for w in warnings if not benign_warning(w)]
    if bad:
        raise OSError("; ".join(bad))
    if warnings:
        _after_benign_warning(data, warnings)
    return pixels


def _after_benign_warning(data: bytes, warnings: list[str]) -> None:
    """OSError unless the native strict check passes `data`, which TurboJPEG decoded with only
    benign warnings reported: libjpeg's default reporter (what TurboJPEG keeps) formats the
    first warning only, so corrupt data after stray header bytes was never seen. Without the
    native extension nothing here can look past that first warning: the file is refused (rare:
    stray bytes between header segments, where the extension is not built)."""
    from batchwire.native.jpeg_roi import JpegRoiError, check_jpeg, jpeg_roi_available

    if not jpeg_roi_available():
        raise OSError(
            f"{warnings[0]} (and nothing here can check the data after it: the native JPEG "
            "checker is not built)"
        )
    try:
        check_jpeg(data)
    except JpegRoiError as e:
        raise OSError(str(e)) from None


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # not DHT, JPG, DAC


def arithmetic_frame(data: bytes | memoryview) -> bool:
    """Whether the JPEG's frame header is an arithmetic-coded one (SOF9..SOF15).

    Walks the header segments as libjpeg does (fill bytes 0xFF skipped, each segment's length
    trusted) up to the first SOF or SOS. A walk that meets anything else (stray bytes, a
    truncated header) stops with False: libjpeg warns on such a file, and `turbo_decode` then
    has the native check (which refuses arithmetic frames itself) judge it. A few microseconds.
    """
    pos, size = 2, len(data)
    if size < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return False
    while pos + 4 <= size:
        if data[pos] != 0xFF:
            return False
        while pos < size and data[pos] == 0xFF:
            pos += 1
        if pos + 3 > size:
            return False
        marker = data[pos]
        if marker in _SOF_MARKERS:
            return marker >= 0xC9
        if marker == 0xDA:
            return False
        pos += 1 + ((data[pos + 1] << 8) | data[pos + 2])
    return False


def has_eoi(data: bytes) -> bool:
    """Whether an end-of-image marker follows the first scan header (the check the native
    decoder makes; entropy-coded data never holds FF D9, so one there ends the image)."""
    sos = data.find(b"\xff\xda")
    return sos >= 0 and data.rfind(b"\xff\xd9") > sos


def check_jpeg_data(data: bytes) -> None:
    """Refuse (DecodeError) a JPEG whose data is corrupt, before OpenCV decodes it.

    OpenCV returns whatever libjpeg made of a corrupt file (grey or garbage rows) without a
    word, so a JPEG goes to OpenCV only after a strict entropy decode of the whole file: the
    native libjpeg check (`batchwire.native.jpeg_roi.check_jpeg`, any colour space and sampling)
    where it is built, else TurboJPEG (to CMYK for CMYK/YCCK files) where it reads the file.
    Any warning but the benign one fails. Where neither can read it, nothing here can see
    corrupt data: only a truncated file (no EOI marker) is refused.
    """
    from batchwire.native.jpeg_roi import JpegRoiError, check_jpeg, jpeg_roi_available

    if jpeg_roi_available():
        try:
            check_jpeg(data)
        except JpegRoiError as e:
            raise DecodeError(f"{jpeg_failure(str(e))} JPEG: {e}") from None
        return
    tj = turbo()
    if tj is not None:
        tj.take_warnings()
        try:
            _w, _h, _subsample, colorspace = tj.decode_header(data)
        except OSError:
            colorspace = None
        tj.take_warnings()
        if colorspace is not None:
            fmt = _TJPF_CMYK if colorspace in (TJCS_CMYK, TJCS_YCCK) else _TJPF_RGB
            try:
                turbo_decode(data, (1, 1), pixel_format=fmt)
            except OSError as e:
                raise DecodeError(f"{jpeg_failure(str(e))} JPEG: {e}") from None
            return
    if not has_eoi(data):
        raise DecodeError("truncated JPEG: no end-of-image marker")


def jpeg_failure(message: str) -> str:
    """ "truncated" or "corrupt", from a libjpeg message."""
    return "truncated" if "Premature end of JPEG file" in message else "corrupt"


def cv2_decode(data: bytes) -> np.ndarray:
    """Any format OpenCV reads, as RGB HxWx3 (grey expanded, alpha dropped like PIL's convert)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        img = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error as e:
        raise DecodeError(f"OpenCV cannot decode: {str(e).strip().splitlines()[-1]}") from None
    if img is None or img.ndim != 3 or img.shape[2] != 3 or img.size == 0:
        raise DecodeError("not a readable image (OpenCV could not decode it)")
    return np.ascontiguousarray(img)
