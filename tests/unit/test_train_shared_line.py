"""pipeline-train's epoch line says how many of the epoch's batches were shared with another job
(a sweep on one server), and says nothing of it where the server shares nothing."""

from __future__ import annotations

from batchwire.train.loop import EpochResult, format_epoch
from batchwire.train.progress import loader_totals


def _result(shared: tuple[int, int] | None) -> EpochResult:
    return EpochResult(0, None, data_wait=0.1, images_per_s=50.0, train_loss=0.7, seconds=2.0,
                       shared=shared)  # fmt: skip


def test_the_epoch_line_counts_shared_batches_only_when_told() -> None:
    line = format_epoch(_result((812, 900)))
    assert "images/s=50 shared 812/900 batches (train loss 0.7000" in line
    assert format_epoch(_result(None)) == (
        "epoch 0: val skipped data-wait=10.0% images/s=50 (train loss 0.7000, 2.0 s)"
    )


def test_a_loader_without_totals_counts_nothing() -> None:
    """Trainer's own loaders (a list, a DataLoader) report no totals: (0, 0), no error."""
    assert loader_totals([(1, 2)]) == (0, 0)
