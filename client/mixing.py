"""Mixup and CutMix on the trainer, deterministic from (seed, epoch, batch index).

Batch mixing needs whole batches (it pairs samples), so it belongs on the trainer, after the
loader, on whatever device the batch is on; the server's batches stay a pure function of
(seed, epoch, rank, world_size, batch index) and so does the mixed batch: its draws (mixup or
cutmix, the mixing weight, the box) come from a NumPy `Generator` keyed by splitmix64 of
(seed, epoch, batch index, rank), not from global state, so a resumed run mixes exactly as the
uninterrupted one. The draws happen on the host (a few scalars), the pixels move on the batch's
device (no host synchronisation).

    mixer = BatchMixer(num_classes=loader.num_classes, mixup_alpha=0.8, cutmix_alpha=1.0)
    for k, (images, labels) in enumerate(loader):          # images: float, normalised
        images, targets = mixer(images, labels, epoch=epoch, batch_index=k)
        loss = torch.nn.functional.cross_entropy(model(images), targets)  # soft targets

Semantics follow torchvision v2's MixUp/CutMix (and timm's Mixup): each sample is paired with
the previous one in the batch (``roll(1)``), ``lam ~ Beta(alpha, alpha)``; CutMix pastes a box
of area ``(1 - lam)`` (clipped at the border, ``lam`` then recomputed from the clipped box);
targets are ``lam * onehot(y) + (1 - lam) * onehot(y_rolled)``, after optional label smoothing.
Each row of the targets sums to 1. No torchvision needed.

Padding slots (label ``PADDING_LABEL``, -100) reach a trainer in train batches too: a pass
resumed at another world size pads its last round (docs/your-data.md). They stay out of the mix:
the real rows are mixed as a batch of only them would be (each with the previous real row), the
padding rows keep their pixels and get an all-zero target row, which adds nothing to a
soft-target cross-entropy, so a rank whose batch is all padding still steps with the others.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from batchwire.wire.batch_spec import PADDING_LABEL

_MASK64 = (1 << 64) - 1
#: Keeps the mixing draws apart from any other use of the same (seed, epoch, batch) key.
_MIX_SALT = 0x4D495855  # "MIXU"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mixing_rng(seed: int, epoch: int, batch_index: int, rank: int = 0) -> np.random.Generator:
    """The draws of one batch's mixing: a function of (seed, epoch, batch_index, rank) only."""
    key = _MIX_SALT
    for part in (seed, epoch, batch_index, rank):
        key = _splitmix64(key ^ (int(part) & _MASK64))
    return np.random.Generator(np.random.PCG64(key))


@dataclass(frozen=True)
class MixParams:
    """One batch's mixing: ``kind`` ("mixup", "cutmix" or "none"), the weight ``lam`` of each
    sample's own label, and CutMix's box (y0, x0, y1, x1) in pixels (None otherwise)."""

    kind: str
    lam: float
    box: tuple[int, int, int, int] | None = None


def one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Float [B, num_classes] targets (label smoothing spreads ``smoothing`` over all classes).

    ValueError on a label out of range (`BatchMixer` takes padding slots out first)."""
    if labels.dim() != 1:
        raise ValueError(f"labels must be [B], got shape {list(labels.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"labels must be in [0, {num_classes}) to mix, got {int(labels.min())}.."
            f"{int(labels.max())}"
        )
    off = smoothing / num_classes
    out = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    out.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + off)
    return out


def cutmix_box(
    rng: np.random.Generator, lam: float, height: int, width: int
) -> tuple[tuple[int, int, int, int], float]:
    """torchvision's CutMix box for ``lam``: centre uniform in the image, sides
    ``sqrt(1 - lam)`` of the image's, clipped; returns the box and the ``lam`` it really gives."""
    cy = int(rng.integers(0, height))
    cx = int(rng.integers(0, width))
    r = 0.5 * math.sqrt(1.0 - lam)
    rh, rw = int(r * height), int(r * width)
    y0, y1 = max(cy - rh, 0), min(cy + rh, height)
    x0, x1 = max(cx - rw, 0), min(cx + rw, width)
    return (y0, x0, y1, x1), 1.0 - (y1 - y0) * (x1 - x0) / float(height * width)


