"""What consuming batches costs the training process: client CPU time per image, and images/s.

    python -m batchwire.bench.bench_consumer --train /path/list.txt --batch-size 64 \\
        --image-size 224 --config float32 --config uint8-normalize

Starts a `pipeline-server` on a private ipc:// endpoint for each configuration, iterates a
CPU `RemoteLoader` over it and prints one JSON line per configuration. Why CPU time and not
only images/s: on a shared machine the server's production rate bounds images/s, while the
loader's own cost (receiving, allocating, normalising) is what a CPU-only trainer pays out of
its step time; `time.process_time` counts every thread of this process, ZeroMQ's I/O thread
included.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from batchwire.client.remote_loader import RemoteLoader
from batchwire.common.launcher import PipelineServer

CONFIGS = {
    "float32": ("float32", False),
    "uint8": ("uint8", False),
    "uint8-normalize": ("uint8", True),
}


def _optional(args: argparse.Namespace, *names: str) -> dict:
    """Loader options given on the command line (the original loader lacks some of them)."""
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def run_config(args: argparse.Namespace, name: str, tmp: Path) -> dict:
    dtype, normalize = CONFIGS[name]
    server = PipelineServer(
        [
            *("--train", args.train),
            *("--batch-size", str(args.batch_size), "--image-size", str(args.image_size)),
            *("--output-dtype", dtype, "--log-level", "WARNING", *args.server_arg),
        ],
        f"ipc://{tmp}/{name}.sock",
    )
    with server.start(timeout=120.0):
        loader = RemoteLoader(
            server.endpoint,
            "train",
            rank=0,
            world_size=1,
            device="cpu",
            prefetch=args.prefetch,
            normalize_on_device=normalize,
            **_optional(args, "reuse_buffers", "prefetch_next_epoch"),
        )
        with loader:
            images = batches = 0
            cpu0 = wall0 = 0.0
            epoch_start_waits = []
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                t0 = time.perf_counter()
                for x, _labels in loader:
                    if t0:  # the wait for an epoch's first batch (the epoch boundary)
                        epoch_start_waits.append(time.perf_counter() - t0)
                        t0 = 0.0
                    if batches == args.warmup:
                        cpu0, wall0, images = time.process_time(), time.perf_counter(), 0
                    batches += 1
                    images += x.shape[0]
                    del x, _labels  # a trainer drops the batch before asking for the next
                    if args.step_ms:
                        time.sleep(args.step_ms / 1000)  # a training step that costs no CPU here
            cpu = time.process_time() - cpu0
            wall = time.perf_counter() - wall0
    return {
        "config": name,
        "images": images,
        "client_cpu_ms_per_image": round(1000 * cpu / images, 4),
        "images_per_s": round(images / wall, 1),
        # epochs after the first: what the next-epoch prefetch saves at each boundary
        "epoch_start_wait_ms": [round(1000 * w, 1) for w in epoch_start_waits[1:]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True, help="list file or ImageFolder root")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="batches not measured")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated step time per batch")
    p.add_argument(
        "--prefetch-next-epoch",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=None,
        help="pass prefetch_next_epoch= to RemoteLoader (default: the loader's default)",
    )
    p.add_argument("--config", action="append", choices=sorted(CONFIGS), default=None)
    p.add_argument(
        "--reuse-buffers",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=None,
        help="pass reuse_buffers= to RemoteLoader (default: the loader's default)",
    )
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bw-consumer-") as tmp:
        for name in args.config or ["float32", "uint8-normalize"]:
            print(json.dumps(run_config(args, name, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
