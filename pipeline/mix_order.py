"""The order of a mixture's epoch: which part and which of its samples fill each position.

A mix (`pipeline.sources.mix`) is one `ImageDataset` whose indices are its parts' samples
back to back (`MixPlan.blocks`), a part drawn more than its size in a mix epoch in several
copies (each part-epoch of that mix epoch under other indices, so its augmentation draws,
keyed on (seed, epoch, index), differ).
`MixPlan.epoch_order(seed, epoch)` is the epoch's order over those indices, a pure function of
(seed, epoch) and the plan, so the sampler cuts it into per-rank batches exactly as it cuts a
permutation (`pipeline.sampler.MixSampler`), and resuming stays (epoch, position).

Three steps, each pure:
1. How many draws each part gets in epoch e (`counts`): weights apportioned over the epoch by
   largest remainder; or ``repeat`` x its size; or its ``choose`` count. A schedule changes
   the weights from a given epoch on (at an epoch boundary, never inside one).
2. Where part p's draws sit (`_interleave`): draw j of part p at time (j + u_p) / n_p, u_p a
   phase drawn from (seed, epoch, p), all draws sorted by time (stride scheduling). Any window
   of W positions then holds W n_p / L of part p give or take one or two, far tighter than
   random draws (whose spread is sqrt(W w)), so the weights hold in every batch.
3. Which sample draw j of part p is: its global draw number D = (draws of p in the epochs
   before e) + j, part-epoch q = D // size_p, the (D % size_p)-th entry of a permutation seeded
   by (seed, p, q): each part is drawn without replacement through its own epochs, reshuffled
   when exhausted, across mix epochs.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: How a part's share of a mix epoch is given.
MODES = ("weight", "repeat", "choose")
# Separate the mix's random draws from the sampler's and the augmentation's.
_PHASE_SALT = 0x4D495850  # "MIXP"
_PART_SALT = 0x4D495844  # "MIXD"
#: The most samples a mix epoch may draw: its order is materialised (about 24 bytes a position
#: while it is made), so a typo such as ``repeat:1e9`` must stop the start, not fill memory.
MAX_EPOCH_LENGTH = 1 << 31
#: The most index blocks (`MixPlan.blocks`, one per part-epoch a mix epoch may show): laid out
#: one by one at start, about a second per million.
MAX_BLOCKS = 1 << 20


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the first part):
    int64 counts summing to ``total``."""
    w = _summable(weights)
    quotas = w / w.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    short = int(total - counts.sum())
    if short:
        # Largest remainders first; a stable sort keeps ties in part order.
        counts[np.argsort(-(quotas - counts), kind="stable")[:short]] += 1
    return counts


