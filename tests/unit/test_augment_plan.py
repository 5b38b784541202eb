"""Augmentation planning: counter-based draws, torchvision crop semantics, determinism."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from batchwire.pipeline.augment_plan import (
    FLIP_DRAW,
    IDENTITY_JITTER,
    NUM_DRAWS,
    RRC_ATTEMPTS,
    AugmentConfig,
    SamplePlan,
    draw_uniforms,
    plan_arrays,
    plan_sample,
    plan_samples,
)

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


# --- draws -------------------------------------------------------------------------------------


def test_draws_are_uniform_and_keyed_per_sample() -> None:
    idx = np.arange(20000, dtype=np.int64)
    u = draw_uniforms(5, 2, idx, 8)
    assert u.shape == (20000, 8) and u.dtype == np.float64
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert np.all(np.abs(hist / u.size - 0.1) < 0.005)
    # Columns and neighbouring samples are uncorrelated.
    corr = np.corrcoef(np.concatenate([u, np.roll(u[:, :1], 1, axis=0)], axis=1).T)
    off_diag = corr[~np.eye(corr.shape[0], dtype=bool)]
    assert np.abs(off_diag).max() < 0.03

    # Row i depends on (seed, epoch, index) only: chunking and order do not matter.
    perm = np.random.default_rng(0).permutation(20000)
    np.testing.assert_array_equal(draw_uniforms(5, 2, idx[perm], 8), u[perm])
    chunks = [draw_uniforms(5, 2, c, 8) for c in np.array_split(idx, 7)]
    np.testing.assert_array_equal(np.concatenate(chunks), u)
    # Draw j does not depend on how many were asked for.
    np.testing.assert_array_equal(draw_uniforms(5, 2, idx[:50], 3), u[:50, :3])
    # Every key component changes the draws.
    for other in (
        draw_uniforms(6, 2, idx[:50], 8),
        draw_uniforms(5, 3, idx[:50], 8),
        draw_uniforms(5, 2, idx[:50], 8, salt=1),
        draw_uniforms(5, 2, idx[:50] + 1, 8),
    ):
        assert not np.any(other == u[:50])


@pytest.mark.parametrize(
    ("ratio", "height", "width"), [((0.25, 0.4), 1, 300), ((2.5, 3.0), 300, 1), (RATIO, 1, 1)]
)
def test_fallback_crop_of_a_thin_image_keeps_at_least_one_pixel(ratio, height, width) -> None:
    """torchvision's fallback rounds an extreme ratio on a 1-pixel-thin image to a crop of
    zero pixels (which no resize can take); ours keeps one."""
    cfg = AugmentConfig(image_size=32, train=True, ratio=ratio)
    for index in range(20):
        y0, x0, y1, x1 = plan_sample(cfg, 0, 0, index, height, width).box
        assert 0 <= y0 < y1 <= height and 0 <= x0 < x1 <= width, (y0, x0, y1, x1)


def test_draw_edge_cases() -> None:
    assert draw_uniforms(0, 0, [], 4).shape == (0, 4)
    assert draw_uniforms(0, 0, [1, 2], 0).shape == (2, 0)
    big = draw_uniforms(2**63 + 5, 10**6, np.array([2**62, 0], dtype=np.int64), 2)
    assert big.shape == (2, 2) and np.all((big >= 0) & (big < 1))
    with pytest.raises(TypeError):
        draw_uniforms(0, 0, [0.5], 2)
    with pytest.raises(ValueError):
        draw_uniforms(0, 0, [1], -1)


# --- random-resized crop: exact algorithm under the documented draw layout ---------------------


def _reference_rrc(next_u, height: int, width: int, scale=SCALE, ratio=RATIO):
    """torchvision's RandomResizedCrop.get_params, written from its documented behaviour,
    consuming uniforms from `next_u()` (one call per random number torchvision draws)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * next_u())
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * next_u())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        u_top, u_left = next_u(), next_u()
        if 0 < w <= width and 0 < h <= height:
            i = min(int(u_top * (height - h + 1)), height - h)
            j = min(int(u_left * (width - w + 1)), width - w)
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    "height,width", [(375, 500), (224, 224), (100, 600), (600, 101), (1, 1), (3, 1000), (37, 41)]
)
def test_rrc_matches_reference_draw_for_draw(height: int, width: int) -> None:
    n = 300
    u = draw_uniforms(1, 0, np.arange(n), NUM_DRAWS)
    config = AugmentConfig(image_size=32, train=True, scale=SCALE, ratio=RATIO)
    boxes = plan_arrays(config, 1, 0, np.arange(n), [height] * n, [width] * n)[0]
    for row, planned in zip(u, boxes.tolist(), strict=True):
        it = iter(row.tolist())
        i, j, h, w = _reference_rrc(lambda it=it: next(it), height, width)
        box = tuple(planned)
        assert box == (i, j, i + h, j + w)
        y0, x0, y1, x1 = box
        assert 0 <= y0 < y1 <= height and 0 <= x0 < x1 <= width


