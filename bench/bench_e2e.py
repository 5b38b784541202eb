"""End-to-end rate: pipeline-server + one RemoteLoader vs a torch DataLoader, in one run.

    python -m batchwire.bench.bench_e2e [--data DIR] [--batch-size 64] [--image-size 224]

Rows (all random-resized-cropped and flipped ``[B, 3, H, W]`` batches delivered to this
process, on the CPU: this machine has no GPU):

- DataLoader: ``--workers`` processes doing PIL decode, RandomResizedCrop, flip, to-tensor and
  normalize (torchvision's transforms where installed, the same ops in PIL + torch otherwise;
  `batchwire.bench.baselines`).
- batchwire: a real ``pipeline-server`` subprocess on the same machine (its cores shared with
  this process) producing uint8 batches, received by a RemoteLoader here; timed twice: yielding
  the uint8 batches (a GPU trainer normalises them on the device for free), and normalising
  them to float32 on this CPU (the DataLoader row's exact output, paying for it here).

Each row is timed over ``--images`` images after ``--warmup`` batches; the server's start-up
falls before the clock starts. The default data is ``../shared/imagenet-sample`` (a flat
folder of JPEGs; the label is the WordNet id in the file name).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from batchwire.bench.baselines import Measured, dataloader_baseline, time_batches

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}


def list_images(folder: Path) -> tuple[list[str], list[int], Path]:
    """Paths, labels (by WordNet id prefix) and a list file for `pipeline-server --train`."""
    from batchwire.pipeline.paths import cache_dir

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"bench_e2e: no images in {folder}")
    classes = sorted({p.name.split("_", 1)[0] for p in files})
    index = {c: i for i, c in enumerate(classes)}
    labels = [index[p.name.split("_", 1)[0]] for p in files]
    list_file = cache_dir() / "bench" / f"e2e-{folder.name}-{len(files)}.txt"
    list_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = list_file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(f"{p} {y}\n" for p, y in zip(files, labels, strict=True)))
    tmp.replace(list_file)
    return [str(p) for p in files], labels, list_file


def free_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def batchwire_rows(args: argparse.Namespace, train: Path) -> list[tuple[str, Measured, dict]]:
    """Time RemoteLoader batches from one pipeline-server subprocess, two ways.

    ``uint8``: the batches as the wire carries them, what a GPU trainer receives before its
    on-device normalisation (which costs the GPU microseconds). ``normalised``: the loader
    normalises to float32 on this CPU, the same output as the DataLoader row.
    """
    from batchwire.client import RemoteLoader

    endpoint = free_endpoint()
    command = [
        sys.executable,
        "-m",
        "batchwire.server",
        "--bind",
        endpoint,
        "--train",
        str(train),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--output-dtype",
        "uint8",
        "--workers",
        str(args.threads),
        "--producers",
        str(args.producers),
        "--log-level",
        "WARNING",
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bw-e2e-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            for name, normalise in (("uint8", False), ("normalised", True)):
                with RemoteLoader(
                    endpoint,
                    "train",
                    rank=0,
                    world_size=1,
                    device="cpu",
                    normalize_on_device=normalise,
                    prefetch=args.prefetch,
                    timeout=180,
                ) as loader:

                    def batches(loader=loader) -> Iterator[int]:
                        for epoch in itertools.count():
                            loader.set_epoch(epoch)
                            for images, _labels in loader:
                                yield int(images.shape[0])

                    measured = time_batches(batches(), args.warmup, args.images, args.max_seconds)
                    rows.append((name, measured, loader.stats() or {}))
        except Exception as exc:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{exc}\n--- pipeline-server log ---\n{tail}") from exc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_e2e", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="flat folder of images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=1024, help="images timed per row")
    p.add_argument("--warmup", type=int, default=6, help="untimed batches per row")
    p.add_argument("--max-seconds", type=float, default=90.0, help="cap on each row's timing")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=2, help="server decode threads")
    p.add_argument("--producers", type=int, default=2, help="server batch producers")
    p.add_argument("--prefetch", type=int, default=4, help="RemoteLoader credits")
    args = p.parse_args(argv)
    if not args.data.is_dir():
        raise SystemExit(f"bench_e2e: {args.data} is not a folder of images")

    paths, labels, list_file = list_images(args.data)
    print(
        f"data: {args.data} ({len(paths)} images), batch {args.batch_size}, "
        f"{args.image_size} px, {os.cpu_count()} cores",
        flush=True,
    )

    t0 = time.perf_counter()
    base, how = dataloader_baseline(
        paths,
        labels,
        batch_size=args.batch_size,
        image_size=args.image_size,
        workers=args.workers,
        measure_images=args.images,
        warmup=args.warmup,
        max_seconds=args.max_seconds,
    )
    print(
        f"torch DataLoader ({args.workers} workers, {how}): {base.images_per_s:8.1f} images/s "
        f"({base.images} images in {base.seconds:.1f} s; row took "
        f"{time.perf_counter() - t0:.0f} s)",
        flush=True,
    )

    for name, ours, stats in batchwire_rows(args, list_file):
        ratio = ours.images_per_s / base.images_per_s if base.images_per_s else float("inf")
        what = (
            "uint8 batches, as a GPU trainer gets them"
            if name == "uint8"
            else "normalised to float32 on this CPU by the loader"
        )
        print(
            f"batchwire ({what}): {ours.images_per_s:8.1f} images/s ({ours.images} images "
            f"in {ours.seconds:.1f} s), {ratio:.2f}x the DataLoader (goal >= 2.5x); "
            f"loader data-wait fraction {stats.get('data_wait_fraction', float('nan')):.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
