"""A settable monotonic clock, so window arithmetic is tested exactly and without sleeping."""

from __future__ import annotations


class FakeClock:
    """Call it for the time; move time on by changing ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
