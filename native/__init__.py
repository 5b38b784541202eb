"""batchwire.native: the fused augment op (crop + antialiased resize, flip, colour jitter,
normalisation, dtype and layout) over a whole batch in one pass.

`augment_impl(device)` decides, once per device type, between the compiled op (built on first
use, see `build.py`) and the pure torch reference, with one logged warning where the extension
cannot be built or was built without CUDA for CUDA tensors: slower, never wrong. On each CUDA
device the compiled op is first launched once on a tiny batch (`probe_launch`): a library
without a kernel image (or PTX) for that GPU raises there ("no kernel image is available for
execution on the device"), and the device then uses the reference, warned once
(`checked_on_device`), instead of failing every batch. `augment_batch` runs that choice for its
output's device. `load()` raises instead of falling back.

`decode_jpeg_roi` (optional, `jpeg_roi_available()`) decodes just a region of a JPEG; see
`jpeg_roi.py`.
"""

from __future__ import annotations

import contextlib
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
    "checked_on_device",
    "decode_jpeg_roi",
    "is_available",
    "jpeg_roi_available",
    "load",
    "probe_launch",
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
    CUDA, for CUDA devices) and, on a CUDA device, launches there (`checked_on_device`), else
    the pure torch reference. Decided once per device type (and CUDA device) and process; a
    fallback is logged once, as a warning that says why. Both take `augment_batch`'s
    arguments; `fn is augment_batch_reference` tells which one it is."""
    dev = torch.device(device)
    with _first_use:
        fn = _augment_impl(dev.type)
        if dev.type != "cuda" or fn is augment_batch_reference:
            return fn
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return checked_on_device(fn, dev)


def _probe_args(device: torch.device) -> tuple[torch.Tensor, ...]:
    """A tiny batch: one 6 x 5 colour image and the output on `device`, the per-image
    parameters on the CPU as the producer passes them; a crop, a flip and every jitter."""
    image = (torch.arange(6 * 5 * 3, dtype=torch.int64) * 37 % 251).to(torch.uint8)
    return (
        image.view(6, 5, 3).to(device),
        torch.tensor([[0.5, 0.25, 5.5, 4.75]], dtype=torch.float32),
        torch.tensor([True]),
        torch.tensor([[1.1, 0.9, 1.2, 0.05]], dtype=torch.float32),
        torch.tensor([0.485, 0.456, 0.406], dtype=torch.float32),
        torch.tensor([0.229, 0.224, 0.225], dtype=torch.float32),
        torch.empty((1, 3, 4, 3), dtype=torch.float32, device=device),
    )


def probe_launch(fn: AugmentFn, device: torch.device) -> str | None:
    """Run `fn` once on a tiny batch on `device` and wait for it: None when it ran and agrees
    with the reference, else why not. Catches what only a launch shows: a library without a
    kernel image or PTX for this GPU ('no kernel image is available for execution on the
    device'), a driver too old for the PTX, a broken kernel."""
    where = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    try:
        with where:
            images, boxes, flips, jitter, mean, std, out = _probe_args(device)
            fn([images], boxes, flips, jitter, mean, std, out)
            got = out.cpu()  # waits for the launch: an asynchronous failure surfaces here
    except Exception as exc:  # whatever a launch raises, the op is not usable on this device
        return f"{type(exc).__name__}: {exc}".strip()[:500]
    images, boxes, flips, jitter, mean, std, out = _probe_args(torch.device("cpu"))
    expected = augment_batch_reference([images], boxes, flips, jitter, mean, std, out)
    if not torch.allclose(got, expected, atol=2e-3, rtol=0):
        worst = (got - expected).abs().max().item()
        return f"its result differs from the reference by up to {worst:.4g} on a test batch"
    return None


_checked: dict[str, AugmentFn] = {}  # device ('cuda:1') -> the function that launched there


def checked_on_device(
    fn: AugmentFn,
    device: torch.device,
    probe: Callable[[AugmentFn, torch.device], str | None] = probe_launch,
) -> AugmentFn:
    """`fn` if its launch probe passes on `device`, else the reference (warned once per
    device). Probed once per device and process (callers hold `_first_use`)."""
    key = str(device)
    chosen = _checked.get(key)
    if chosen is None:
        why = probe(fn, device)
        chosen = fn
        if why is not None:
            log.warning(
                "batchwire.native: using the slow reference op on %s: the compiled op failed "
                "its launch probe there (%s). A library built for other GPUs lacks this one's "
                "architecture: set TORCH_CUDA_ARCH_LIST to include it (or its PTX) and rebuild "
                "(`python -m batchwire.native build`)",
                key,
                why,
            )
            chosen = augment_batch_reference
        _checked[key] = chosen
    return chosen


@functools.cache
def _augment_impl(device_type: str) -> AugmentFn:
    try:
        ops = load()
    except NativeBuildError as exc:
        log.warning("batchwire.native: using the slow reference op on %s: %s", device_type, exc)
        return augment_batch_reference
    if device_type == "cpu" or (device_type == "cuda" and ops.with_cuda):
        log.info("batchwire.native: the native fused op is ready on %s", device_type)
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
