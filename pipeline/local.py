"""`LocalLoader`: batches produced in-process, the server-less way to use the pipeline.

Same sampler, decoder, bad-input handling and augment op as the server, so a model trained with
`LocalLoader` sees exactly the batches `RemoteLoader` would deliver for the same seed, rank,
world size and epoch, given ``output_dtype="uint8"`` (the server's default wire; `LocalLoader`'s
default is float32, normalised here from the unrounded pixel, where a `RemoteLoader` normalises
the rounded uint8 one: values differ by up to half a grey level over std). Unlike
`RemoteLoader`, it takes ``rank`` and ``world_size`` as given (torchrun's are not read) and
moves to another epoch only on ``set_epoch``, as a DataLoader with a DistributedSampler. A
background thread produces the next batches into a ring of preallocated buffers while the caller
works on the current one.

Buffer ownership: by default (`copy=True`) every yielded batch is a tensor of its own, safe to
keep. With `copy=False` the yielded tensor *is* a ring buffer: it stays valid until the next
batch is drawn from the iterator, then it is refilled. That saves one copy per batch for
callers who consume a batch before asking for the next (the usual training loop).

On CUDA the background thread produces on a stream of its own, and events order each ring
buffer between it and the consumer (`_CudaOrder`, over `common.cuda_events.HandOff`): the stream
that is current when a batch is handed out waits for that batch's production, and the producer
writes a buffer again only after an event recorded on that consumer stream when the buffer came
back (after the clone with ``copy=True``; when the next batch is drawn with ``copy=False``). So
a consumer on a side stream is as safe as one on the default stream. Host buffers are never
pinned here: nothing in the loader copies them to a GPU (pinning would also open a CUDA context
on a CPU-only run).
"""

from __future__ import annotations

import logging
import numbers
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from batchwire.common.cuda_events import HandOff
from batchwire.common.devices import process_device
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.buffers import BufferRing, BufferTimeout
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, BatchDecoder
from batchwire.pipeline.decode.select import make_decoder
from batchwire.pipeline.producer import BatchMeta
from batchwire.pipeline.sampler import check_int
from batchwire.pipeline.samples import batch_may_pass, next_batches
from batchwire.pipeline.sources.metadata import batch_metadata
from batchwire.pipeline.sources.mix import is_mix, open_mix, parse_mix
from batchwire.pipeline.split import build_split

log = logging.getLogger("batchwire.pipeline")

_SPLITS = ("train", "val")
_POLL_S = 0.2  # how often a blocked background thread checks whether to stop
# A batch that fails transient (a store restarting, descriptors running out) is made again,
# backing off from the first to the longest wait, for at most this long: as a RemoteLoader
# asks its servers again within its default timeout.
TRANSIENT_WAIT_S = 60.0
_RETRY_FIRST_S, _RETRY_MAX_S = 0.25, 4.0


@dataclass(eq=False)
class _Pass:
    """One iteration's background producer and the batches it made ahead of the consumer."""

    stop: threading.Event
    worker: threading.Thread
    ready: queue.Queue


def _open(
    data: str | Path | ImageDataset | None,
    split: str,
    allow_outside_root: bool,
    verify_checksums: str,
    checksum_dirs: Sequence[str | Path],
    mix_schedule: str | None,
) -> ImageDataset:
    """The split's dataset, opened as the server opens its --train/--val (a ``mix:`` text
    included: each part through `open_dataset`, ordered by ``mix_schedule`` for train)."""
    if mix_schedule is not None and not is_mix(data):
        raise ValueError("mix_schedule needs a mix: data='mix:NAME=WEIGHT@SOURCE,...'")
    if isinstance(data, ImageDataset):
        return data
    if data is not None and not _is_source(data):
        raise ValueError(
            "data must be a path, a list of shard paths, a mix: text, an ImageDataset or None, "
            f"got {data!r}"
        )
    checks = {"verify_checksums": verify_checksums, "checksum_dirs": checksum_dirs}
    if data is None:
        from batchwire.pipeline.synthetic import default_dataset

        roots = default_dataset()
        return open_dataset(roots.train_root if split == "train" else roots.val_root, **checks)
    if is_mix(data):
        train = split == "train"
        return open_mix(
            parse_mix(str(data), where=f"LocalLoader({split})"),
            lambda source: open_dataset(source, allow_outside_root=allow_outside_root, **checks),
            train=train,
            schedule=mix_schedule if train else None,
        )
    return open_dataset(data, allow_outside_root=allow_outside_root, **checks)


def _is_source(data: object) -> bool:
    """A path (not ""), or a non-empty list or tuple of them (tar shards, Parquet files)."""
    if isinstance(data, (list, tuple)):
        return bool(data) and all(_is_source(d) for d in data)
    return isinstance(data, os.PathLike) or (isinstance(data, str) and bool(data))


