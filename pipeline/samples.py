"""From dataset indices to decoded, planned samples, with bad input replaced deterministically.

Real datasets contain broken files (truncated downloads, HTML saved as .jpg, CMYK oddities,
decompression bombs). Failing the batch would stall every rank of a DDP job; dropping the sample
would make ranks' batch sizes differ. So a bad sample is logged once per path and process (a
file that train and val hold, or several loaders of one process meet, is named once), counted, and
replaced by a substitute drawn from a sequence that depends only on (seed, index): every
server, thread count and resume point picks the same substitute, keeping runs reproducible.

Only content is judged: a file is bad when its bytes are (corrupt, truncated, not an image, a
header claiming more pixels than the file holds, not the bytes its dataset's checksum manifest
recorded: `pipeline.checksums`) or when the file itself is (missing, no
permission, a FIFO/device/directory). A *transient* failure (out of descriptors or memory, EIO,
EAGAIN, EINTR; `decode.is_transient`) says nothing about the file: it is retried with backoff
(`DEFAULT_RETRY_DELAYS`, about 1 s in all), and if it persists the batch fails with
`TransientReadError`, the file not remembered as bad, so the next attempt (the client's retry, a
later epoch) reads it again. Remembering it would turn a burst of EMFILE into "most of the
dataset is bad" until a restart.

A read denied (PermissionError: an object store's 401/403, a file without read permission) is
a bad file, unless most reads are: then the credentials expired or were revoked
(`pipeline.access.AccessWatch`, fed with every read's outcome), and the batch fails with
`AccessDeniedError` (transient) instead of being filled with substitutes that are mostly denied
too; the files found denied so far are forgotten as bad, so they are read again once the
credentials are renewed.

`load` (what `BatchProducer.produce` calls for a batch, on a producer thread) runs the
producer's first four stages (pipeline/stages.py) over a `SampleBatch`: read (the bytes),
verify (checksum and header), plan (augmentation draws), decode (pixels of the whole batch in
one `BatchDecoder.decode_batch` call, which lets GPU decoders batch). A file that verify or
decode finds bad sends its sample back to read, for its next substitute. Reads and checks run
on the decoder's threads where it has a pool (`CpuBatchDecoder.pool`; a GPU decoder lends its CPU
fallback's, `GpuDecoderBase.pool`).

Object stores answer a request in 10-50 ms: read one by one on the decoder's few threads, a
batch would wait for its samples in turn. So where the dataset reads many samples at once
(`ImageDataset.read_many`: a bucket keeps up to `--store-concurrency` requests in flight),
the read stage first fetches every sample it is to read in one call, and each sample then
starts from its fetched bytes; a fetched error goes the usual way (a transient one is
retried by reading that sample again, any other makes it bad). With several producers (the
default is three) one batch's fetch is in flight while the others decode, so the reads hide
behind decoding. Local files have no batched read (`read_many` is None): each sample is
read alone, on the decoder's threads where it has a pool.

Multi-view configs (`AugmentConfig.views`): each sample is read and decoded ONCE, and every
view is planned (`PlannedSample.views`, view k on its own draws). The decoder is then asked for
the whole image at full size (as for a user transform), not for the union of the views' crops:
the views of a DINO-style set cover most of the image anyway (a global view alone takes up to
all of it), so a region decode would save little, and DCT scaling could not serve a 224 px view
and a 96 px view of different boxes at once without a per-view scale. The fused op then runs
once per view on the same decoded image (`BatchProducer.produce`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from batchwire.pipeline.access import AccessState, AccessWatch
from batchwire.pipeline.augment_plan import AugmentConfig, SamplePlan, draw_uniforms, plan_samples
from batchwire.pipeline.decode import (
    DEFAULT_MAX_PIXELS,
    BatchDecoder,
    Box,
    DecodeError,
    DecodeRequest,
    ImageHeader,
    decode_full,
    is_transient,
    read_header,
)
from batchwire.pipeline.decode.cpu import chunked
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.sampler import BatchPlan, ShardSampler
from batchwire.pipeline.sources.mix import MixDataset
from batchwire.pipeline.stages import DECODE, PLAN, READ, UNTIMED, VERIFY, StageClock

log = logging.getLogger("batchwire.pipeline")

# Separates the substitute sequence from the augmentation draws of the same (seed, index).
_SUBSTITUTE_SALT = 0x53554253  # "SUBS"
DEFAULT_MAX_ATTEMPTS = 64
# Sleeps between the tries of a transiently failing read (or decode): 5 tries over ~0.94 s.
DEFAULT_RETRY_DELAYS = (0.0625, 0.125, 0.25, 0.5)


# Bad files already named in the log by any SampleLoader of this process: a server's splits
# (train and val may hold the same file) and the loaders of one training process say it once.
_logged_bad: set[str] = set()
_logged_bad_lock = threading.Lock()


def _log_bad_once(path: str, reason: str) -> None:
    """Log that ``path`` is unusable and replaced, unless this process said so already."""
    with _logged_bad_lock:
        if path in _logged_bad:
            return
        _logged_bad.add(path)
    log.warning("unreadable image %s (%s): replacing it with another sample", path, reason)


class UnreadableDatasetError(ValueError):
    """The dataset (or a long run of substitutes) has no readable image: a setup problem."""


class TransientReadError(OSError):
    """A file kept failing for a reason that says nothing about it (EMFILE, ENFILE, EIO,
    EAGAIN, EINTR, ENOMEM) through every retry. The batch fails; the file is not remembered as
    bad, so a later attempt reads it again. `errno` is the last error's."""


