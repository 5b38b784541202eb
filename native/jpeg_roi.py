"""Region-of-interest JPEG decoding (csrc/jpeg_roi.cpp): only the part of a JPEG a crop reads.

For files with restart markers at MCU granularity (`pipeline-prepare`), the decoder copies the
restart intervals under the crop into a small JPEG and decodes that (csrc/jpeg_restart.cpp):
the same pixels for about half the work. `crop_bitstream` gives GPU decoders the same bytes.
Where the file carries pipeline-prepare's interval index (`with_interval_index`,
csrc/jpeg_index.h), both find the intervals from it instead of scanning the file.

Optional by design: it needs libjpeg-turbo's headers at build time (`libjpeg62-turbo-dev`), so
it is a separate extension from the augment op, and callers (pipeline/decode/roi.py) keep their
full-image decoder for when it is unavailable. The build is tried once per process; a failure
is logged once and remembered, never retried per image.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from batchwire.native.build import NativeBuildError, build_jpeg_roi

log = logging.getLogger("batchwire.native")

Region = tuple[int, int, int, int]


class JpegRoiError(ValueError):
    """The JPEG could not be decoded (corrupt, truncated, unsupported): the message says why."""


_first_use = threading.Lock()  # functools.cache alone may run a first call twice at once


def _module() -> Any | None:
    """The loaded extension, or None when it cannot be built here (logged once)."""
    with _first_use:
        return _load_module()


@functools.cache
def _load_module() -> Any | None:
    try:
        return build_jpeg_roi().module
    except NativeBuildError as exc:
        log.warning("batchwire.native: ROI JPEG decoding unavailable: %s", exc)
        return None


def jpeg_roi_available() -> bool:
    """True when the ROI decoder builds and loads here (the first call may compile it)."""
    return _module() is not None


def native_function(name: str) -> Callable[..., Any] | None:
    """The extension's own function `name`, without this module's wrapper (no lock, no argument
    conversion per call), or None when the extension is unavailable: for callers that look it
    up once and call it for every image (the GPU path's header and cut). Its arguments must
    already be what the wrapper would pass (ints, contiguous bytes)."""
    module = _module()
    return None if module is None else getattr(module, name)


def jpeg_header(data: bytes | memoryview) -> tuple[int, int, int] | None:
    """(height, width, EXIF orientation) of a JPEG as stored (the orientation not applied), or
    None: `read_header`'s fast path. It answers only for a header that libjpeg reads without
    error, Huffman-coded, greyscale or YCbCr/RGB at a sampling TurboJPEG names (4:4:4, 4:2:2,
    4:2:0, 4:4:0, 4:1:1), where TurboJPEG's header call gives the same size and a colour space
    that routes to "jpeg"; the orientation is exif.py's, by a port of its walk. None for
    anything else (CMYK, odd sampling, arithmetic coding, any error): ask TurboJPEG. RuntimeError
    when the extension is unavailable."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    found = module.jpeg_header(data)
    return None if found is None else tuple(found)


def decode_jpeg_roi(
    data: bytes | memoryview,
    y0: int,
    x0: int,
    y1: int,
    x1: int,
    scale_denom: int = 1,
    *,
    verify: bool = True,
    restarts: bool = True,
    fast_entropy: bool = True,
) -> tuple[np.ndarray, Region, tuple[int, int]]:
    """Rows [y0, y1) and at least columns [x0, x1) of a JPEG at 1/scale_denom, as RGB.

    Coordinates refer to the stored image (EXIF orientation not applied) at that scale and are
    clamped to it. Returns (pixels HxWx3 uint8, (ry0, rx0, ry1, rx1) the region actually
    decoded, (height, width) of the whole scaled image): the columns are widened to iMCU
    boundaries, so callers re-express their crop in region coordinates.

    What is verified (csrc/jpeg_roi.cpp's file comment has the details): strict everywhere (any
    libjpeg warning in what is read fails, except stray bytes between header segments;
    arithmetic-coded frames are refused). With `restarts` (the default), a file whose restart
    intervals tile its MCU rows (pipeline-prepare's) is read through a small JPEG of the
    intervals under the region plus one MCU of context: their data is decoded strictly and the
    whole scan's structure (markers in order, interval count, EOI) is checked, but the other
    intervals' data is not decoded. Any other file (or `restarts=False`) is read itself, and
    `verify` (the default) entropy-decodes the rest of it too, so that corrupt data anywhere
    fails exactly as a full strict decode fails; without `verify` rows below the region are never
    read and only a missing EOI marker is checked there. Raises JpegRoiError for bad data,
    RuntimeError when the extension is unavailable. The GIL is released while decoding.

    The restart path entropy decodes with batchwire's own baseline Huffman decoder
    (csrc/jpeg_fast_huffman.h; libjpeg's slow one is the only one it offers for files with
    restart markers), which gives libjpeg's coefficients and, by handing anything unsound back
    to libjpeg, its verdicts; `fast_entropy=False` uses libjpeg's, for tests and benchmarks
    that compare the two.
    """
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    try:
        pixels, region, full = module.decode_jpeg_roi(
            data,
            int(y0),
            int(x0),
            int(y1),
            int(x1),
            int(scale_denom),
            bool(verify),
            bool(restarts),
            bool(fast_entropy),
        )
    except module.JpegRoiError as exc:
        raise JpegRoiError(str(exc)) from None
    return pixels, tuple(region), tuple(full)


def check_jpeg(data: bytes | memoryview) -> None:
    """Entropy decode a whole JPEG (CMYK/YCCK included) with the strict error handling of
    `decode_jpeg_roi`, producing no pixels, and check the structure of its restart intervals
    where the header promises a layout of them: JpegRoiError for corrupt, truncated or
    arithmetic-coded data, None for a sound file. The reference of "strict full decode"; used for
    the JPEGs OpenCV decodes (its libjpeg ignores every warning), after a benign TurboJPEG
    warning, and before GPU decodes. The GIL is released; RuntimeError when the extension is
    unavailable."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    try:
        module.check_jpeg(data)
    except module.JpegRoiError as exc:
        raise JpegRoiError(str(exc)) from None


def restart_layout(data: bytes | memoryview) -> tuple[dict | None, str]:
    """(layout, "") when `decode_jpeg_roi` can enter this JPEG at its restart markers (what
    `pipeline-prepare` writes: sequential Huffman, one scan, restart intervals tiling the MCU
    rows), else (None, why not). The layout dict gives the frame's height and width, the MCU's
    size in pixels, the MCU grid, the restart interval in MCUs and the number of intervals.
    Costs a look at each interval's boundary where the file's interval index agrees with it
    (`index_agrees`), else one pass over the file looking for 0xFF bytes. RuntimeError when the
    extension is unavailable."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    layout, why = module.restart_layout(data)
    return layout, why


def with_interval_index(data: bytes | memoryview) -> bytes:
    """`data` with an interval index recorded in it (csrc/jpeg_index.h: an APP9 segment just
    before the SOS, about 2 bytes per restart interval; any earlier index dropped), so that
    `crop_bitstream` and the restart decode path find the intervals without scanning the file.
    What `pipeline-prepare` does to every file it rewrites. ValueError when the file has no
    restart layout (`restart_layout`); RuntimeError when the extension is unavailable."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    return module.with_interval_index(data)


def index_agrees(data: bytes | memoryview) -> bool:
    """Whether the JPEG carries an interval index (`with_interval_index`) that agrees with it
    in every respect (csrc/jpeg_index.h), so that the restart decode path and `crop_bitstream`
    take the intervals from it instead of scanning; a damaged, truncated or stale one does not.
    RuntimeError when the extension is unavailable."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    return module.index_agrees(data)


def has_interval_index(data: bytes | memoryview) -> bool | None:
    """Whether the JPEG's header holds an interval index segment (sound or not; a damaged one is
    ignored when decoding): None when the header runs past the bytes given, so a caller that
    read only the start of a file reads more. False for anything that is no JPEG."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    return module.has_interval_index(data)


def crop_bitstream(
    data: bytes | memoryview, y0: int, x0: int, y1: int, x1: int
) -> tuple[bytes, Region] | None:
    """A small JPEG holding the whole restart intervals that cover rows [y0, y1) and columns
    [x0, x1) of the stored (EXIF-unoriented) full-size image, and the region (y0, x0, y1, x1)
    of the file's pixels it holds; None when the file has no restart layout (`restart_layout`).

    The intervals cover the region plus one MCU of context on every side (upsampling reads
    across an MCU edge, and libjpeg picks its upsampler from the image's width; see
    `context_rect` in csrc/jpeg_restart.h), so the region decodes as in the whole file; the small
    JPEG's own edges replicate where the file continues. For decoders that cannot crop cheaply
    themselves (nvJPEG, DALI): less to entropy decode."""
    module = _module()
    if module is None:
        raise RuntimeError("the ROI JPEG decoder is unavailable (see the logged build error)")
    found = module.crop_bitstream(data, int(y0), int(x0), int(y1), int(x1))
    if found is None:
        return None
    small, region = found
    return small, tuple(region)
