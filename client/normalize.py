"""``(x / 255 - mean) / std`` for a uint8 batch, the same arithmetic on every device.

Why on the device: a uint8 wire carries a quarter of the bytes of a float32 one; converting
after the host-to-device copy costs the GPU a few microseconds and saves PCIe and network
bandwidth.

It is computed as ``x * scale + bias`` with ``scale = 1 / (255 std)`` and ``bias = -mean / std``
(float32, rounded from double), the same affine form the server's fused op applies to its float
output, in two passes per channel plane written straight into the output: a multiply that reads
the uint8 plane, and an add in place. No temporary batch for a float32 output.

On the CPU the same two roundings are tabulated once: a uint8 input has 256 values per channel,
so ``out = table[c][x]`` through OpenCV's ``cv2.LUT`` is one pass with bit-identical results
(0.046 against 0.068 CPU ms per 224 px image for the numpy ufunc pair, which remains the path for
layouts that differ between input and output). Not torch's elementwise kernels: they fan out to
torch's intra-op threads, whose barriers spin; on a machine whose cores are busy anyway (the
server, the training step) that burned ~3x the CPU time for the same result (measured: 22 vs 6.7
CPU ms per 64x224x224 batch on 2 loaded cores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

#: ImageNet channel statistics, the usual defaults for pretrained-style normalisation.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype}")
    return dtype


def channel_stats(values: Sequence[float], name: str) -> tuple[float, float, float]:
    """Three per-channel statistics, checked."""
    vals = tuple(float(v) for v in values)
    if len(vals) != 3:
        raise ValueError(f"{name} must have 3 values (one per channel), got {len(vals)}")
    if name == "std" and any(v <= 0 for v in vals):
        raise ValueError(f"std values must be > 0, got {list(vals)}")
    return vals  # type: ignore[return-value]


@dataclass(frozen=True)
class Affine:
    """Per-channel ``scale`` and ``bias`` as float32 values, as scalars and as tensors."""

    scale: tuple[float, float, float]
    bias: tuple[float, float, float]
    scale_t: torch.Tensor  # float32 [1, 3, 1, 1] on the target device
    bias_t: torch.Tensor
    #: float32 ``[3, 256]``: every uint8 value through the two roundings of ``apply_cpu``.
    cpu_tables: np.ndarray = field(compare=False, repr=False)

    @classmethod
    def from_stats(
        cls, mean: Sequence[float], std: Sequence[float], device: torch.device
    ) -> Affine:
        m = torch.tensor(channel_stats(mean, "mean"), dtype=torch.float64)
        s = torch.tensor(channel_stats(std, "std"), dtype=torch.float64)
        scale = (1.0 / (255.0 * s)).to(torch.float32)
        bias = (-m / s).to(torch.float32)
        return cls(
            scale=tuple(scale.tolist()),  # type: ignore[arg-type]
            bias=tuple(bias.tolist()),  # type: ignore[arg-type]
            scale_t=scale.view(1, 3, 1, 1).to(device),
            bias_t=bias.view(1, 3, 1, 1).to(device),
            cpu_tables=_value_tables(scale.numpy(), bias.numpy()),
        )

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """``x = x * scale + bias`` in place (float32 ``[B, 3, H, W]``, any device)."""
        return x.mul_(self.scale_t).add_(self.bias_t)

    def apply_cpu(self, images: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = images * scale + bias`` for CPU tensors (``out`` float32), single-threaded."""
        src, dst = images.numpy(), out.numpy()
        if _same_dense_layout(src, dst):
            _apply_tables(self.cpu_tables, src, dst)
            return out
        for c in range(3):
            plane = dst[:, c]
            np.multiply(src[:, c], np.float32(self.scale[c]), out=plane)
            np.add(plane, np.float32(self.bias[c]), out=plane)
        return out


def _value_tables(scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    values = np.arange(256, dtype=np.float32)
    return np.stack([values * scale[c] + bias[c] for c in range(3)])


def _same_dense_layout(src: np.ndarray, dst: np.ndarray) -> bool:
    """Both ``[B, 3, H, W]`` batches dense per image in the same layout (NCHW or NHWC)."""
    if src.ndim != 4 or src.shape != dst.shape or src.shape[1] != 3 or len(src) == 0:
        return False
    nchw = all(a[b].flags.c_contiguous for a in (src, dst) for b in range(len(a)))
    nhwc = all(
        a[b].transpose(1, 2, 0).flags.c_contiguous for a in (src, dst) for b in range(len(a))
    )
    return nchw or nhwc


def _apply_tables(tables: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[b, c] = tables[c][src[b, c]]``, one image (NHWC) or plane (NCHW) per cv2.LUT call;
    ``dst=`` writes into our buffer, which the layout check guarantees is dense."""
    import cv2  # a dependency of the package; imported here so the loader starts without it

    if src[0].flags.c_contiguous:
        for b in range(len(src)):
            for c in range(3):
                cv2.LUT(src[b, c], tables[c], dst=dst[b, c])
    else:
        table3 = np.ascontiguousarray(tables.T).reshape(1, 256, 3)
        for b in range(len(src)):
            cv2.LUT(src[b].transpose(1, 2, 0), table3, dst=dst[b].transpose(1, 2, 0))


def normalize_uint8(
    images: torch.Tensor,
    affine: Affine,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the normalised ``images`` (uint8 ``[B, 3, H, W]``) into ``out`` and return it.

    Runs on the current stream of ``images``' device; ``out`` has ``out.dtype`` and may be
    channels_last (its strides are kept). A half-precision ``out`` is computed in float32 first
    (in ``scratch`` when given, shaped like ``out``), so its only rounding is the final one.
    """
    f32 = out if out.dtype == torch.float32 else scratch
    if f32 is None:
        f32 = torch.empty_like(out, dtype=torch.float32)
    if images.device.type == "cpu":
        affine.apply_cpu(images, f32)
    else:
        affine.apply_(f32.copy_(images))
    return f32 if f32 is out else out.copy_(f32)
