"""Where a RemoteLoader stands in its epochs: the position policy, without I/O.

`RemoteLoader` (the shell: sockets through its receiver, torch, the process's rank) tells
`Progress` what happened and asks it where to go; every rule about the position lives here:

- ``iter(loader)`` starts a fresh pass from batch 0 (`begin_pass`), unless a restored state
  positioned it; a train loader iterated again after a full pass, with no `set_epoch` since,
  moves to the next epoch by itself; a val loader repeats its epoch.
- `set_epoch` with the current epoch keeps a restored position; another epoch starts at 0.
- `restore` (``load_state_dict``): the same world size resumes at the saved batch; another one
  (elastic trainers) serves the rest of the epoch as a new *pass*: ``pass_`` = (first sample of
  the epoch order, the world size the epoch was started at), part of every hello.
- `check_resumed`: a restored mid-epoch position must meet epochs of the shape it was saved
  against (batches per epoch, batch size, samples) and the world size it was saved at.

No clock: nothing here depends on time. Plain data, so a pickled loader carries it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

#: What a state must hold for `restore`.
STATE_KEYS = ("epoch", "next_batch", "split", "rank", "world_size")


class Progress:
    """One loader's epoch, next batch and pass, and the restored position's checks."""

    def __init__(self) -> None:
        self.epoch = 0
        self.next_batch = 0
        self.positioned = False  # a restored state chose where the next pass starts
        self.epoch_passed = False  # a full pass of `epoch` ended and set_epoch was not called
        #: The pass of `epoch` being served: (first sample in the epoch order, world size the
        #: epoch was started at); (0, 0): the epoch's own batches. Elastic resume sets it.
        self.pass_: tuple[int, int] = (0, 0)
        #: A restored mid-epoch position's epoch shape and world size: checked at the next
        #: welcome (`check_resumed`).
        self.resume_shape: dict[str, int] | None = None
        self.resume_world: int | None = None

    # ------------------------------------------------------------------ events

    def set_epoch(self, epoch: int) -> None:
        """The user selected ``epoch``: it decides over the automatic advance; the current
        epoch keeps a restored position."""
        self.epoch_passed = False
        if epoch != self.epoch:
            self.epoch, self.next_batch, self.positioned = epoch, 0, False
            self.pass_ = (0, 0)

    def begin_pass(self, repeats: bool) -> bool:
        """``iter(loader)``: where the pass starts. ``repeats``: the loader evaluates the same
        epoch again (a val loader). Returns whether it moved on to the next epoch by itself
        (a train epoch passed in full and iterated again without `set_epoch`: each rank
        iterates once per epoch, so every rank advances alike and they stay in step)."""
        advanced = self.epoch_passed and not self.positioned and not repeats
        if advanced:
            self.epoch_passed = False
            self.epoch, self.next_batch, self.pass_ = self.epoch + 1, 0, (0, 0)
        self.next_batch, self.positioned = self.start_batch(), False
        return advanced

    def at_end(self, total: int) -> bool:
        """Is the pass over before it began (a restored position at the epoch's end, of
        ``total`` batches)? Then the epoch counts as passed."""
        if self.next_batch >= total:
            self.epoch_passed = True
            return True
        return False

    def handed_out(self, total: int) -> None:
        """The consumer took the next batch of an epoch of ``total`` batches."""
        self.next_batch += 1
        if self.next_batch == total:
            self.epoch_passed = True

    def restore(self, state: Mapping[str, Any], world_size: int) -> None:
        """``load_state_dict``'s position, for a loader of ``world_size`` ranks (the state's
        own if this loader's is not known yet). Another world size serves the rest of the
        epoch after the saved global position (``start_sample + next_batch * world_size *
        batch_size``) as a pass of its own (`pass_`); a saved position at the epoch's end
        makes the next pass the next epoch."""
        saved_world = _state_int(state, "world_size", 1)
        epoch, nxt = _state_int(state, "epoch", 0), _state_int(state, "next_batch", 0)
        shape = state.get("epoch_shape", state.get("stream"))
        shape = dict(shape) if isinstance(shape, dict) else {}
        if nxt > shape.get("num_batches", nxt):
            raise ValueError(
                f"invalid RemoteLoader state position: next_batch {nxt} is past the end of "
                f"its epoch ({shape['num_batches']} batches)"
            )
        start = _state_int({"start_sample": 0, **state}, "start_sample", 0)
        epoch_world = _state_int({"epoch_world_size": saved_world, **state}, "epoch_world_size", 1)
        self.epoch, self.epoch_passed = epoch, False
        if start == 0 and saved_world == world_size:
            # The epoch's own batches at the same world size: resume at the saved batch.
            self.next_batch, self.positioned, self.pass_ = nxt, True, (0, 0)
            self.resume_shape, self.resume_world = shape, saved_world
            return
        if nxt and "batch_size" not in shape:
            raise ValueError(
                "cannot resume this state at another world size: it does not record the batch "
                "size (saved before the loader first connected)"
            )
        if nxt >= shape.get("num_batches", nxt + 1):  # the pass was over: the epoch is done
            self.next_batch, self.positioned, self.pass_ = nxt, False, (0, 0)
            self.epoch_passed = True  # the next pass is the next epoch (or set_epoch's)
            self.resume_shape = self.resume_world = None
            return
        position = start + nxt * saved_world * int(shape.get("batch_size", 0))
        self.next_batch, self.positioned = 0, True
        self.pass_ = (position, epoch_world) if position else (0, 0)
        # Another pass: its length differs; batch size and samples must still match.
        self.resume_shape = {k: v for k, v in shape.items() if k != "num_batches"}
        self.resume_world = None

    def check_resumed(self, shape: Mapping[str, int] | None, world_size: int | None) -> None:
        """The first welcome after a restore: ``shape`` (`epoch_shape`) of the epochs served
        now, ``world_size`` this loader's if known. A mismatch is a ValueError, and the
        restored position stays (asked again, the loader says the same)."""
        expected = self.resume_shape
        if expected is None or shape is None or (self.next_batch == 0 and self.pass_ == (0, 0)):
            self.resume_shape = self.resume_world = None
            return
        try:
            saved = self.resume_world
            if saved is not None and world_size is not None and saved != world_size:
                raise ValueError(
                    f"state is for world_size {saved}, this loader runs with world_size "
                    f"{world_size}: each rank's shard depends on it (resume from an epoch "
                    "boundary instead)"
                )
            if any(key in expected and expected[key] != value for key, value in shape.items()):
                raise ValueError(
                    f"cannot resume epoch {self.epoch} at batch {self.next_batch}: the state "
                    f"was saved against epochs of {expected}, the server now serves "
                    f"{dict(shape)}; a mid-epoch position only holds for the same data, batch "
                    "size and world size (restart the server with the old settings, or resume "
                    "from an epoch boundary)"
                )
        except ValueError:
            self.positioned = True  # nothing was served: the next pass meets the same check
            raise
        self.resume_shape = self.resume_world = None

    # ------------------------------------------------------------------ queries

    def start_batch(self) -> int:
        """Where the next pass starts: the restored position, else the epoch's first batch."""
        return self.next_batch if self.positioned else 0

    def position(self, world_size: int) -> dict[str, Any]:
        """The position part of ``state_dict`` for a loader of ``world_size`` ranks."""
        return {
            "epoch": self.epoch,
            "next_batch": self.next_batch,
            "start_sample": self.pass_[0],
            "epoch_world_size": self.pass_[1] or world_size,
        }


def _state_int(state: Mapping[str, Any], key: str, lowest: int) -> int:
    """``state[key]``, an integer >= ``lowest`` (what `state_dict` saves; a bool, a float or a
    numeric string is a damaged or hand-made state, not a position to round)."""
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ValueError(
            f"invalid RemoteLoader state position: {key} must be an integer >= {lowest}, "
            f"got {value!r}"
        )
    return int(value)
