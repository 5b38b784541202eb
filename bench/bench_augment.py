"""Benchmark of the fused augment op against the usual per-image chain.

    python -m batchwire.bench.bench_augment [--data ../shared/imagenet-sample] [--images 256]

Decodes the images once with PIL, then times the same work (random-resized-crop, flip, to float,
normalise, 224 px, float32 NCHW batches of 64):
- `chain`: per image PIL crop + resize (BILINEAR, antialiased) + flip, to tensor, normalise with
  torch: what a torchvision-style Dataset does; single thread, and on a thread pool of all cores.
- `op cpu`: batchwire.native.augment_batch on the CPU with 1 thread and with all cores.
With CUDA: the op on the GPU against torchvision.transforms.v2 on GPU tensors (where torchvision
is installed), and the op's bandwidth (crop bytes read + batch bytes written per second) as a
fraction of a measured device-to-device copy.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from batchwire import native

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"


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
    t = torch.from_numpy(np.asarray(im)).permute(2, 0, 1).float().div(255)
    out.copy_((t - mean) / std)


def best_rate(fn: Callable[[], int], repeats: int) -> float:
    """Images per second of the best of `repeats` runs (the machine is shared: best is steadiest)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - start))
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    pil = load_images(args.data, args.images)
    tensors = [torch.from_numpy(np.asarray(im)).contiguous() for im in pil]
    rng = np.random.default_rng(0)
    boxes = [random_resized_crop(rng, im.height, im.width) for im in pil]
    flips = [bool(rng.integers(0, 2)) for _ in pil]
    n, b, s = len(pil), args.batch, args.size
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    out = torch.empty(b, 3, s, s)
    ops = native.load()
    print(f"{n} images from {args.data}, batch {b}, {s} px, float32 NCHW, {args.threads} cores")

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
            ops.augment_batch(device_images[sl], box_t[sl], flip_t[sl], jitter[sl], mean_t, std_t, dst)
        return (n // b) * b

    rates = {}
    torch.set_num_threads(1)
    rates["chain, 1 thread"] = best_rate(lambda: chain_batches(None), args.repeats)
    rates["op cpu, 1 thread"] = best_rate(lambda: op_batches(tensors, out), args.repeats)
    torch.set_num_threads(args.threads)
    with ThreadPoolExecutor(args.threads) as pool:
        torch.set_num_threads(1)  # one image per thread: torch inside the chain stays serial
        rates[f"chain, {args.threads} threads"] = best_rate(lambda: chain_batches(pool), args.repeats)
    torch.set_num_threads(args.threads)
    rates[f"op cpu, {args.threads} threads"] = best_rate(lambda: op_batches(tensors, out), args.repeats)
    for name, rate in rates.items():
        print(f"{name:>24}: {rate:9.1f} images/s")
    print(f"ratio op/chain, 1 thread: {rates['op cpu, 1 thread'] / rates['chain, 1 thread']:.2f}x")
    key_chain, key_op = f"chain, {args.threads} threads", f"op cpu, {args.threads} threads"
    print(f"ratio op/chain, {args.threads} threads: {rates[key_op] / rates[key_chain]:.2f}x")

    if torch.cuda.is_available():
        from batchwire.bench.bench_augment_cuda import run_cuda

        run_cuda(ops, tensors, boxes, flips, args)


if __name__ == "__main__":
    main()
