"""Multi-label validation figures in torch alone (no sklearn): mAP and F1 at threshold 0.5.

- Average precision of one class (sklearn's ``average_precision_score``, no interpolation):
  rank the samples by score, and average, over the class's positives, the precision at each
  positive's rank; samples with equal scores share one threshold, so a positive tied with
  negatives gets the precision of the whole tie group. mAP is the mean over the classes that
  have at least one positive in the val set (a class without one has no AP: skipped, and the
  count of classes averaged is reported).
- F1 at 0.5: a class is predicted where sigmoid(logit) >= 0.5. Micro F1 pools every class's
  true/false positives and false negatives: 2TP / (2TP + FP + FN). Macro F1 is the mean of the
  classes' F1 over the classes with something to count (a positive or a prediction); a class
  neither present nor predicted is 0/0, skipped rather than counted as 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MultiLabelScores:
    """A multi-label val split's figures (percent), as `Accuracy` is a single-label one's."""

    mean_ap: float  # percent, over `ap_classes` classes
    f1_micro: float  # percent
    f1_macro: float  # percent
    total: int  # valid samples counted, all ranks together
    loss: float = 0.0  # mean binary cross-entropy per (sample, class)
    ap_classes: int = 0  # classes with a positive in the val set (those mAP averages)


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-class AP of ``scores`` [N, C] against 0/1 ``targets`` [N, C]: float64 [C], NaN for
    a class without positives. Ties share a threshold (see the module docstring)."""
    if scores.shape != targets.shape or scores.dim() != 2:
        raise ValueError(
            f"scores and targets must both be [N, C], got {scores.shape} and {targets.shape}"
        )
    n = scores.shape[0]
    order = scores.argsort(dim=0, descending=True, stable=True)
    ranked = scores.gather(0, order)
    hits = targets.gather(0, order).to(torch.float64)
    precision = hits.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    # Each rank's tie group ends at the first rank j >= it whose next score differs (or the
    # last rank): the precision there is the one every member of the group gets.
    rank = torch.arange(n)[:, None].expand_as(ranked)
    ends_group = torch.ones_like(ranked, dtype=torch.bool)
    ends_group[:-1] = ranked[:-1] != ranked[1:]
    group_end = torch.where(ends_group, rank, torch.full_like(rank, n))
    group_end = group_end.flip(0).cummin(0).values.flip(0)
    positives = hits.sum(0)
    ap = (hits * precision.gather(0, group_end)).sum(0) / positives
    return torch.where(positives > 0, ap, torch.full_like(ap, float("nan")))


def f1_counts(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-class [true positives, false positives, false negatives] at sigmoid >= 0.5, float64
    [C, 3] (sums: add them over batches and ranks)."""
    predicted = logits >= 0  # sigmoid(x) >= 0.5 exactly when x >= 0
    actual = targets > 0.5
    tp = (predicted & actual).sum(0)
    fp = (predicted & ~actual).sum(0)
    fn = (~predicted & actual).sum(0)
    return torch.stack([tp, fp, fn], dim=1).to(torch.float64)


def f1_scores(counts: torch.Tensor) -> tuple[float, float]:
    """(micro F1, macro F1) in percent from `f1_counts` [C, 3]; 0.0 when nothing counts."""
    tp, fp, fn = counts.unbind(1)
    denominators = 2 * tp + fp + fn
    micro = 2 * tp.sum() / denominators.sum() if denominators.sum() > 0 else torch.tensor(0.0)
    counted = denominators > 0
    macro = (2 * tp[counted] / denominators[counted]).mean() if counted.any() else torch.tensor(0.0)
    return 100.0 * float(micro), 100.0 * float(macro)


def mean_average_precision(scores: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """(mAP in percent, classes averaged): the mean AP over classes with a positive."""
    ap = average_precision(scores, targets)
    present = ~ap.isnan()
    if not present.any():
        return 0.0, 0
    return 100.0 * float(ap[present].mean()), int(present.sum())
