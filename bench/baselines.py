"""The reference rows of `pipeline-bench`: what batchwire is compared with.

- `decode_limit`: TurboJPEG full-size decode of preloaded bytes on every core, nothing else. No
  pipeline that decodes every pixel can beat it; batchwire may, because DCT scaling decodes
  random-resized crops at reduced size.
- `dataloader_baseline`: the usual torch recipe, a `DataLoader` with worker processes doing PIL
  decode, RandomResizedCrop, flip, to-tensor and normalize (torchvision's transforms where
  torchvision is installed, the same operations written with PIL and torch otherwise).
- `dali_pipeline`: DALI's own in-process pipeline doing the same augmentation (file reader,
  `decoders.image_random_crop`, `resize`, `crop_mirror_normalize`), on the CPU (device_id=None)
  or the GPU.

Each returns a `Measured` for `measure_images` images after a warm-up, or stops early at
`max_seconds` and reports what it did.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from batchwire.common.cores import available_cores

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Measured:
    """Images delivered in the timed window, its length, and the CPU time this process and its
    child processes (DataLoader workers, the server) spent in it (None where unmeasurable)."""

    images: int
    seconds: float
    cpu_seconds: float | None = None
    #: Images the server's GPU decoder handed to the CPU decoder (its stats'
    #: `decode_fallbacks_total`); None for rows without a batchwire server.
    fallbacks: int | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RowLoop:
    """What every batch-delivering row is asked, one value for all rows of a run: its batch and
    output size, the images it times after `warmup` batches, and when it stops early."""

    batch_size: int
    image_size: int
    measure_images: int
    warmup: int = 10
    max_seconds: float = 60

    def time(self, batches: Iterator[int], sync: Callable[[], None] = lambda: None) -> Measured:
        """`time_batches` over `batches` with this loop's counts."""
        return time_batches(batches, self.warmup, self.measure_images, self.max_seconds, sync)

    @property
    def images_needed(self) -> int:
        """How many samples a row may draw at most (sizes finite samplers)."""
        return batches_needed(self.warmup, self.measure_images, self.batch_size) * self.batch_size


def tree_cpu_seconds(root: int | None = None) -> float | None:
    """User + system CPU seconds of process `root` (default: this one) and its live descendants.

    On a shared machine wall-clock rates swing with other people's load; CPU time per image
    does much less, so the report shows both. Linux /proc only (None elsewhere).
    """
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    if root not in cpu:
        return None
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, ()))
    return total


MIN_TIMED_BATCHES = 8


def time_batches(
    batches: Iterator[int],
    warmup: int,
    measure_images: int,
    max_seconds: float,
    sync: Callable[[], None] = lambda: None,
) -> Measured:
    """Drain `warmup` batches untimed, then time batches (each yields its image count) until
    `measure_images` images (and at least MIN_TIMED_BATCHES batches) or `max_seconds` passed.

    The clock starts when the last warm-up batch arrives, so with a warm-up longer than the
    pipeline's prefetch queue the window holds steady-state arrivals, not batches that were
    already waiting.
    """
    for _ in range(warmup):
        next(batches)
    sync()
    cpu0 = tree_cpu_seconds()
    images, start = 0, time.perf_counter()
    for count, n in enumerate(batches, start=1):
        images += n
        enough = images >= measure_images and count >= MIN_TIMED_BATCHES
        if enough or time.perf_counter() - start >= max_seconds:
            break
    sync()
    seconds = time.perf_counter() - start
    cpu1 = tree_cpu_seconds()
    if images == 0:
        raise RuntimeError("the pipeline delivered no batch in the timed window")
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return Measured(images, seconds, cpu)


def batches_needed(warmup: int, measure_images: int, batch_size: int) -> int:
    """How many batches a row can consume at most (sizes finite samplers)."""
    return warmup + max(MIN_TIMED_BATCHES, math.ceil(measure_images / batch_size)) + 1


# ---------------------------------------------------------------------------------------------
# Decode-only limit


