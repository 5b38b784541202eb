"""Per-optimizer-step learning-rate schedules: linear warm-up, then cosine or one-cycle.

Both are a `LambdaLR` over a picklable multiplier object, so the scheduler's `state_dict()` is
plain numbers that `torch.load(weights_only=True)` accepts, and a resumed run rebuilt with the
same arguments continues on exactly the same curve.

- cosine: warm-up from `warmup_start` x lr to lr over `warmup_steps`, then half a cosine down to
  `final_fraction` x lr at `total_steps`.
- onecycle: Smith's one-cycle shape, linear up from lr / 25 to lr over the warm-up (at least
  30% of training when no warm-up is given), then cosine down to lr / 1e4.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

SCHEDULES = ("cosine", "onecycle")


@dataclass(frozen=True)
class WarmupCosine:
    """lr multiplier at step s: linear warm-up, then cosine from 1 to `final` (held after)."""

    warmup_steps: int
    total_steps: int
    start: float
    final: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start + (1.0 - self.start) * step / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    *,
    total_steps: int,
    warmup_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step scheduler of `kind` ("cosine" or "onecycle") over `total_steps` steps."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup_steps = max(0, min(warmup_steps, total_steps))
    if kind == "cosine":
        fn = WarmupCosine(warmup_steps, total_steps, start=0.1, final=0.0)
    else:
        peak = warmup_steps or max(1, round(0.3 * total_steps))
        fn = WarmupCosine(peak, total_steps, start=1.0 / 25.0, final=1e-4)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def resume_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict, position: int
) -> bool:
    """Continue `scheduler` from a checkpoint's scheduler state; True if it was restored as is.

    A checkpoint stores its curve (steps per epoch, epochs, warm-up) with its position. When
    the resumed run's curve differs (another world size or --accum-steps changes the steps per
    epoch; another --epochs or --warmup-epochs), loading the saved state would put the old
    curve back, ending the decay too early or never. Then the run keeps its own curve and
    starts it at `position`, the optimizer steps already taken in this run's units.
    """
    if saved.get("lr_lambdas") == scheduler.state_dict().get("lr_lambdas"):
        scheduler.load_state_dict(saved)
        return True
    scheduler.last_epoch = position - 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose, to seek
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return False
