"""Smaller bitstreams for GPU decoders: a JPEG with restart markers cut down to the crop.

The CPU decoder enters a `pipeline-prepare`d file at its restart markers natively
(`batchwire.native.jpeg_roi`). nvJPEG and DALI decode whole bitstreams, so for them
`narrow_request` does the same cut in front of the decoder: the request becomes one for a small
JPEG of the restart intervals under the crop's reach (`region.reach_region`) plus
`EDGE_MARGIN`, with the header and box re-expressed in it. Whatever decodes it then reads only
the crop's share of the entropy-coded data, and produces the same crop pixels as from the
whole file. A request it cannot narrow (no restart layout, not a JPEG, extension unavailable)
comes back unchanged. The cut finds the intervals from the interval index pipeline-prepare writes
into each file (native/csrc/jpeg_index.h) where it agrees with the file, else by scanning the
file for its restart markers (files prepared before the index; about twice the cut's CPU).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from batchwire.pipeline.decode.contract import DecodeRequest
from batchwire.pipeline.decode.files import read_file
from batchwire.pipeline.decode.headers import ImageHeader
from batchwire.pipeline.decode.orientation import swaps_axes
from batchwire.pipeline.decode.region import Box, displayed_region, reach_region, stored_region

log = logging.getLogger("batchwire.pipeline")

# Pixels asked for beyond the crop's reach. `crop_bitstream` itself keeps one MCU of context on
# every side (what libjpeg's upsampling needs to give the whole file's pixels, at any DCT scale
# the CPU fallback may choose: see context_rect in native/csrc/jpeg_restart.h); this margin is
# for other decoders' upsampling (nvJPEG, DALI), which reads one chroma sample (two pixels)
# across an edge.
EDGE_MARGIN = 2


@functools.cache
def _crop_bitstream():
    """The extension's `crop_bitstream` itself (`batchwire.native.jpeg_roi.crop_bitstream` less
    its wrapper), or None when the extension is unavailable.

    Looked up once per process (the extension's build is tried once and remembered): the
    lookup's import and the wrapper's lock would otherwise run for every image."""
    from batchwire.native import jpeg_roi

    return jpeg_roi.native_function("crop_bitstream")


def narrow_request(req: DecodeRequest, *, upright_only: bool = False) -> DecodeRequest:
    """`req` for the small JPEG of its crop's restart intervals, or `req` itself when its file
    has none (see the module doc). The result's box is in the small image's coordinates.

    The small JPEG carries no EXIF: the request's header keeps the orientation for decoders
    that apply it from there. `upright_only` leaves oriented images alone, for decoders that
    read the orientation from the bitstream (DALI).

    Runs once per image on the GPU decoders' producer thread with the GIL held, so it is
    written for that: the cut itself is one native call, the rest plain arithmetic."""
    header = req.header
    orientation = header.orientation
    if header.kind != "jpeg" or (upright_only and orientation != 1):
        return req
    crop = _crop_bitstream()
    if crop is None:
        return req
    region = cut_region(header, req.box, req.out_hw)
    if region is None:
        return req
    found = crop(req.data, *region)
    if found is None:
        return req
    small, held = found
    h, w = header.height, header.width
    stored_hw = (w, h) if swaps_axes(orientation) else (h, w)
    top, left, bottom, right = displayed_region(orientation, stored_hw, held)
    by0, bx0, by1, bx1 = map(float, req.box)
    # Built directly rather than through dataclasses.replace (several times the cost): a field
    # added to DecodeRequest must be carried over here (test_narrow_identity lists the fields).
    return DecodeRequest(
        index=req.index,
        data=small,
        header=ImageHeader(
            height=bottom - top, width=right - left, orientation=orientation, kind="jpeg"
        ),
        box=(by0 - top, bx0 - left, by1 - top, bx1 - left),
        out_hw=req.out_hw,
        intact=req.intact,
    )


def cut_region(
    header: ImageHeader, box: Box, out_hw: tuple[int, int]
) -> tuple[int, int, int, int] | None:
    """The region of the stored image (before EXIF orientation) the cut asks the native code
    for: what the resize of `box` to `out_hw` reads, EDGE_MARGIN more on each side, clamped;
    None when nothing is left of it."""
    h, w = header.height, header.width
    y0, x0, y1, x1 = reach_region(box, out_hw, (h, w))
    wanted = (
        max(0, y0 - EDGE_MARGIN),
        max(0, x0 - EDGE_MARGIN),
        min(h, y1 + EDGE_MARGIN),
        min(w, x1 + EDGE_MARGIN),
    )
    if wanted[2] <= wanted[0] or wanted[3] <= wanted[1]:
        return None
    stored_hw = (w, h) if swaps_axes(header.orientation) else (h, w)
    return stored_region(header.orientation, stored_hw, wanted)


def restart_share(paths: Sequence[str], sample: int = 16) -> tuple[int, int]:
    """(JPEGs that decoders can enter at restart markers, JPEGs looked at) among up to `sample`
    files spread evenly over `paths`: whether a dataset was `pipeline-prepare`d, for the
    server's start-up log. Files that cannot be read or are not JPEGs are not counted; (0, 0)
    when the extension is unavailable."""
    from batchwire.native import jpeg_roi

    if not paths or not jpeg_roi.jpeg_roi_available():
        return 0, 0
    step = max(1, len(paths) // sample)
    entered = looked = 0
    for path in paths[::step][:sample]:
        try:
            data = read_file(path)  # regular files only: a FIFO in a list never blocks start-up
        except OSError:
            continue
        if not data.startswith(b"\xff\xd8"):
            continue
        looked += 1
        entered += jpeg_roi.restart_layout(data)[0] is not None
    return entered, looked
