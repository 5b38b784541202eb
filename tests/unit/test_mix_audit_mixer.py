"""Audit of `BatchMixer` in a trainer's loop after an elastic resume (docs/your-data.md, "Resume
at another world size"): the resumed pass pads its last round (label -100) in train batches too,
so the mixer must take such a batch: the padding rows stay out of the mix (their pixels
unchanged, their target rows all 0, so they add nothing to a soft-target loss), and each real
row mixes with the previous real row, its targets summing to 1."""

from __future__ import annotations

import pytest
import torch
from batchwire.client.mixing import BatchMixer

PAD = -100


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(6, 3, 8, 8, generator=g)
    return images, torch.tensor([3, 1, 4, PAD, PAD, PAD])  # a resumed pass's last batch


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_padding_rows_stay_out_of_the_mix(kind: str) -> None:
    images, labels = _batch()
    mixer = BatchMixer(
        num_classes=5,
        mixup_alpha=0.8 if kind == "mixup" else 0.0,
        cutmix_alpha=1.0 if kind == "cutmix" else 0.0,
        seed=2,
    )
    real = labels != PAD
    for k in range(6):
        mixed, targets = mixer(images, labels, epoch=0, batch_index=k)
        assert torch.equal(mixed[~real], images[~real])
        assert torch.equal(targets[~real], torch.zeros(3, 5))
        assert torch.allclose(targets[real].sum(1), torch.ones(3))
        # The real rows mix exactly as a batch of only them would.
        alone, alone_targets = mixer(images[real], labels[real], epoch=0, batch_index=k)
        assert torch.equal(mixed[real], alone) and torch.equal(targets[real], alone_targets)


def test_an_all_padding_batch_is_a_zero_loss_step() -> None:
    images, _ = _batch()
    labels = torch.full((6,), PAD)
    mixed, targets = BatchMixer(num_classes=5)(images, labels, epoch=0, batch_index=0)
    assert torch.equal(mixed, images) and not targets.any()
    logits = torch.randn(6, 5, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    loss.backward()  # every rank steps in lockstep: this rank's step adds nothing
    assert loss.item() == 0.0 and not logits.grad.any()


def test_other_negative_labels_are_still_refused() -> None:
    images, labels = _batch()
    with pytest.raises(ValueError, match="labels must be in"):
        BatchMixer(num_classes=5)(images, labels.clamp(min=-1), epoch=0, batch_index=0)


def test_a_multi_view_batch_is_refused_with_how_to_mix_it() -> None:
    """`--views` batches are a list of tensors (docs/transforms.md "Multi-view"): a TypeError
    that says to mix each view, not an AttributeError from inside the mixer."""
    views = [torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 4, 4)]
    mixer = BatchMixer(num_classes=3)
    with pytest.raises(TypeError, match="each view"):
        mixer(views, torch.tensor([0, 1]), epoch=0, batch_index=0)
    # What the message says to do: the same batch key gives every view the same pairing and
    # weight (with Mixup, the same targets for every view).
    mixup = BatchMixer(num_classes=3, cutmix_alpha=0.0)
    targets = [mixup(v, torch.tensor([0, 1]), epoch=0, batch_index=0)[1] for v in views]
    assert torch.equal(targets[0], targets[1])
