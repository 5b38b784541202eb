"""End-to-end rate: pipeline-server + one RemoteLoader vs a torch DataLoader, in one run.

    python -m batchwire.bench.bench_e2e [--data DIR] [--batch-size 64] [--image-size 224]

Rows (all random-resized-cropped and flipped ``[B, 3, H, W]`` batches delivered to this
process, on the CPU):

- DataLoader: ``--workers`` processes doing PIL decode, RandomResizedCrop, flip, to-tensor and
  normalize (`batchwire.bench.baselines.dataloader_baseline`).
- batchwire: one real ``pipeline-server`` subprocess on the same machine (its cores shared with
  this process) producing uint8 batches, received by a RemoteLoader here
  (`batchwire.bench.e2e_row`); timed twice against that server: yielding the uint8 batches (a
  GPU trainer normalises them on the device for free), and normalising them to float32 on this
  CPU (the DataLoader row's exact output, paying for it here).

Each row is timed over ``--images`` images after ``--warmup`` batches; the server's start-up
falls before the clock starts. ``--data`` takes what `pipeline-bench --data` takes; the default
is ``../shared/imagenet-sample`` (a flat folder of JPEGs, served as one class: labels do not
change the rates).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from batchwire.bench.baselines import RowLoop, dataloader_baseline
from batchwire.bench.data import DEFAULT_DATA, resolve_data
from batchwire.bench.e2e_row import pipeline_server, time_remote_loader
from batchwire.common.cores import available_cores

GOAL = 2.5  # issue 4: batchwire at least this many times the DataLoader's rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_e2e", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder or list of images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=1024, help="images timed per row")
    p.add_argument("--warmup", type=int, default=6, help="untimed batches per row")
    p.add_argument("--max-seconds", type=float, default=90.0, help="cap on each row's timing")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=2, help="server decode threads")
    p.add_argument(
        "--producers", type=int, help="server batch producers (default: the server's own)"
    )
    p.add_argument("--prefetch", type=int, default=4, help="RemoteLoader credits")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = resolve_data(str(args.data))
    print(
        f"data: {data.shown} ({len(data.paths)} images), batch {args.batch_size}, "
        f"{args.image_size} px, {available_cores()} cores",
        flush=True,
    )
    timing = {"measure_images": args.images, "warmup": args.warmup, "max_seconds": args.max_seconds}

    t0 = time.perf_counter()
    loop = RowLoop(args.batch_size, args.image_size, **timing)
    base, how = dataloader_baseline(data.paths, data.labels, loop, workers=args.workers)
    print(
        f"torch DataLoader ({args.workers} workers, {how}): {base.images_per_s:8.1f} images/s "
        f"({base.images} images in {base.seconds:.1f} s; row took "
        f"{time.perf_counter() - t0:.0f} s)",
        flush=True,
    )

    with pipeline_server(
        data.server_train,
        batch_size=args.batch_size,
        image_size=args.image_size,
        threads=args.threads,
        producers=args.producers,
    ) as endpoint:
        for normalise, what in (
            (False, "uint8 batches, as a GPU trainer gets them"),
            (True, "normalised to float32 on this CPU by the loader"),
        ):
            ours, stats = time_remote_loader(
                endpoint,
                device="cpu",
                normalize_on_device=normalise,
                prefetch=args.prefetch,
                start_timeout=180,
                **timing,
            )
            ratio = ours.images_per_s / base.images_per_s if base.images_per_s else float("inf")
            print(
                f"batchwire ({what}): {ours.images_per_s:8.1f} images/s ({ours.images} images "
                f"in {ours.seconds:.1f} s), {ratio:.2f}x the DataLoader (goal >= {GOAL}x); "
                f"loader data-wait fraction {stats.get('data_wait_fraction', float('nan')):.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
