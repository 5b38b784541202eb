"""`LocalLoader`: batches produced in-process, the server-less way to use the pipeline.

Same sampler, decoder, bad-input handling and augment op as the server, so a model trained with
`LocalLoader` sees exactly the batches `RemoteLoader` would deliver for the same seed. A
background thread produces the next batches into a ring of preallocated buffers while the caller
works on the current one.

Buffer ownership: by default (`copy=True`) every yielded batch is a tensor of its own, safe to
keep. With `copy=False` the yielded tensor *is* a ring buffer: it stays valid until the next
batch is drawn from the iterator, then it is refilled. That saves one copy per batch for
callers who consume a batch before asking for the next (the usual training loop).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.buffers import BufferRing, BufferTimeout
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, BatchDecoder, CpuBatchDecoder
from batchwire.pipeline.producer import BatchMeta
from batchwire.pipeline.split import build_split

log = logging.getLogger("batchwire.pipeline")

_SPLITS = ("train", "val")
_POLL_S = 0.2  # how often a blocked background thread checks whether to stop


def _open(
    data: str | Path | ImageDataset | None, split: str, allow_outside_root: bool
) -> ImageDataset:
    if isinstance(data, ImageDataset):
        return data
    if data is None:
        from batchwire.pipeline.synthetic import default_dataset

        roots = default_dataset()
        return open_dataset(roots.train_root if split == "train" else roots.val_root)
    return open_dataset(data, allow_outside_root=allow_outside_root)


def _make_decoder(
    decoder: str | BatchDecoder, threads: int | None, device: str | None, batch_size: int
) -> tuple[BatchDecoder, bool]:
    """(decoder, owned): a decoder built here is closed by `close()`."""
    if not isinstance(decoder, str):
        return decoder, False
    if decoder == "cpu":
        return CpuBatchDecoder(threads), True
    from batchwire.pipeline.decode.select import make_decoder

    where = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return make_decoder(decoder, where, threads or 0, max_batch=batch_size), True


class LocalLoader:
    """Iterate `(images [B, 3, H, W], labels int64 [B])` (plus `indices`, -1 = padding, with
    `with_indices=True`) for one rank of one split.

    `data`: ImageFolder root, list file, an `ImageDataset`, or None for the embedded dataset.
    Train: shuffled, drop_last; val: in order, the last batches padded. `decoder`: "cpu", a
    name `decode.select.make_decoder` knows ("auto", "nvjpeg", "dali"), or a `BatchDecoder`.
    `allow_outside_root`: a list file may name files outside its folder (see
    `dataset.read_list_file`). `device`: where batches are produced (default: the decoder's
    device). Extra keyword
    arguments are `AugmentConfig` fields (scale, ratio, flip_prob, brightness, ...,
    output_dtype, layout).
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
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        allow_outside_root: bool = False,
        **augment: Any,
    ) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if ring < 1:
            raise ValueError(f"ring must be >= 1, got {ring}")
        self.split = split
        self.dataset = _open(data, split, allow_outside_root)
        self.config = AugmentConfig(image_size=image_size, train=split == "train", **augment)
        self.copy = bool(copy)
        self.with_indices = bool(with_indices)
        self.batch_size = int(batch_size)
        self.epoch = 0
        self.decoder, self._owns_decoder = _make_decoder(decoder, threads, device, batch_size)
        try:  # the producer's probe fails on a dataset without a readable image
            self._split = build_split(
                split, self.dataset, self.config, seed, self.decoder, max_pixels=max_pixels
            )
            self.producer = self._split.producer
            self.sampler = self._split.sampler(batch_size, seed, rank, world_size)
            self.ring = BufferRing.for_spec(
                ring,
                self.producer.output_spec(self.batch_size),
                device=torch.device(device) if device else self.decoder.device,
            )
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def counts(self) -> dict[str, int]:
        """Bad-input counters: `bad_total` (distinct bad files), `replaced_total` (samples)."""
        return self.producer.counts()

    def close(self) -> None:
        if self._owns_decoder and hasattr(self.decoder, "close"):
            self.decoder.close()

    def __enter__(self) -> LocalLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._iterate(self.epoch)

    def _iterate(self, epoch: int) -> Iterator[tuple[torch.Tensor, ...]]:
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()
        worker = threading.Thread(
            target=self._produce_all, args=(epoch, ready, stop), name="bw-local", daemon=True
        )
        worker.start()
        held: torch.Tensor | None = None
        try:
            for _ in range(len(self)):
                if held is not None:
                    self.ring.release(held)
                    held = None
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                buf, meta = item
                if self.copy:
                    images = buf.clone(memory_format=self.config.memory_format)
                    self.ring.release(buf)
                else:
                    images = held = buf
                yield self._output(images, meta)
        finally:
            stop.set()
            if held is not None:
                self.ring.release(held)
            worker.join()
            while not ready.empty():  # batches produced ahead of a caller who stopped early
                item = ready.get_nowait()
                if not isinstance(item, BaseException):
                    self.ring.release(item[0])

    def _output(self, images: torch.Tensor, meta: BatchMeta) -> tuple[torch.Tensor, ...]:
        labels = torch.from_numpy(meta.labels)
        if self.with_indices:
            return images, labels, torch.from_numpy(meta.indices)
        return images, labels

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
                    meta = self.producer.produce(plan, buf)
                except BaseException:
                    self.ring.release(buf)
                    raise
                ready.put((buf, meta))
        except BaseException as e:
            ready.put(e)
