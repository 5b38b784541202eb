"""One JPEG through one decode path, for the strict-decode tests and tools: `served` gives the
pixels a path hands out or None when it refuses the file; `crops` the boxes each file is asked
for. Shared by test_decode_strict and fuzz_rerun.py."""

from __future__ import annotations

from batchwire.pipeline.decode import DecodeError, decode_for_crop, read_header

OUT = (24, 24)


def crops(height: int, width: int) -> list[tuple[float, float, float, float]]:
    """A val centre crop, the whole image, and train-like crops in three corners (small and
    large), so damage above, inside and below a crop is met."""
    h, w = float(height), float(width)
    return [
        (h * 0.125, w * 0.125, h * 0.875, w * 0.875),
        (0.0, 0.0, h, w),
        (0.5, 1.5, h * 0.4, w * 0.5),
        (h * 0.6, w * 0.55, h - 0.5, w - 1.0),
        (h * 0.3, 0.0, h * 0.7, w * 0.3),
    ]


def served(data: bytes, box, roi: bool, scale_out=OUT, intact: bool = False):
    """The decoded pixels and box of one path, or None when it refuses the file."""
    try:
        header = read_header(data)
        got = decode_for_crop(data, header, box, scale_out, roi=roi, intact=intact)
    except (DecodeError, ValueError, OSError):
        return None
    return got
