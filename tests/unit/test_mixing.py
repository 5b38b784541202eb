"""Mixup/CutMix on the trainer: deterministic per (seed, epoch, batch), targets that add up."""

from __future__ import annotations

import pytest
import torch
from batchwire.client.mixing import BatchMixer, one_hot


def batch(b: int = 8, h: int = 12, w: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, h, w, generator=g), torch.arange(b) % 5


def test_deterministic_and_varies_with_the_batch() -> None:
    images, labels = batch()
    mixer = BatchMixer(num_classes=5, seed=3)
    a = mixer(images, labels, epoch=1, batch_index=4)
    b = BatchMixer(num_classes=5, seed=3)(images, labels, epoch=1, batch_index=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    kinds = {mixer.params(e, k, 12, 16) for e in range(3) for k in range(20)}
    assert len(kinds) == 60  # every (epoch, batch) draws afresh
    assert {p.kind for p in kinds} == {"mixup", "cutmix"}
    assert mixer.params(1, 4, 12, 16) != BatchMixer(num_classes=5, seed=3, rank=1).params(
        1, 4, 12, 16
    )


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_targets_sum_to_one_and_match_the_pixels(kind: str) -> None:
    images, labels = batch()
    mixer = BatchMixer(
        num_classes=5,
        mixup_alpha=0.8 if kind == "mixup" else 0.0,
        cutmix_alpha=1.0 if kind == "cutmix" else 0.0,
        label_smoothing=0.1,
    )
    for k in range(10):
        p = mixer.params(0, k, 12, 16)
        assert p.kind == kind and 0.0 <= p.lam <= 1.0
        mixed, targets = mixer(images, labels, epoch=0, batch_index=k)
        assert mixed.shape == images.shape and targets.shape == (8, 5)
        assert torch.allclose(targets.sum(1), torch.ones(8))
        base = one_hot(labels, 5, 0.1)
        expect = p.lam * base + (1 - p.lam) * base.roll(1, 0)
        assert torch.allclose(targets, expect)
        rolled = images.roll(1, 0)
        if kind == "mixup":
            assert torch.allclose(mixed, p.lam * images + (1 - p.lam) * rolled, atol=1e-6)
        else:
            assert p.box is not None
            y0, x0, y1, x1 = p.box
            inside = torch.zeros(12, 16, dtype=torch.bool)
            inside[y0:y1, x0:x1] = True
            assert torch.equal(mixed[..., inside], rolled[..., inside])
            assert torch.equal(mixed[..., ~inside], images[..., ~inside])
            assert p.lam == pytest.approx(1 - inside.float().mean().item())


def test_refuses_uint8_and_labels_out_of_range() -> None:
    images, labels = batch()
    mixer = BatchMixer(num_classes=5)
    with pytest.raises(TypeError, match="float"):
        mixer(images.to(torch.uint8), labels, epoch=0, batch_index=0)
    with pytest.raises(ValueError, match="labels must be in"):
        mixer(images, torch.full((8,), -1), epoch=0, batch_index=0)
    none = BatchMixer(num_classes=5, prob=0.0)
    mixed, targets = none(images, labels, epoch=0, batch_index=0)
    assert torch.equal(mixed, images) and torch.equal(targets.argmax(1), labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_equals_cpu() -> None:
    images, labels = batch()
    mixer = BatchMixer(num_classes=5)
    for k in range(4):
        a = mixer(images, labels, epoch=0, batch_index=k)
        b = mixer(images.cuda(), labels.cuda(), epoch=0, batch_index=k)
        assert torch.allclose(a[0], b[0].cpu()) and torch.allclose(a[1], b[1].cpu())
