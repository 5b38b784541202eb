"""`pipeline-bench`: one command that shows how batchwire compares, on a given image folder.

Rows, each timed for `--images` images (or `--max-seconds`) after a warm-up:
  decode-only limit   TurboJPEG full decode of preloaded bytes on all cores (nothing else)
  torch DataLoader    PIL decode + RandomResizedCrop + flip + to-tensor + normalize, --workers
  DALI pipeline       DALI's own file reader + random-crop decode + resize + normalize
  batchwire           a real pipeline-server subprocess + RemoteLoader here, over ipc:// (or
                      --transport tcp); uint8 wire normalised by the loader (or --wire
                      float32, normalised by the server)

`--data` takes an ImageFolder tree, a list file, or a flat folder of images (treated as one
class, through a list file written to the cache folder); default: the embedded dataset.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from batchwire.bench import baselines
from batchwire.bench.report import Report, Row, format_table, write_json, write_plot
from batchwire.wire.keys import create_keys

ROWS = ("decode", "dataloader", "dali", "batchwire")
log = logging.getLogger("batchwire.bench")


@dataclass(frozen=True)
class BenchData:
    """The image files, their labels, and what to pass to `pipeline-server --train`."""

    shown: str
    paths: list[str]
    labels: np.ndarray
    server_train: str


def resolve_data(path: str | None) -> BenchData:
    """Open `path` as an ImageFolder or list file; a flat folder of images becomes one class."""
    from batchwire.pipeline.dataset import IMAGE_EXTENSIONS, open_dataset
    from batchwire.pipeline.paths import cache_dir
    from batchwire.pipeline.synthetic import default_dataset

    target = Path(path).expanduser().resolve() if path else default_dataset().train_root
    if not target.exists():
        raise SystemExit(f"pipeline-bench: --data {target} does not exist")
    has_class_dirs = target.is_dir() and any(p.is_dir() for p in target.iterdir())
    if target.is_file() or has_class_dirs:
        ds = open_dataset(target)
        return BenchData(str(target), list(ds.paths), np.asarray(ds.labels), str(target))
    files = sorted(
        str(p) for p in target.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if not files:
        raise SystemExit(f"pipeline-bench: no image files in {target}")
    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
    list_file = cache_dir() / "bench" / f"flat-{digest}.txt"
    if not list_file.exists():
        list_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = list_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(f"{f} 0\n" for f in files))
        tmp.replace(list_file)
    ds = open_dataset(list_file, allow_outside_root=True)  # our own list, naming the images
    return BenchData(str(target), list(ds.paths), np.asarray(ds.labels), str(list_file))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline-bench",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", metavar="PATH", help="images to read (default: the embedded dataset)")
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="(default: 64)")
    p.add_argument(
        "--image-size", type=int, default=224, metavar="PX", help="output side (default: 224)"
    )
    p.add_argument(
        "--images",
        type=int,
        default=2048,
        metavar="N",
        help="images timed per row after the warm-up, at least 8 batches (default: 2048)",
    )
    p.add_argument(
        "--warmup-batches",
        type=int,
        default=10,
        metavar="N",
        help="batches each row runs before timing starts; more than the prefetch queues "
        "hold (server work-ahead + loader credits), so the timed window is steady state "
        "(default: 10)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="stop a row's timing after this long, whatever --images says (default: 60)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the rows N times in turn and keep each row's fastest run (default: 1)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="cpu or cuda[:N]: where DALI and batchwire decode/augment and where the "
        "loader delivers (default: cpu)",
    )
    cores = os.cpu_count() or 1
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="DataLoader worker processes (default: 2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=cores,
        metavar="N",
        help=f"decode threads of the decode-limit, DALI and server rows (default: all "
        f"{cores} cores)",
    )
    p.add_argument(
        "--decoder",
        default="auto",
        choices=("auto", "cpu", "nvjpeg", "dali"),
        help="pipeline-server --decoder for the batchwire row (default: auto)",
    )
    p.add_argument(
        "--wire",
        default="uint8",
        choices=("uint8", "float32"),
        help="batchwire row: uint8 on the wire, normalised by the loader (default), or float32 "
        "normalised by the server's fused op",
    )
    p.add_argument(
        "--transport",
        default="ipc",
        choices=("ipc", "tcp"),
        help="how the batchwire row's loader reaches its server: ipc (a Unix socket, as a "
        "trainer on the same host would) or tcp (loopback, as from another host) "
        "(default: ipc)",
    )
    p.add_argument(
        "--keys",
        action="store_true",
        help="add a batchwire row over tcp with CURVE keys (every byte encrypted), beside the "
        "plain one",
    )
    p.add_argument(
        "--rows",
        default=",".join(ROWS),
        metavar="LIST",
        help=f"comma-separated rows to run, from {','.join(ROWS)} (default: all)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw a bar chart (needs matplotlib)")
    return p


@dataclass
class RowPlan:
    key: str
    name: str
    run: Callable[[], baselines.Measured]
    note: str = ""
    best: Row | None = None
    runs: list[float] = field(default_factory=list)


def _run_row(plan: RowPlan) -> None:
    """Run one row once, keeping the fastest run (a failure never loses the other rows)."""
    print(f"running: {plan.name} ...", file=sys.stderr, flush=True)
    try:
        m = plan.run()
    except Exception as e:
        log.debug("row %s failed", plan.key, exc_info=True)
        if plan.best is None:
            plan.best = Row(plan.key, plan.name, skipped=f"{type(e).__name__}: {e}"[:500])
        return
    plan.runs.append(m.images_per_s)
    row = Row(plan.key, plan.name, m.images, m.seconds, m.cpu_seconds, note=plan.note)
    if plan.best is None or (plan.best.images_per_s or 0.0) < m.images_per_s:
        plan.best = row


def run_bench(args: argparse.Namespace) -> Report:
    import torch
    from batchwire.bench.e2e_row import batchwire_row

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"pipeline-bench: unknown rows {unknown}; choose from {', '.join(ROWS)}")
    data = resolve_data(args.data)
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        dev = torch.device("meta")  # rejected just below
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"pipeline-bench: --device must be cpu or cuda[:N], got {args.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pipeline-bench: --device cuda needs CUDA, and torch sees no CUDA device")
    config = {
        "data": data.shown,
        "dataset_images": len(data.paths),
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "images_per_row": args.images,
        "device": str(dev),
        "workers": args.workers,
        "threads": args.threads,
        "cpu_cores": os.cpu_count(),
        "warmup_batches": args.warmup_batches,
        "max_seconds": args.max_seconds,
        "repeat": args.repeat,
        "transport": args.transport,
        "torch": torch.__version__,
    }
    report = Report(config)
    common = {"measure_images": args.images, "max_seconds": args.max_seconds}
    loop = {
        **common,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "warmup": args.warmup_batches,
    }
    plans: list[RowPlan] = []
    if "decode" in rows:
        plans.append(
            RowPlan(
                "decode_limit",
                f"decode-only limit (TurboJPEG, {args.threads} threads)",
                lambda: baselines.decode_limit(data.paths, threads=args.threads, **common),
            )
        )
    if "dataloader" in rows:
        _, how = baselines.make_transform(args.image_size)
        plans.append(
            RowPlan(
                "dataloader",
                f"torch DataLoader ({args.workers} workers, PIL)",
                lambda: baselines.dataloader_baseline(
                    data.paths, data.labels, workers=args.workers, **loop
                )[0],
                note=how,
            )
        )
    if "dali" in rows:
        name = f"DALI pipeline ({dev.type}, {args.threads} threads)"
        plans.append(
            RowPlan(
                "dali",
                name,
                lambda: baselines.dali_pipeline(
                    data.paths, data.labels, device=str(dev), threads=args.threads, **loop
                ),
            )
        )
        try:
            import nvidia.dali  # noqa: F401
        except ImportError:
            plans[-1].best = Row("dali", name, skipped="NVIDIA DALI is not installed")
    if "batchwire" in rows:
        row = functools.partial(
            batchwire_row,
            data.server_train,
            device=str(dev),
            threads=args.threads,
            decoder=args.decoder,
            wire=args.wire,
            **loop,
        )
        plans.append(
            RowPlan(
                "batchwire",
                f"batchwire (server + RemoteLoader, {dev.type}, {args.wire} wire)",
                functools.partial(row, transport=args.transport),
                note=f"pipeline-server --decoder {args.decoder} --workers {args.threads}, "
                f"{args.transport}",
            )
        )
        if args.keys:
            keys_dir = tempfile.mkdtemp(prefix="bw-bench-keys-")
            atexit.register(shutil.rmtree, keys_dir, True)
            keys = str(create_keys(Path(keys_dir) / "keys"))
            plans.append(
                RowPlan(
                    "batchwire-keys",
                    f"batchwire with keys (CURVE over tcp, {dev.type}, {args.wire} wire)",
                    functools.partial(row, transport="tcp", keys=keys),
                    note=f"pipeline-server --keys, --workers {args.threads}, tcp",
                )
            )
    # Rows take turns, so a burst of someone else's load on a shared machine hits them alike.
    for _ in range(args.repeat):
        for plan in plans:
            if plan.best is None or plan.best.skipped is None:
                _run_row(plan)
    for plan in plans:
        assert plan.best is not None
        if len(plan.runs) > 1:
            runs = ", ".join(f"{r:.0f}" for r in plan.runs)
            extra = f"best of {len(plan.runs)} runs ({runs} images/s)"
            plan.best.note = f"{plan.best.note}; {extra}" if plan.best.note else extra
        report.rows.append(plan.best)
    return report


def main(argv: list[str] | None = None) -> int:
    """Console script `pipeline-bench`."""
    args = build_parser().parse_args(argv)
    if (
        args.batch_size < 1
        or args.image_size < 1
        or args.images < 1
        or args.workers < 0
        or args.repeat < 1
    ):
        raise SystemExit(
            "pipeline-bench: --batch-size, --image-size, --images, --repeat must be >= 1"
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = run_bench(args)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        why_not = write_plot(report, args.plot)
        print(why_not if why_not else f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
