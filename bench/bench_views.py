"""Multi-view crops against one view: CPU ms per image and images/s, same data, same run.

    python -m batchwire.bench.bench_views [--data DIR] [--batches N] [--views SPEC]

Every row produces the same batches of train samples with `BatchProducer.produce` on one
thread (read, decode, augment; as a server's producer does). "single view 224" is the default
path (crop-region decode at a DCT scale, one fused op call); "1 view via --views" is the same
crop count through the multi-view path (the whole image decoded at full size, which is what
views pay for decoding once); the multi-view row (default DINO's ``2x224:0.4-1.0,6x96:0.05-0.4``)
runs the fused op once per view on each decoded image. Images/s counts source images (samples),
crops/s every view produced. CPU time is the process's (steadier than wall time on a shared
machine).
"""

from __future__ import annotations

import argparse

import torch
from batchwire.bench.bench_transforms import time_produce
from batchwire.bench.data import DEFAULT_DATA
from batchwire.pipeline.augment_plan import AugmentConfig

DINO = "2x224:0.4-1.0,6x96:0.05-0.4"


def run(data: str, batches: int, batch_size: int, views: str | None) -> tuple[float, float, int]:
    """(CPU ms per image, images per second, crops per image) of ``batches`` batches."""
    config = AugmentConfig(image_size=224, train=True, output_dtype="uint8", views=views)
    ms, rate = time_produce(data, config, batches, batch_size)
    return ms, rate, max(1, len(config.views))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--views", default=DINO, help=f"the multi-view row's --views (default {DINO})")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.batches} x {args.batch_size} images from {args.data}")
    print("| path | CPU ms/img | images/s (1 thread) | crops/s |")
    print("| --- | ---: | ---: | ---: |")
    rows = (
        ("single view 224", None),
        ("1 view via --views 1x224:0.08-1.0", "1x224:0.08-1.0"),
        (f"multi-view {args.views}", args.views),
    )
    for name, views in rows:
        ms, rate, crops = run(args.data, args.batches, args.batch_size, views)
        print(f"| {name} | {ms:.2f} | {rate:.0f} | {rate * crops:.0f} |")


if __name__ == "__main__":
    main()
