"""Per-sample augmentation parameters from a counter-based random source.

A sample's crop box, flip and colour-jitter factors depend only on (seed, epoch, dataset index)
and the image's size. No generator state is carried from one sample to the next, so the result
is the same whatever the thread count, rank count, server count, batch composition or resume
point. Drawing is vectorised: a whole batch is planned in a few numpy operations.

Layout of a training sample's uniform draws (`draw_uniforms(..., n=NUM_DRAWS)`), all in [0, 1):

    [4a + 0] attempt a's area fraction    (a = 0 .. RRC_ATTEMPTS-1)
    [4a + 1] attempt a's log aspect ratio
    [4a + 2] attempt a's top offset        (used only if attempt a is the first accepted)
    [4a + 3] attempt a's left offset
    [FLIP_DRAW]          flip when < flip_prob
    [JITTER_DRAW + 0..3] brightness, contrast, saturation, hue factors

Draw j of a sample never depends on how many draws were requested, so other consumers may use
draws past NUM_DRAWS (or another `salt`) without disturbing these.

Multi-view crops (`AugmentConfig.views`, `--views 2x224:0.4-1.0,6x96:0.05-0.4`): view k of a
sample has its own draws, the same layout with salt ``VIEW_SALT + k``, so it depends on
(seed, epoch, index, k) only; its crop uses the view's scale range (ratio, flip and jitter
settings are the config's). Without views nothing changes: salt 0, as always.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from batchwire.pipeline.decode.region import Box
from batchwire.wire.batch_spec import DTYPES, LAYOUTS, BatchSpec
from batchwire.wire.messages import MAX_IMAGE_SIDE

if TYPE_CHECKING:
    import torch

RRC_ATTEMPTS = 10
FLIP_DRAW = 4 * RRC_ATTEMPTS
JITTER_DRAW = FLIP_DRAW + 1
NUM_DRAWS = JITTER_DRAW + 4

#: View k of a multi-view config draws with salt VIEW_SALT + k ("VIEW" + k).
VIEW_SALT = 0x56494557 << 8

Jitter = tuple[float, float, float, float]
IDENTITY_JITTER: Jitter = (1.0, 1.0, 1.0, 0.0)

# ---------------------------------------------------------------------------------------------
# Counter-based uniforms (splitmix64 finaliser over a keyed counter).

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_INV_2_53 = 1.0 / float(1 << 53)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function: a bijective avalanche of 64-bit words (wraps mod 2**64)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _key(seed: int, epoch: int, salt: int) -> np.ndarray:
    k = _mix(np.array([seed & _MASK64], dtype=np.uint64))
    k = _mix(k ^ np.array([epoch & _MASK64], dtype=np.uint64))
    return _mix(k ^ np.array([salt & _MASK64], dtype=np.uint64))


def draw_uniforms(seed: int, epoch: int, indices: Any, n: int, *, salt: int = 0) -> np.ndarray:
    """Uniform floats in [0, 1), float64 `[len(indices), n]`, keyed on (seed, epoch, index).

    Row i depends only on (seed, epoch, salt, indices[i]); column j is the j-th draw of that
    sample, independent of `n`. `salt` separates unrelated uses of the same key (0 is the
    augmentation plan). Each sample seeds a splitmix64 sequence at mix(key ^ mix(index)).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    idx = np.asarray(indices)
    if idx.ndim != 1:
        idx = idx.reshape(-1)
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
    idx64 = idx.astype(np.int64, copy=False).view(np.uint64)
    state = _mix(_key(seed, epoch, salt) ^ _mix(idx64 + _GAMMA))
    counters = np.arange(1, n + 1, dtype=np.uint64) * _GAMMA
    bits = _mix(state[:, None] + counters[None, :])
    return (bits >> _S11).astype(np.float64) * _INV_2_53


# ---------------------------------------------------------------------------------------------
# Configuration


def _pair(name: str, value: Any, kind: type) -> tuple:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value, value)
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair, got {value!r}") from None
    return (kind(a), kind(b))


@dataclass(frozen=True)
class View:
    """One crop of a multi-view config: output ``size`` (height, width) and the random-resized
    crop's ``scale`` range."""

    size: tuple[int, int]
    scale: tuple[float, float]


