"""Deterministic, directly addressable sharding of an epoch into per-rank batches.

Every batch is a pure function of (seed, epoch, rank, world_size, batch index). Nothing is
iterated to reach batch k, so a resumed run, a restarted server or a second server sharing a
rank's batches all compute exactly the same samples without coordinating.

Layout: the epoch order is a permutation of the dataset (identity when not shuffling). It is
cut into global batches of `batch_size` slots; global batch g = k * world_size + rank is batch
k of `rank`. Interleaving ranks this way keeps every rank's k-th batch drawn from the same
region of the epoch, so a validation epoch's padding lands only in the last round.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from batchwire.pipeline.mix_order import MixPlan

# A padded slot's index and label: defined in wire/batch_spec.py, re-exported here.
from batchwire.wire import PADDING_INDEX, PADDING_LABEL  # noqa: F401

# Separates the sampler's random draws from any other consumer of the same user seed.
_ORDER_SALT = 0x5A4D504C  # "ZMPL"
_CACHED_EPOCHS = 2


@dataclass(frozen=True)
class BatchPlan:
    """Which dataset samples make up one batch of one rank.

    `indices` always holds valid dataset indices (padding slots repeat a real sample so a
    producer can treat every slot alike); `valid` is False for padding, which metrics must
    exclude and which user-facing code reports as index `PADDING_INDEX` (-1).
    """

    epoch: int
    batch_index: int
    indices: np.ndarray  # int64 [batch_size]
    valid: np.ndarray  # bool [batch_size]

    def public_indices(self) -> np.ndarray:
        """Indices with padding shown as `PADDING_INDEX` (the user-facing convention)."""
        return np.where(self.valid, self.indices, np.int64(PADDING_INDEX))


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int (numpy's too, never a bool): TypeError for another type, ValueError
    below ``minimum``; the check of every integer argument a user passes here and LocalLoader."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class ShardSampler:
    """Per-rank batch plans for one split (train: shuffle + drop_last; val: in order, padded).

    All ranks get the same `num_batches`. With `drop_last` the tail of the epoch that does not
    fill a whole round of `batch_size * world_size` is skipped (a different tail each epoch when
    shuffling). Without it the last round is padded, and every sample appears exactly once among
    the valid slots of all ranks together.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool,
        drop_last: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, 1)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {rank}")
        self.seed = check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)

        per_round = self.batch_size * self.world_size
        if self.drop_last:
            if self.num_samples < per_round:
                raise ValueError(
                    f"drop_last with {self.num_samples} samples leaves no batch: one round needs "
                    f"batch_size * world_size = {self.batch_size} * {self.world_size} = "
                    f"{per_round} samples; use a smaller batch size or fewer ranks"
                )
            self.num_batches = self.num_samples // per_round
        else:
            self.num_batches = -(-self.num_samples // per_round)

        #: A resumed pass (`resumed`): slots [start, stop) of the epoch order, padded.
        self.start, self.stop = 0, None
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def epoch_stop(self, epoch_world_size: int) -> int:
        """Where the epoch's samples end in its order when it was started at
        ``epoch_world_size`` ranks (train drops the last incomplete round, val keeps all)."""
        per_round = self.batch_size * check_int("epoch_world_size", epoch_world_size, 1)
        return (self.num_samples // per_round) * per_round if self.drop_last else self.num_samples

    def resumed(self, start: int, epoch_world_size: int = 0) -> ShardSampler:
        """This rank's sampler for the rest of an epoch resumed at another world size.

        Elastic trainers: the epoch was started at ``epoch_world_size`` ranks (0: this
        sampler's), whose rounds fix its samples: slots ``[0, stop)`` of the epoch order. Its
        first ``start`` slots were consumed; the rest, ``[start, stop)``, is cut into rounds of
        ``batch_size * world_size`` as usual (global batch g = k * world_size + rank) and the
        last round padded (index -1, label -100: `PADDING_INDEX`, `PADDING_LABEL`), so every
        remaining sample is served exactly once and every rank has the same number of batches.
        The order is a pure function of (seed, epoch, epoch_world_size, start, world_size);
        each sample's augmentation depends on (seed, epoch, sample) only.
        """
        stop = self.epoch_stop(epoch_world_size or self.world_size)
        start = check_int("start", start, 0)
        if start >= stop:
            raise ValueError(f"resume at sample {start}: the epoch has {stop} samples")
        out = copy.copy(self)
        out._orders, out._lock = OrderedDict(), threading.Lock()
        out.start, out.stop = start, stop
        out.num_batches = -(-(stop - start) // (self.batch_size * self.world_size))
        return out

    def __len__(self) -> int:
        return self.num_batches

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
            f"rank={self.rank}, world_size={self.world_size}, num_batches={self.num_batches})"
        )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (read-only int64), a function of (seed, epoch) only.

        Cached for the last couple of epochs: a 1.3 M-sample permutation costs tens of ms and
        every batch plan of the epoch needs it.
        """
        epoch = check_int("epoch", epoch, 0)
        with self._lock:
            order = self._orders.get(epoch)
            if order is not None:
                self._orders.move_to_end(epoch)
                return order
        order = self._make_order(epoch)
        order.flags.writeable = False
        with self._lock:
            self._orders[epoch] = order
            self._orders.move_to_end(epoch)
            while len(self._orders) > _CACHED_EPOCHS:
                self._orders.popitem(last=False)
        return order

    def _make_order(self, epoch: int) -> np.ndarray:
        """A permutation of the dataset drawn from (seed, epoch), or its identity."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        seq = np.random.SeedSequence([self.seed, epoch, _ORDER_SALT])
        order = np.random.Generator(np.random.PCG64(seq)).permutation(self.num_samples)
        return order.astype(np.int64, copy=False)

    def plan(self, epoch: int, batch_index: int) -> BatchPlan:
        """Batch `batch_index` of this rank in `epoch`, computed directly."""
        batch_index = check_int("batch_index", batch_index, 0)
        if batch_index >= self.num_batches:
            raise IndexError(
                f"batch_index {batch_index} out of range: this rank has {self.num_batches} "
                "batches per epoch"
            )
        order = self.epoch_order(epoch)
        g = batch_index * self.world_size + self.rank
        first = self.start + g * self.batch_size
        slots = np.arange(first, first + self.batch_size, dtype=np.int64)
        valid = slots < (self.num_samples if self.stop is None else self.stop)
        # Padding repeats real samples so every slot can be produced the same way.
        indices = order[slots % self.num_samples]
        return BatchPlan(epoch=int(epoch), batch_index=batch_index, indices=indices, valid=valid)

    def plans(self, epoch: int, start: int = 0) -> Iterator[BatchPlan]:
        """This rank's batches of `epoch` from `start` on (resume point) to the end."""
        start = check_int("start", start, 0)
        for k in range(start, self.num_batches):
            yield self.plan(epoch, k)


class MixSampler(ShardSampler):
    """A train split of a mixture (`pipeline.sources.mix`): the epoch order is the mix's
    (`MixPlan.epoch_order`: which part and which of its samples at each position, a pure
    function of (seed, epoch)) instead of a permutation; ranks, batches, `drop_last` and
    resuming at another world size are `ShardSampler`'s, over that order."""

    def __init__(
        self, plan: MixPlan, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.mix = plan
        super().__init__(
            plan.epoch_length,
            batch_size,
            seed=seed,
            shuffle=True,
            drop_last=True,
            rank=rank,
            world_size=world_size,
        )

    def _make_order(self, epoch: int) -> np.ndarray:
        return self.mix.epoch_order(self.seed, epoch)
