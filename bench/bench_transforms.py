"""A user transform against the fused op: CPU ms per image and images/s, same data, same run.

    python -m batchwire.bench.bench_transforms [--data DIR] [--batches N] [--image-size PX]

Both rows produce the same batches' worth of train samples with `BatchProducer.produce` on one
thread (read, decode, augment): "fused op" is the built-in path (crop-region decode at a DCT
scale, then the C++ op), "user transform" is `pipeline.transforms.RandomResizedCropFlip`, the
same recipe in plain torch, on the whole image decoded at full size (what `--transform` gets).
CPU time is the process's (steadier than wall time on a shared machine).
"""

from __future__ import annotations

import argparse
import time

import torch
from batchwire.bench.data import DEFAULT_DATA, resolve_data
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.transforms import RandomResizedCropFlip


def run(
    data: str, batches: int, size: int, batch_size: int, transform: bool
) -> tuple[float, float]:
    """(CPU ms per image, images per second) of producing ``batches`` batches."""
    config = AugmentConfig(
        image_size=size,
        train=True,
        output_dtype="uint8",
        transform=RandomResizedCropFlip(size) if transform else None,
    )
    return time_produce(data, config, batches, batch_size)


def time_produce(
    data: str, config: AugmentConfig, batches: int, batch_size: int
) -> tuple[float, float]:
    """(CPU ms per image, images per second) of ``batches`` train batches of ``data`` produced
    with ``config`` by `BatchProducer.produce` on one thread, after one warm-up batch (imports,
    first allocations). Shared by the benches that compare augment paths (this one and
    bench_views), so their rows are measured the same way: same sampler, seed and loop."""
    bench_data = resolve_data(data)
    dataset = open_dataset(bench_data.server_train, allow_outside_root=True)
    with CpuBatchDecoder(threads=1) as decoder:
        producer = BatchProducer(dataset, config, 0, decoder)
        sampler = ShardSampler(len(dataset), batch_size, seed=0, shuffle=True, drop_last=True)
        out = config.batch_spec(batch_size).empty()
        producer.produce(sampler.plan(0, 0), out)  # warm-up: imports, first allocations
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for k in range(1, batches + 1):
            producer.produce(sampler.plan(0, k % sampler.num_batches), out)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = batches * batch_size
    return 1000.0 * cpu / n, n / wall


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.batches} x {args.batch_size} images at {args.image_size} px from {args.data}")
    print("| path | CPU ms/img | images/s (1 thread) |")
    print("| --- | ---: | ---: |")
    for name, transform in (("fused op", False), ("user transform (torch)", True)):
        ms, rate = run(args.data, args.batches, args.image_size, args.batch_size, transform)
        print(f"| {name} | {ms:.2f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