class _CudaOrder:
    """The producer stream of a CUDA `LocalLoader` and a `HandOff` per ring buffer.

    The producer stream writes buffer ``i`` (after the last consumer's work on it:
    `before_produce`); the stream current when the batch is handed out waits for that
    production and guards the buffer until it is given back (the contract is in
    common/cuda_events.py).
    """

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.buffers = [HandOff() for _ in range(count)]

    def before_produce(self, i: int) -> None:
        """Producer thread, on `stream`: the last consumer of buffer ``i`` comes first."""
        self.buffers[i].before_write(self.stream)

    def produced(self, i: int) -> None:
        self.buffers[i].written(self.stream)

    def hand_out(self, i: int) -> None:
        """Consumer thread: its current stream waits for buffer ``i``'s production."""
        self.buffers[i].hand_out(torch.cuda.current_stream(self.device))

    def give_back(self, i: int) -> None:
        """Consumer thread, before the ring gets buffer ``i`` back."""
        self.buffers[i].give_back()

    def synchronize(self) -> None:
        """Wait until neither side uses any buffer (before the buffers may be freed)."""
        with torch.cuda.device(self.device):
            for buffer in self.buffers:
                buffer.freed.synchronize()
            self.stream.synchronize()


def _make_decoder(
    decoder: str | BatchDecoder, threads: int | None, device: str | None, batch_size: int
) -> tuple[BatchDecoder, bool]:
    """(decoder, owned): a decoder built here is closed by `close()`.

    A GPU decoder made here decodes on this rank's GPU: an index-less (or absent) CUDA device
    is resolved as RemoteLoader resolves it (`common.devices.process_device`: set_device's,
    else LOCAL_RANK's), not left to the decoders' own default, GPU 0, where every rank of a
    node would decode."""
    if not isinstance(decoder, str):
        return decoder, False
    if device is None and decoder != "cpu" and torch.cuda.is_available():
        device = "cuda"
    where = None if device is None else str(process_device(device))
    return make_decoder(decoder, where, threads, max_batch=batch_size), True


