"""batchwire.native: the fused augment op (crop + antialiased resize, flip, colour jitter,
normalisation, dtype and layout) over a whole batch in one pass.

`augment_batch` runs the compiled op (built on first use, see `build.py`) and falls back to the
pure torch reference, with one logged warning, where the extension cannot be built or was built
without CUDA for CUDA tensors: slower, never wrong. `load()` raises instead of falling back.

`decode_jpeg_roi` (optional, `jpeg_roi_available()`) decodes just a region of a JPEG; see
`jpeg_roi.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from batchwire.native.build import BuildResult, NativeBuildError
from batchwire.native.build import build as _build
from batchwire.native.jpeg_roi import JpegRoiError, decode_jpeg_roi, jpeg_roi_available

__all__ = [
    "JpegRoiError",
    "NativeBuildError",
    "NativeOps",
    "augment_batch",
    "decode_jpeg_roi",
    "is_available",
    "jpeg_roi_available",
    "load",
]

log = logging.getLogger("batchwire.native")


@dataclass(frozen=True)
class NativeOps:
    """The loaded extension: its op and what the build holds."""

    build: BuildResult

    @property
    def with_cuda(self) -> bool:
        return self.build.plan.with_cuda

    def augment_batch(
        self,
        images: Sequence[torch.Tensor],
        boxes: torch.Tensor,
        flips: torch.Tensor,
        jitter: torch.Tensor,
        mean: torch.Tensor,
        std: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        # Called through the dispatcher, which releases the GIL while the kernel runs.
        torch.ops.batchwire.augment_batch(list(images), boxes, flips, jitter, mean, std, out)
        return out


def load(verbose: bool = False) -> NativeOps:
    """Builds (first use only, cached on disk) and loads the extension; raises NativeBuildError."""
    return NativeOps(_build(verbose=verbose))


def is_available() -> bool:
    """True when the extension builds and loads here (this may compile it on first use)."""
    try:
        load()
    except NativeBuildError:
        return False
    return True


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def augment_batch(
    images: Sequence[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    jitter: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Crops `boxes` (y0, x0, y1, x1) out of each HWC uint8 image, resizes to out's H x W,
    flips, jitters, normalises and writes `out` [N, 3, H, W] in place; returns `out`.

    `jitter` [N, 4] holds (brightness, contrast, saturation, hue) per image, (1, 1, 1, 0) for
    none; hue is a shift in turns within [-0.5, 0.5]. The semantics are spelled out in
    `batchwire.native.reference`."""
    try:
        ops = load()
    except NativeBuildError as exc:
        _warn_once("build", f"batchwire.native: using the slow reference op: {exc}")
        ops = None
    if ops is not None and (out.device.type == "cpu" or ops.with_cuda):
        return ops.augment_batch(images, boxes, flips, jitter, mean, std, out)
    if ops is not None:
        _warn_once(
            "cuda",
            f"batchwire.native: the extension was built without CUDA "
            f"({ops.build.plan.cuda_reason}); using the slow reference op on {out.device}",
        )
    from batchwire.native.reference import augment_batch_reference

    return augment_batch_reference(images, boxes, flips, jitter, mean, std, out)
