"""Lines a peer can cause, bounded per window (pure: callers pass ``now``).

A trainer fleet logs a few lines per rank and epoch; a peer that says hello, bye or reconnects,
sends garbage or asks for what it may not have thousands of times a second would log as many
lines and fill the disk. A `LineBudget` lets `per_window` lines through per `window_s` at their
own level, takes the rest down to DEBUG and counts them, and `summary` is the one line that
says how many were held back. The budget comes back each window: after a hostile burst, an
honest client's refusal is still said.
"""

from __future__ import annotations

import logging
import math

#: Lines about clients coming and going (admitted, bye, disconnected), per window.
CLIENT_LINES_PER_WINDOW = 100
CLIENT_LINES_WINDOW_S = 10.0
#: Refusals (error replies) and malformed messages, per window (minutes: rare from trainers).
ERROR_LINES_PER_WINDOW = 100
MALFORMED_LINES_PER_WINDOW = 20
PEER_FAULT_WINDOW_S = 60.0


class LineBudget:
    """At most ``per_window`` lines about ``what`` per ``window_s`` at their level; the rest at
    DEBUG, counted."""

    def __init__(
        self,
        what: str = "lines about clients (admitted, bye, disconnected)",
        per_window: int = CLIENT_LINES_PER_WINDOW,
        window_s: float = CLIENT_LINES_WINDOW_S,
        summary_level: int = logging.INFO,
    ) -> None:
        self.what, self.per_window, self.window_s = what, per_window, window_s
        #: The summary's level: the lines' own, so a log filtered at WARNING still says it.
        self.summary_level = summary_level
        self._window_start = -math.inf
        self._used = 0
        self._held = 0

    def level(self, now: float, level: int = logging.INFO) -> int:
        """The level to log one more line at (call `summary` first: a new window resets)."""
        if now - self._window_start >= self.window_s:
            self._window_start, self._used = now, 0
        self._used += 1
        if self._used <= self.per_window:
            return level
        self._held += 1
        return logging.DEBUG

    def last_in_window(self) -> bool:
        """Was the line just given a level the window's last at it (say "further ones are
        only counted" beside it)?"""
        return self._used == self.per_window

    def summary(self, now: float) -> str | None:
        """Once the window that held lines back is over: the line that says how many."""
        if not self._held or now - self._window_start < self.window_s:
            return None
        held, self._held = self._held, 0
        return (
            f"{held} more {self.what} in the last {self.window_s:g} s or more were only "
            "counted; --log-level DEBUG shows each"
        )
