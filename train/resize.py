"""`--resize-schedule`: progressive resizing, the image size of each epoch (torch-free).

``128:0,160:10,224:30`` trains epochs 0-9 at 128 px, 10-29 at 160 px and 30 on at 224 px (a
size is PX or HxW). The trainer asks its train loader for the epoch's size before the epoch
(`RemoteLoader.set_image_size`); the servers produce the batches at that size, up to their
--max-image-size, which must cover the schedule's largest size (checked at start, not at epoch
30). Validation stays at the servers' --image-size. A mid-epoch resume continues at the size the
checkpoint's loader state records, the size that epoch was started at.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from batchwire.wire.messages import MAX_IMAGE_SIDE


class ScheduleError(ValueError):
    """A --resize-schedule that cannot be read; the message shows the expected form."""


@dataclass(frozen=True)
class ResizeStep:
    epoch: int  # the first epoch at this size
    size: tuple[int, int]  # (height, width)


FORM = "SIZE:EPOCH[,SIZE:EPOCH...] from epoch 0 on, e.g. 128:0,160:10,224:30 (SIZE: PX or HxW)"


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ScheduleError(f"size {text!r} is not PX or HxW")
    h, w = int(parts[0]), int(parts[-1])
    if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
        raise ScheduleError(f"size {text!r} is not in 1..{MAX_IMAGE_SIDE}")
    return h, w


def parse_resize_schedule(text: str) -> tuple[ResizeStep, ...]:
    """The steps of ``text``, epochs strictly increasing from 0; `ScheduleError` otherwise."""
    steps = []
    try:
        for item in text.split(","):
            size, sep, epoch = item.strip().rpartition(":")
            if not sep or not epoch.strip().isdigit():
                raise ScheduleError(f"{item.strip()!r} is not SIZE:EPOCH")
            steps.append(ResizeStep(int(epoch), _size(size.strip())))
        if steps[0].epoch != 0:
            raise ScheduleError(f"it starts at epoch {steps[0].epoch}, not 0")
        for a, b in itertools.pairwise(steps):
            if b.epoch <= a.epoch:
                raise ScheduleError(f"epoch {b.epoch} does not come after epoch {a.epoch}")
    except ScheduleError as exc:
        raise ScheduleError(f"--resize-schedule {text!r}: {exc}; expected {FORM}") from None
    return tuple(steps)


def size_at(steps: tuple[ResizeStep, ...], epoch: int) -> tuple[int, int]:
    """The size of ``epoch``: that of the last step starting at or before it."""
    return [s.size for s in steps if s.epoch <= epoch][-1]


def largest(steps: tuple[ResizeStep, ...]) -> tuple[int, int]:
    """The (height, width) a server's --max-image-size must cover: each side's largest."""
    return max(s.size[0] for s in steps), max(s.size[1] for s in steps)