class AccessDeniedError(TransientReadError):
    """Most reads are denied (`AccessWatch`): credentials expired or revoked? The batch fails
    as transient; no file is remembered as bad for it."""


def batch_may_pass(exc: BaseException) -> bool:
    """Whether a batch that failed with ``exc`` may succeed if made again: its reads kept
    failing for a reason that says nothing about the files (`TransientReadError`,
    `AccessDeniedError`), or the machine ran out of memory or descriptors elsewhere
    (`decode.files.is_transient`). The server answers such a batch "transient" and its
    client asks again; `LocalLoader` makes it again."""
    return isinstance(exc, TransientReadError) or is_transient(exc)


def _retrying(
    fn: Callable[[], object],
    what: str,
    delays: Sequence[float],
    sleep: Callable[[float], None],
    on_transient: Callable[[], None],
) -> object:
    """`fn()`, retried after each transient error (OSError/MemoryError, `is_transient`) with
    the given sleeps in between; TransientReadError once they are used up. Other errors pass."""
    for attempt in range(len(delays) + 1):
        try:
            return fn()
        except (OSError, MemoryError) as e:
            if isinstance(e, TransientReadError) or not is_transient(e):
                raise
            on_transient()
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            if attempt == len(delays):
                raise TransientReadError(
                    getattr(e, "errno", None),
                    f"{what}: {reason} (transient; {attempt + 1} tries over "
                    f"{sum(delays):.2f} s): the batch fails, the file is not marked bad",
                ) from e
            log.debug("%s: %s (transient), retrying in %.3f s", what, reason, delays[attempt])
            sleep(delays[attempt])
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class PlannedSample:
    """A readable sample's bytes, header and plan, before decoding.

    `requested` is the index the batch asked for; `index` the one actually used (they differ
    when the requested file was bad and `replaced` is True); `attempt` is the position reached
    in the requested index's substitute sequence (0 = the requested file itself). `intact`:
    `data` matched the checksum of a file its manifest recorded as passing the strict full
    decode (`ImageDataset.checksum_verdict`), handed to the decoder as `DecodeRequest.intact`.
    """

    requested: int
    index: int
    data: bytes
    header: ImageHeader
    plan: SamplePlan
    label: int
    replaced: bool
    attempt: int
    intact: bool = False
    views: tuple[SamplePlan, ...] = ()  # multi-view configs: one plan per view


@dataclass(frozen=True)
class LoadedSample:
    """A decoded sample: HWC uint8 image on the decoder's device, its plan (box in full-size
    oriented coords), `box` in the decoded image's coords, label, provenance, and the CPU
    decoder's route (`DecodeResult.route`: "restart" only for intact files)."""

    requested: int
    index: int
    image: torch.Tensor
    plan: SamplePlan
    box: Box
    label: int
    replaced: bool
    route: str = ""
    attempt: int = 0  # `PlannedSample.attempt`: where `requested`'s substitute sequence is
    # Multi-view configs: (plan, box in the decoded image's coords) per view, in order.
    views: tuple[tuple[SamplePlan, Box], ...] = ()


