"""`--log-dir DIR`: the run's figures as CSV files, and as TensorBoard events when it is installed.

Rank 0 writes; other ranks get a `MetricsLog` that does nothing. Two CSV files, appended to (a
resumed run continues them; the header is written once, to a new file):

- ``DIR/steps.csv``: one row per log line (every ``--log-every`` optimizer steps): step, epoch,
  batch, loss, lr, images/s (all ranks), data-wait fraction;
- ``DIR/epochs.csv``: one row per epoch: train loss, val top-1/top-5/loss (empty with --no-val),
  val mAP and micro/macro F1 (a multi-label split; then top-1/top-5 are empty), data-wait,
  images/s, seconds.

A file written by an older version, with fewer columns, keeps its own header: rows are
appended under it (the columns it lacks are said once and left out), never shifted.

TensorBoard (``torch.utils.tensorboard.SummaryWriter``) needs the ``tensorboard`` package, which
batchwire does not depend on (it pulls in protobuf, grpcio and a web server): without it the run
says once how to install it and writes the CSV files alone, which any plotting tool reads.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("batchwire.train")

STEP_FIELDS = ("step", "epoch", "batch", "loss", "lr", "images_per_s", "data_wait")
EPOCH_FIELDS = (
    "epoch",
    "train_loss",
    "val_top1",
    "val_top5",
    "val_loss",
    "val_map",
    "val_f1_micro",
    "val_f1_macro",
    "data_wait",
    "images_per_s",
    "seconds",
)
TENSORBOARD_MISSING = (
    "TensorBoard logging needs the tensorboard package (pip install tensorboard); "
    "writing CSV files only"
)


class MetricsLog:
    """Appends rows to the CSV files and scalars to TensorBoard; `close` flushes both."""

    def __init__(self, directory: str | Path | None, enabled: bool = True) -> None:
        self.directory = None if directory is None or not enabled else Path(directory)
        self._files: dict[str, tuple[TextIO, csv.DictWriter]] = {}
        self._tb: Any = None
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises ImportError naming tensorboard when it is missing
            log.warning("%s", TENSORBOARD_MISSING)
        else:
            self._tb = SummaryWriter(str(self.directory))

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def step(self, row: Mapping[str, float | int]) -> None:
        """One log line's figures (`STEP_FIELDS`); TensorBoard: ``train/<name>`` at ``step``."""
        self._append("steps", STEP_FIELDS, row)
        if self._tb is not None:
            for name in ("loss", "lr", "images_per_s", "data_wait"):
                self._tb.add_scalar(f"train/{name}", row[name], row["step"])

    def epoch(self, row: Mapping[str, float | int | None]) -> None:
        """One epoch's figures (`EPOCH_FIELDS`; None for what was not measured)."""
        self._append("epochs", EPOCH_FIELDS, row)
        if self._tb is not None:
            for name in EPOCH_FIELDS[1:-1]:
                if row.get(name) is not None:
                    group = "val" if name.startswith("val_") else "epoch"
                    self._tb.add_scalar(
                        f"{group}/{name.removeprefix('val_')}", row[name], row["epoch"]
                    )

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _append(self, name: str, columns: tuple[str, ...], row: Mapping[str, Any]) -> None:
        if self.directory is None:
            return
        if name not in self._files:
            path = self.directory / f"{name}.csv"
            new = not path.exists() or path.stat().st_size == 0
            if not new:
                columns = _header_of(path, columns)
            f = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - kept open
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            self._files[name] = (f, writer)
        f, writer = self._files[name]
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})
        f.flush()


def _header_of(path: Path, columns: tuple[str, ...]) -> tuple[str, ...]:
    """The columns of an existing CSV file (an older version's may lack some of `columns`)."""
    with open(path, newline="", encoding="utf-8") as f:
        header = tuple(next(csv.reader(f), ()))
    missing = [c for c in columns if c not in header]
    if missing:
        log.warning(
            "%s was started by an older pipeline-train: appending under its header, without "
            "the columns %s",
            path,
            ", ".join(missing),
        )
    return header
