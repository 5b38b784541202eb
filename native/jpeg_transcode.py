"""Lossless JPEG rewriting with restart markers (csrc/jpeg_transcode.cpp), for pipeline-prepare.

A JPEG with a restart marker after every MCU lets the ROI decoder build a small JPEG of just
the MCUs under a crop by copying entropy-coded segments. The rewrite works on the quantised DCT
coefficients, so no pixel changes, and `verify` proves it for each file: the result is read
back and both its coefficients and a full decode's pixels are compared with the source's.

It lives in the ROI decoder's extension (one build, one strict libjpeg error policy), so it is
available exactly where that is (`transcode_available`).
"""

from __future__ import annotations

from typing import Any

from batchwire.native.jpeg_roi import _module


class JpegTranscodeError(ValueError):
    """The JPEG was not rewritten (unsupported, too large, or not verified): the file itself
    may be sound, so callers keep it as it was."""


class JpegCorruptError(JpegTranscodeError):
    """The source JPEG is corrupt or truncated (a strict decode fails)."""


class JpegMismatchError(JpegTranscodeError):
    """The rewritten file did not decode to the source's coefficients and pixels."""


def _loaded() -> Any:
    module = _module()
    if module is None:
        raise RuntimeError("the JPEG transcoder is unavailable (see the logged build error)")
    return module


def transcode_available() -> bool:
    """True when the extension builds and loads here (the first call may compile it)."""
    return _module() is not None


def transcode_restart(
    data: bytes | memoryview,
    restart_interval: int = 1,
    *,
    fit_rows: bool = False,
    optimize: bool = True,
    verify: bool = True,
    max_memory: int | None = None,
) -> bytes:
    """`data` rewritten losslessly as a baseline Huffman JPEG with a restart marker every
    `restart_interval` MCUs (0: none), every APPn and COM marker kept.

    `fit_rows` makes `restart_interval` the most MCUs per interval: the interval is the largest
    that divides the file's MCU rows (1 at worst), so the intervals tile the rows and the
    decoder can cut any rectangle of them out (`batchwire.native.jpeg_roi.restart_layout`).

    `optimize` fits the Huffman tables to the file (they pay for part of the markers' cost);
    `verify` checks the result against the source (coefficients and pixels); `max_memory`
    caps the coefficient arrays per decoder (bytes; the extension's default when None).
    Raises JpegCorruptError for a corrupt or truncated source, JpegMismatchError when the
    check fails and JpegTranscodeError when libjpeg cannot rewrite the file (e.g. 12-bit or
    lossless JPEG, or over the memory cap); RuntimeError when the extension is unavailable.
    The GIL is released while it works.
    """
    module = _loaded()
    limit = module.TRANSCODE_MAX_MEMORY if max_memory is None else int(max_memory)
    try:
        return module.transcode_restart(
            data, int(restart_interval), bool(fit_rows), bool(optimize), bool(verify), limit
        )
    except module.JpegCorruptError as exc:
        raise JpegCorruptError(str(exc)) from None
    except module.JpegMismatchError as exc:
        raise JpegMismatchError(str(exc)) from None
    except module.JpegTranscodeError as exc:
        raise JpegTranscodeError(str(exc)) from None


def jpeg_difference(a: bytes | memoryview, b: bytes | memoryview) -> str | None:
    """None when two JPEGs hold the same quantised coefficients and decode to the same pixels
    (ISLOW IDCT, fancy upsampling; RGB, greyscale or CMYK), else where they first differ.
    Raises JpegTranscodeError when either cannot be decoded strictly. GIL released."""
    module = _loaded()
    try:
        return module.jpeg_difference(a, b, module.TRANSCODE_MAX_MEMORY)
    except module.JpegTranscodeError as exc:
        raise JpegTranscodeError(str(exc)) from None