#: A read sample: (slot, requested, index, attempt, bytes).
_Read = tuple[int, int, int, int, bytes]
#: A verified one: (slot, requested, index, attempt, bytes, header, intact).
_Found = tuple[int, int, int, int, bytes, ImageHeader, bool]
#: The samples of the next (at most) k batches of the epoch, batch after batch: `next_batches`.
Upcoming = Callable[[int], Sequence[Sequence[int]]]


def next_batches(sampler: ShardSampler, plan: BatchPlan) -> Upcoming:
    """What `SampleLoader.load` may read along for batch ``plan`` of ``sampler``'s session:
    the samples of its next batches of the same epoch (the sampler is a pure function of its
    seed and position, so they are known now). Cheap until asked: a source that reads nothing
    ahead never calls it."""

    def upcoming(k: int) -> list[np.ndarray]:
        last = min(plan.batch_index + 1 + int(k), sampler.num_batches)
        return [sampler.plan(plan.epoch, b).indices for b in range(plan.batch_index + 1, last)]

    return upcoming


@dataclass
class SampleBatch:
    """One batch's samples on their way through read -> verify -> plan -> decode
    (pipeline/stages.py): each stage takes its own list and fills the next stage's (or sends
    a sample back to read). A slot is a sample's place in the batch."""

    epoch: int
    config: AugmentConfig
    to_read: list[tuple[int, int, int]]  # (slot, requested, attempt): that candidate's bytes
    loaded: list[LoadedSample | None]  # by slot, once decoded
    to_verify: list[_Read] = field(default_factory=list)
    to_plan: list[_Found] = field(default_factory=list)
    to_decode: list[tuple[int, PlannedSample]] = field(default_factory=list)
    tries: int = 0  # transient decode failures retried so far
    # The epoch's next batches' samples, given how many batches: what the first read may read
    # along (`Upcoming`); None once read, and for a substitute's batch.
    upcoming: Upcoming | None = None


def _apply(fn: Callable[[Any], Any], chunk: Sequence) -> list:
    """``fn`` over one chunk of items (a pool thread's share of `SampleLoader._each`)."""
    return [fn(item) for item in chunk]


def substitute_candidates(seed: int, index: int, count: int, num_samples: int) -> np.ndarray:
    """The first `count` substitutes for `index` (int64), a pure function of (seed, index).

    Uniform over the dataset (excluding `index` itself), so a substitute's class is drawn
    like any sample's rather than always the neighbour's class.
    """
    if num_samples < 2:
        return np.zeros(0, dtype=np.int64)
    u = draw_uniforms(seed, 0, [index], count, salt=_SUBSTITUTE_SALT)[0]
    offsets = 1 + np.minimum(np.floor(u * (num_samples - 1)), num_samples - 2).astype(np.int64)
    return (index + offsets) % num_samples


