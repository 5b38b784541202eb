"""Crop and region geometry: which pixels a crop's resize reads, and where they sit once oriented.

Region-of-interest decoding (the native libjpeg-turbo one on the CPU, DALI's `image_slice`)
decodes only the crop plus what the resize filter reads outside it, so that the augmented output
equals the one from a full decode. How far that filter reaches is decided here, once
(`filter_reach`), for every decoder: a second copy of the formula in one decoder would let its
outputs differ from the others' at crop edges without any test noticing.

Boxes are float `(y0, x0, y1, x1)`, end-exclusive; regions are the integer pixel rectangles a
decoder is asked for, in the same order. `Box` is defined here only: augmentation planning
(`SamplePlan.box`), sample loading and every decoder import it.
"""

from __future__ import annotations

import math

from batchwire.pipeline.decode.orientation import orientation_ops

Box = tuple[float, float, float, float]  # (y0, x0, y1, x1), float pixels, end-exclusive
Region = tuple[int, int, int, int]


def filter_reach(b0: float, b1: float, out_size: int, size: int) -> tuple[int, int]:
    """Pixels [lo, hi) of one axis that resizing [b0, b1) to `out_size` may read, plus one.

    The antialiasing triangle reaches `max(scale, 1)` pixels beyond the box (see
    native/csrc/filter_math.h); one more pixel keeps libjpeg's crop edge, whose chroma
    upsampling lacks its outer neighbour and may differ from a full decode, out of reach.
    """
    support = math.ceil(max((b1 - b0) / out_size, 1.0)) + 1
    return max(0, math.floor(b0) - support), min(size, math.ceil(b1) + support)


def reach_region(box: Box, out_hw: tuple[int, int], hw: tuple[int, int]) -> Region:
    """The region of an `hw`-sized image that resizing `box` to `out_hw` reads (`filter_reach`
    on both axes); it may be empty for a box outside the image."""
    y0, x0, y1, x1 = box
    ry0, ry1 = filter_reach(y0, y1, out_hw[0], hw[0])
    rx0, rx1 = filter_reach(x0, x1, out_hw[1], hw[1])
    return ry0, rx0, ry1, rx1


def _flip(lo: int, hi: int, size: int) -> tuple[int, int]:
    return size - hi, size - lo


def stored_region(orientation: int, stored_hw: tuple[int, int], region: Region) -> Region:
    """The region of the stored (EXIF-unoriented) image that displays as `region`."""
    if orientation == 1:  # the common case, per image on the GPU decoders' producer thread
        return region
    ops = orientation_ops(orientation)
    y0, x0, y1, x1 = region
    r0, r1, c0, c1 = (x0, x1, y0, y1) if ops.transpose else (y0, y1, x0, x1)
    if ops.flip_rows:
        r0, r1 = _flip(r0, r1, stored_hw[0])
    if ops.flip_cols:
        c0, c1 = _flip(c0, c1, stored_hw[1])
    return r0, c0, r1, c1


def displayed_region(orientation: int, stored_hw: tuple[int, int], region: Region) -> Region:
    """The inverse of `stored_region`: where a stored region lands once oriented."""
    if orientation == 1:
        return region
    ops = orientation_ops(orientation)
    r0, c0, r1, c1 = region
    if ops.flip_rows:
        r0, r1 = _flip(r0, r1, stored_hw[0])
    if ops.flip_cols:
        c0, c1 = _flip(c0, c1, stored_hw[1])
    return (c0, r0, c1, r1) if ops.transpose else (r0, c0, r1, c1)
