"""What each `pipeline-bench` row runs, and how a row keeps its fastest run.

A row is a `RowPlan`: a key, a name and a no-argument callable (a `functools.partial` over a
baseline or `batchwire_row`) returning a `Measured`. The rows that read image files
(the decode-only limit and batchwire) are built from one function of the files, so a
`--prepared` copy gets the very same measurement as its original (`_with_prepared`).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from batchwire.bench.data import BenchData
from batchwire.bench.report import Row, prepared_key
from batchwire.common.cores import available_cores
from batchwire.wire.keys import create_keys

if TYPE_CHECKING:  # imported where a row runs: `pipeline-bench --help` needs no torch
    from batchwire.bench import baselines

#: Every row, in table order; `DEFAULT_ROWS` those a bare `pipeline-bench` runs.
ROWS = ("decode", "dataloader", "dataloader-tuned", "dali", "spdl", "batchwire")
DEFAULT_ROWS = ("decode", "dataloader", "dali", "batchwire")
log = logging.getLogger("batchwire.bench")


@dataclass
class RowPlan:
    """One row to run: `run` measures it once; `best` is its fastest run so far (or why it
    could not run), `runs` the rate of every run."""

    key: str
    name: str
    run: Callable[[], baselines.Measured]
    note: str = ""
    best: Row | None = None
    runs: list[float] = field(default_factory=list)


def run_row(plan: RowPlan) -> None:
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
    row = Row(
        plan.key, plan.name, m.images, m.seconds, m.cpu_seconds, note=plan.note,
        fallbacks=m.fallbacks,
    )  # fmt: skip
    if plan.best is None or (plan.best.images_per_s or 0.0) < m.images_per_s:
        plan.best = row


def best_row(plan: RowPlan) -> Row:
    """The row's fastest run (or why it never ran), noting every run's rate when it had several."""
    assert plan.best is not None, "run_row has not run this plan"
    if len(plan.runs) > 1:
        runs = ", ".join(f"{r:.0f}" for r in plan.runs)
        extra = f"best of {len(plan.runs)} runs ({runs} images/s)"
        plan.best.note = f"{plan.best.note}; {extra}" if plan.best.note else extra
    return plan.best


def _with_prepared(
    plan: RowPlan,
    label: str,
    run_on: Callable[[BenchData], Callable[[], baselines.Measured]],
    prepared: BenchData | None,
) -> list[RowPlan]:
    """`plan`, and with a prepared copy its twin: the same measurement (`run_on`, which also
    made `plan.run`) on the copy's files, named "`label` (prepared)"."""
    if prepared is None:
        return [plan]
    where = f"on {prepared.shown}"
    twin = RowPlan(
        prepared_key(plan.key),
        f"{label} (prepared)",
        run_on(prepared),
        note=f"{plan.note}; {where}" if plan.note else where,
    )
    return [plan, twin]


def plan_rows(
    args: argparse.Namespace,
    rows: list[str],
    device: str,
    data: BenchData,
    prepared: BenchData | None,
) -> list[RowPlan]:
    """The rows asked for, in table order, each prepared twin right after its original."""
    plans: list[RowPlan] = []
    if "decode" in rows:
        plans += _decode_plans(args, data, prepared)
    if "dataloader" in rows:
        plans.append(_dataloader_plan(args, data))
    if "dataloader-tuned" in rows:
        plans.append(_dataloader_tuned_plan(args, data))
    if "dali" in rows:
        plans.append(_dali_plan(args, device, data))
    if "spdl" in rows:
        plans.append(_spdl_plan(args, data))
    if "batchwire" in rows:
        plans += _batchwire_plans(args, device, data, prepared)
    return plans


def row_threads(args: argparse.Namespace) -> int:
    """Threads of the decode-limit and DALI rows: --threads, else every core."""
    return args.threads if args.threads is not None else available_cores()


def _server_flags(args: argparse.Namespace) -> str:
    """How the server rows' decode threads were set, for their notes."""
    return f" --workers {args.threads}" if args.threads is not None else ""