class SampleLoader:
    """bytes -> header -> plan -> decode for lists of dataset indices, bad input replaced.

    Counters (`counts()`): `bad_total` distinct bad files found (by path: a file listed twice
    counts once), `replaced_total` samples replaced in what was loaded (each occurrence, every
    epoch), `transient_total` transient errors met (each failed try, retried or not; never a
    bad file). Known-bad indices are remembered so they are not read again; `bad_files` lists
    the bad paths (`BadFileTally` counts them over several loaders, e.g. a server's splits).
    Thread-safe: several batches may load at once.

    `retry_delays` are the sleeps between tries of a transiently failing read or decode
    (`sleep` does them; tests pass their own).
    """

    def __init__(
        self,
        dataset: ImageDataset,
        config: AugmentConfig,
        seed: int,
        decoder: BatchDecoder,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        check_start: bool = True,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if len(dataset) < 1:
            raise UnreadableDatasetError(f"no images in {dataset.root}")
        self.dataset = dataset
        self.config = config
        self.seed = int(seed)
        self.decoder = decoder
        self.max_pixels = max_pixels
        self.max_attempts = int(max_attempts)
        self.retry_delays = tuple(float(d) for d in retry_delays)
        self._sleep = sleep
        self.replaced_total = 0
        self.transient_total = 0
        self._bad: dict[int, str] = {}
        self._bad_paths: set[str] = set()
        self._bad_order: list[str] = []  # the same paths, in the order found
        self._bad_taken = 0  # of them, handed out by `take_bad_files`
        # Every read's outcome, denied or not: most denied means credentials, not files.
        self.access = AccessWatch()
        self._denied: set[int] = set()  # indices in `_bad` because their read was denied
        self._lock = threading.Lock()
        if check_start:
            self._probe(dataset, max_pixels, sleep)

    def _probe(
        self, dataset: ImageDataset, max_pixels: int | None, sleep: Callable[[float], None]
    ) -> None:
        """`probe` the dataset, a mix part by part: a part with no readable image would pass a
        probe of the whole mix (its other parts decode) and fail every batch drawing from it."""
        named: Iterable[tuple[str, ImageDataset]] = [("", dataset)]
        if isinstance(dataset, MixDataset):
            named = zip(dataset.names, dataset.parts, strict=True)
        for name, part in named:
            try:
                probe(
                    part,
                    max_pixels=max_pixels,
                    retry_delays=self.retry_delays,
                    sleep=sleep,
                    on_transient=self._count_transient,
                )
            except UnreadableDatasetError as exc:
                if not name:
                    raise
                raise UnreadableDatasetError(f"mix part {name!r}: {exc}") from None

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def bad_total(self) -> int:
        with self._lock:
            return len(self._bad_paths)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "bad_total": len(self._bad_paths),
                "replaced_total": self.replaced_total,
                "transient_total": self.transient_total,
            }

    def bad_files(self, start: int = 0) -> list[str]:
        """The distinct bad files' paths in the order found, from the `start`-th on."""
        with self._lock:
            return self._bad_order[start:]

    def take_bad_files(self) -> tuple[str, ...]:
        """The bad files' paths found since the last call (each path handed out once: a
        producer thread reports them with its batch, `BatchStats.bad_files`)."""
        with self._lock:
            taken = self._bad_order[self._bad_taken :]
            self._bad_taken = len(self._bad_order)
        return tuple(taken)

    @property
    def known_bad(self) -> dict[int, str]:
        """Index -> reason for every bad file found so far (a copy)."""
        with self._lock:
            return dict(self._bad)

    def _count_transient(self) -> None:
        with self._lock:
            self.transient_total += 1

    def _mark_bad(self, index: int, reason: str) -> None:
        path = self.dataset.paths[index]
        with self._lock:
            if index in self._bad:
                return
            self._bad[index] = reason
            if path in self._bad_paths:  # listed under another index too: counted, logged
                return
            self._bad_paths.add(path)
            self._bad_order.append(path)
        _log_bad_once(path, reason)

    def _is_bad(self, index: int) -> bool:
        with self._lock:
            return index in self._bad

    # -- the stages (pipeline/stages.py) ------------------------------------------------------

    def load(
        self,
        epoch: int,
        indices: Sequence[int],
        *,
        config: AugmentConfig | None = None,
        clock: StageClock = UNTIMED,
        upcoming: Upcoming | None = None,
    ) -> list[LoadedSample]:
        """read -> verify -> plan -> decode: one LoadedSample per index, in order (``config``:
        another output size's, `BatchProducer.config_at`; ``clock``: the batch's, told each
        stage it enters; ``upcoming``: the epoch's next batches (`next_batches`), whose
        samples a source that reads ahead reads along with these: never what is loaded)."""
        batch = self._batch(epoch, indices, None, config)
        batch.upcoming = upcoming
        self._run(batch, READ, clock)
        return batch.loaded  # type: ignore[return-value]  # every slot filled, or raised

    def substitute(self, epoch: int, sample: LoadedSample) -> LoadedSample:
        """The next substitute of ``sample.requested`` after ``sample``, decoded: for a sample
        that decoded but could not be used (a user transform failed on it). The sample is not
        marked bad (the failure may be this epoch's draws, not the file)."""
        batch = self._batch(epoch, [sample.requested], [sample.attempt + 1], None)
        self._run(batch, READ, UNTIMED)
        return batch.loaded[0]  # type: ignore[return-value]

    def _batch(
        self,
        epoch: int,
        indices: Sequence[int],
        start_attempts: Sequence[int] | None,
        config: AugmentConfig | None,
    ) -> SampleBatch:
        n = len(indices)
        attempts = [0] * n if start_attempts is None else [int(a) for a in start_attempts]
        return SampleBatch(
            epoch=int(epoch),
            config=config or self.config,
            to_read=[(k, int(r), attempts[k]) for k, r in enumerate(indices)],
            loaded=[None] * n,
        )

    def _run(self, batch: SampleBatch, stage: str | None, clock: StageClock) -> None:
        """Run the stages from ``stage`` on (each names the next, None once the batch is
        done)."""
        steps = {READ: self.read, VERIFY: self.verify, PLAN: self.plan, DECODE: self.decode}
        while stage is not None:
            clock.enter(stage)
            stage = steps[stage](batch)

    def read(self, batch: SampleBatch) -> str:
        """Stage read: the bytes of each sample in ``to_read``, into ``to_verify``.

        A file that cannot be read (missing, denied, not a regular file) is bad: the next
        substitute is read instead. Reads run on the decoder's threads where it has a pool
        (reading releases the GIL); where the dataset reads many samples at once (an object
        store), the first candidates are fetched together first (module doc)."""
        jobs, batch.to_read = batch.to_read, []
        upcoming, batch.upcoming = batch.upcoming, None
        fetched = self._fetch(
            [(requested, attempt) for _, requested, attempt in jobs], batch.epoch, upcoming
        )

        def read_one(job: tuple[int, int, int]) -> _Read:
            slot, requested, attempt = job
            got = self._read_candidate(requested, attempt, fetched.get((requested, attempt)))
            return (slot, requested, *got)

        batch.to_verify += self._each(read_one, jobs)
        return VERIFY

    def verify(self, batch: SampleBatch) -> str:
        """Stage verify: each read file's bytes against its checksum, and its header (size,
        orientation, route; too large or implausible is a `DecodeError`). A bad file goes
        back to read (its next substitute); the rest wait in ``to_plan``."""
        read, batch.to_verify = batch.to_verify, []
        checked = self._each(lambda r: self._check(r[2], r[4]), read)
        for (slot, requested, index, attempt, data), got in zip(read, checked, strict=True):
            if isinstance(got, str):
                self._mark_bad(index, got)
                batch.to_read.append((slot, requested, attempt + 1))
            else:
                batch.to_plan.append((slot, requested, index, attempt, data, *got))
        return READ if batch.to_read else PLAN

    def plan(self, batch: SampleBatch) -> str:
        """Stage plan: the augmentation draws of every verified sample (one plan per view of
        a multi-view config), into ``to_decode``."""
        found, batch.to_plan = batch.to_plan, []
        config = batch.config
        sources = [f[2] for f in found]
        heights = [f[5].height for f in found]
        widths = [f[5].width for f in found]
        plans = plan_samples(config, self.seed, batch.epoch, sources, heights, widths)
        view_plans: list[tuple[SamplePlan, ...]] = [()] * len(found)
        if config.views:
            per_view = [
                plan_samples(config, self.seed, batch.epoch, sources, heights, widths, view=k)
                for k in range(len(config.views))
            ]
            view_plans = list(zip(*per_view, strict=True))
        labels = self.dataset.labels
        for (slot, requested, index, attempt, data, header, intact), plan, views in zip(
            found, plans, view_plans, strict=True
        ):
            sample = PlannedSample(
                requested=requested,
                index=index,
                data=data,
                header=header,
                plan=plan,
                label=int(labels[index]),
                replaced=attempt > 0,
                attempt=attempt,
                intact=intact,
                views=views,
            )
            batch.to_decode.append((slot, sample))
        return DECODE

    def decode(self, batch: SampleBatch) -> str | None:
        """Stage decode: the pixels of every planned sample in one `decode_batch` call (GPU
        decoders batch), into ``loaded``.

        A file that fails to decode is bad: back to read for its next substitute. A transient
        failure (`DecodeResult.transient`, out of memory) is decoded again after
        `retry_delays`; TransientReadError when it persists (the file is not marked bad)."""
        todo, batch.to_decode = batch.to_decode, []
        out_hw = batch.config.image_size
        # A user transform decides the crop itself: it gets the whole image at full size; so
        # do the views of a multi-view config (module doc).
        whole = batch.config.transform is not None or bool(batch.config.views)
        requests = [
            DecodeRequest(p.index, p.data, p.header, p.plan.box, out_hw, p.intact)
            if not whole
            else DecodeRequest(
                p.index,
                p.data,
                p.header,
                (0.0, 0.0, float(p.header.height), float(p.header.width)),
                (p.header.height, p.header.width),
                p.intact,
            )
            for _, p in todo
        ]
        results = self.decoder.decode_batch(requests)
        transient_error = ""
        for (slot, p), r in zip(todo, results, strict=True):
            if r.image is None and r.transient:
                self._count_transient()
                batch.to_decode.append((slot, p))
                transient_error = f"decoding {self.dataset.paths[p.index]}: {r.error}"
            elif r.image is None:
                self._mark_bad(p.index, r.error or "decode failed")
                batch.to_read.append((slot, p.requested, p.attempt + 1))
            else:
                batch.loaded[slot] = LoadedSample(
                    requested=p.requested,
                    index=p.index,
                    image=r.image,
                    plan=p.plan,
                    box=tuple(float(v) for v in r.box),
                    label=p.label,
                    replaced=p.replaced,
                    route=r.route,
                    attempt=p.attempt,
                    views=_view_boxes(p, r.box),
                )
        if batch.to_decode:
            if batch.tries == len(self.retry_delays):
                raise TransientReadError(
                    None,
                    f"{transient_error} (transient; {batch.tries + 1} tries): the batch fails, "
                    "the file is not marked bad",
                )
            self._sleep(self.retry_delays[batch.tries])
            batch.tries += 1
        if batch.to_read:
            return READ
        if batch.to_decode:
            return DECODE
        replaced = sum(s.replaced for s in batch.loaded if s is not None)
        if replaced:
            with self._lock:
                self.replaced_total += replaced
        return None

    # -- the stages' parts ---------------------------------------------------------------------

    def _each(self, fn: Callable[[Any], Any], items: Sequence) -> list:
        """``fn`` over ``items``, results in order: on the decoder's threads where it has a
        pool (`CpuBatchDecoder.pool`, in its chunks), else here."""
        pool = getattr(self.decoder, "pool", None)
        if pool is None or len(items) <= 1:
            return [fn(item) for item in items]
        parts = chunked(items, getattr(self.decoder, "threads", 1))
        return [r for part in pool.map(_apply, itertools.repeat(fn), parts) for r in part]

    def _read_candidate(
        self, requested: int, attempt: int, fetched: bytes | OSError | None = None
    ) -> tuple[int, int, bytes]:
        """(index, attempt, bytes) of the first readable file at or after ``attempt`` in
        ``requested``'s substitute sequence (known-bad files are not read again); raises
        UnreadableDatasetError after `max_attempts` unusable candidates in a row.
        ``fetched``: what a batched read got for the candidate at ``attempt``."""
        # Substitutes are drawn only once the requested file turned out bad: drawing them
        # costs ~0.1 ms, as much as a quarter of the pipeline's per-image overhead.
        candidates: np.ndarray | None = None
        lo, hi = self.dataset.substitute_range(requested)
        limit = self.max_attempts if hi - lo >= 2 else 0  # one file: nothing to swap in
        while attempt <= limit:
            if attempt == 0:
                index = requested
            else:
                if candidates is None:
                    candidates = self._substitutes(requested)
                index = int(candidates[attempt - 1])
            if not self._is_bad(index):
                got = self._read_bytes(index, fetched)
                if not isinstance(got, str):
                    return index, attempt, got
                self._mark_bad(index, got)
            fetched = None
            attempt += 1
        with self._lock:
            bad = len(self._bad)
        raise UnreadableDatasetError(
            f"sample {requested} ({self.dataset.paths[requested]}) and {self.max_attempts} "
            f"substitutes for it are all unreadable ({bad} of {len(self.dataset)} files in "
            f"{self.dataset.root} found bad so far): the dataset looks broken"
        )

    def _read_bytes(self, index: int, fetched: bytes | OSError | None = None) -> bytes | str:
        """One file's bytes, or the reason it is unusable; TransientReadError when reading
        kept failing transiently. ``fetched``: its bytes (or the error) from a batched read,
        used as the first try."""
        first: list[bytes | OSError | None] = [fetched]

        def read() -> bytes:
            got, first[0] = first[0], None
            if got is None:
                return self.dataset.read_bytes(index)
            if isinstance(got, OSError):
                raise got  # transient: counted and read again after a pause; else the file's
            return got

        try:
            data = _retrying(
                read,
                f"reading {self.dataset.paths[index]}",
                self.retry_delays,
                self._sleep,
                self._count_transient,
            )
        except TransientReadError:
            raise
        except PermissionError as e:
            self._denied_read(index)
            return f"cannot read: {e.strerror or e}"
        except OSError as e:
            self._note_access(denied=False)
            return f"cannot read: {e.strerror or e}"
        assert isinstance(data, bytes)
        self._note_access(denied=False)
        return data

    def _check(self, index: int, data: bytes) -> tuple[ImageHeader, bool] | str:
        """Header and intact verdict (`PlannedSample.intact`) of file ``index``'s bytes, or
        the reason they are unusable (not the bytes its checksum manifest recorded, a header
        no decoder should be given)."""
        try:
            verdict = self.dataset.checksum_verdict(index, data)
            if verdict.problem is not None:  # bytes that may still decode, to wrong pixels
                return verdict.problem
            return read_header(data, max_pixels=self.max_pixels), verdict.intact
        except DecodeError as e:
            return str(e)
        except OSError as e:
            return f"cannot read: {e.strerror or e}"

    def _note_access(self, denied: bool) -> AccessState:
        """Record a read's outcome (`access`); log when most reads become or stop being
        denied."""
        state, changed = self.access.record(denied, time.monotonic())
        if changed and state.most_denied:
            log.warning("%s: %s", self.dataset.root, state.message())
        elif changed:
            log.info("%s: reads succeed again", self.dataset.root)
        return state

    def _denied_read(self, index: int) -> None:
        """A read of file `index` was denied: a bad file (the caller marks it), unless most
        reads are denied: then AccessDeniedError, and the files found denied so far are no
        longer taken as bad (module doc)."""
        state = self._note_access(denied=True)
        if not state.most_denied:
            with self._lock:
                self._denied.add(index)
            return
        with self._lock:
            for i in self._denied:
                self._bad.pop(i, None)
            self._denied.clear()
        raise AccessDeniedError(
            errno.EACCES, f"reading {self.dataset.paths[index]}: {state.message()}"
        )

    def _substitutes(self, requested: int) -> np.ndarray:
        """`substitute_candidates` of ``requested`` within its dataset's substitute range (a
        mix's part: a bad web image is replaced by a web image, as the part alone would)."""
        lo, hi = self.dataset.substitute_range(requested)
        subs = substitute_candidates(self.seed, requested - lo, self.max_attempts, hi - lo)
        return lo + subs

    def _fetch(
        self, jobs: Sequence[tuple[int, int]], epoch: int = 0, upcoming: Upcoming | None = None
    ) -> dict[tuple[int, int], bytes | OSError]:
        """The first candidates of `jobs` ((requested, attempt) pairs) read in one batched
        call where the dataset has one (`ImageDataset.read_many`); {} where it has not (local
        files) or for candidates already known bad. ``upcoming``: the next batches, whose
        samples (not known bad) the call reads along where the dataset reads ahead."""
        read_many = getattr(self.dataset, "read_many", None)
        if read_many is None or not jobs:
            return {}
        wanted: dict[tuple[int, int], int] = {}
        for requested, attempt in jobs:
            if attempt == 0:
                index = requested
            elif attempt <= self.max_attempts and _span(self.dataset, requested) >= 2:
                index = int(self._substitutes(requested)[attempt - 1])
            else:
                continue
            if not self._is_bad(index):
                wanted[(requested, attempt)] = index
        if not wanted:
            return {}
        unique = sorted(set(wanted.values()))
        ahead = self.dataset.read_ahead_batches if upcoming is not None else 0
        if ahead and upcoming is not None:
            got = read_many(unique, epoch, self._readable(upcoming(ahead)))
        else:
            got = read_many(unique)
        if got is None:  # the source reads one sample at a time
            return {}
        by_index = dict(zip(unique, got, strict=True))
        return {job: by_index[index] for job, index in wanted.items()}

    def _readable(self, batches: Sequence[Sequence[int]]) -> list[list[int]]:
        """``batches`` less their samples known bad (their substitutes are read when their
        batch comes)."""
        with self._lock:
            return [[int(i) for i in b if int(i) not in self._bad] for b in batches]


