"""Benchmark of the fused augment op against the usual per-image chain.

    python -m batchwire.bench.bench_augment [--data ../shared/imagenet-sample] [--images 256]
        [--dtype float32|float16|bfloat16|uint8] [--layout nchw|nhwc]

Decodes the images once with PIL, then times the same work (random-resized-crop, flip, to float,
normalise, 224 px, float32 NCHW batches of 64 by default):
- `chain`: per image PIL crop + resize (BILINEAR, antialiased) + flip, to tensor, normalise with
  torch: what a torchvision-style Dataset does; single thread, and on a thread pool of all cores.
  For uint8 output (the server's wire format) the chain stops at the uint8 tensor, as the op
  does: no normalisation.
- `op cpu`: batchwire.native.augment_batch on the CPU with 1 thread and with all cores.
With CUDA: the op on the GPU against torchvision.transforms.v2 on GPU tensors (where torchvision
is installed), and the op's bandwidth (crop bytes read + batch bytes written per second) as a
fraction of a measured device-to-device copy.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from batchwire import native
from batchwire.bench.data import DEFAULT_DATA
from batchwire.common.cores import available_cores
from PIL import Image

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DTYPES = ("float32", "float16", "bfloat16", "uint8")


def random_resized_crop(
    rng: np.random.Generator, h: int, w: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """An integer (y0, x0, y1, x1) box with torchvision's RandomResizedCrop semantics."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw = round(math.sqrt(target * aspect))
        ch = round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            y0 = int(rng.integers(0, h - ch + 1))
            x0 = int(rng.integers(0, w - cw + 1))
            return y0, x0, y0 + ch, x0 + cw
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, (h - side) // 2 + side, (w - side) // 2 + side


def load_images(folder: Path, count: int) -> list[Image.Image]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg", ".png"))
    if not files:
        raise SystemExit(f"no images in {folder}")
    return [Image.open(p).convert("RGB") for p in files[:count]]


def chain_one(img: Image.Image, box, flip: bool, out: torch.Tensor, mean, std) -> None:
    """The usual per-image chain, written into a slot of the batch."""
    y0, x0, y1, x1 = box
    im = img.crop((x0, y0, x1, y1)).resize((out.shape[2], out.shape[1]), Image.BILINEAR)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.array(im)).permute(2, 0, 1)
    if out.dtype == torch.uint8:
        out.copy_(t)
    else:
        out.copy_((t.float().div(255) - mean) / std)


