"""From dataset indices to decoded, planned samples, with bad input replaced deterministically.

Real datasets contain broken files (truncated downloads, HTML saved as .jpg, CMYK oddities,
decompression bombs). Failing the batch would stall every rank of a DDP job; dropping the sample
would make ranks' batch sizes differ. So a bad sample is logged once per path, counted, and
replaced by a substitute drawn from a sequence that depends only on (seed, index): every
server, thread count and resume point picks the same substitute, keeping runs reproducible.

The work is split in two steps so a server can run them as separate pipeline stages:
`prepare` (read bytes, parse header, plan augmentation) and `decode` (pixels via the pluggable
`BatchDecoder`); `load` does both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from batchwire.pipeline.augment_plan import AugmentConfig, SamplePlan, draw_uniforms, plan_samples
from batchwire.pipeline.dataset import ImageDataset
from batchwire.pipeline.decode import (
    DEFAULT_MAX_PIXELS,
    BatchDecoder,
    DecodeError,
    DecodeRequest,
    ImageHeader,
    decode_full,
    read_header,
)

log = logging.getLogger("batchwire.pipeline")

Box = tuple[float, float, float, float]

# Separates the substitute sequence from the augmentation draws of the same (seed, index).
_SUBSTITUTE_STREAM = 0x53554253  # "SUBS"
DEFAULT_MAX_ATTEMPTS = 64


class UnreadableDatasetError(ValueError):
    """The dataset (or a long run of substitutes) has no readable image: a setup problem."""


@dataclass(frozen=True)
class PreparedSample:
    """A readable sample's bytes, header and plan, before decoding.

    `requested` is the index the batch asked for; `index` the one actually used (they differ
    when the requested file was bad and `replaced` is True); `attempt` is the position reached
    in the requested index's substitute sequence (0 = the requested file itself).
    """

    requested: int
    index: int
    data: bytes
    header: ImageHeader
    plan: SamplePlan
    label: int
    replaced: bool
    attempt: int


@dataclass(frozen=True)
class LoadedSample:
    """A decoded sample: HWC uint8 image on the decoder's device, its plan (box in full-size
    oriented coords), `box` in the decoded image's coords, label, and provenance."""

    requested: int
    index: int
    image: torch.Tensor
    plan: SamplePlan
    box: Box
    label: int
    replaced: bool


def substitute_candidates(seed: int, index: int, count: int, num_samples: int) -> np.ndarray:
    """The first `count` substitutes for `index` (int64), a pure function of (seed, index).

    Uniform over the dataset (excluding `index` itself), so a substitute's class is drawn
    like any sample's rather than always the neighbour's class.
    """
    if num_samples < 2:
        return np.zeros(0, dtype=np.int64)
    u = draw_uniforms(seed, 0, [index], count, stream=_SUBSTITUTE_STREAM)[0]
    offsets = 1 + np.minimum(np.floor(u * (num_samples - 1)), num_samples - 2).astype(np.int64)
    return (index + offsets) % num_samples