def _span(dataset: ImageDataset, index: int) -> int:
    lo, hi = dataset.substitute_range(index)
    return hi - lo


def _view_boxes(p: PlannedSample, decoded: Box) -> tuple[tuple[SamplePlan, Box], ...]:
    """Each view's plan with its box mapped from full-size coords into the decoded image's
    (``decoded``: where the whole image lies in it; the identity when decoded at full size)."""
    if not p.views:
        return ()
    h, w = p.header.height, p.header.width
    y0, x0, y1, x1 = (float(v) for v in decoded)
    sy, sx = (y1 - y0) / h, (x1 - x0) / w
    if (y0, x0, sy, sx) == (0.0, 0.0, 1.0, 1.0):
        return tuple((v, tuple(float(c) for c in v.box)) for v in p.views)
    return tuple(
        (v, (y0 + v.box[0] * sy, x0 + v.box[1] * sx, y0 + v.box[2] * sy, x0 + v.box[3] * sx))
        for v in p.views
    )


def probe(
    dataset: ImageDataset,
    n: int = 8,
    limit: int = 256,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    *,
    retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
    sleep: Callable[[float], None] = time.sleep,
    on_transient: Callable[[], None] = lambda: None,
) -> int:
    """Index of a readable image, checked at start so an all-bad dataset fails fast and clearly.

    Tries `n` files spread over the dataset, then up to `limit` more in order; raises
    UnreadableDatasetError naming the root (and a sample reason) if none decodes, and
    TransientReadError when a read keeps failing transiently (not the dataset's fault).
    """
    total = len(dataset)
    spread = np.unique(np.linspace(0, total - 1, num=min(n, total)).astype(np.int64)).tolist()
    tried = set(spread)
    rest = [i for i in range(min(total, limit + len(spread))) if i not in tried]
    reasons: list[str] = []
    for i in (spread + rest)[: len(spread) + limit]:
        try:
            data = _retrying(
                lambda i=i: dataset.read_bytes(i),
                f"reading {dataset.paths[i]}",
                retry_delays,
                sleep,
                on_transient,
            )
            assert isinstance(data, bytes)
            mismatch = dataset.checksum_problem(i, data)
            if mismatch is not None:
                reasons.append(f"{dataset.paths[i]}: {mismatch}")
                continue
            decode_full(data, max_pixels=max_pixels)
            return i
        except DecodeError as e:
            reasons.append(f"{dataset.paths[i]}: {e}")
        except TransientReadError:
            raise
        except OSError as e:
            reasons.append(f"{dataset.paths[i]}: cannot read: {e.strerror or e}")
    raise UnreadableDatasetError(
        f"no readable image in {dataset.root} (checked {len(reasons)} of {total} files; "
        f"e.g. {reasons[0]})"
    )


class BadFileTally:
    """Distinct bad files over several SampleLoaders: a file that two splits (or two list
    entries) hold counts once. `add(paths)` (the bad files a batch reported,
    `BatchStats.bad_files`) returns how many of them are new; `total` is the count so far.
    For one thread (the server's loop)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    @property
    def total(self) -> int:
        return len(self._seen)

    def add(self, paths: Iterable[str]) -> int:
        new = 0
        for path in paths:
            if path not in self._seen:
                self._seen.add(path)
                new += 1
        return new