def _decode_plans(
    args: argparse.Namespace, data: BenchData, prepared: BenchData | None
) -> list[RowPlan]:
    from batchwire.bench import baselines

    def run_on(files: BenchData) -> Callable[[], baselines.Measured]:
        return functools.partial(
            baselines.decode_limit,
            files.paths,
            threads=row_threads(args),
            measure_images=args.images,
            max_seconds=args.max_seconds,
        )

    label = "decode-only limit"
    plan = RowPlan(
        "decode_limit", f"{label} (TurboJPEG, {row_threads(args)} threads)", run_on(data)
    )
    return _with_prepared(plan, label, run_on, prepared)


def _loop(args: argparse.Namespace) -> baselines.RowLoop:
    """What every batch-delivering row is asked."""
    from batchwire.bench.baselines import RowLoop

    return RowLoop(
        batch_size=args.batch_size,
        image_size=args.image_size,
        measure_images=args.images,
        warmup=args.warmup_batches,
        max_seconds=args.max_seconds,
    )


def _dataloader_plan(args: argparse.Namespace, data: BenchData) -> RowPlan:
    from batchwire.bench import baselines

    _, how = baselines.make_transform(args.image_size)
    return RowPlan(
        "dataloader",
        f"torch DataLoader ({args.workers} workers, PIL)",
        lambda: baselines.dataloader_baseline(
            data.paths, data.labels, _loop(args), workers=args.workers
        )[0],
        note=how,
    )


def _dataloader_tuned_plan(args: argparse.Namespace, data: BenchData) -> RowPlan:
    from batchwire.bench.tuned_baselines import dataloader_tuned

    return RowPlan(
        "dataloader_tuned",
        f"torch DataLoader tuned ({args.workers} workers, PIL draft, uint8)",
        functools.partial(
            dataloader_tuned, data.paths, data.labels, _loop(args), workers=args.workers
        ),
        note="PIL decodes at the DCT scale the crop allows; uint8 batches",
    )


def _spdl_plan(args: argparse.Namespace, data: BenchData) -> RowPlan:
    from batchwire.bench.tuned_baselines import spdl_missing, spdl_pipeline

    plan = RowPlan(
        "spdl",
        f"SPDL pipeline (FFmpeg, {row_threads(args)} threads, uint8)",
        functools.partial(spdl_pipeline, data.paths, _loop(args), threads=row_threads(args)),
    )
    missing = spdl_missing()
    if missing is not None:
        plan.best = Row("spdl", plan.name, skipped=missing)
    return plan


def _dali_plan(args: argparse.Namespace, device: str, data: BenchData) -> RowPlan:
    from batchwire.bench import baselines

    dev_type = device.split(":", 1)[0]
    plan = RowPlan(
        "dali",
        f"DALI pipeline ({dev_type}, {row_threads(args)} threads)",
        functools.partial(
            baselines.dali_pipeline,
            data.paths,
            data.labels,
            _loop(args),
            device=device,
            threads=row_threads(args),
        ),
    )
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        plan.best = Row("dali", plan.name, skipped="NVIDIA DALI is not installed")
    return plan


def _batchwire_plans(
    args: argparse.Namespace, device: str, data: BenchData, prepared: BenchData | None
) -> list[RowPlan]:
    from batchwire.bench.e2e_row import batchwire_row

    dev_type = device.split(":", 1)[0]
    loop = _loop(args)
    row = functools.partial(
        batchwire_row,
        device=device,
        threads=args.threads,
        decoder=args.decoder,
        wire=args.wire,
    )

    def run_on(files: BenchData) -> Callable[[], baselines.Measured]:
        return functools.partial(row, files.server_train, loop, transport=args.transport)

    label = "batchwire"
    plan = RowPlan(
        "batchwire",
        f"{label} (server + RemoteLoader, {dev_type}, {args.wire} wire)",
        run_on(data),
        note=f"pipeline-server --decoder {args.decoder}{_server_flags(args)}, {args.transport}",
    )
    plans = _with_prepared(plan, label, run_on, prepared)
    if args.keys:
        keys_dir = tempfile.mkdtemp(prefix="bw-bench-keys-")
        atexit.register(shutil.rmtree, keys_dir, True)
        keys = str(create_keys(Path(keys_dir) / "keys"))
        plans.append(
            RowPlan(
                "batchwire-keys",
                f"batchwire with keys (CURVE over tcp, {dev_type}, {args.wire} wire)",
                functools.partial(row, data.server_train, loop, transport="tcp", keys=keys),
                note=f"pipeline-server --keys{_server_flags(args)}, tcp",
            )
        )
    return plans
