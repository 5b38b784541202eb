"""Throughput and data-wait bookkeeping, and rank 0's progress bar (tqdm).

Data-wait fraction = time blocked waiting for the next batch / wall time of the steps. Wall time
is taken between consecutive batch requests, so on a GPU (where kernels run asynchronously) the
host time of a step converges to the device time of a step as soon as the launch queue fills:
the fraction is honest without a per-step synchronisation. The loss is kept as a device tensor
and read (one host sync) only when a log line is printed.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import torch
from batchwire.common.rates import RateMeter
from tqdm import tqdm


def throughput_meter() -> RateMeter:
    """Images trained (column 0) and data-wait intervals since the start or the last `reset`.

    The trainer reports per log line and per epoch, so its meter does not slide but tumbles:
    an infinite one, reset after each log line (the epoch's is a fresh one per epoch). Wall time
    runs on ``perf_counter`` (the step timings use it too); the rate's floor is only there to
    never divide by zero, since a log interval shorter than a second is a real interval.
    """
    return RateMeter(math.inf, clock=time.perf_counter, min_span_s=1e-9)


def loader_totals(loader: Any) -> tuple[int, int]:
    """The loader's batches received and shared so far (`RemoteLoader.batch_totals`: shared
    production in a sweep); (0, 0) for a loader that reports none."""
    totals = getattr(loader, "batch_totals", None)
    return totals() if callable(totals) else (0, 0)


class LossAverage:
    """Running sum of the loss on the device; `.mean()` is the only host sync."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.count = 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss.detach().float()
        self.count += 1

    def mean_and_reset(self) -> float:
        value = self.total.item() / max(1, self.count)
        self.total.zero_()
        self.count = 0
        return value


class EpochBar:
    """Rank 0's progress bar over one epoch's batches: tqdm, on a terminal only.

    A log file or CI output gets the periodic ``step ...`` lines instead of a bar's carriage
    returns (tqdm's own rule for ``disable=None``). It appears when the epoch starts, before the
    first batch has come, so a slow first batch (a server still warming up, 224 px on a CPU)
    shows as a bar at 0, not as silence. `write` prints a line above the bar.
    """

    def __init__(
        self,
        enabled: bool,
        total: int,
        *,
        initial: int = 0,
        desc: str = "",
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self._bar: tqdm | None = None
        if enabled and self.stream.isatty():
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="batch",
                file=self.stream,
                dynamic_ncols=True,
                leave=False,
            )

    def update(self, batches: int, **postfix: str) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(batches)

    def write(self, line: str, out: TextIO | None = None) -> None:
        """Print ``line`` (to ``out``, default stdout) without tearing the bar."""
        out = out or sys.stdout
        if self._bar is None:
            print(line, file=out, flush=True)
        else:
            tqdm.write(line, file=out)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