class LocalLoader:
    """Iterate `(images [B, 3, H, W], labels int64 [B])` (plus `indices`, -1 = padding, with
    `with_indices=True`) for one rank of one split.

    `data`: ImageFolder root, list file, an `ImageDataset`, None for the embedded dataset, or
    a mix, the server's ``mix:NAME=WEIGHT@SOURCE,...`` text (docs/mixtures.md; `mix_schedule`:
    its --mix-schedule), served in the server's order. Train: shuffled, drop_last (a mix in
    its plan's order); val: in order, the last batches padded. `decoder`: "cpu", a
    name `decode.select.make_decoder` knows ("auto", "nvjpeg", "dali"), or a `BatchDecoder`.
    `allow_outside_root`: a list file may name files outside its folder (see
    `dataset.read_list_file`). `verify_checksums` ("auto", "on", "off") and `checksum_dirs`:
    files are checked against their checksum manifest as the server checks them
    (`dataset.open_dataset`; an `ImageDataset` given keeps its own). `device`: where batches
    are produced (default: the decoder's device); an index-less "cuda" (and a GPU decoder's
    default device) is this rank's GPU: the one `torch.cuda.set_device` chose, else
    LOCAL_RANK's. Extra keyword arguments are `AugmentConfig` fields (scale, ratio, flip_prob,
    brightness, ..., output_dtype, layout, and `transform`: a user transform, "module:callable"
    or the callable itself, as the server's --transform on a train loader and its
    --val-transform on a val one: give each loader its own; pipeline/transforms.py; `views`:
    multi-view crops, the server's --views spelling, e.g. "2x224:0.4-1.0,6x96:0.05-0.4").
    `threads`: the decoder's threads (None: the cores this process may use); `ring`: the
    output buffers the background thread fills ahead of the loop; `max_pixels`: a file
    declaring more pixels is a bad sample (the server's --max-pixels; None: no bound).
    With views each batch is `(views_list, labels[, indices])`, views_list[k] `[B, 3, Hk, Wk]`
    in the order given, exactly what a server with the same --views sends. `with_metadata`:
    one more element, the per-sample metadata of a manifest's other columns (a list of dicts,
    None for padding slots and datasets without), as `RemoteLoader(with_metadata=True)`.

    One pass at a time: a newer ``iter(loader)`` ends a pass still open (its background
    thread stops and gives its buffers back), and the older iterator's next step raises
    RuntimeError, as `RemoteLoader`'s does; `close` ends the open pass too. It is a plain
    iterable, not a torch Dataset, and holds threads: iterate it directly (not through a
    DataLoader), in the process that made it (it cannot be pickled).
    """

    def __init__(
        self,
        data: str | Path | ImageDataset | None,
        *,
        split: str = "train",
        batch_size: int,
        image_size: int | tuple[int, int],
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        decoder: str | BatchDecoder = "cpu",
        threads: int | None = None,
        device: str | None = None,
        ring: int = 3,
        copy: bool = True,
        with_indices: bool = False,
        with_metadata: bool = False,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        allow_outside_root: bool = False,
        verify_checksums: str = "auto",
        checksum_dirs: Sequence[str | Path] = (),
        mix_schedule: str | None = None,
        **augment: Any,
    ) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        for name, value, lowest in (
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
            ("ring", ring, 1),
            ("threads", threads, 1),
            ("max_pixels", max_pixels, 1),
        ):
            if value is None and name in ("threads", "max_pixels"):
                continue
            if name == "max_pixels" and isinstance(value, float) and value.is_integer():
                value = max_pixels = int(value)  # 1e8
            check_int(name, value, lowest)
        if isinstance(checksum_dirs, (str, Path)):
            raise ValueError(
                f"checksum_dirs must be a list of folders, got the one {checksum_dirs!r}: "
                "give [folder]"
            )
        self.split = split
        self.dataset = _open(
            data, split, allow_outside_root, verify_checksums, checksum_dirs, mix_schedule
        )
        self.config = AugmentConfig(image_size=image_size, train=split == "train", **augment)
        self.copy = bool(copy)
        self.with_indices = bool(with_indices)
        self.with_metadata = bool(with_metadata)
        self.batch_size = int(batch_size)
        self.epoch = 0
        # The pass being iterated: a newer iter() ends it (its worker holds ring buffers).
        self._pass: _Pass | None = None
        self._iteration = 0
        self._closed = False
        self.decoder, self._owns_decoder = _make_decoder(decoder, threads, device, batch_size)
        try:  # the producer's probe fails on a dataset without a readable image
            self._split = build_split(
                split, self.dataset, self.config, seed, self.decoder, max_pixels=max_pixels
            )
            self.producer = self._split.producer
            self.sampler = self._split.sampler(batch_size, seed, rank, world_size)
            # This rank's GPU for an index-less "cuda" (resolved once, here): batches produced
            # on GPU 0 by every rank would be copied across GPUs at each step.
            where = process_device(device if device else self.decoder.device)
            self.device = where
            self._order: _CudaOrder | None = None
            spec = self.producer.output_spec(self.batch_size)
            self.spec = spec
            if where.type == "cuda":
                # Stream first (it opens this device's context), then the buffers, all with
                # the device current: nothing lands on GPU 0 of a run on another GPU.
                self._order = _CudaOrder(where, ring)
                with torch.cuda.device(where):
                    self.ring = BufferRing.for_spec(ring, spec, pin=False, device=where)
                    # The caching allocator gave the buffers on the current stream (a block
                    # freed there may still be read by its queued kernels); the producer stream
                    # writes them, so it waits for what is queued there first.
                    self._order.stream.wait_stream(torch.cuda.current_stream(where))
            else:
                self.ring = BufferRing.for_spec(ring, spec, pin=False, device=where)
            self._index = {t.data_ptr(): i for i, t in enumerate(self.ring.buffers)}
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return self.sampler.num_batches

    @property
    def classes(self) -> list[str]:
        """Class names in label id order (as `RemoteLoader.classes`, torchvision's)."""
        return list(self.dataset.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.dataset.classes)}

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter(loader)`` serves (as `RemoteLoader.set_epoch`)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def counts(self) -> dict[str, int]:
        """Bad-input counters: `bad_total` (distinct bad files), `replaced_total` (samples)."""
        return self.producer.counts()

    def close(self) -> None:
        active = getattr(self, "_pass", None)
        if active is not None:  # its worker must not decode on a closed decoder
            self._iteration += 1  # and its iterator raises, rather than wait for it
            self._closed = True
            self._end_pass(active)
        order = getattr(self, "_order", None)
        if order is not None:
            order.synchronize()
        if self._owns_decoder and hasattr(self.decoder, "close"):
            self.decoder.close()

    def __enter__(self) -> LocalLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._iterate(self.epoch)

    def _iterate(self, epoch: int) -> Iterator[tuple[torch.Tensor, ...]]:
        # A newer pass supersedes an older one still open (a peeked iterator kept, zip(loader,
        # loader), a notebook cell re-run after an error): the older one's worker held the ring's
        # buffers, and the newer one waited for them for ever. As `RemoteLoader`, the older
        # iterator then raises.
        if self._pass is not None:
            self._end_pass(self._pass)
        self._iteration += 1
        iteration = self._iteration
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()
        worker = threading.Thread(
            target=self._produce_all, args=(epoch, ready, stop), name="bw-local", daemon=True
        )
        this = self._pass = _Pass(stop, worker, ready)
        worker.start()
        held: torch.Tensor | None = None
        try:
            for _ in range(len(self)):
                if held is not None:
                    self._give_back(held)
                    held = None
                if iteration != self._iteration:
                    raise RuntimeError(
                        "the loader was closed while this iterator was in use"
                        if self._closed
                        else "this iterator was superseded by a newer iter(loader)"
                    )
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                buf, meta = item
                if self._order is not None:
                    self._order.hand_out(self._index[buf.data_ptr()])
                if self.copy:
                    images = self._images(buf)
                    if isinstance(images, list):
                        images = [v.clone(memory_format=self.config.memory_format) for v in images]
                    else:
                        images = images.clone(memory_format=self.config.memory_format)
                    self._give_back(buf)
                else:
                    held = buf
                    images = self._images(buf)
                yield self._output(images, meta)
        finally:
            if held is not None:
                self._give_back(held)
            self._end_pass(this)

    def _end_pass(self, ended: _Pass) -> None:
        """Stop a pass's worker and give back what it made ahead (idempotent)."""
        ended.stop.set()
        ended.worker.join()
        while not ended.ready.empty():  # batches produced ahead of a caller who stopped early
            item = ended.ready.get_nowait()
            if not isinstance(item, BaseException):
                self.ring.release(item[0])
        if self._pass is ended:
            self._pass = None

    def _give_back(self, buf: torch.Tensor) -> None:
        """A buffer the consumer had: guarded by its stream's event, then back to the ring."""
        if self._order is not None:
            self._order.give_back(self._index[buf.data_ptr()])
        self.ring.release(buf)

    def _images(self, buf: torch.Tensor) -> Any:
        """A ring buffer as the batch: itself, or its views' tensors (multi-view)."""
        return self.spec.view_bytes(buf) if self.spec.multi_view else buf

    def _output(self, images: Any, meta: BatchMeta) -> tuple[Any, ...]:
        out: tuple[Any, ...] = (images, torch.from_numpy(meta.labels))
        if self.with_indices:
            out += (torch.from_numpy(meta.indices),)
        if self.with_metadata:
            out += (batch_metadata(getattr(self.dataset, "metadata", None), meta.indices),)
        return out

    def _produce_all(self, epoch: int, ready: queue.Queue, stop: threading.Event) -> None:
        """Background thread: produce the epoch's batches in order into ring buffers."""
        try:
            for plan in self.sampler.plans(epoch):
                buf = None
                while buf is None:
                    if stop.is_set():
                        return
                    try:
                        buf = self.ring.acquire(timeout=_POLL_S)
                    except BufferTimeout:
                        continue
                try:
                    meta = self._produce_patiently(plan, buf, stop)
                except BaseException:
                    self.ring.release(buf)
                    raise
                ready.put((buf, meta))
        except BaseException as e:
            ready.put(e)

    def _produce_patiently(self, plan: Any, buf: torch.Tensor, stop: threading.Event) -> BatchMeta:
        """`_produce`, made again while it fails for a reason that may pass (`batch_may_pass`)
        for up to `TRANSIENT_WAIT_S`, each time logged: the server answers such a batch
        "transient" and its client asks again, so a store restarting mid-epoch costs a wait,
        never a sample, in-process too."""
        deadline = time.monotonic() + TRANSIENT_WAIT_S
        delay = _RETRY_FIRST_S
        while True:
            try:
                return self._produce(plan, buf)
            except Exception as exc:
                if not batch_may_pass(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "batch %d failed (%s: %s); making it again in %.2f s",
                    plan.batch_index, type(exc).__name__, exc, delay,
                )  # fmt: skip
                if stop.wait(delay):  # the pass ended meanwhile: nobody waits for the batch
                    raise
                delay = min(_RETRY_MAX_S, 2 * delay)

    def _produce(self, plan: Any, buf: torch.Tensor) -> BatchMeta:
        # The epoch's next batches, for a source that reads along (tar shards in a bucket), as
        # the server's producer threads give them.
        upcoming = next_batches(self.sampler, plan)
        order = self._order
        if order is None:
            return self.producer.produce(plan, self._images(buf), upcoming=upcoming)
        i = self._index[buf.data_ptr()]
        with torch.cuda.device(order.device), torch.cuda.stream(order.stream):
            order.before_produce(i)
            meta = self.producer.produce(plan, self._images(buf), upcoming=upcoming)
            order.produced(i)
        return meta
