"""The two libraries behind every CPU decode, with their quirks turned into plain errors.

TurboJPEG decodes JPEGs, at a reduced DCT scale when asked; OpenCV decodes everything else (and
the JPEGs TurboJPEG refuses). Both release the GIL while decoding, which is what lets
`CpuBatchDecoder` use threads. What this module hides:
- PyTurboJPEG reports libjpeg warnings through `warnings.warn` and returns the (possibly partial)
  image; "Premature end of JPEG file" is such a warning, so a truncated file would decode into a
  half-grey picture. `turbo_decode` treats every warning but the benign ones as an error.
- libturbojpeg may be missing: `turbo()` is then None and JPEGs go to OpenCV, without DCT scaling.
- OpenCV signals failure by returning None or raising `cv2.error`; `cv2_decode` raises
  `DecodeError` either way.
"""

from __future__ import annotations

import logging
import threading

import cv2
import numpy as np
from batchwire.pipeline.decode.contract import DecodeError

log = logging.getLogger("batchwire.pipeline")

# TurboJPEG colourspaces (TJCS_*) it cannot convert to RGB: those JPEGs go to OpenCV.
TJCS_CMYK = 3
TJCS_YCCK = 4
_TJPF_RGB = 0

# libjpeg warnings after which the decoded pixels are still the image: stray bytes between
# segments, common in files from some cameras and editors (PIL and djpeg accept them too).
_BENIGN_WARNINGS = ("extraneous bytes before marker",)


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


def turbo_decode(data: bytes, scale: tuple[int, int]) -> np.ndarray:
    """RGB pixels at a DCT scale, or OSError.

    libjpeg reports a truncated or corrupt stream as a *warning* and returns a partly grey (or,
    when a later error follows, uninitialised) image, so any warning but the benign ones is an
    error here.
    """
    tj = turbo()
    factor = None if scale == (1, 1) else scale
    tj.take_warnings()  # drop anything a failed call left behind on this thread
    pixels = tj.decode(data, pixel_format=_TJPF_RGB, scaling_factor=factor)
    bad = [w for w in tj.take_warnings() if not any(b in w for b in _BENIGN_WARNINGS)]
    if bad:
        raise OSError("; ".join(bad))
    return pixels


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
