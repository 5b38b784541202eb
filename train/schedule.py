"""Per-optimizer-step learning-rate schedules, built from torch's own schedulers.

- cosine: `LinearLR` warm-up from 0.1 x lr to lr over `warmup_steps`, then `CosineAnnealingLR`
  down to 0 at `total_steps` (chained by `SequentialLR`; no warm-up: the cosine alone).
- onecycle: `OneCycleLR` (Smith's one cycle): from lr / 25 up to lr over the warm-up (at least
  30% of training when no warm-up is given), then down to lr / 1e4, both halves cosine;
  momentum is left alone (the optimizer's setting holds throughout).

Each scheduler carries ``curve`` (its kind and lengths; plain values, so it travels in
``state_dict()`` and `torch.load(weights_only=True)` accepts it): a resumed run rebuilt with the
same arguments restores the saved state and continues on exactly the same curve, and one whose
curve changed (another world size or --accum-steps changes the steps per epoch) is told apart
by `resume_schedule`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
)

from .config import SCHEDULES

WARMUP_START = 0.1  # cosine: the warm-up starts at this fraction of the peak lr
ONECYCLE_START = 1 / 25  # onecycle: from lr / 25 ...
ONECYCLE_END = 1e-4  # ... to lr / 1e4


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    *,
    total_steps: int,
    warmup_steps: int,
) -> LRScheduler:
    """A per-step scheduler of `kind` ("cosine" or "onecycle") over `total_steps` steps."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup_steps = max(0, min(warmup_steps, total_steps))
    scheduler: LRScheduler
    if kind == "cosine":
        decay = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=0.0)
        if warmup_steps == 0:
            scheduler = decay
        else:
            warm = LinearLR(
                optimizer, start_factor=WARMUP_START, end_factor=1.0, total_iters=warmup_steps
            )
            scheduler = SequentialLR(optimizer, [warm, decay], milestones=[warmup_steps])
    else:
        peak = warmup_steps or max(1, round(0.3 * total_steps))
        # OneCycleLR peaks at step pct_start x steps - 1 and refuses a step past its last: one
        # step of margin, so the run's last optimizer step never ends training with an error.
        steps = total_steps + 1
        scheduler = OneCycleLR(
            optimizer,
            max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=steps,
            pct_start=min(1.0, (peak + 1) / steps),
            anneal_strategy="cos",
            cycle_momentum=False,
            div_factor=1 / ONECYCLE_START,
            final_div_factor=ONECYCLE_START / ONECYCLE_END,
        )
    scheduler.curve = {  # type: ignore[attr-defined]
        "kind": kind,
        "total_steps": total_steps,
        "warmup_steps": warmup_steps,
    }
    return scheduler


def step_schedule(scheduler: LRScheduler) -> None:
    """One optimizer step's scheduler step, none past the curve's last: a pass resumed at another
    world size can take a step or two more than the rebuilt curve counts (its position is
    rounded, its samples cut at the old world size), and OneCycleLR raises past its end while a
    cosine would climb again."""
    curve = getattr(scheduler, "curve", None)
    if curve is None or scheduler.last_epoch < curve["total_steps"]:
        scheduler.step()


def resume_schedule(scheduler: LRScheduler, saved: dict[str, Any], position: int) -> bool:
    """Continue `scheduler` from a checkpoint's scheduler state; True if it was restored as is.

    A checkpoint stores its curve (``curve``: kind, steps, warm-up) with its position. When the
    resumed run's curve differs (another world size or --accum-steps changes the steps per
    epoch; another --epochs or --warmup-epochs), loading the saved state would put the old
    curve back, ending the decay too early or never. Then the run keeps its own curve and
    starts it at `position`, the optimizer steps already taken in this run's units (stepped
    there: the chained schedulers compute each step from the last, a few microseconds each).
    """
    if saved.get("curve") == getattr(scheduler, "curve", None):
        scheduler.load_state_dict(saved)
        return True
    # The optimizer's restored state put the old curve's lr in each group, and the schedulers
    # compute each step from the current lr: seek from this curve's own first value, or the old
    # curve's ratio carries into every later step (a warm-up past the peak, a cosine kept low).
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose, to seek
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(position):
            scheduler.step()
    return False
