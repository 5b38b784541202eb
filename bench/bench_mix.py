"""Mixture cost: CPU ms per image of a two-part mix against the weighted mean of its parts'.

Each part alone, then the mix `mix:a=W@A,b=1-W@B`, produced by `BatchProducer.produce` on one
thread through the split's own sampler (`Split.sampler`: a `MixSampler` for the mix), the same
loop as `bench_transforms.time_produce`. The issue's bound: the mix costs at most 1.05x
W * ms(A) + (1 - W) * ms(B). Runs are interleaved and the best of ``--rounds`` kept per
configuration, so that a busy shared machine skews all three alike.
"""

from __future__ import annotations

import argparse
import time

import torch
from batchwire.bench.data import DEFAULT_DATA, resolve_data
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.sources.mix import open_mix, parse_mix
from batchwire.pipeline.split import build_split
from batchwire.pipeline.synthetic import default_dataset


def time_split(dataset: ImageDataset, config: AugmentConfig, batches: int, size: int) -> float:
    """CPU ms per image of ``batches`` train batches of ``dataset`` (after one warm-up)."""
    with CpuBatchDecoder(threads=1) as decoder:
        split = build_split("train", dataset, config, 0, decoder)
        sampler = split.sampler(size, 0, 0, 1)
        out = config.batch_spec(size).empty()
        split.producer.produce(sampler.plan(0, 0), out)
        cpu0 = time.process_time()
        for k in range(1, batches + 1):
            split.producer.produce(sampler.plan(0, k % sampler.num_batches), out)
        return 1000.0 * (time.process_time() - cpu0) / (batches * size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default=str(DEFAULT_DATA), help="part a (default: the ImageNet sample)")
    p.add_argument("--b", default=None, help="part b (default: the embedded train split)")
    p.add_argument("--weight", type=float, default=0.7, help="part a's weight")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a = resolve_data(args.a).server_train
    b = args.b or str(default_dataset().train_root)
    spec = parse_mix(f"mix:a={args.weight}@{a},b={1 - args.weight}@{b}")
    sets = {
        "a": open_dataset(a, allow_outside_root=True),
        "b": open_dataset(b),
        "mix": open_mix(spec, lambda s: open_dataset(s, allow_outside_root=True), train=True),
    }
    config = AugmentConfig(image_size=args.image_size, train=True)
    best = {name: float("inf") for name in sets}
    for _ in range(args.rounds):
        for name, ds in sets.items():
            best[name] = min(best[name], time_split(ds, config, args.batches, args.batch_size))
    mean = args.weight * best["a"] + (1 - args.weight) * best["b"]
    print(
        f"{args.batches} x {args.batch_size} images at {args.image_size} px, best of {args.rounds}"
    )
    print("| configuration | CPU ms/img |")
    print("| --- | ---: |")
    print(f"| a: {args.a} | {best['a']:.2f} |")
    print(f"| b: {b} | {best['b']:.2f} |")
    print(f"| weighted mean ({args.weight:g} a + {1 - args.weight:g} b) | {mean:.2f} |")
    print(f"| mix a={args.weight:g}, b={1 - args.weight:g} | {best['mix']:.2f} |")
    print(f"| mix / weighted mean | {best['mix'] / mean:.3f} |")


if __name__ == "__main__":
    main()