_VIEWS_HELP = (
    "expected COUNTxSIZE:LO-HI[,COUNTxSIZE:LO-HI...], SIZE = PX or HxW, 0 < LO <= HI <= 1, "
    "e.g. 2x224:0.4-1.0,6x96:0.05-0.4"
)


def parse_views(text: str) -> tuple[View, ...]:
    """``"2x224:0.4-1.0,6x96:0.05-0.4"`` -> 8 `View`s, in order (ValueError naming the part)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"views: empty; {_VIEWS_HELP}")
    views: list[View] = []
    for part in text.split(","):
        item = part.strip()
        try:
            head, scale = item.split(":")
            count, *size = head.lower().split("x")
            lo, hi = (float(v) for v in scale.split("-"))
            n = int(count)
            if len(size) == 1:
                hw = (int(size[0]), int(size[0]))
            elif len(size) == 2:
                hw = (int(size[0]), int(size[1]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"views: cannot read {item!r}; {_VIEWS_HELP}") from None
        if n < 1 or min(hw) < 1:
            raise ValueError(f"views: {item!r}: count and size must be >= 1")
        if not (0.0 < lo <= hi <= 1.0):
            raise ValueError(f"views: {item!r}: scale must satisfy 0 < LO <= HI <= 1")
        views += [View(hw, (lo, hi))] * n
    return tuple(views)


def _views(value: Any) -> tuple[View, ...]:
    if value is None or value == "" or value == ():
        return ()
    if isinstance(value, str):
        return parse_views(value)
    out = []
    for v in value:
        if isinstance(v, View):
            out.append(v)
        else:
            raise ValueError(f"views must be a --views spelling or View objects, got {value!r}")
    return tuple(out)


@dataclass(frozen=True)
class AugmentConfig:
    """How to turn a decoded image into a training or validation sample.

    Train: random-resized-crop with torchvision's `scale`/`ratio` semantics, horizontal flip
    with `flip_prob`, colour jitter with torchvision ColorJitter ranges (factor uniform in
    [max(0, 1 - b), 1 + b] for brightness/contrast/saturation, hue shift in [-hue, hue] turns),
    applied in that fixed order (ColorJitter shuffles it per image).
    Val: resize the shorter side to `size / val_crop_fraction`, centre crop, nothing random.

    `views` (multi-view crops for self-supervised training): a `--views` spelling or `View`s;
    each sample then yields one crop per view (train: view k's own draws and scale range;
    val: the centre crop at view k's size), and `batch_spec` is multi-view. ``image_size`` is
    then unused by the op (the views say their sizes). Not with a `transform`.
    """

    image_size: tuple[int, int]
    train: bool
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    flip_prob: float = 0.5
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    val_crop_fraction: float = 0.875
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    output_dtype: str = "float32"
    layout: str = "nchw"
    # A user transform (`pipeline.transforms`): "module:callable", "file.py:callable" or the
    # callable itself; it replaces the crop/flip/jitter/normalise above for this split.
    transform: Any = None
    views: Any = ()

    def __post_init__(self) -> None:
        size = self.image_size
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            size = (int(size), int(size))
        try:
            h, w = size
        except (TypeError, ValueError):
            msg = f"image_size must be an int or (height, width), got {size!r}"
            raise ValueError(msg) from None
        if (
            int(h) != h
            or int(w) != w
            or not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE)
        ):
            raise ValueError(f"image_size must be integers in 1..{MAX_IMAGE_SIDE}, got {size!r}")
        object.__setattr__(self, "image_size", (int(h), int(w)))
        object.__setattr__(self, "train", bool(self.train))

        scale = _pair("scale", self.scale, float)
        if not (0.0 < scale[0] <= scale[1] <= 1.0):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {scale}")
        ratio = _pair("ratio", self.ratio, float)
        if not (0.0 < ratio[0] <= ratio[1]) or not all(map(math.isfinite, ratio)):
            raise ValueError(f"ratio must satisfy 0 < min <= max (finite), got {ratio}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)

        if not (0.0 <= self.flip_prob <= 1.0):
            raise ValueError(f"flip_prob must be in [0, 1], got {self.flip_prob}")
        for name in ("brightness", "contrast", "saturation"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not (0.0 <= self.hue <= 0.5):
            raise ValueError(f"hue must be in [0, 0.5], got {self.hue}")
        if not (0.0 < self.val_crop_fraction <= 1.0):
            raise ValueError(f"val_crop_fraction must be in (0, 1], got {self.val_crop_fraction}")

        for name in ("mean", "std"):
            v = tuple(float(x) for x in getattr(self, name))
            if len(v) != 3 or not all(map(math.isfinite, v)):
                raise ValueError(f"{name} must be 3 finite numbers (R, G, B), got {v}")
            object.__setattr__(self, name, v)
        if min(self.std) <= 0.0:
            raise ValueError(f"std must be > 0, got {self.std}")
        if self.output_dtype not in DTYPES:
            raise ValueError(
                f"output_dtype must be one of {', '.join(DTYPES)}, got {self.output_dtype!r}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        t = self.transform
        if t is not None and not callable(t) and not (isinstance(t, str) and ":" in t):
            raise ValueError(
                f"transform must be 'module:callable', 'file.py:callable' or a callable, got {t!r}"
            )
        views = _views(self.views)
        if views and t is not None:
            raise ValueError("views cannot be combined with a user transform")
        object.__setattr__(self, "views", views)

    def batch_spec(self, batch_size: int) -> BatchSpec:
        """The batches this augmentation writes: the wire's one description of a batch."""
        if self.views:
            sizes = tuple(v.size for v in self.views)
            h, w = sizes[0]
            return BatchSpec(batch_size, h, w, self.output_dtype, self.layout, sizes)
        h, w = self.image_size
        return BatchSpec(batch_size, h, w, self.output_dtype, self.layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.batch_spec(1).torch_dtype

    @property
    def memory_format(self) -> torch.memory_format:
        return self.batch_spec(1).memory_format


# ---------------------------------------------------------------------------------------------
# Geometry


@dataclass(frozen=True)
class SamplePlan:
    """What to do with one sample: crop `box` (y0, x0, y1, x1; float pixels of the full-size,
    EXIF-oriented source, end-exclusive), resize to the output size, flip horizontally, jitter."""

    box: Box
    flip: bool
    jitter: Jitter


def _rrc_arrays(
    u: np.ndarray,
    heights: np.ndarray,
    widths: np.ndarray,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> np.ndarray:
    """Vectorised RandomResizedCrop.get_params over rows of draws; returns [N, 4] boxes."""
    n = u.shape[0]
    H = heights.astype(np.float64)[:, None]
    W = widths.astype(np.float64)[:, None]
    a = u[:, : 4 * RRC_ATTEMPTS].reshape(n, RRC_ATTEMPTS, 4)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target_area = H * W * (scale[0] + (scale[1] - scale[0]) * a[:, :, 0])
    aspect = np.exp(log_lo + (log_hi - log_lo) * a[:, :, 1])
    # np.rint rounds half to even, like Python's round() in torchvision.
    cw = np.rint(np.sqrt(target_area * aspect))
    ch = np.rint(np.sqrt(target_area / aspect))
    ok = (cw > 0) & (cw <= W) & (ch > 0) & (ch <= H)
    first = np.argmax(ok, axis=1)
    found = ok[np.arange(n), first]
    rows = np.arange(n)
    h = ch[rows, first]
    w = cw[rows, first]
    hh = heights.astype(np.float64)
    ww = widths.astype(np.float64)
    # randint(0, m) from a uniform: floor(u * m), guarded against u * m rounding up to m.
    top = np.minimum(np.floor(a[rows, first, 2] * (hh - h + 1)), hh - h)
    left = np.minimum(np.floor(a[rows, first, 3] * (ww - w + 1)), ww - w)

    # Fallback: the largest centred crop whose ratio is clamped into `ratio`.
    in_ratio = ww / hh
    fw = ww.copy()
    fh = hh.copy()
    narrow = in_ratio < ratio[0]
    wide = in_ratio > ratio[1]
    # At least one pixel: a 1-pixel-thin image with an extreme ratio would round to nothing.
    fh[narrow] = np.clip(np.rint(ww[narrow] / ratio[0]), 1, hh[narrow])
    fw[wide] = np.clip(np.rint(hh[wide] * ratio[1]), 1, ww[wide])
    ftop = np.floor((hh - fh) / 2)
    fleft = np.floor((ww - fw) / 2)

    h = np.where(found, h, fh)
    w = np.where(found, w, fw)
    top = np.where(found, top, ftop)
    left = np.where(found, left, fleft)
    return np.stack([top, left, top + h, left + w], axis=1)


def _center_arrays(
    heights: np.ndarray, widths: np.ndarray, out_h: int, out_w: int, crop_fraction: float
) -> np.ndarray:
    H = heights.astype(np.float64)
    W = widths.astype(np.float64)
    # Resize so the image covers (out / crop_fraction): for a square output that is "resize the
    # shorter side to size / crop_fraction". Then the output-sized centre crop, mapped back.
    s = np.maximum(out_h / crop_fraction / H, out_w / crop_fraction / W)
    ch = np.minimum(out_h / s, H)
    cw = np.minimum(out_w / s, W)
    y0 = (H - ch) / 2.0
    x0 = (W - cw) / 2.0
    return np.stack([y0, x0, y0 + ch, x0 + cw], axis=1)


# ---------------------------------------------------------------------------------------------
# Planning


def plan_arrays(
    config: AugmentConfig,
    seed: int,
    epoch: int,
    indices: Any,
    heights: Any,
    widths: Any,
    *,
    view: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plans for a batch as arrays: boxes float32 [N, 4], flips bool [N], jitter float32 [N, 4].

    This is the form `batchwire.native.augment_batch` takes. `heights`/`widths` are the
    full-size, EXIF-oriented image sizes. `view`: the plan of view ``view`` of a multi-view
    config (its size, its scale, its draws with salt ``VIEW_SALT + view``).
    """
    salt, scale, out_hw = 0, config.scale, config.image_size
    if view is not None:
        if not 0 <= view < len(config.views):
            raise ValueError(f"view {view} out of range: the config has {len(config.views)}")
        v = config.views[view]
        salt, scale, out_hw = VIEW_SALT + view, v.scale, v.size
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    hs = np.asarray(heights, dtype=np.int64).reshape(-1)
    ws = np.asarray(widths, dtype=np.int64).reshape(-1)
    if not (idx.shape == hs.shape == ws.shape):
        raise ValueError(
            f"indices, heights and widths must have the same length, got "
            f"{idx.shape[0]}, {hs.shape[0]}, {ws.shape[0]}"
        )
    if hs.size and (hs.min() < 1 or ws.min() < 1):
        raise ValueError("image heights and widths must be >= 1")
    n = idx.shape[0]
    out_h, out_w = out_hw
    jitter = np.tile(np.array(IDENTITY_JITTER, dtype=np.float32), (n, 1))
    if not config.train:
        boxes = _center_arrays(hs, ws, out_h, out_w, config.val_crop_fraction)
        return boxes.astype(np.float32), np.zeros(n, dtype=bool), jitter

    u = draw_uniforms(seed, epoch, idx, NUM_DRAWS, salt=salt)
    boxes = _rrc_arrays(u, hs, ws, scale, config.ratio)
    flips = u[:, FLIP_DRAW] < config.flip_prob
    for col, name in enumerate(("brightness", "contrast", "saturation")):
        b = getattr(config, name)
        if b > 0.0:
            lo = max(0.0, 1.0 - b)
            jitter[:, col] = lo + (1.0 + b - lo) * u[:, JITTER_DRAW + col]
    if config.hue > 0.0:
        jitter[:, 3] = -config.hue + 2.0 * config.hue * u[:, JITTER_DRAW + 3]
    return boxes.astype(np.float32), flips, jitter


def plan_samples(
    config: AugmentConfig,
    seed: int,
    epoch: int,
    indices: Any,
    heights: Any,
    widths: Any,
    *,
    view: int | None = None,
) -> list[SamplePlan]:
    """Vectorised `plan_sample` over a batch; same results as planning one by one."""
    boxes, flips, jitter = plan_arrays(config, seed, epoch, indices, heights, widths, view=view)
    # float32 -> float via tolist keeps the exact float32 values the arrays carry.
    return [
        SamplePlan(box=tuple(b), flip=bool(f), jitter=tuple(j))
        for b, f, j in zip(boxes.tolist(), flips.tolist(), jitter.tolist(), strict=True)
    ]


def plan_sample(
    config: AugmentConfig, seed: int, epoch: int, index: int, height: int, width: int
) -> SamplePlan:
    """The augmentation of dataset sample `index` (full-size oriented image height x width)."""
    return plan_samples(config, seed, epoch, [index], [height], [width])[0]
