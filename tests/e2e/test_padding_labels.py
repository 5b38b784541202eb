"""Padded validation slots carry label -100 (cross-entropy's ignore_index) and index -1, in the
server's batches and LocalLoader's alike, and validation stays exact (never NaN) when a rank's
last val batch is all padding.

The embedded dataset's val split (400 images, 10 classes) at 16-32 px, real JPEGs throughout.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.sampler import PADDING_LABEL
from batchwire.pipeline.synthetic import default_dataset
from batchwire.train.distributed import DistContext
from batchwire.train.evaluate import batch_sums, evaluate
from serverproc import running_server, small_server_args
from torch import nn
from torch.nn import functional as F

N_VAL = 400  # the embedded val split


def _cpu_ctx() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _check_padding(batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """Every padding slot has label -100, every real slot a class; returns the padding count."""
    padding = 0
    for _, labels, indices in batches:
        pad = indices == -1
        assert (labels[pad] == PADDING_LABEL).all(), (labels, indices)
        assert ((labels[~pad] >= 0) & (labels[~pad] < 10)).all(), (labels, indices)
        padding += int(pad.sum())
    return padding


def test_padding_label_is_cross_entropys_ignore_index() -> None:
    assert PADDING_LABEL == nn.CrossEntropyLoss().ignore_index == -100


def test_local_loader_val_padding_has_label_minus_100() -> None:
    """400 images, batches of 48 on rank 1 of 2: rounds of 96 slots, the last round's second
    half (rank 1's last batch) is all padding."""
    with LocalLoader(
        None, split="val", batch_size=48, image_size=16, threads=1, with_indices=True,
        rank=1, world_size=2, output_dtype="uint8",
    ) as loader:  # fmt: skip
        batches = list(loader)
    assert len(batches) == 5
    last_labels, last_indices = batches[-1][1], batches[-1][2]
    assert (last_indices == -1).all() and (last_labels == -100).all()
    assert _check_padding(batches) == 48  # rank 1 holds slots 432..479 of 480: all padding


@pytest.mark.timeout(120)
def test_server_val_padding_has_label_minus_100() -> None:
    """A real server's val batches, as RemoteLoader yields them: 400 images in batches of 16 on
    rank 2 of 3 (rounds of 48 slots: 9 rounds = 432 slots, padding 32 at the end)."""
    val_root = str(default_dataset().val_root)
    with running_server(*small_server_args(seed=0, root=val_root, val=True)) as srv:
        seen = []
        for rank in range(3):
            loader = RemoteLoader(
                srv.endpoint, split="val", rank=rank, world_size=3, device="cpu",
                with_indices=True, timeout=30,
            )  # fmt: skip
            try:
                batches = [(i.clone(), lab.clone(), idx.clone()) for i, lab, idx in loader]
            finally:
                loader.close()
            seen.append(_check_padding(batches))
            if rank == 2:  # slots 432-447 (all padding) are rank 2's last batch
                assert (batches[-1][2] == -1).all() and (batches[-1][1] == -100).all()
    assert sum(seen) == 9 * 48 - N_VAL


def test_all_padding_batch_adds_nothing_and_no_nan() -> None:
    logits = torch.randn(4, 10)
    labels = torch.full((4,), -100)
    indices = torch.full((4,), -1)
    sums = batch_sums(logits, labels, indices)
    assert sums.tolist() == [0.0, 0.0, 0.0, 0.0]
    # the masked mean it replaces: NaN
    assert math.isnan(F.cross_entropy(logits, labels).item())


def test_batch_sums_count_only_real_slots() -> None:
    # hit; top-2 hit only; padding (a hit if counted); miss at k=2
    logits = torch.tensor([[5.0, 0.0, 1.0], [0.0, 5.0, 1.0], [0.0, 0.0, 5.0], [5.0, 0.0, 1.0]])
    labels = torch.tensor([0, 2, -100, 1])
    indices = torch.tensor([7, 8, -1, 9])
    loss, top1, top5, total = batch_sums(logits, labels, indices, k=2).tolist()
    expect = F.cross_entropy(logits[[0, 1, 3]], labels[[0, 1, 3]], reduction="sum").item()
    assert loss == pytest.approx(expect)
    assert (top1, top5, total) == (1.0, 2.0, 3.0)
    # An older server's padding (a real label, index -1) is excluded by its index alone.
    old = batch_sums(logits, torch.tensor([0, 2, 2, 1]), indices, k=2).tolist()
    assert old == pytest.approx([expect, 1.0, 2.0, 3.0])


def test_evaluate_on_a_rank_whose_last_val_batch_is_all_padding() -> None:
    """Rank 1 of 2 with batches of 48: its last batch is all padding; the loss and accuracy
    are finite and equal those computed over the real samples alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    with LocalLoader(
        None, split="val", batch_size=48, image_size=16, threads=1, with_indices=True,
        rank=1, world_size=2,
    ) as loader:  # fmt: skip
        batches = list(loader)
    assert (batches[-1][2] == -1).all()
    acc = evaluate(model, batches, _cpu_ctx(), autocast=contextlib.nullcontext)
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    real = torch.cat([b[2] for b in batches]) != -1
    with torch.no_grad():
        logits = model(images[real])
    assert acc.total == int(real.sum()) == 4 * 48  # slots 48-95, 144-191, 240-287, 336-383
    assert math.isfinite(acc.loss) and acc.loss == pytest.approx(
        F.cross_entropy(logits, labels[real]).item(), rel=1e-5
    )
    top1 = (logits.argmax(1) == labels[real]).float().mean().item() * 100
    assert acc.top1 == pytest.approx(top1)
