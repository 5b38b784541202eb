"""SIGUSR1 as "checkpoint now and stop": how a job at its time limit keeps every step it trained.

Slurm warns a job before its time limit with a signal (`--signal=B:USR1@120` in
deploy/slurm/batchwire.sbatch), and the recipe passes USR1 on to the trainers. The handler only
sets a flag: it runs between two bytecodes of the main thread, possibly inside a collective or
half-way through an optimizer step, where writing a checkpoint would be neither safe nor exact.
The loop reads the flag after each optimizer step, where model, optimizer, schedule and loader
stand at one step; the ranks agree on it first (one may see the signal a step after another), all
write that step's checkpoint together and `fit()` raises `CheckpointedOnSignal`. `pipeline-train`
exits with `CHECKPOINTED_EXIT` then: the same command resumes from that checkpoint exactly.

Torch-free, so that `pipeline-train` installs the handler before torch is imported: a USR1
during the start-up is kept for the first step rather than ending the process (USR1's default).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

#: pipeline-train's exit code after a checkpoint on SIGUSR1: "resume with the same command".
CHECKPOINTED_EXIT = 3


class CheckpointRequest:
    """Whether this process got SIGUSR1 since the handler was installed."""

    def __init__(self) -> None:
        self.requested = False

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True


class CheckpointedOnSignal(Exception):
    """`Trainer.fit()` wrote the checkpoint of `step` on SIGUSR1 and stopped; the run resumes
    from it with the same command."""

    def __init__(self, step: int) -> None:
        super().__init__(f"checkpointed at step {step} on SIGUSR1")
        self.step = step


@contextmanager
def checkpoint_on_usr1(enabled: bool) -> Iterator[CheckpointRequest | None]:
    """A `CheckpointRequest` set by SIGUSR1 while the block runs (the previous handler comes
    back after it); None when not `enabled` (no --checkpoint-dir: nowhere to write to).

    Python runs signal handlers in the main thread only, and only it may install one: elsewhere
    the request is still returned (every rank must take part in the vote the same way) but no
    signal can set it, which is logged.
    """
    if not enabled:
        yield None
        return
    request = CheckpointRequest()
    if threading.current_thread() is not threading.main_thread():
        log.warning("not the main thread: SIGUSR1 cannot request a checkpoint in this run")
        yield request
        return
    previous: Any = signal.signal(signal.SIGUSR1, request._on_signal)
    try:
        yield request
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL if previous is None else previous)
