"""batchwire.native: the fused augment op (crop + antialiased resize, flip, colour jitter,
normalisation, dtype and layout) over a whole batch in one pass.

`augment_impl(device)` decides, once per device type, between the compiled op (built on first
use, see `build.py`) and the pure torch reference, with one logged warning where the extension
cannot be built or was built without CUDA for CUDA tensors: slower, never wrong.
`augment_batch` runs that choice for its output's device. `load()` raises instead of falling
back.

`decode_jpeg_roi` (optional, `jpeg_roi_available()`) decodes just a region of a JPEG; see
`jpeg_roi.py`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from batchwire.native.build import BuildResult, NativeBuildError
from batchwire.native.build import build as _build
from batchwire.native.jpeg_roi import JpegRoiError, decode_jpeg_roi, jpeg_roi_available
from batchwire.native.reference import augment_batch_reference

__all__ = [
    "JpegRoiError",
    "NativeBuildError",
    "NativeOps",
    "augment_batch",
    "augment_batch_reference",
    "augment_impl",
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


AugmentFn = Callable[..., torch.Tensor]
_first_use = threading.Lock()  # functools.cache alone may run a first call twice at once


def augment_impl(device: torch.device | str) -> AugmentFn:
    """The augment function for outputs on `device`: the compiled op where it is built (with
    CUDA, for CUDA devices), else the pure torch reference. Decided once per device type and
    process; a fallback is logged once, as a warning that says why. Both take
    `augment_batch`'s arguments; `fn is augment_batch_reference` tells which one it is."""
    device_type = torch.device(device).type
    with _first_use:
        return _augment_impl(device_type)


@functools.cache
def _augment_impl(device_type: str) -> AugmentFn:
    try:
        ops = load()
    except NativeBuildError as exc:
        log.warning("batchwire.native: using the slow reference op on %s: %s", device_type, exc)
        return augment_batch_reference
    if device_type == "cpu" or (device_type == "cuda" and ops.with_cuda):
        log.info("batchwire.native: augmenting on %s with the native fused op", device_type)
        return ops.augment_batch
    if device_type == "cuda":
        why = f"the extension was built without CUDA ({ops.build.plan.cuda_reason})"
    else:
        why = f"the extension has no kernel for {device_type} devices"
    log.warning("batchwire.native: using the slow reference op on %s: %s", device_type, why)
    return augment_batch_reference


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
    `batchwire.native.reference`. Runs `augment_impl(out.device)`."""
    return augment_impl(out.device)(images, boxes, flips, jitter, mean, std, out)