def decode_limit(
    paths: Sequence[str], measure_images: int, threads: int | None = None, max_seconds: float = 60
) -> Measured:
    """TurboJPEG full-size RGB decode of preloaded bytes on `threads` (default: all cores)."""
    from turbojpeg import TJPF_RGB, TurboJPEG

    tj = TurboJPEG()
    threads = threads or available_cores()
    blobs = [Path(p).read_bytes() for p in paths[: max(1, min(len(paths), measure_images))]]

    def decode(data: bytes) -> int:
        try:
            tj.decode(data, pixel_format=TJPF_RGB)  # libjpeg-turbo releases the GIL (ctypes)
        except OSError:
            return 0  # not a JPEG TurboJPEG reads: not part of the limit
        return 1

    with ThreadPoolExecutor(threads, thread_name_prefix="bench-decode") as pool:
        list(pool.map(decode, blobs[: 4 * threads]))  # warm-up
        cpu0 = tree_cpu_seconds()
        images, attempted, start = 0, 0, time.perf_counter()
        while attempted < measure_images and time.perf_counter() - start < max_seconds:
            chunk = blobs[: measure_images - attempted]
            attempted += len(chunk)
            images += sum(pool.map(decode, chunk))
        seconds = time.perf_counter() - start
        cpu1 = tree_cpu_seconds()
    if images == 0:
        raise RuntimeError("TurboJPEG decoded none of the files")
    return Measured(images, seconds, None if cpu0 is None or cpu1 is None else cpu1 - cpu0)


# ---------------------------------------------------------------------------------------------
# torch DataLoader baseline


def rrc_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params: (left, top, w, h), torch's RNG (seeded per
    DataLoader worker, so workers do not repeat each other)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio).item())
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,)).item())
            left = int(torch.randint(0, width - w + 1, (1,)).item())
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class PilTransform:
    """RandomResizedCrop + flip + to-tensor + normalize with PIL and torch (no torchvision)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __call__(self, img):
        from PIL import Image

        left, top, w, h = rrc_box(*img.size)
        img = img.resize(
            (self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
        )
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
        return x.sub_(self.mean).div_(self.std)


def make_transform(size: int):
    """torchvision's classic transform chain where installed, else `PilTransform` (same ops)."""
    try:
        from torchvision import transforms as T
    except ImportError:
        return PilTransform(size), "PIL + torch ops (torchvision not installed)"
    chain = T.Compose(
        [
            T.RandomResizedCrop(size, antialias=True),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ]
    )
    return chain, "torchvision transforms"


class FileDataset(torch.utils.data.Dataset):
    """PIL-decoded images with labels, the way a torchvision ImageFolder serves them."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int], transform) -> None:
        self.paths = list(paths)
        self.labels = [int(v) for v in labels]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as img:
            return self.transform(img.convert("RGB")), self.labels[i]


def dataloader_baseline(
    paths: Sequence[str], labels: Sequence[int], loop: RowLoop, *, workers: int
) -> tuple[Measured, str]:
    """A torch DataLoader with `workers` processes; returns the rate and which ops it used."""
    transform, how = make_transform(loop.image_size)
    return time_dataloader(FileDataset(paths, labels, transform), loop, workers=workers), how


def time_dataloader(dataset: torch.utils.data.Dataset, loop: RowLoop, *, workers: int) -> Measured:
    """Time a DataLoader over `dataset` (random samples, `workers` processes): the DataLoader
    rows differ only in their dataset."""
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=loop.images_needed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=loop.batch_size,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
    )
    it = (len(images) for images, _labels in loader)
    try:
        return loop.time(it)
    finally:
        it.close()  # shuts the worker processes down


# ---------------------------------------------------------------------------------------------
# DALI in-process pipeline


def dali_pipeline(
    paths: Sequence[str], labels: Sequence[int], loop: RowLoop, *, device: str, threads: int
) -> Measured:
    """DALI reading, random-crop decoding, resizing, flipping and normalizing by itself."""
    from nvidia.dali import fn, pipeline_def, types

    on_gpu = torch.device(device).type == "cuda"
    device_id = (torch.device(device).index or 0) if on_gpu else None

    batch_size, image_size = loop.batch_size, loop.image_size

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=1)
    def graph():
        jpegs, label = fn.readers.file(
            files=list(paths), labels=[int(v) for v in labels], random_shuffle=True, name="files"
        )
        images = fn.decoders.image_random_crop(
            jpegs,
            device="mixed" if on_gpu else "cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
        )
        images = fn.resize(images, resize_x=image_size, resize_y=image_size, antialias=True)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[m * 255 for m in MEAN],
            std=[s * 255 for s in STD],
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, label

    pipe = graph()
    pipe.build()

    def batches(pipe) -> Iterator[int]:
        while True:
            images, _labels = pipe.run()
            tensor = torch.from_dlpack(images.as_tensor())  # what a training loop would take
            yield int(tensor.shape[0])

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    return loop.time(batches(pipe), sync)
