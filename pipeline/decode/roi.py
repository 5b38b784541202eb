"""Region-of-interest JPEG decoding on the CPU: only the crop plus the resize filter's margin.

A crop of a training sample is about half the image, and the DCT scale rarely applies at 224 px,
so where the native ROI decoder is built (`batchwire.native.jpeg_roi`, libjpeg-turbo with a crop)
decoding just the region `region.reach_region` names saves real work. `decode_roi` returns None
when it cannot help (not built, switched off, sizes disagree with the header), and the caller
then decodes the whole image. When the native decoder refuses the file's data, that verdict is
final (`DecodeError`): it is at least as strict as the whole-image path (see `ROI_VERIFY_TAIL`
for what it reads), and a second opinion could only serve what it refused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from batchwire.pipeline.decode.backends import jpeg_failure
from batchwire.pipeline.decode.contract import (
    ROUTE_REGION,
    ROUTE_RESTART,
    DecodedImage,
    DecodeError,
)
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
# Entropy-decode the rows below the crop too (skipping them costs no IDCT, upsampling or colour
# conversion), so that corrupt data anywhere in the file fails the sample exactly as a full
# strict decode does: the region path then checks every byte a full decode reads. Off (only for
# benchmarks and tests of the trade-off): rows below the crop are never read and damage there is
# served (the crop's pixels are the intact file's, but the file is bad). Costs ~0.12 CPU ms per
# ImageNet file (0.75 -> 0.87 ms for a random 224 px crop, 1,000 imagenet-sample files).
# One rule for bytes known intact (`decode_roi(intact=True)`, an `intact` request: contract.py):
# they passed the strict full decode, so nothing outside the crop is verified again. A file with
# restart markers that tile its MCU rows (pipeline-prepare) is entered at the markers: the
# intervals under the crop (plus one MCU of context) are decoded strictly and the whole scan's
# structure is checked, but not the other intervals' data, nor whether the tables still decode
# them (a one-byte change in a DHT can leave the crop's intervals decodable, to wrong pixels,
# while the full decode fails). Any other file (originals, `--checksums-only`) is read itself
# without its tail: only the rows down to the crop's last, plus the EOI marker's presence.
# Both are sound only for bytes known to pass the strict full decode (what the checksum proves,
# issue 32); any other request reads the file itself, tail verified.
ROI_VERIFY_TAIL = True
# The native refusal that is about the decoder, not the data (csrc/jpeg_roi.cpp's wording).
_NOT_FOR_ROI = "CMYK/YCCK JPEGs are not decoded here"
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
    *,
    intact: bool = False,
) -> DecodedImage | None:
    """Decode only what the resize of `box` (full-size oriented coords) to `out_hw` reads, at
    the DCT `scale`; None when ROI decoding is unavailable here, DecodeError when the native
    decoder refuses the file (corrupt, truncated, unsupported). `intact`: the bytes are known to
    pass the strict full decode, so it enters a file at its restart markers and verifies no
    tail (see `ROI_VERIFY_TAIL`); the result's route says which was allowed."""
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
    if want[2] <= want[0] or want[3] <= want[1]:
        return None  # nothing to crop: the whole-image path handles the degenerate box
    try:
        verify = ROI_VERIFY_TAIL and not intact
        raw, got, full = decode(data, *want, denom, verify=verify, restarts=intact)
    except JpegRoiError as e:
        if _NOT_FOR_ROI in str(e):
            return None  # a colour space the whole-image path converts (OpenCV)
        raise DecodeError(f"{jpeg_failure(str(e))} JPEG: {e}") from None
    if full != scaled_stored:
        log.debug("ROI decode size %s, header says %s: decoding it whole", full, scaled_stored)
        return None
    oy0, ox0, _, _ = displayed_region(header.orientation, scaled_stored, got)
    pixels = apply_orientation(raw, header.orientation)
    route = ROUTE_RESTART if intact else ROUTE_REGION
    return DecodedImage(pixels, (y0 - oy0, x0 - ox0, y1 - oy0, x1 - ox0), route)
