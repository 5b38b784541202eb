"""Validation accuracy over the server's val split, exact across ranks.

The val split is padded so every rank gets the same number of batches; padded slots carry index
-1 and repeat a real image, so counting them would bias the accuracy. Each rank counts correct
predictions among its valid slots on the device, and one all_reduce of
[top1 correct, top5 correct, valid total] at the end gives the global figures: no per-batch host
sync, and exactly the whole val set counted once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from .distributed import DistContext, all_reduce_sum


@dataclass(frozen=True)
class Accuracy:
    top1: float  # percent
    top5: float  # percent
    total: int  # valid samples counted, all ranks together


def count_correct(
    logits: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, k: int = 5
) -> torch.Tensor:
    """[top1 correct, top-k correct, valid count] of one batch, padding (index -1) excluded."""
    valid = indices.to(labels.device) != -1
    k = min(k, logits.shape[1])
    topk = logits.topk(k, dim=1).indices
    hits = topk == labels[:, None]
    top1 = (hits[:, 0] & valid).sum()
    topk_hits = (hits.any(dim=1) & valid).sum()
    return torch.stack([top1, topk_hits, valid.sum()]).to(torch.float64)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ctx: DistContext,
    *,
    autocast: Callable[[], AbstractContextManager[None]],
    prepare: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> Accuracy:
    """Top-1/top-5 of `model` over `(images, labels, indices)` batches, summed over ranks."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    try:
        for images, labels, indices in batches:
            with autocast():
                logits = model(prepare(images))
            counts += count_correct(logits.float(), labels, torch.as_tensor(indices))
    finally:
        model.train(was_training)
    all_reduce_sum(counts, ctx)
    top1, top5, total = counts.tolist()
    if total == 0:
        return Accuracy(0.0, 0.0, 0)
    return Accuracy(100.0 * top1 / total, 100.0 * top5 / total, int(total))
