"""EXIF orientation as one table, and everything that turns pixels or regions by it.

Cameras store pixels in sensor order and record in the EXIF Orientation tag (1-8) how to turn
them for display; PIL's `ImageOps.exif_transpose`, which most training code uses, honours it, and
so must every decoder here, or a GPU run would see rotated images a CPU run does not. The eight
values are written down once, in `ORIENTATIONS`, as operations on the *stored* image: reverse its
rows, reverse its columns, then transpose. The numpy applier (CPU decode), the torch applier
(nvJPEG output on the GPU) and the region mapping of region-of-interest decoding
(`region.stored_region`) all read that table, so they cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the torch applier only calls the tensor's own methods
    import torch


class Orientation(NamedTuple):
    """What displaying an EXIF orientation does to the stored image, in this order."""

    flip_rows: bool  # the stored rows are reversed (upside down)
    flip_cols: bool  # the stored columns are reversed (mirrored)
    transpose: bool  # then rows and columns swap (displayed height is the stored width)


IDENTITY = Orientation(False, False, False)

# As PIL's `exif_transpose`: 2 mirror, 3 half turn, 4 flip, 5 TRANSPOSE (main diagonal),
# 6 ROTATE_270 (quarter turn clockwise), 7 TRANSVERSE (anti-diagonal), 8 ROTATE_90.
ORIENTATIONS: dict[int, Orientation] = {
    1: IDENTITY,
    2: Orientation(False, True, False),
    3: Orientation(True, True, False),
    4: Orientation(True, False, False),
    5: Orientation(False, False, True),
    6: Orientation(True, False, True),
    7: Orientation(True, True, True),
    8: Orientation(False, True, True),
}


def orientation_ops(orientation: int) -> Orientation:
    """The table's entry; anything outside 1-8 (a malformed tag) displays as stored."""
    return ORIENTATIONS.get(orientation, IDENTITY)


def swaps_axes(orientation: int) -> bool:
    """True when the orientation transposes the image (5-8), so displayed h/w are swapped."""
    return orientation_ops(orientation).transpose


def apply_orientation(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Turn an HxWxC image the way `PIL.ImageOps.exif_transpose` does for `orientation`.

    1 (or anything outside 2-8) returns the input unchanged; otherwise a C-contiguous copy.
    Always a copy: for a one-pixel-thin image the flipped view already counts as contiguous
    to numpy, yet has a negative stride that torch refuses.
    """
    ops = orientation_ops(orientation)
    if ops == IDENTITY:
        return pixels
    out = pixels
    if ops.flip_rows:
        out = out[::-1]
    if ops.flip_cols:
        out = out[:, ::-1]
    if ops.transpose:
        out = out.swapaxes(0, 1)
    return out.copy(order="C")


def apply_orientation_tensor(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """`apply_orientation` for an HWC tensor on any device (at most one copy, for the flips;
    the result may be non-contiguous). 1 or anything outside 2-8 returns `image` itself."""
    ops = orientation_ops(orientation)
    dims = [d for d, flipped in ((0, ops.flip_rows), (1, ops.flip_cols)) if flipped]
    out = image.flip(dims) if dims else image
    return out.transpose(0, 1) if ops.transpose else out
