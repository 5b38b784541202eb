"""Throughput and data-wait bookkeeping, and the rank-0 progress line.

Data-wait fraction = time blocked waiting for the next batch / wall time of the steps. Wall time
is taken between consecutive batch requests, so on a GPU (where kernels run asynchronously) the
host time of a step converges to the device time of a step as soon as the launch queue fills:
the fraction is honest without a per-step synchronisation. The loss is kept as a device tensor
and read (one host sync) only when a log line is printed.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import torch


class WindowMeter:
    """Images, blocked time and wall time since the last `reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.images = 0
        self.wait_s = 0.0
        self.steps = 0

    def add(self, images: int, wait_s: float) -> None:
        self.images += images
        self.wait_s += wait_s

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def images_per_s(self) -> float:
        return self.images / self.elapsed()

    def wait_fraction(self) -> float:
        return min(1.0, self.wait_s / self.elapsed())


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
