"""Multi-label batches on the trainer's side.

A multi-label dataset (a manifest whose labels are lists) arrives as padded ids: int64
[B, K], each row the sample's class ids in the order written, then -1; a padded validation
slot's row is all -100 (`wire.PADDING_LABEL`). Ids rather than multi-hot on the wire: the size
is bounded by K (not the number of classes: 8 bytes x K per sample whatever the class count)
and exact; `multi_hot` turns them into the [B, C] targets a BCE loss takes, on any device.
"""

from __future__ import annotations

import torch


def multi_hot(
    labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[B, num_classes] targets: 1 where a row of ``labels`` ([B, K] padded ids, or [B] single
    labels) names the class, 0 elsewhere. Negative entries (the -1 padding, a padded slot's
    -100) set nothing, so a padded slot's row is all zeros; an id >= ``num_classes`` is a
    ValueError, and so are float or bool ``labels`` (a truncated float, or a multi-hot row
    read as ids, would be a silently wrong target). Same device as ``labels``."""
    if num_classes < 0:
        raise ValueError(f"num_classes must be >= 0, got {num_classes}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be integer class ids, got dtype {labels.dtype}")
    if labels.dim() == 1:
        labels = labels[:, None]
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B] or [B, K], got shape {list(labels.shape)}")
    labels = labels.long()
    if labels.numel() and int(labels.max()) >= num_classes:
        raise ValueError(f"label id {int(labels.max())} is not below num_classes={num_classes}")
    out = torch.zeros(labels.shape[0], num_classes + 1, dtype=dtype, device=labels.device)
    ids = torch.where(labels >= 0, labels, torch.full_like(labels, num_classes))
    out.scatter_(1, ids, 1)
    return out[:, :num_classes].contiguous()
