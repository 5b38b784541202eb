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
`--prepared` takes a copy of it made by `pipeline-prepare` (the same JPEGs with a restart
marker after every MCU, which the CPU decoder crops without decoding the rest) and adds the
decode-only limit and batchwire rows on it, each beside its original.
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from batchwire.bench.chart import plot_unavailable, write_plot
from batchwire.bench.data import BenchData, check_prepared, resolve_data
from batchwire.bench.report import Report, format_table, write_json
from batchwire.bench.rows import DEFAULT_ROWS, ROWS, best_row, plan_rows, run_row
from batchwire.common.cores import available_cores
from batchwire.wire.cli import ArgumentParser
from batchwire.wire.version import add_version_argument

if TYPE_CHECKING:
    import torch


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pipeline-bench",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_argument(p)
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
    cores = available_cores()
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
        metavar="N",
        help=f"decode threads of the decode-limit and DALI rows (default: all {cores} cores) "
        "and the server rows' --workers (default: the server's own choice)",
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
        default=",".join(DEFAULT_ROWS),
        metavar="LIST",
        help=f"comma-separated rows to run, from {','.join(ROWS)} (default: "
        f"{','.join(DEFAULT_ROWS)})",
    )
    p.add_argument(
        "--prepared",
        metavar="PATH",
        help="a copy of --data made by pipeline-prepare, of the same kind (for a list file, "
        "the copy's list file): adds the decode-only limit and batchwire rows on it",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw images/s and CPU ms/img per row (needs matplotlib: "
        "pip install 'batchwire[bench]')",
    )
    return p


def run_bench(args: argparse.Namespace) -> Report:
    """Resolve the data and device, run every requested row `--repeat` times in turn, and
    return the report holding each row's fastest run."""
    import torch

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"pipeline-bench: unknown rows {unknown}; choose from {', '.join(ROWS)}")
    data = resolve_data(args.data)
    prepared = resolve_data(args.prepared, "--prepared") if args.prepared else None
    if prepared is not None:
        check_prepared(data, prepared)
    dev = _device(args.device)
    report = Report(_config(args, data, prepared, str(dev), torch.__version__))
    plans = plan_rows(args, rows, str(dev), data, prepared)
    # Rows take turns, so a burst of someone else's load on a shared machine hits them alike.
    for _ in range(args.repeat):
        for plan in plans:
            if plan.best is None or plan.best.skipped is None:
                run_row(plan)
    report.rows += [best_row(plan) for plan in plans]
    return report


def _device(name: str) -> torch.device:
    """`--device` as a torch.device, refused unless it is the CPU or a CUDA device torch sees."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = torch.device("meta")  # rejected just below
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"pipeline-bench: --device must be cpu or cuda[:N], got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pipeline-bench: --device cuda needs CUDA, and torch sees no CUDA device")
    return dev


def _config(
    args: argparse.Namespace,
    data: BenchData,
    prepared: BenchData | None,
    device: str,
    torch_version: str,
) -> dict:
    """What the report says it measured: enough to rerun it and to read its figures right."""
    return {
        "data": data.shown,
        "prepared": prepared.shown if prepared is not None else None,
        "dataset_images": len(data.paths),
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "images_per_row": args.images,
        "device": device,
        "workers": args.workers,
        "threads": args.threads,
        "cpu_cores": available_cores(),
        "warmup_batches": args.warmup_batches,
        "max_seconds": args.max_seconds,
        "repeat": args.repeat,
        "transport": args.transport,
        "torch": torch_version,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


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
    why_no_plot = plot_unavailable() if args.plot else None
    if why_no_plot is not None:  # said now, not after minutes of measuring
        raise SystemExit(f"pipeline-bench: {why_no_plot}")
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