def best_rate(fn: Callable[[], int], repeats: int) -> tuple[float, float]:
    """Images per wall second and per CPU second (all threads, `time.process_time`) of the best
    of `repeats` runs. On a shared machine the CPU-second figure is the steadier per-core
    measure."""
    wall = cpu = 0.0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        n = fn()
        wall = max(wall, n / (time.perf_counter() - start))
        cpu = max(cpu, n / max(time.process_time() - start_cpu, 1e-9))
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw")
    args = parser.parse_args(argv)

    pil = load_images(args.data, args.images)
    tensors = [torch.from_numpy(np.array(im)) for im in pil]
    rng = np.random.default_rng(0)
    boxes = [random_resized_crop(rng, im.height, im.width) for im in pil]
    flips = [bool(rng.integers(0, 2)) for _ in pil]
    # Fewer images than a batch (a small kit) make one smaller batch rather than no batch.
    n, b, s = len(pil), min(args.batch, len(pil)), args.size
    if n == 0:
        raise SystemExit(f"bench_augment: no images in {args.data}")
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    fmt = torch.channels_last if args.layout == "nhwc" else torch.contiguous_format
    out = torch.empty(b, 3, s, s, dtype=getattr(torch, args.dtype)).contiguous(memory_format=fmt)
    ops = native.load()
    print(
        f"{n} images from {args.data}, batch {b}, {s} px, {args.dtype} {args.layout.upper()}, "
        f"{args.threads} cores"
    )

    def chain_batches(pool: ThreadPoolExecutor | None) -> int:
        for start in range(0, n - b + 1, b):
            items = range(start, start + b)

            def job(i: int, start: int = start) -> None:
                chain_one(pil[i], boxes[i], flips[i], out[i - start], mean, std)

            if pool is None:
                for i in items:
                    job(i)
            else:
                list(pool.map(job, items))
        return (n // b) * b

    box_t = torch.tensor(boxes, dtype=torch.float32)
    flip_t = torch.tensor(flips)
    jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).repeat(n, 1)
    mean_t, std_t = torch.tensor(MEAN), torch.tensor(STD)

    def op_batches(device_images, dst: torch.Tensor) -> int:
        for start in range(0, n - b + 1, b):
            sl = slice(start, start + b)
            ops.augment_batch(
                device_images[sl], box_t[sl], flip_t[sl], jitter[sl], mean_t, std_t, dst
            )
        return (n // b) * b

    rates = {}
    torch.set_num_threads(1)
    rates["chain, 1 thread"] = best_rate(lambda: chain_batches(None), args.repeats)
    rates["op cpu, 1 thread"] = best_rate(lambda: op_batches(tensors, out), args.repeats)
    torch.set_num_threads(args.threads)
    with ThreadPoolExecutor(args.threads) as pool:
        torch.set_num_threads(1)  # one image per thread: torch inside the chain stays serial
        rates[f"chain, {args.threads} threads"] = best_rate(
            lambda: chain_batches(pool), args.repeats
        )
    torch.set_num_threads(args.threads)
    rates[f"op cpu, {args.threads} threads"] = best_rate(
        lambda: op_batches(tensors, out), args.repeats
    )
    for name, (wall, cpu) in rates.items():
        print(
            f"{name:>24}: {wall:9.1f} images/s wall, {cpu:9.1f} images per CPU-second "
            f"({1e3 / cpu:.3f} CPU ms/image)"
        )
    for threads in (1, args.threads):
        suffix = "thread" if threads == 1 else "threads"
        op, chain = rates[f"op cpu, {threads} {suffix}"], rates[f"chain, {threads} {suffix}"]
        print(
            f"ratio op/chain, {threads} {suffix}: {op[0] / chain[0]:.2f}x wall, "
            f"{op[1] / chain[1]:.2f}x per CPU-second"
        )

    if torch.cuda.is_available():
        run_cuda(ops, tensors, box_t, flip_t, args)
    else:
        print("no CUDA device: GPU figures skipped")


def cuda_rate(fn: Callable[[], int], repeats: int) -> float:
    """Images per second of `fn` on the GPU, timed with events after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        n = fn()
        end.record()
        end.synchronize()
        best = max(best, n / (start.elapsed_time(end) / 1e3))
    return best


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the practical HBM ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> int:
        dst.copy_(src)
        return 1

    return 2 * nbytes * cuda_rate(copy, 5)


def run_cuda(ops, tensors, boxes: torch.Tensor, flips: torch.Tensor, args) -> None:
    if not ops.with_cuda:
        print(f"op cuda: the extension has no CUDA ({ops.build.plan.cuda_reason})")
        return
    n, b, s = len(tensors), min(args.batch, len(tensors)), args.size
    images = [t.cuda() for t in tensors]
    jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).repeat(n, 1)
    mean_t, std_t = torch.tensor(MEAN), torch.tensor(STD)
    fmt = torch.channels_last if args.layout == "nhwc" else torch.contiguous_format
    out = torch.empty(b, 3, s, s, dtype=getattr(torch, args.dtype), device="cuda")
    out = out.contiguous(memory_format=fmt)

    def op_batches() -> int:
        for start in range(0, n - b + 1, b):
            sl = slice(start, start + b)
            ops.augment_batch(images[sl], boxes[sl], flips[sl], jitter[sl], mean_t, std_t, out)
        return (n // b) * b

    rate = cuda_rate(op_batches, args.repeats)
    used = (n // b) * b
    crop = (boxes[:used, 2] - boxes[:used, 0]) * (boxes[:used, 3] - boxes[:used, 1])
    bytes_per_image = float(crop.sum()) * 3 / used + 3 * s * s * out.element_size()
    achieved, ceiling = rate * bytes_per_image, copy_bandwidth()
    print(f"{'op cuda':>24}: {rate:9.1f} images/s")
    print(
        f"op cuda bandwidth: {achieved / 1e9:.1f} GB/s (crop bytes read + batch written) = "
        f"{achieved / ceiling:.0%} of a measured device copy ({ceiling / 1e9:.0f} GB/s)"
    )
    try:
        from torchvision.transforms.v2 import functional as tvf
    except ImportError:
        print("torchvision not installed: no transforms.v2 comparison")
        return
    box_list, flip_list = boxes.round().int().tolist(), flips.tolist()

    def tv_batches() -> int:
        for start in range(0, n - b + 1, b):
            for i in range(start, start + b):
                y0, x0, y1, x1 = box_list[i]
                img = images[i].permute(2, 0, 1)
                r = tvf.resized_crop(img, y0, x0, y1 - y0, x1 - x0, [s, s], antialias=True)
                if flip_list[i]:
                    r = tvf.horizontal_flip(r)
                if out.dtype != torch.uint8:
                    r = tvf.normalize(tvf.to_dtype(r, torch.float32, scale=True), MEAN, STD)
                out[i - start].copy_(r)
        return (n // b) * b

    tv_rate = cuda_rate(tv_batches, args.repeats)
    print(f"{'torchvision v2 cuda':>24}: {tv_rate:9.1f} images/s")
    print(f"ratio op/torchvision on cuda: {rate / tv_rate:.2f}x")


if __name__ == "__main__":
    main()