@dataclass(frozen=True)
class BatchMixer:
    """Mixup and/or CutMix per batch, deterministic from (seed, epoch, batch index, rank).

    ``mixup_alpha``/``cutmix_alpha``: Beta parameters (0 turns one off); with both on, CutMix
    is chosen with ``switch_prob``. ``prob``: the chance a batch is mixed at all. Give each
    rank its ``rank`` so DDP ranks draw independently.
    """

    num_classes: int
    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    switch_prob: float = 0.5
    prob: float = 1.0
    label_smoothing: float = 0.0
    seed: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        n = self.num_classes
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"num_classes must be an integer >= 1, got {n!r}")
        object.__setattr__(self, "num_classes", int(n))
        if not all(0 <= a < math.inf for a in (self.mixup_alpha, self.cutmix_alpha)):
            raise ValueError(
                "mixup_alpha and cutmix_alpha must be finite and >= 0, got "
                f"{self.mixup_alpha!r} and {self.cutmix_alpha!r}"
            )
        if not (0.0 <= self.prob <= 1.0 and 0.0 <= self.switch_prob <= 1.0):
            raise ValueError("prob and switch_prob must be in [0, 1]")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError("label_smoothing must be in [0, 1)")

    def params(self, epoch: int, batch_index: int, height: int, width: int) -> MixParams:
        """What batch ``batch_index`` of ``epoch`` gets (the same on every call)."""
        rng = mixing_rng(self.seed, epoch, batch_index, self.rank)
        mix_draw, switch_draw = rng.random(), rng.random()
        if mix_draw >= self.prob or (self.mixup_alpha == 0 and self.cutmix_alpha == 0):
            return MixParams("none", 1.0)
        use_cutmix = self.cutmix_alpha > 0 and (
            self.mixup_alpha == 0 or switch_draw < self.switch_prob
        )
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(rng.beta(alpha, alpha))
        if not use_cutmix:
            return MixParams("mixup", lam)
        box, lam = cutmix_box(rng, lam, height, width)
        return MixParams("cutmix", lam, box)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, batch_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images (new tensor, same dtype/device/layout; floating point required) and
        soft targets float [B, num_classes] whose rows sum to 1."""
        if not isinstance(images, torch.Tensor):
            raise TypeError(
                f"BatchMixer mixes one [B, C, H, W] tensor, got a {type(images).__name__}: for "
                "a multi-view batch (--views) call it on each view with the same epoch and "
                "batch_index (the same pairing and draws for every view)"
            )
        if not images.is_floating_point():
            raise TypeError(
                "mix float images (RemoteLoader's default output; not the raw uint8 of "
                f"normalize_on_device=False or of a uint8 LocalLoader); got {images.dtype}"
            )
        if labels.dim() == 1 and bool((labels == PADDING_LABEL).any()):
            return self._with_padding(images, labels, epoch, batch_index)
        p = self.params(epoch, batch_index, int(images.shape[-2]), int(images.shape[-1]))
        targets = one_hot(labels, self.num_classes, self.label_smoothing).to(images.device)
        if p.kind == "none":
            return images.clone(), targets
        rolled = images.roll(1, 0)
        if p.kind == "mixup":
            mixed = images.mul(p.lam).add_(rolled, alpha=1.0 - p.lam)
        else:
            assert p.box is not None
            y0, x0, y1, x1 = p.box
            mixed = images.clone()
            mixed[..., y0:y1, x0:x1] = rolled[..., y0:y1, x0:x1]
        targets = targets.mul(p.lam).add_(targets.roll(1, 0), alpha=1.0 - p.lam)
        return mixed, targets

    def _with_padding(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch with padding slots (module doc): its real rows mixed as a batch of their
        own (the same draws: they depend on the batch's key and image size, not its length),
        the padding rows as they are with all-zero targets."""
        real = (labels != PADDING_LABEL).nonzero().squeeze(1)
        mixed = images.clone()
        targets = torch.zeros(labels.shape[0], self.num_classes, device=images.device)
        if real.numel():
            mixed[real], targets[real] = self(
                images[real], labels[real], epoch=epoch, batch_index=batch_index
            )
        return mixed, targets
