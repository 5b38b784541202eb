"""Validation loss and accuracy over the server's val split, exact across ranks.

The val split is padded so every rank gets the same number of batches; padded slots carry index
-1 and label -100 (cross-entropy's default ``ignore_index``) and repeat a real image, so counting
them would bias the figures. Each rank sums the loss and counts correct predictions among its
valid slots on the device, and one all_reduce of [loss sum, top1 correct, top5 correct, valid
total] at the end gives the global figures: no per-batch host sync, exactly the whole val set
counted once, and a batch that is all padding (a rank's last one) adds zeros, never a NaN (a
masked *mean* of an empty batch would be 0/0). A multi-label val split (`evaluate_multilabel`)
is scored by mAP and F1 instead (`metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from batchwire.pipeline.sampler import PADDING_INDEX, PADDING_LABEL
from torch import nn
from torch.nn import functional as F

from .distributed import DistContext, all_gather_objects, all_reduce_sum
from .metrics import MultiLabelScores, f1_counts, f1_scores, mean_average_precision


@dataclass(frozen=True)
class Accuracy:
    top1: float  # percent
    top5: float  # percent
    total: int  # valid samples counted, all ranks together
    loss: float = 0.0  # mean cross-entropy over the valid samples (0.0 when there are none)


def valid_mask(labels: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """True for real samples: index not `PADDING_INDEX` and label not `PADDING_LABEL`."""
    return (indices.to(labels.device) != PADDING_INDEX) & (labels != PADDING_LABEL)


def count_correct(
    logits: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, k: int = 5
) -> torch.Tensor:
    """[top1 correct, top-k correct, valid count] of one batch, padding (index -1 or label
    -100) excluded."""
    valid = valid_mask(labels, indices)
    k = min(k, logits.shape[1])
    topk = logits.topk(k, dim=1).indices
    hits = topk == labels[:, None]
    top1 = (hits[:, 0] & valid).sum()
    topk_hits = (hits.any(dim=1) & valid).sum()
    return torch.stack([top1, topk_hits, valid.sum()]).to(torch.float64)


def batch_sums(
    logits: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, k: int = 5
) -> torch.Tensor:
    """[loss sum, top1 correct, top-k correct, valid count] of one batch over its valid slots.

    The loss is a sum (never a mean), so an all-padding batch contributes 0, not NaN.
    """
    valid = valid_mask(labels, indices)
    targets = labels.masked_fill(~valid, PADDING_LABEL)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=PADDING_LABEL, reduction="sum")
    counts = count_correct(logits, labels, indices, k)
    return torch.cat([loss.detach().to(torch.float64).reshape(1), counts])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ctx: DistContext,
    *,
    autocast: Callable[[], AbstractContextManager[None]],
    to_model_input: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> Accuracy:
    """Loss, top-1 and top-5 of `model` over `(images, labels, indices)` batches, all ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)
    try:
        for images, labels, indices in batches:
            with autocast():
                logits = model(to_model_input(images))
            sums += batch_sums(logits.float(), labels, torch.as_tensor(indices))
    finally:
        model.train(was_training)
    all_reduce_sum(sums, ctx)
    return accuracy_from_sums(sums)


def accuracy_from_sums(sums: torch.Tensor) -> Accuracy:
    """The figures from summed [loss, top1, top5, total]; all zeros when nothing was valid."""
    loss, top1, top5, total = sums.tolist()
    if total == 0:
        return Accuracy(0.0, 0.0, 0, 0.0)
    return Accuracy(100.0 * top1 / total, 100.0 * top5 / total, int(total), loss / total)


@torch.no_grad()
def evaluate_multilabel(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ctx: DistContext,
    num_classes: int,
    *,
    autocast: Callable[[], AbstractContextManager[None]],
    to_model_input: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> MultiLabelScores:
    """mAP, micro/macro F1 at 0.5 and the BCE loss of `model` over multi-label batches
    (labels [B, K] padded ids), all ranks.

    AP ranks every val sample of a class, so it does not come from per-batch sums: each rank
    keeps its valid rows' logits and targets on the host (4 + 1 bytes per sample and class:
    50,000 images x 1,000 classes is 250 MB) and every rank gathers them all. Padded slots
    (index -1, labels all -100) are left out, as in `evaluate`.
    """
    from batchwire.client import multi_hot

    was_training = model.training
    model.eval()
    kept_logits, kept_targets = [], []
    try:
        for images, labels, indices in batches:
            with autocast():
                logits = model(to_model_input(images)).float()
            valid = torch.as_tensor(indices).to(labels.device) != PADDING_INDEX
            valid &= labels[:, 0] != PADDING_LABEL
            kept_logits.append(logits[valid.to(logits.device)].cpu())
            kept_targets.append(multi_hot(labels[valid], num_classes, torch.bool).cpu())
    finally:
        model.train(was_training)
    mine = (
        torch.cat(kept_logits) if kept_logits else torch.zeros(0, num_classes),
        torch.cat(kept_targets) if kept_targets else torch.zeros(0, num_classes, dtype=torch.bool),
    )
    parts = all_gather_objects(mine, ctx)
    logits = torch.cat([p[0] for p in parts])
    targets = torch.cat([p[1] for p in parts])
    return multilabel_scores(logits, targets)


def multilabel_scores(logits: torch.Tensor, targets: torch.Tensor) -> MultiLabelScores:
    """The figures of the whole val set's `logits` [N, C] and 0/1 `targets` [N, C]."""
    if logits.shape[0] == 0:
        return MultiLabelScores(0.0, 0.0, 0.0, 0, 0.0, 0)
    loss = F.binary_cross_entropy_with_logits(logits, targets.float())
    mean_ap, ap_classes = mean_average_precision(logits, targets)
    f1_micro, f1_macro = f1_scores(f1_counts(logits, targets))
    return MultiLabelScores(
        mean_ap, f1_micro, f1_macro, int(logits.shape[0]), float(loss), ap_classes
    )
