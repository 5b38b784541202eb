"""Throughput and data-wait bookkeeping, and the rank-0 progress line.

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
from typing import TextIO

import torch
from batchwire.common.rates import RateWindow


def throughput_window() -> RateWindow:
    """Images trained (column 0) and data-wait intervals since the start or the last `reset`.

    The trainer reports per log line and per epoch, so its window is not sliding but tumbling:
    an infinite one, reset after each log line (the epoch's is a fresh one per epoch). Wall time
    runs on ``perf_counter`` (the step timings use it too); the rate's floor is only there to
    never divide by zero, since a log interval shorter than a second is a real interval.
    """
    return RateWindow(math.inf, clock=time.perf_counter, min_span_s=1e-9)


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


class ProgressLine:
    """A single `\\r`-rewritten status line, only when `stream` is a terminal (rank 0 decides)."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.enabled = enabled and self.stream.isatty()
        self._width = 0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
