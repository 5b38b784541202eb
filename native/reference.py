"""Pure torch reference of `batchwire::augment_batch`: the tests' oracle, and the fallback where
the extension cannot be built.

It computes in float64 with dense per-image weight matrices (one per axis, restricted to the
crop's taps), so it is exact enough to judge the kernels and still vectorised. The semantics are
spelled out here once:

- resample: PIL's BILINEAR with a box, separable. For output i of an axis, centre =
  b0 + (i + 0.5) * scale with scale = (b1 - b0) / out_size; the triangle filter's half-width is
  max(scale, 1) (antialiased when shrinking, plain bilinear when enlarging); taps are
  [trunc(centre - half + 0.5), trunc(centre + half + 0.5)) clipped to the image; weights are
  normalised. A 1-channel image is expanded to RGB.
- horizontal flip of the output; then brightness, contrast, saturation, each clamped to [0, 255],
  then hue, in that fixed order. Contrast blends with the mean grey (0.299, 0.587, 0.114) of the
  brightness-adjusted output image; saturation with each pixel's grey. Hue moves each pixel's
  HSV hue by jitter[3] turns (in [-0.5, 0.5]) and keeps its value and saturation, as
  torchvision's adjust_hue; grey pixels stay as they are.
- float outputs hold (x / 255 - mean) / std; uint8 holds x rounded half to even.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

GREY = (0.299, 0.587, 0.114)
OUTPUT_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
BOX_SLACK = 1e-3
MAX_HUE = 0.5  # a hue shift in turns; torchvision's hue_factor range


def axis_weights(
    b0: float, b1: float, in_size: int, out_size: int, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """Weights [out_size, hi - lo] over source pixels [lo, hi) of one axis, and lo."""
    f64 = torch.float64
    scale = (b1 - b0) / out_size
    half = max(scale, 1.0)
    centre = b0 + (torch.arange(out_size, dtype=f64, device=device) + 0.5) * scale
    lo = torch.trunc(centre - half + 0.5).clamp(min=0)
    hi = torch.trunc(centre + half + 0.5).clamp(max=in_size)
    first, last = int(lo.min()), max(int(hi.max()), int(lo.min()) + 1)
    x = torch.arange(first, last, dtype=f64, device=device)[None, :]
    inside = (x >= lo[:, None]) & (x < hi[:, None])
    w = (1.0 - ((x - centre[:, None] + 0.5) / half).abs()).clamp(min=0.0) * inside
    total = w.sum(dim=1, keepdim=True)
    return torch.where(total > 0, w / total.clamp(min=1e-300), w), first


def _resample(image: torch.Tensor, box: Sequence[float], out_h: int, out_w: int) -> torch.Tensor:
    """[out_h, out_w, 3] float64 resampled crop of an HWC uint8 image."""
    y0, x0, y1, x1 = box
    h, w, _ = image.shape
    wy, ylo = axis_weights(y0, y1, h, out_h, image.device)
    wx, xlo = axis_weights(x0, x1, w, out_w, image.device)
    region = image[ylo : ylo + wy.shape[1], xlo : xlo + wx.shape[1]].to(torch.float64)
    rows = torch.einsum("oh,hwc->owc", wy, region)
    resampled = torch.einsum("pw,owc->opc", wx, rows)
    return resampled.expand(-1, -1, 3) if resampled.shape[2] == 1 else resampled


def rotate_hue(x: torch.Tensor, turns: float) -> torch.Tensor:
    """[..., 3] RGB (0-255) with each pixel's HSV hue moved by ``turns``."""
    r, g, b = x.unbind(-1)
    hi, lo = x.amax(-1), x.amin(-1)
    chroma = hi - lo
    safe = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    sixths = torch.where(
        hi == r,
        (g - b) / safe,
        torch.where(hi == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe),
    )
    sixths = torch.remainder(sixths + 6.0 * turns, 6.0)
    sector = torch.floor(sixths).clamp(max=5)
    frac = sixths - sector
    rising, falling = lo + chroma * frac, hi - chroma * frac
    # (r, g, b) per sector of the hue circle: red-yellow, yellow-green, ... magenta-red
    table = torch.stack(
        [
            torch.stack([hi, rising, lo], -1),
            torch.stack([falling, hi, lo], -1),
            torch.stack([lo, hi, rising], -1),
            torch.stack([lo, falling, hi], -1),
            torch.stack([rising, lo, hi], -1),
            torch.stack([hi, lo, falling], -1),
        ],
        -2,
    )
    index = sector.long()[..., None, None].expand(*sector.shape, 1, 3)
    return table.gather(-2, index).squeeze(-2)


