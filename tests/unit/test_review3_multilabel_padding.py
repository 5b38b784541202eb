"""Review 3 (b850278..76675ae): pipeline-train's multi-label loss over a padded train batch.

An elastic resume pads the last round of a train pass (docs/your-data.md, "Resume at another
world size": index -1, label -100), and a padded slot's pixels repeat a real sample's. For one
label, `Objective.loss` is `cross_entropy`, whose default ignore_index (-100) leaves those rows
out, and a mixed batch's all-zero target row adds nothing. For multi-label, a padded row's
target is all zero too (`multi_hot`, and c37221e's mixing path), but BCE against 0 is not
nothing: it teaches the model that the repeated photo has none of its classes, and it dilutes
the real rows' mean. Written as pipeline-train's own step does it: targets from `Objective`,
the loss from `Objective.loss`, backward through it.
"""

from __future__ import annotations

import torch
from batchwire.client.mixing import BatchMixer
from batchwire.train.objective import Objective
from batchwire.wire import PADDING_LABEL

CLASSES = 5


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four real samples ([B, K] ids, -1 padded) and two padding slots repeating samples 0, 1."""
    g = torch.Generator().manual_seed(3)
    real = torch.rand(4, 3, 8, 8, generator=g)
    images = torch.cat([real, real[:2]])
    labels = torch.tensor(
        [[1, 3], [0, -1], [4, 2], [2, -1], [PADDING_LABEL] * 2, [PADDING_LABEL] * 2]
    )
    return images, labels


def _step(objective: Objective, images: torch.Tensor, labels: torch.Tensor, batch_index: int):
    """pipeline-train's step (train/loop.py): targets, loss, backward; the loss and the grads
    of the logits."""
    inputs, targets = objective(images, labels, epoch=0, batch_index=batch_index)
    logits = (inputs.flatten(1)[:, :CLASSES] * 3).detach().requires_grad_(True)
    loss = objective.loss(logits, targets)
    loss.backward()
    return loss.detach(), logits.grad


def test_a_padded_row_adds_nothing_to_the_multi_label_loss() -> None:
    images, labels = _batch()
    objective = Objective(CLASSES, multi_label=True)
    loss, grad = _step(objective, images, labels, 0)
    assert not grad[4:].any(), f"padding rows get gradients: {grad[4:]}"
    # The loss of the real rows alone, as cross_entropy's ignore_index gives for one label.
    alone, _ = _step(objective, images[:4], labels[:4], 0)
    assert torch.allclose(loss, alone), (loss, alone)


def test_a_padded_row_adds_nothing_to_the_mixed_multi_label_loss() -> None:
    images, labels = _batch()
    for batch_index in range(4):
        mixer = BatchMixer(CLASSES, mixup_alpha=0.8, cutmix_alpha=1.0, seed=9, rank=0)
        objective = Objective(CLASSES, multi_label=True, mixer=mixer)
        _, grad = _step(objective, images, labels, batch_index)
        assert not grad[4:].any(), f"batch {batch_index}: padding rows get gradients"


def test_one_label_padding_already_adds_nothing() -> None:
    """The single-label path, the behaviour the multi-label one should match (passes today)."""
    images, labels = _batch()
    single = labels[:, 0]
    objective = Objective(CLASSES, multi_label=False)
    loss, grad = _step(objective, images, single, 0)
    assert not grad[4:].any()
    alone, _ = _step(objective, images[:4], single[:4], 0)
    assert torch.allclose(loss, alone)
    mixer = BatchMixer(CLASSES, mixup_alpha=0.8, cutmix_alpha=1.0, seed=9, rank=0)
    _, grad = _step(Objective(CLASSES, multi_label=False, mixer=mixer), images, single, 1)
    assert not grad[4:].any()


def test_the_mixed_one_label_loss_is_the_mean_over_the_real_rows() -> None:
    """pipeline-train --mixup, one label: the mixed real rows are those of a batch of only them
    (BatchMixer's draws depend on the batch's key, not its length), so the loss should be theirs,
    as the unmixed path's ignore_index makes it; cross_entropy's mean over all B rows scales it
    by real/B instead (a rank with 1 real row in 256 steps with 1/256 of its loss)."""
    images, labels = _batch()
    single = labels[:, 0]
    for batch_index in range(4):
        mixer = BatchMixer(CLASSES, mixup_alpha=0.8, cutmix_alpha=1.0, seed=9, rank=0)
        objective = Objective(CLASSES, multi_label=False, mixer=mixer)
        loss, _ = _step(objective, images, single, batch_index)
        alone, _ = _step(objective, images[:4], single[:4], batch_index)
        assert torch.allclose(loss, alone), (batch_index, loss, alone)


def test_an_all_padding_one_label_batch_is_a_zero_loss_step() -> None:
    """An elastic resume that grows the world size can hand a rank a batch of padding only (its
    last round). cross_entropy's mean over no rows is NaN; the step must be 0, with 0 grads, as
    the docstring of `Objective.loss` says and the multi-label path does."""
    images, labels = _batch()
    padding = labels[4:, 0]
    for smoothing in (0.0, 0.1):
        objective = Objective(CLASSES, multi_label=False, label_smoothing=smoothing)
        loss, grad = _step(objective, images[4:], padding, 0)
        assert loss.item() == 0.0 and not grad.any(), (smoothing, loss)
        real, _ = _step(objective, images[:4], labels[:4, 0], 0)  # real rows: a real loss
        assert torch.isfinite(real) and real > 0
