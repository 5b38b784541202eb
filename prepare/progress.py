"""pipeline-prepare's progress on stderr: a tqdm bar on a terminal, a line every few seconds
otherwise (a log file or CI output must not fill with carriage returns).

A rewrite of a large dataset runs for hours, so the line says how far it is, how fast it goes,
when it should end and how many problem files it has met so far.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

TTY_INTERVAL_S = 0.2
LOG_INTERVAL_S = 5.0


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Call `update` as files finish, `note` for a message line, `close` at the end."""

    def __init__(
        self,
        total: int,
        *,
        out: TextIO | None = None,
        enabled: bool = True,
        interval_s: float | None = None,
    ) -> None:
        self.total = total
        self.out = out if out is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.interval_s = interval_s or (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S)
        self.started = time.monotonic()
        self._last_draw = self.started
        self.done = 0
        self.problems = 0
        self._bar: tqdm | None = None
        if self.enabled and self.tty:
            self._bar = tqdm(
                total=total,
                desc="prepare",
                unit="file",
                file=self.out,
                mininterval=self.interval_s,
                dynamic_ncols=True,
            )

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        text = f"prepare: {self.done}/{self.total} files ({pct:.1f} %), {rate:.0f} files/s"
        text += f", {_clock(elapsed)} elapsed, ETA {eta}"
        if self.problems:
            text += f", {self.problems} problem files"
        return text

    def update(self, done: int, problems: int) -> None:
        if self._bar is not None:
            if problems != self.problems:
                self._bar.set_postfix_str(f"{problems} problem files", refresh=False)
            self._bar.update(done - self.done)
        self.done, self.problems = done, problems
        if self._bar is not None:
            return
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self.interval_s:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        self.out.write(self.line() + "\n")
        self.out.flush()

    def note(self, message: str) -> None:
        """A line of its own (a problem file), above the redrawn progress line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.out)
            return
        self.out.write(message + "\n")
        self.out.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()  # its last state stays on screen
            self._bar = None
        elif self.enabled:
            self._draw()