class SampleLoader:
    """bytes -> header -> plan -> decode for lists of dataset indices, bad input replaced.

    Counters (`counts()`): `bad_total` distinct bad files found, `replaced_total` samples
    replaced in what was loaded (each occurrence, every epoch). Known-bad indices are
    remembered so they are not read again. Thread-safe: several batches may load at once.
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
    ) -> None:
        if len(dataset) < 1:
            raise UnreadableDatasetError(f"no images in {dataset.root}")
        self.dataset = dataset
        self.config = config
        self.seed = int(seed)
        self.decoder = decoder
        self.max_pixels = max_pixels
        self.max_attempts = int(max_attempts)
        self.bad_total = 0
        self.replaced_total = 0
        self._bad: dict[int, str] = {}
        self._lock = threading.Lock()
        if check_start:
            probe(dataset, max_pixels=max_pixels)

    # -- bookkeeping ---------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"bad_total": self.bad_total, "replaced_total": self.replaced_total}

    @property
    def known_bad(self) -> dict[int, str]:
        """Index -> reason for every bad file found so far (a copy)."""
        with self._lock:
            return dict(self._bad)

    def _mark_bad(self, index: int, reason: str) -> None:
        with self._lock:
            if index in self._bad:
                return
            self._bad[index] = reason
            self.bad_total += 1
        log.warning(
            "unreadable image %s (%s): replacing it with another sample",
            self.dataset.paths[index],
            reason,
        )

    def _is_bad(self, index: int) -> bool:
        with self._lock:
            return index in self._bad

    # -- steps -------------------------------------------------------------------------------

    def _read(self, index: int) -> tuple[bytes, ImageHeader] | str:
        """Bytes and header of one file, or the reason it is unusable."""
        try:
            data = self.dataset.read_bytes(index)
            return data, read_header(data, max_pixels=self.max_pixels)
        except DecodeError as e:
            return str(e)
        except OSError as e:
            return f"cannot read: {e.strerror or e}"

    def _next_readable(self, requested: int, attempt: int) -> tuple[int, int, bytes, ImageHeader]:
        """The first usable file at or after `attempt` in `requested`'s substitute sequence.

        Returns (index, attempt, data, header); raises UnreadableDatasetError after
        `max_attempts` unusable candidates in a row.
        """
        n = len(self.dataset)
        # Substitutes are drawn only once the requested file turned out bad: drawing them
        # costs ~0.1 ms, as much as a quarter of the pipeline's per-image overhead.
        candidates: np.ndarray | None = None
        limit = self.max_attempts if n >= 2 else 0  # a one-file dataset has nothing to swap in
        while attempt <= limit:
            if attempt == 0:
                index = requested
            else:
                if candidates is None:
                    candidates = substitute_candidates(self.seed, requested, self.max_attempts, n)
                index = int(candidates[attempt - 1])
            if not self._is_bad(index):
                got = self._read(index)
                if not isinstance(got, str):
                    return index, attempt, got[0], got[1]
                self._mark_bad(index, got)
            attempt += 1
        with self._lock:
            bad = len(self._bad)
        raise UnreadableDatasetError(
            f"sample {requested} ({self.dataset.paths[requested]}) and {self.max_attempts} "
            f"substitutes for it are all unreadable ({bad} of {n} files in "
            f"{self.dataset.root} found bad so far): the dataset looks broken"
        )

    def prepare(
        self, epoch: int, indices: Sequence[int], *, start_attempts: Sequence[int] | None = None
    ) -> list[PreparedSample]:
        """Read and plan each index (substituting unreadable files).

        Files are read on the decoder's threads when it offers `map` (CpuBatchDecoder does):
        reading and header parsing release the GIL for most of their time.
        """
        jobs = [
            (int(r), 0 if start_attempts is None else int(start_attempts[k]))
            for k, r in enumerate(indices)
        ]

        def find(job: tuple[int, int]) -> tuple[int, int, int, bytes, ImageHeader]:
            return (job[0], *self._next_readable(*job))

        mapper = getattr(self.decoder, "map", None)
        found = mapper(find, jobs) if callable(mapper) else [find(j) for j in jobs]
        plans = plan_samples(
            self.config,
            self.seed,
            epoch,
            [f[1] for f in found],
            [f[4].height for f in found],
            [f[4].width for f in found],
        )
        labels = self.dataset.labels
        return [
            PreparedSample(
                requested=requested,
                index=index,
                data=data,
                header=header,
                plan=plan,
                label=int(labels[index]),
                replaced=attempt > 0,
                attempt=attempt,
            )
            for (requested, index, attempt, data, header), plan in zip(found, plans, strict=True)
        ]

    def decode(self, epoch: int, prepared: Sequence[PreparedSample]) -> list[LoadedSample]:
        """Decode prepared samples; files that fail to decode are replaced (and re-decoded)."""
        out: list[LoadedSample | None] = [None] * len(prepared)
        todo = list(enumerate(prepared))
        out_hw = self.config.image_size
        while todo:
            requests = [
                DecodeRequest(p.index, p.data, p.header, p.plan.box, out_hw) for _, p in todo
            ]
            results = self.decoder.decode_batch(requests)
            retry: list[tuple[int, PreparedSample]] = []
            for (slot, p), r in zip(todo, results, strict=True):
                if r.image is None:
                    self._mark_bad(p.index, r.error or "decode failed")
                    retry.append((slot, p))
                    continue
                out[slot] = LoadedSample(
                    requested=p.requested,
                    index=p.index,
                    image=r.image,
                    plan=p.plan,
                    box=tuple(float(v) for v in r.box),
                    label=p.label,
                    replaced=p.replaced,
                )
            if not retry:
                break
            again = self.prepare(
                epoch,
                [p.requested for _, p in retry],
                start_attempts=[p.attempt + 1 for _, p in retry],
            )
            todo = [(slot, p) for (slot, _), p in zip(retry, again, strict=True)]
        loaded = [s for s in out if s is not None]
        replaced = sum(s.replaced for s in loaded)
        if replaced:
            with self._lock:
                self.replaced_total += replaced
        return loaded

    def load(self, epoch: int, indices: Sequence[int]) -> list[LoadedSample]:
        """`prepare` then `decode`: one LoadedSample per index, in order."""
        return self.decode(epoch, self.prepare(epoch, indices))


def probe(
    dataset: ImageDataset, n: int = 8, limit: int = 256, max_pixels: int | None = DEFAULT_MAX_PIXELS
) -> int:
    """Index of a readable image, checked at start so an all-bad dataset fails fast and clearly.

    Tries `n` files spread over the dataset, then up to `limit` more in order; raises
    UnreadableDatasetError naming the root (and a sample reason) if none decodes.
    """
    total = len(dataset)
    spread = np.unique(np.linspace(0, total - 1, num=min(n, total)).astype(np.int64)).tolist()
    tried = set(spread)
    rest = [i for i in range(min(total, limit + len(spread))) if i not in tried]
    reasons: list[str] = []
    for i in (spread + rest)[: len(spread) + limit]:
        try:
            decode_full(dataset.read_bytes(i), max_pixels=max_pixels)
            return i
        except DecodeError as e:
            reasons.append(f"{dataset.paths[i]}: {e}")
        except OSError as e:
            reasons.append(f"{dataset.paths[i]}: cannot read: {e.strerror or e}")
    raise UnreadableDatasetError(
        f"no readable image in {dataset.root} (checked {len(reasons)} of {total} files; "
        f"e.g. {reasons[0]})"
    )
