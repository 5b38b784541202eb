"""The op against PIL on real photos: antialiased shrinking as `Image.resize(size, BILINEAR,
box=...)`, and the validation transform (resize the shorter side, centre crop) as one box.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from batchwire import native
from PIL import Image

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
IDENTITY = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
MEAN, STD = torch.zeros(3), torch.ones(3)


@pytest.fixture(scope="module")
def ops() -> native.NativeOps:
    return native.load()


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    if not SAMPLE.is_dir():
        pytest.skip(f"{SAMPLE} is absent (the shared ImageNet sample)")
    files = sorted(SAMPLE.glob("*.JPEG"))[:40:10]
    return [Image.open(f).convert("RGB") for f in files]


def _op(ops, image: Image.Image, box: tuple[float, float, float, float], out_hw) -> np.ndarray:
    """HWC uint8 result of the op for one PIL image and a (y0, x0, y1, x1) box."""
    pixels = torch.from_numpy(np.array(image))
    if pixels.dim() == 2:
        pixels = pixels[:, :, None]
    out = torch.empty(1, 3, *out_hw, dtype=torch.uint8)
    ops.augment_batch(
        [pixels], torch.tensor([box]), torch.tensor([False]), IDENTITY, MEAN, STD, out
    )
    return out[0].permute(1, 2, 0).numpy()


def _pil(image: Image.Image, box, out_hw) -> np.ndarray:
    y0, x0, y1, x1 = box
    resized = image.resize((out_hw[1], out_hw[0]), Image.BILINEAR, box=(x0, y0, x1, y1))
    arr = np.asarray(resized)
    return np.repeat(arr[:, :, None], 3, axis=2) if arr.ndim == 2 else arr


@pytest.mark.parametrize("factor", [4, 8])
def test_antialiased_shrink_matches_pil(ops, photos, factor):
    for image in photos:
        out_hw = (min(48, (image.height - 4) // factor), min(52, (image.width - 8) // factor))
        box = (3.25, 7.5, 3.25 + out_hw[0] * factor, 7.5 + out_hw[1] * factor)
        assert box[2] <= image.height and box[3] <= image.width
        ours = _op(ops, image, box, out_hw).astype(np.float64)
        theirs = _pil(image, box, out_hw).astype(np.float64)
        diff = np.abs(ours - theirs).mean()
        assert diff < 1.5, f"mean abs diff {diff:.2f} vs PIL at {factor}x"

        # The comparison has teeth: plain bilinear (no antialias) is far from PIL here.
        y0, x0, y1, x1 = (round(v) for v in box)
        crop = torch.from_numpy(np.array(image)[y0:y1, x0:x1]).permute(2, 0, 1)[None].float()
        aliased = F.interpolate(crop, size=out_hw, mode="bilinear", antialias=False)
        aliased_diff = np.abs(aliased[0].permute(1, 2, 0).round().numpy() - theirs).mean()
        assert aliased_diff > 2 * diff


def _validation_box(h: int, w: int, size: int, fraction: float) -> tuple[tuple, tuple[int, int]]:
    """The box in the source image equivalent to: resize the shorter side to size / fraction,
    then centre-crop size x size (the box and the resized (h, w) PIL produces)."""
    short = round(size / fraction)
    rh, rw = (short, round(w * short / h)) if h <= w else (round(h * short / w), short)
    top, left = (rh - size) // 2, (rw - size) // 2
    sy, sx = h / rh, w / rw
    return (top * sy, left * sx, (top + size) * sy, (left + size) * sx), (rh, rw)


@pytest.mark.parametrize("grey", [False, True], ids=["rgb", "grey"])
def test_validation_mode_is_resize_then_centre_crop(ops, photos, grey):
    size = 56
    for image in photos:
        src = image.convert("L") if grey else image
        box, (rh, rw) = _validation_box(src.height, src.width, size, 0.875)
        top, left = (rh - size) // 2, (rw - size) // 2
        expected = np.asarray(
            src.resize((rw, rh), Image.BILINEAR).crop((left, top, left + size, top + size))
        )
        if grey:
            expected = np.repeat(expected[:, :, None], 3, axis=2)
        diff = np.abs(_op(ops, src, box, (size, size)).astype(int) - expected.astype(int))
        # PIL rounds to uint8 between its two passes and uses fixed point; we stay in float.
        assert diff.mean() < 0.25 and diff.max() <= 1, (diff.mean(), diff.max())