def _torchvision_like(rng: random.Random, height: int, width: int, n: int) -> np.ndarray:
    """Independent sampler: the same algorithm driven by Python's Mersenne Twister."""
    boxes = []
    for _ in range(n):
        i, j, h, w = _reference_rrc(rng.random, height, width)
        boxes.append((i, j, i + h, j + w))
    return np.asarray(boxes, dtype=np.float64)


def _stats(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray | float]:
    h = boxes[:, 2] - boxes[:, 0]
    w = boxes[:, 3] - boxes[:, 1]
    frac = h * w / (height * width)
    return {
        "area_hist": np.histogram(frac, bins=8, range=(0, 1))[0] / len(boxes),
        "logratio_hist": np.histogram(np.log(w / h), bins=8, range=(-0.4, 0.4))[0] / len(boxes),
        "area_mean": frac.mean(),
        "cy": ((boxes[:, 0] + boxes[:, 2]) / 2 / height).mean(),
        "cx": ((boxes[:, 1] + boxes[:, 3]) / 2 / width).mean(),
        "full": np.mean((h == height) & (w == width)),
    }


@pytest.mark.parametrize("height,width", [(375, 500), (120, 600)])
def test_rrc_distribution_matches_torchvision_semantics(height: int, width: int) -> None:
    n = 20000
    ours = plan_arrays(
        AugmentConfig(image_size=64, train=True),
        seed=9,
        epoch=0,
        indices=np.arange(n),
        heights=np.full(n, height),
        widths=np.full(n, width),
    )[0].astype(np.float64)
    theirs = _torchvision_like(random.Random(1234), height, width, n)
    a, b = _stats(ours, height, width), _stats(theirs, height, width)
    np.testing.assert_allclose(a["area_hist"], b["area_hist"], atol=0.012)
    np.testing.assert_allclose(a["logratio_hist"], b["logratio_hist"], atol=0.012)
    for key in ("area_mean", "cy", "cx", "full"):
        assert abs(a[key] - b[key]) < 0.01, key


# --- validation crop ---------------------------------------------------------------------------


def center_crop_box(
    height: int, width: int, out_h: int, out_w: int, crop_fraction: float
) -> tuple[float, ...]:
    """The validation crop `plan_samples` plans for one image (the source's float box)."""
    config = AugmentConfig(image_size=(out_h, out_w), train=False, val_crop_fraction=crop_fraction)
    return plan_samples(config, 0, 0, [0], [height], [width])[0].box


def test_center_crop_box_follows_resize_then_center_crop() -> None:
    # 256x256 with 224/0.875 = 256: no resize, a 224 crop 16 px in from each side.
    assert center_crop_box(256, 256, 224, 224, 0.875) == (16.0, 16.0, 240.0, 240.0)
    # 375x500: shorter side 375 -> 256, so the 224 crop is 224 * 375 / 256 source pixels.
    y0, x0, y1, x1 = center_crop_box(375, 500, 224, 224, 0.875)
    side = 224 * 375 / 256
    assert y1 - y0 == pytest.approx(side) and x1 - x0 == pytest.approx(side)
    assert (y0 + y1) / 2 == pytest.approx(187.5) and (x0 + x1) / 2 == pytest.approx(250)
    # Fraction 1: the largest centred square.
    assert center_crop_box(100, 300, 50, 50, 1.0) == (0.0, 100.0, 100.0, 200.0)
    # Non-square output keeps its aspect ratio in the source.
    y0, x0, y1, x1 = center_crop_box(400, 400, 100, 200, 1.0)
    assert (y1 - y0, x1 - x0) == (200.0, 400.0)
    with pytest.raises(ValueError):
        center_crop_box(10, 10, 8, 8, 0.0)
    with pytest.raises(ValueError):
        center_crop_box(0, 10, 8, 8, 0.5)


# --- plans -------------------------------------------------------------------------------------


def _train_config(**kw) -> AugmentConfig:
    base = dict(image_size=(48, 64), train=True, brightness=0.4, contrast=0.3, saturation=1.5)
    base.update(kw)
    return AugmentConfig(hue=0.1, **base)


def test_plans_are_deterministic_and_batch_independent() -> None:
    cfg = _train_config()
    rng = np.random.default_rng(0)
    n = 500
    idx = rng.integers(0, 10**6, n)
    hs, ws = rng.integers(50, 900, n), rng.integers(50, 900, n)
    whole = plan_samples(cfg, 3, 1, idx, hs, ws)
    assert whole == plan_samples(cfg, 3, 1, idx, hs, ws)
    one_by_one = [
        plan_sample(cfg, 3, 1, int(i), int(h), int(w)) for i, h, w in zip(idx, hs, ws, strict=True)
    ]
    assert whole == one_by_one
    perm = rng.permutation(n)
    assert plan_samples(cfg, 3, 1, idx[perm], hs[perm], ws[perm]) == [whole[p] for p in perm]
    assert plan_samples(cfg, 3, 2, idx, hs, ws) != whole, "a new epoch gives new augmentations"
    assert isinstance(whole[0], SamplePlan) and isinstance(whole[0].flip, bool)
    for p, h, w in zip(whole, hs, ws, strict=True):
        y0, x0, y1, x1 = p.box
        assert 0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w