@dataclass(frozen=True)
class MixPlan:
    """A mix's parts (their sizes), how each is drawn, and the weight schedule.

    ``values``: one per part, in the ``mode``'s unit (a weight, epochs of the part per mix
    epoch, or samples per mix epoch). ``schedule``: (first epoch, weights) pairs, increasing,
    weight mixes only; epochs before the first entry use ``values``.
    """

    sizes: tuple[int, ...]
    mode: str = "weight"
    values: tuple[float, ...] = ()
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mix mode must be one of {list(MODES)}, got {self.mode!r}")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("every part of a mix needs at least one sample")
        values = self.values or (1.0,) * len(self.sizes)
        object.__setattr__(self, "values", tuple(float(v) for v in values))
        if len(self.values) != len(self.sizes):
            raise ValueError(f"{len(self.sizes)} parts but {len(self.values)} values")
        if self.schedule and self.mode != "weight":
            raise ValueError("a mix schedule changes weights: give every part a weight")
        for _, weights in ((0, self.values), *self.schedule):
            _check_values(self.mode, weights, len(self.sizes))
        starts = [e for e, _ in self.schedule]
        if starts != sorted(set(starts)) or (starts and starts[0] < 0):
            raise ValueError(f"mix schedule epochs must increase from 0, got {starts}")
        if self.epoch_length < 1:
            raise ValueError("this mix draws no sample in an epoch")
        if self.epoch_length > MAX_EPOCH_LENGTH:
            raise ValueError(
                f"a mix epoch of {self.epoch_length} samples is over {MAX_EPOCH_LENGTH}: the "
                "parts together, or a repeat or choose value, are too large"
            )
        if sum(self.copies) > MAX_BLOCKS:
            raise ValueError(
                f"a mix epoch would show its parts in {sum(self.copies)} copies (one per "
                f"pass over a part), over {MAX_BLOCKS}: a small part drawn far more times "
                "than its size (a repeat, choose or weight value too large)"
            )

    @property
    def epoch_length(self) -> int:
        """Samples in a mix epoch (the same every epoch: a schedule moves weights only)."""
        return int(self._counts(self.values).sum())

    def weights_at(self, epoch: int) -> tuple[float, ...]:
        """The values in force in ``epoch``: the last schedule entry starting at or before it."""
        current = self.values
        for start, weights in self.schedule:
            if start > epoch:
                break
            current = weights
        return current

    def _counts(self, values: Sequence[float]) -> np.ndarray:
        sizes = np.asarray(self.sizes, dtype=np.int64)
        if self.mode == "choose":
            return np.asarray([int(v) for v in values], dtype=np.int64)
        if self.mode == "repeat":
            return np.asarray(
                [round(v * s) for v, s in zip(values, self.sizes, strict=True)], dtype=np.int64
            )
        return apportion(values, int(sizes.sum()))

    def counts(self, epoch: int) -> np.ndarray:
        """Draws of each part in ``epoch`` (int64 [parts], summing to `epoch_length`)."""
        return self._counts(self.weights_at(epoch))

    def drawn_before(self, epoch: int) -> np.ndarray:
        """Draws of each part in all epochs before ``epoch`` (closed form per schedule span)."""
        total = np.zeros(len(self.sizes), dtype=np.int64)
        bounds = [0, *(e for e, _ in self.schedule if e > 0), None]
        for lo, hi in itertools.pairwise(bounds):
            if lo >= epoch:
                break
            span = (epoch if hi is None else min(hi, epoch)) - lo
            total += span * self.counts(lo)
        return total

    @functools.cached_property
    def copies(self) -> tuple[int, ...]:
        """Index blocks per part. A part drawn more than its size in an epoch spans up to
        ceil((n - 1) / size) + 1 of its own epochs there, each shown under its own block, so
        every draw of the mix epoch has its own index (and augmentation). A part drawn at most
        its size has one block: a second would double a large part's index space for the rare
        sample drawn at both ends of the seam between two of its epochs (the same index, so
        the same pixels, twice in that mix epoch)."""
        most = np.zeros(len(self.sizes), dtype=np.int64)
        for _, values in ((0, self.values), *self.schedule):
            most = np.maximum(most, self._counts(values))
        return tuple(
            1 if n <= s else math.ceil((int(n) - 1) / s) + 1
            for n, s in zip(most, self.sizes, strict=True)
        )

    @functools.cached_property
    def blocks(self) -> tuple[tuple[int, int, int], ...]:
        """The index layout: (first index, part, copy) per block of ``size_part`` indices.
        Copy 0 of every part first, back to back (a mix without repeats is just its parts
        concatenated), then each part's further copies in part order: copies added by a later
        schedule entry go after those of the parts before it, so indices already in use keep
        their meaning."""
        out, at = [], 0
        for p, size in enumerate(self.sizes):
            out.append((at, p, 0))
            at += size
        for p, (size, copies) in enumerate(zip(self.sizes, self.copies, strict=True)):
            for c in range(1, copies):
                out.append((at, p, c))
                at += size
        return tuple(out)

    @property
    def num_indices(self) -> int:
        """The mix dataset's length: every part's blocks."""
        return sum(c * s for c, s in zip(self.copies, self.sizes, strict=True))

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's mix indices, position by position (int64 [epoch_length])."""
        counts = self.counts(epoch)
        before = self.drawn_before(epoch)
        drawn = [self._part_draws(seed, p, int(before[p]), int(n)) for p, n in enumerate(counts)]
        return np.concatenate(drawn)[_interleave(seed, epoch, counts)]

    def parts_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The part of each mix index (int64, same shape): the server counts each part's
        samples sent with it, per batch."""
        starts, owners = self._block_index
        return owners[np.searchsorted(starts, np.asarray(indices, dtype=np.int64), "right") - 1]

    @functools.cached_property
    def _block_index(self) -> tuple[np.ndarray, np.ndarray]:
        """`blocks`' first indices and parts as arrays, for `parts_of`."""
        starts = np.asarray([b[0] for b in self.blocks], dtype=np.int64)
        return starts, np.asarray([b[1] for b in self.blocks], dtype=np.int64)

    def shares(self, epoch: int) -> tuple[float, ...]:
        """Each part's planned share of ``epoch``, summing to 1: its weight normalised (the
        weight in force then), or, for repeat and choose, its draws over the epoch's."""
        values = _summable(self.weights_at(epoch) if self.mode == "weight" else self.counts(epoch))
        total = float(values.sum())
        return tuple(float(v) / total for v in values)

    def _part_draws(self, seed: int, part: int, first: int, n: int) -> np.ndarray:
        """Mix indices of part ``part``'s global draws [first, first + n). A part drawn more
        than its size this epoch shows its c-th part-epoch of the epoch in copy c; one drawn at
        most its size always in copy 0 (so an epoch's indices depend on its own counts only)."""
        size = self.sizes[part]
        starts = {(p, c): at for at, p, c in self.blocks}
        q0 = first // size
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            q, r = divmod(first + done, size)
            take = min(size - r, n - done)
            seq = np.random.SeedSequence([seed, q, _PART_SALT, part])
            perm = np.random.Generator(np.random.PCG64(seq)).permutation(size)
            copy = q - q0 if n > size else 0
            out[done : done + take] = starts[(part, copy)] + perm[r : r + take]
            done += take
        return out


