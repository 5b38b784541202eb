"""One batch, start to finish, through the declared stages (pipeline/stages.py): read ->
verify -> plan -> decode (`SampleLoader.load`) -> augment (the fused op or a user transform,
into `out`) -> label (`BatchMeta`).

This is the unit of work both the in-process `LocalLoader` and the server run. It writes into a
caller-provided tensor (a ring buffer) rather than returning a new one, so steady-state
production allocates no batch-sized memory. The decoder is the caller's (`decoder`); a
`StageClock` passed to `produce` is told each stage the batch enters, and `batch_stats` turns
it into the batch's report: data, no call into the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from batchwire import native
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, BatchDecoder
from batchwire.pipeline.decode.fallback import upload
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.sample_window import CHUNK, WAIT_S, SampleEntry, SampleWindow
from batchwire.pipeline.sampler import PADDING_LABEL, BatchPlan
from batchwire.pipeline.samples import LoadedSample, SampleLoader, Upcoming
from batchwire.pipeline.stages import AUGMENT, LABEL, UNTIMED, BatchStats, StageClock
from batchwire.pipeline.transforms import TransformError, TransformRunner, transform_seeds
from batchwire.wire import BatchSpec

log = logging.getLogger("batchwire.pipeline")

AugmentFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BatchMeta:
    """What goes with a produced batch.

    `indices`: the sampler's dataset indices (`PADDING_INDEX`, -1, for padding slots).
    `pixel_indices`: the indices whose pixels are actually in the batch (they differ from
    `indices` where a bad file was replaced). `labels` belong to `pixel_indices`, except that a
    padding slot's label is `PADDING_LABEL` (-100, cross-entropy's default ``ignore_index``), so
    a loss or an accuracy that honours it never counts padding. `replaced`: replaced valid slots.
    """

    epoch: int
    batch_index: int
    labels: np.ndarray  # int64 [B]
    indices: np.ndarray  # int64 [B], PADDING_INDEX (-1) = padding
    valid: np.ndarray  # bool [B]
    pixel_indices: np.ndarray  # int64 [B]
    replaced: int


class BatchProducer:
    """Produces batches of `dataset` under `config` into caller-provided output tensors."""

    def __init__(
        self,
        dataset: ImageDataset,
        config: AugmentConfig,
        seed: int,
        decoder: BatchDecoder,
        *,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        augment: AugmentFn | None = None,
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.seed = int(seed)
        self.decoder = decoder
        self.samples = SampleLoader(dataset, config, seed, decoder, max_pixels=max_pixels)
        if augment is None:
            # batchwire.native owns the choice (fused op or reference, per device, logged once).
            self._augment = native.augment_batch
            fallback = native.augment_impl("cpu") is native.augment_batch_reference
            self.augment_name = "reference" if fallback else "native"
        else:
            self.augment_name, self._augment = getattr(augment, "__name__", "custom"), augment
        # A user transform replaces the fused op (pipeline/transforms.py); ValueError here, at
        # start, when it does not import.
        self.transform: TransformRunner | None = None
        if config.transform is not None:
            self.transform = TransformRunner(config.transform, config.image_size)
            self.augment_name = f"transform {self.transform.name}"
        self._sized: dict[tuple[int, int], AugmentConfig] = {}
        self._specs: dict[tuple[tuple[int, int], int], BatchSpec] = {}  # `_spec`'s
        self._sized_lock = threading.Lock()
        self._mean = torch.tensor(config.mean, dtype=torch.float32)
        self._std = torch.tensor(config.std, dtype=torch.float32)

    def counts(self) -> dict[str, int]:
        """Bad-input counters (`bad_total`, `replaced_total`) of the sample loader, and
        `transform_errors_total` (samples a user transform failed on) with a transform."""
        counts = self.samples.counts()
        if self.transform is not None:
            counts["transform_errors_total"] = self.transform.errors_total
        return counts

    def batch_stats(self, clock: StageClock) -> BatchStats:
        """A batch's report, produced or failed (`BatchStats`): ``clock`` stopped, the
        decoder's fallback total (images a GPU decoder handed to the CPU; 0 for the CPU
        decoder) and the bad files found since the last report."""
        return BatchStats(
            clock.stop(),
            self.decoder.name,
            int(getattr(self.decoder, "fallbacks", 0)),
            self.samples.take_bad_files(),
        )

    def output_spec(self, batch_size: int) -> BatchSpec:
        """What `produce` writes for a batch of ``batch_size`` (the wire's description)."""
        return self.config.batch_spec(batch_size)

    def _spec(self, config: AugmentConfig, n: int) -> BatchSpec:
        """``config.batch_spec(n)``, made once per output size and batch size (``config`` is
        this producer's at its output size: `config_at`)."""
        key = (config.image_size, n)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = config.batch_spec(n)
        return spec

    def config_at(self, image_size: tuple[int, int] | None) -> AugmentConfig:
        """The config producing batches at output size ``image_size`` (None: the config's
        own): progressive resizing. Train crops do not depend on the output size (the same
        boxes, flips and jitter at any size), val centre crops do (planned at that size)."""
        if image_size is None or tuple(image_size) == self.config.image_size:
            return self.config
        size = (int(image_size[0]), int(image_size[1]))
        with self._sized_lock:
            config = self._sized.get(size)
            if config is None:
                if self.transform is not None or self.config.views:
                    raise ValueError(
                        "a user transform or multi-view config has a fixed output size"
                    )
                config = self._sized[size] = dataclasses.replace(self.config, image_size=size)
            return config

    def produce(
        self,
        plan: BatchPlan,
        out: torch.Tensor | list[torch.Tensor],
        *,
        image_size: tuple[int, int] | None = None,
        reuse: tuple[SampleWindow, Hashable] | None = None,
        clock: StageClock = UNTIMED,
        upcoming: Upcoming | None = None,
    ) -> BatchMeta:
        """Fill `out` ([B, 3, H, W], config dtype, any memory format) with batch `plan`.

        Multi-view configs: `out` is a list of one such tensor per view (`BatchSpec.view_bytes`
        of one buffer gives it); each sample is decoded once and the fused op runs once per
        view, over the whole batch, with that view's boxes, flips and jitter. ``image_size``:
        produce at that output size instead of the config's (`config_at`). ``reuse``: a
        `SampleWindow` and this output's key there (split, size, dtype, layout): samples of
        the batch in the window are copied instead of produced, those produced are published
        (pipeline/sample_window.py; single-view, no user transform, CPU tensors only).
        ``clock``: the batch's `StageClock`, told each stage it enters. ``upcoming``: the
        epoch's next batches (`samples.next_batches`), which a source that reads ahead reads
        along (`SampleLoader.load`).
        """
        config = self.config_at(image_size)
        if (
            reuse is not None
            and self.transform is None
            and not self.config.views
            and isinstance(out, torch.Tensor)
            and out.device.type == "cpu"
        ):
            return self._produce_reusing(plan, out, config, *reuse, clock, upcoming)
        return self._produce(plan, out, config, clock, upcoming)

    def _produce(
        self,
        plan: BatchPlan,
        out: torch.Tensor | list[torch.Tensor],
        config: AugmentConfig,
        clock: StageClock,
        upcoming: Upcoming | None = None,
    ) -> BatchMeta:
        n = len(plan.indices)
        expected = self._spec(config, n)
        outs = out if isinstance(out, (list, tuple)) else [out]
        if len(outs) != len(expected.view_specs) or any(
            list(o.shape) != e.shape or o.dtype != e.torch_dtype
            for o, e in zip(outs, expected.view_specs, strict=False)
        ):
            got = [f"{list(o.shape)} {o.dtype}" for o in outs]
            raise ValueError(
                f"out must be {expected.view_shapes} {expected.torch_dtype}, got {got}"
            )
        samples = self.samples.load(
            plan.epoch, plan.indices, config=config, clock=clock, upcoming=upcoming
        )
        clock.enter(AUGMENT)
        if self.transform is not None:
            samples = self._transform_into(plan.epoch, samples, out)
            clock.enter(LABEL)
            return self._meta(plan, samples)
        device = outs[0].device
        # CPU-decoded images on a GPU server: `upload`, queued from pinned memory (a pageable
        # copy would make this producer wait for its stream's queued work).
        images = [s.image if s.image.device == device else upload(s.image, device) for s in samples]
        # The parameters stay on the host whatever the device: the op reads them there, and
        # device copies would cost a host synchronisation each.
        if not self.config.views:
            boxes = torch.tensor([s.box for s in samples], dtype=torch.float32)
            flips = torch.tensor([s.plan.flip for s in samples], dtype=torch.bool)
            jitter = torch.tensor([s.plan.jitter for s in samples], dtype=torch.float32)
            self._augment(images, boxes, flips, jitter, self._mean, self._std, outs[0])
            clock.enter(LABEL)
            return self._meta(plan, samples)
        for k, view_out in enumerate(outs):
            boxes = torch.tensor([s.views[k][1] for s in samples], dtype=torch.float32)
            flips = torch.tensor([s.views[k][0].flip for s in samples], dtype=torch.bool)
            jitter = torch.tensor([s.views[k][0].jitter for s in samples], dtype=torch.float32)
            self._augment(images, boxes, flips, jitter, self._mean, self._std, view_out)
        clock.enter(LABEL)
        return self._meta(plan, samples)

    def _produce_reusing(
        self,
        plan: BatchPlan,
        out: torch.Tensor,
        config: AugmentConfig,
        window: SampleWindow,
        prefix: Hashable,
        clock: StageClock,
        upcoming: Upcoming | None = None,
    ) -> BatchMeta:
        """`produce` through the sample window (module doc of pipeline/sample_window.py);
        the samples it makes read the epoch's next batches along, as `_produce`'s do."""
        n = len(plan.indices)
        expected = self._spec(config, n)
        if list(out.shape) != expected.shape or out.dtype != expected.torch_dtype:
            raise ValueError(
                f"out must be {expected.shape} {expected.torch_dtype}, "
                f"got {list(out.shape)} {out.dtype}"
            )
        indices = [int(i) for i in plan.indices]
        keys = {i: (prefix, int(plan.epoch), i) for i in dict.fromkeys(indices)}
        entries: dict[int, SampleEntry] = {}
        need = dict(keys)  # index -> key, not yet in `entries`
        made = reused = 0
        while need:
            for key, entry in window.found(need.values()).items():
                entries[key[2]] = entry
                del need[key[2]]
                reused += 1
            if not need:
                break
            taken = window.take(need.values(), CHUNK)
            if taken:
                try:
                    todo = [k[2] for k in taken]
                    self._make(plan, todo, config, entries, window, keys, clock, upcoming)
                except BaseException:
                    window.abandon(taken)
                    raise
                for key in taken:
                    need.pop(key[2], None)
                made += len(taken)
                continue
            # All that is missing is being made by other producers: wait for one of them.
            events = window.events(need.values())
            if events:
                events[0].wait(WAIT_S)
        clock.enter(AUGMENT)  # the batch's samples, made or found, into the output
        for pos, i in enumerate(indices):
            out[pos].copy_(entries[i].image)
        window.count(reused, made)
        clock.enter(LABEL)
        return self._batch_meta(
            plan,
            labels=np.fromiter((entries[i].label for i in indices), dtype=np.int64, count=n),
            replaced=np.fromiter((entries[i].replaced for i in indices), dtype=bool, count=n),
            pixel_indices=np.fromiter(
                (entries[i].pixel_index for i in indices), dtype=np.int64, count=n
            ),
        )

    def _make(
        self,
        plan: BatchPlan,
        todo: list[int],
        config: AugmentConfig,
        entries: dict[int, SampleEntry],
        window: SampleWindow | None,
        keys: dict[int, Hashable],
        clock: StageClock,
        upcoming: Upcoming | None = None,
    ) -> int:
        """Produce samples ``todo`` as a batch of their own into a scratch tensor; each into
        ``entries`` and, with a window, published there. Returns how many."""
        if not todo:
            return 0
        sub = BatchPlan(
            epoch=plan.epoch,
            batch_index=plan.batch_index,
            indices=np.asarray(todo, dtype=np.int64),
            valid=np.ones(len(todo), dtype=bool),
        )
        scratch = self._spec(config, len(todo)).empty()
        meta = self._produce(sub, scratch, config, clock, upcoming)
        for j, i in enumerate(todo):
            pixel_index = int(meta.pixel_indices[j])
            # The sample's own (scalar) label, as `SampleLoader` gives it; multi-label rows are
            # built per batch from the pixel indices (`_produce_reusing`, as `_meta`).
            label = int(self.dataset.labels[pixel_index])
            entry = SampleEntry(scratch[j], label, pixel_index, pixel_index != i)
            entries[i] = entry
            if window is not None:
                window.publish(keys[i], entry)
        return len(todo)

    def _transform_into(
        self, epoch: int, samples: list[LoadedSample], out: torch.Tensor
    ) -> list[LoadedSample]:
        """Run the user transform on each sample into its slot of ``out``; a sample it fails
        on is counted, logged and replaced by its next substitute (transformed in turn)."""
        assert self.transform is not None
        seeds = transform_seeds(self.seed, epoch, [s.index for s in samples])
        done = list(samples)
        for i, sample in enumerate(samples):
            seed = seeds[i]
            while True:
                try:
                    self.transform.apply(sample.image, seed, out[i])
                    break
                except TransformError as exc:
                    self.transform.record_error(exc, f"{self.dataset.paths[sample.index]}")
                    if sample.attempt >= self.samples.max_attempts:
                        raise RuntimeError(
                            f"{exc}; it failed on sample {sample.requested} and "
                            f"{sample.attempt} substitutes in a row"
                        ) from exc
                    sample = self.samples.substitute(epoch, sample)
                    seed = transform_seeds(self.seed, epoch, [sample.index])[0]
            done[i] = sample
        return done

    def _meta(self, plan: BatchPlan, samples: list[LoadedSample]) -> BatchMeta:
        n = len(plan.indices)
        return self._batch_meta(
            plan,
            labels=np.fromiter((s.label for s in samples), dtype=np.int64, count=n),
            replaced=np.fromiter((s.replaced for s in samples), dtype=bool, count=n),
            pixel_indices=np.fromiter((s.index for s in samples), dtype=np.int64, count=n),
        )

    def _batch_meta(
        self,
        plan: BatchPlan,
        labels: np.ndarray,
        replaced: np.ndarray,
        pixel_indices: np.ndarray,
    ) -> BatchMeta:
        """A batch's metadata from its slots' labels, substitution flags and pixel indices,
        whether the samples were produced here or taken from the sample window: padding slots
        get PADDING_LABEL and PADDING_INDEX, and a multi-label dataset (ImageDataset's
        `batch_labels`) gets its [B, K] rows built from the pixel indices."""
        valid = np.asarray(plan.valid, dtype=bool)
        labels[~valid] = PADDING_LABEL
        multi = getattr(self.dataset, "batch_labels", None)
        return BatchMeta(
            epoch=int(plan.epoch),
            batch_index=int(plan.batch_index),
            labels=labels if multi is None else multi(pixel_indices, labels, valid),  # [B, K]
            indices=plan.public_indices(),
            valid=valid,
            pixel_indices=pixel_indices,
            replaced=int((replaced & valid).sum()),
        )