def test_flip_rate_and_jitter_ranges() -> None:
    n = 20000
    idx, hs, ws = np.arange(n), np.full(n, 300), np.full(n, 400)
    _, flips, jitter = plan_arrays(_train_config(flip_prob=0.3), 0, 0, idx, hs, ws)
    assert abs(flips.mean() - 0.3) < 0.015
    assert flips.dtype == np.bool_ and jitter.dtype == np.float32 and jitter.shape == (n, 4)
    # ColorJitter ranges: [max(0, 1 - b), 1 + b]; hue in [-h, h]; each uniform over its range.
    for col, (lo, hi) in enumerate([(0.6, 1.4), (0.7, 1.3), (0.0, 2.5), (-0.1, 0.1)]):
        x = jitter[:, col]
        assert x.min() >= lo - 1e-6 and x.max() <= hi + 1e-6
        assert abs(x.mean() - (lo + hi) / 2) < 0.02 * (hi - lo)
    # Flip and crop draws are separate: flipping is independent of the crop's position.
    boxes, flips, _ = plan_arrays(_train_config(), 0, 0, idx, hs, ws)
    cx = (boxes[:, 1] + boxes[:, 3]) / 2
    assert abs(cx[flips].mean() - cx[~flips].mean()) < 3.0
    u = draw_uniforms(0, 0, idx, NUM_DRAWS)
    np.testing.assert_array_equal(flips, u[:, FLIP_DRAW] < 0.5)
    assert FLIP_DRAW == 4 * RRC_ATTEMPTS

    never = plan_arrays(_train_config(flip_prob=0.0), 0, 0, idx[:100], hs[:100], ws[:100])[1]
    always = plan_arrays(_train_config(flip_prob=1.0), 0, 0, idx[:100], hs[:100], ws[:100])[1]
    assert not never.any() and always.all()
    plain = AugmentConfig(image_size=32, train=True)
    np.testing.assert_array_equal(
        plan_arrays(plain, 0, 0, idx[:100], hs[:100], ws[:100])[2],
        np.tile(np.float32(IDENTITY_JITTER), (100, 1)),
    )


def test_val_plans_are_center_crops_without_randomness() -> None:
    cfg = AugmentConfig(image_size=224, train=False, brightness=0.5, flip_prob=1.0)
    plans = plan_samples(cfg, 1, 7, [3, 4], [375, 256], [500, 256])
    assert plans[1] == SamplePlan((16.0, 16.0, 240.0, 240.0), False, IDENTITY_JITTER)
    expected = center_crop_box(375, 500, 224, 224, 0.875)
    assert plans[0].box == pytest.approx(expected, rel=1e-6)
    assert plan_samples(cfg, 2, 9, [3], [375], [500]) == plans[:1]


def test_plan_input_errors() -> None:
    cfg = AugmentConfig(image_size=32, train=True)
    with pytest.raises(ValueError, match="same length"):
        plan_samples(cfg, 0, 0, [1, 2], [10], [10])
    with pytest.raises(ValueError, match=">= 1"):
        plan_samples(cfg, 0, 0, [1], [0], [10])


# --- config ------------------------------------------------------------------------------------


def test_config_normalises_and_exposes_torch_settings() -> None:
    cfg = AugmentConfig(image_size=40, train=True, output_dtype="bfloat16", layout="nhwc")
    assert cfg.image_size == (40, 40)
    assert cfg.torch_dtype is torch.bfloat16
    assert cfg.memory_format is torch.channels_last
    assert AugmentConfig(image_size=(8, 9), train=False).memory_format is torch.contiguous_format
    assert AugmentConfig(image_size=(8, 9), train=False).torch_dtype is torch.float32
    assert AugmentConfig(image_size=8, train=True, scale=[0.2, 0.9]).scale == (0.2, 0.9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.flip_prob = 0.1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"image_size": 0}, "image_size"),
        ({"image_size": (3, 4, 5)}, "image_size"),
        ({"image_size": (3.5, 4)}, "image_size"),
        ({"scale": (0.5, 0.2)}, "scale"),
        ({"scale": (0.0, 1.0)}, "scale"),
        ({"scale": (0.1, 1.5)}, "scale"),
        ({"ratio": (2.0, 1.0)}, "ratio"),
        ({"ratio": (-1.0, 1.0)}, "ratio"),
        ({"flip_prob": 1.5}, "flip_prob"),
        ({"brightness": -0.1}, "brightness"),
        ({"saturation": float("nan")}, "saturation"),
        ({"hue": 0.6}, "hue"),
        ({"val_crop_fraction": 0.0}, "val_crop_fraction"),
        ({"val_crop_fraction": 1.2}, "val_crop_fraction"),
        ({"mean": (0.5, 0.5)}, "mean"),
        ({"std": (0.5, 0.0, 0.5)}, "std"),
        ({"output_dtype": "int32"}, "output_dtype"),
        ({"layout": "chw"}, "layout"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"image_size": 32, "train": True, **kwargs}
    with pytest.raises(ValueError, match=field):
        AugmentConfig(**args)