def _jitter(
    x: torch.Tensor, brightness: float, contrast: float, saturation: float, hue: float
) -> torch.Tensor:
    grey = torch.tensor(GREY, dtype=x.dtype, device=x.device)
    if brightness != 1.0:
        x = (x * brightness).clamp(0.0, 255.0)
    if contrast != 1.0:
        mean = (x @ grey).mean()
        x = (contrast * x + (1.0 - contrast) * mean).clamp(0.0, 255.0)
    if saturation != 1.0:
        g = (x @ grey)[..., None]
        x = (saturation * x + (1.0 - saturation) * g).clamp(0.0, 255.0)
    if hue != 0.0:
        x = rotate_hue(x, hue)
    return x


def _is_dense(t: torch.Tensor) -> bool:
    """No two elements share memory and none is skipped, whatever the dimension order."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def check_args(
    images: Sequence[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    jitter: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The kernels' argument checks, with the same exception types (ValueError, TypeError)."""
    if out.dim() != 4 or out.shape[1] != 3 or out.shape[2] < 1 or out.shape[3] < 1:
        raise ValueError(f"augment_batch: out must be [N, 3, H, W], got shape {tuple(out.shape)}")
    if not _is_dense(out):
        raise ValueError("augment_batch: out must be dense (contiguous or channels_last)")
    if out.dtype not in OUTPUT_DTYPES:
        raise TypeError(
            f"augment_batch: out must be uint8, float16, bfloat16 or float32, got {out.dtype}"
        )
    n = out.shape[0]
    if len(images) != n:
        raise ValueError(f"augment_batch: got {len(images)} images for an out batch of {n}")
    for name, t, dtype, shape in (
        ("boxes", boxes, torch.float32, (n, 4)),
        ("flips", flips, torch.bool, (n,)),
        ("jitter", jitter, torch.float32, (n, 4)),
        ("mean", mean, torch.float32, (3,)),
        ("std", std, torch.float32, (3,)),
    ):
        if t.dtype != dtype:
            raise TypeError(f"augment_batch: {name} must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"augment_batch: {name} must have shape {shape}, got {tuple(t.shape)}")
    for i, img in enumerate(images):
        if img.dtype != torch.uint8:
            raise TypeError(f"augment_batch: images[{i}] must be uint8 HWC, got {img.dtype}")
        if img.dim() != 3 or img.shape[2] not in (1, 3):
            raise ValueError(
                f"augment_batch: images[{i}] must be HWC with 1 or 3 channels, got shape "
                f"{tuple(img.shape)}"
            )
        if img.shape[0] < 1 or img.shape[1] < 1:
            raise ValueError(f"augment_batch: images[{i}] is empty: {tuple(img.shape)}")
        if img.device != out.device:
            raise ValueError(
                f"augment_batch: images[{i}] is on {img.device} but out is on {out.device}"
            )
    for i, (box, factors) in enumerate(zip(boxes.tolist(), jitter.tolist(), strict=True)):
        y0, x0, y1, x1 = box
        h, w = images[i].shape[:2]
        inside = all(math.isfinite(v) for v in box) and (
            y0 >= -BOX_SLACK and x0 >= -BOX_SLACK and y1 <= h + BOX_SLACK and x1 <= w + BOX_SLACK
        )
        if not (inside and y1 > y0 and x1 > x0):
            raise ValueError(
                f"augment_batch: box {i} (y0, x0, y1, x1) = {tuple(box)} must lie inside its "
                f"{h}x{w} image and have a positive size"
            )
        b, c, s, hue = factors
        if not all(math.isfinite(v) and v >= 0 for v in (b, c, s)):
            raise ValueError(
                f"augment_batch: jitter[{i}] = {tuple(factors)} must have finite, non-negative "
                "brightness, contrast and saturation"
            )
        if not (math.isfinite(hue) and -MAX_HUE <= hue <= MAX_HUE):
            raise ValueError(
                f"augment_batch: hue jitter[{i}][3] = {hue} must be in [-0.5, 0.5] (turns)"
            )
    if out.dtype != torch.uint8 and not (
        torch.isfinite(mean).all() and torch.isfinite(std).all() and (std != 0).all()
    ):
        raise ValueError("augment_batch: mean/std must be finite and std non-zero")


def augment_batch_reference(
    images: Sequence[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    jitter: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `batchwire.native.augment_batch`; writes `out` in place and returns it."""
    check_args(images, boxes, flips, jitter, mean, std, out)
    out_h, out_w = out.shape[2], out.shape[3]
    m = mean.to(device=out.device, dtype=torch.float64)
    s = std.to(device=out.device, dtype=torch.float64)
    for i, image in enumerate(images):
        x = _resample(image.to(out.device), boxes[i].tolist(), out_h, out_w)
        if bool(flips[i]):
            x = x.flip(1)
        b, c, sat, hue = jitter[i].tolist()
        x = _jitter(x, b, c, sat, hue)
        if out.dtype == torch.uint8:
            value = torch.round(x).clamp(0, 255).to(torch.uint8)
        else:
            value = ((x / 255.0 - m) / s).to(out.dtype)
        out[i].copy_(value.permute(2, 0, 1))
    return out
