"""Region-of-interest JPEG decoding on the CPU: only the crop plus the resize filter's margin.

A crop of a training sample is about half the image, and the DCT scale rarely applies at 224 px,
so where the native ROI decoder is built (`batchwire.native.jpeg_roi`, libjpeg-turbo with a crop)
decoding just the region `region.reach_region` names saves real work. It is an optimisation
only: `decode_roi` returns None on any trouble (not built, switched off, the decoder refuses the
file, sizes disagree with the header), and the caller then decodes the whole image, which also
decides what a bad file's error is.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from batchwire.pipeline.decode.contract import DecodedImage
from batchwire.pipeline.decode.headers import ImageHeader
from batchwire.pipeline.decode.orientation import apply_orientation, swaps_axes
from batchwire.pipeline.decode.region import (
    Box,
    displayed_region,
    reach_region,
    stored_region,
)

log = logging.getLogger("batchwire.pipeline")

_ROI_SWITCH = "BATCHWIRE_JPEG_ROI"  # "0" turns ROI decoding off (benchmarks, debugging)
# Entropy-decode the rows below the crop too, so corrupt data there fails the sample as a full
# decode does. Off: those rows are never read (the crop's pixels are unaffected by them); a
# truncated file is still caught, by its missing EOI marker. Strict decoding (any libjpeg
# warning fails) covers what is read, so with this off a file whose damage (zeroed or random
# bytes, a cut with FF D9 appended) lies wholly below a crop is served for that crop, with
# exactly the intact file's pixels, and found bad (logged, counted, replaced) when a crop
# reaches the damage. Costs ~0.2 CPU ms per ImageNet file. A file with restart markers that tile
# its MCU rows (pipeline-prepare) is entered at the markers: then the intervals above and beside
# the crop are not read either (pipeline-prepare checked every one of them, once); with this on,
# such a file is read as a whole like any other.
ROI_VERIFY_TAIL = False
_roi_lock = threading.Lock()
_roi_state: list = []


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


def decode_roi(
    data: bytes,
    header: ImageHeader,
    box: Box,
    scale: tuple[int, int],
    out_hw: tuple[int, int],
) -> DecodedImage | None:
    """Decode only what the resize of `box` (full-size oriented coords) to `out_hw` reads, at
    the DCT `scale`; None when ROI decoding is unavailable or fails here."""
    decode = _roi_decoder()
    if decode is None:
        return None
    from batchwire.native.jpeg_roi import JpegRoiError

    denom = scale[1] // scale[0]
    transposed = swaps_axes(header.orientation)
    stored_hw = (header.width, header.height) if transposed else (header.height, header.width)
    scaled_stored = (-(-stored_hw[0] // denom), -(-stored_hw[1] // denom))
    scaled_h, scaled_w = scaled_stored[::-1] if transposed else scaled_stored
    sy, sx = scaled_h / header.height, scaled_w / header.width
    y0, x0, y1, x1 = box[0] * sy, box[1] * sx, box[2] * sy, box[3] * sx
    reach = reach_region((y0, x0, y1, x1), out_hw, (scaled_h, scaled_w))
    want = stored_region(header.orientation, scaled_stored, reach)
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