def _summable(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """``values`` as float64, scaled down by their largest only where their sum would overflow
    (weights are relative: 1e308 twice is 1 twice); otherwise unchanged, so every existing mix
    keeps its counts to the last bit."""
    w = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(w.sum()))
    return w if finite else w / w.max()


def _interleave(seed: int, epoch: int, counts: np.ndarray) -> np.ndarray:
    """For each position of the epoch, which entry of the parts' draws (concatenated in part
    order) fills it: draw j of part p sits at time (j + u_p) / n_p (module doc, step 2)."""
    seq = np.random.SeedSequence([seed, epoch, _PHASE_SALT])
    phases = np.random.Generator(np.random.PCG64(seq)).random(len(counts))
    times = np.concatenate(
        [
            (np.arange(n, dtype=np.float64) + u) / n
            for n, u in zip(counts, phases, strict=True)
            if n > 0
        ]
    )
    return np.argsort(times, kind="stable")


def _check_values(mode: str, values: Sequence[float], parts: int) -> None:
    if len(values) != parts:
        raise ValueError(f"{parts} parts but {len(values)} values")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"mix {mode}s must be finite and >= 0, got {list(values)}")
    if mode != "weight" and max(values) > MAX_EPOCH_LENGTH:
        # Checked before any count is made: int(1e19) overflows numpy's int64.
        raise ValueError(
            f"mix {mode} values over {MAX_EPOCH_LENGTH} would make a mix epoch over "
            f"{MAX_EPOCH_LENGTH} samples, got {list(values)}"
        )
    if mode == "weight" and not sum(values) > 0:
        raise ValueError("mix weights must not all be 0")
    if mode == "choose" and any(v != int(v) for v in values):
        raise ValueError(f"choose counts must be whole numbers, got {list(values)}")
