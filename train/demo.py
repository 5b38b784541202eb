"""The demo: serve the embedded dataset, train the small model with 2 DDP ranks, report.

    python -m batchwire.train.demo            # what `make demo` runs
    python -m batchwire.train.demo --epochs 8 --ranks 1

It starts `pipeline-server` on a private ipc:// endpoint (small images, a uint8 wire), waits until
it answers, launches `torchrun --nproc_per_node=2 --no-python pipeline-train ...` (gloo on the
CPU, NCCL on GPUs), streams the trainer's output (validation accuracy and data-wait fraction per
epoch), and always stops the server again, on success, failure and Ctrl-C alike. The exit code is
the trainer's (or 1 when --min-top1 is given and not reached).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from batchwire.common.launcher import PipelineServer, terminate

_EPOCH_LINE = re.compile(r"^epoch (\d+): val top1=([\d.]+)% top5=([\d.]+)% data-wait=([\d.]+)%")
# Enough for the embedded dataset's shapes and textures; one third of the area still shows them.
_TRAIN_ARGS = ("--lr", "0.2", "--label-smoothing", "0.1", "--warmup-epochs", "0.5")
# How long the server and the trainer get to exit on SIGTERM before they are killed.
GRACE_S = 10.0


def _bin(name: str) -> str | None:
    """The console script next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def server_args(args: argparse.Namespace) -> list[str]:
    """`pipeline-server` options for the demo (the launcher adds the executable and --bind)."""
    return [
        "--image-size", str(args.image_size),
        "--batch-size", str(args.batch_size),
        "--output-dtype", "uint8",
        "--scale", "0.35,1",
        "--seed", str(args.seed),
        "--log-level", "WARNING",
    ]  # fmt: skip


def trainer_command(endpoint: str, args: argparse.Namespace) -> list[str]:
    train_args = [
        "--server", endpoint,
        "--model", "small",
        "--epochs", str(args.epochs),
        "--log-every", str(args.log_every),
        "--device", args.device,
        "--seed", str(args.seed),
        *_TRAIN_ARGS,
    ]  # fmt: skip
    exe = _bin("pipeline-train")
    if args.ranks == 1:
        return [*([exe] if exe else [sys.executable, "-m", "batchwire.train.cli"]), *train_args]
    # --standalone: a private rendezvous on a free port, so two demos never collide.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher.append(f"--nproc_per_node={args.ranks}")
    if exe:
        return [*launcher, "--no-python", exe, *train_args]
    return [*launcher, "-m", "batchwire.train.cli", *train_args]


def _stop(proc: subprocess.Popen, name: str) -> None:
    """SIGTERM, then SIGKILL after `GRACE_S`: a child never outlives the demo."""
    if terminate(proc, GRACE_S):
        _say_killed(name)


def _say_killed(name: str) -> None:
    print(f"demo: {name} ignored SIGTERM for {GRACE_S:g}s; killed it", file=sys.stderr)


def run_trainer(cmd: list[str]) -> tuple[int, list[tuple[int, float, float, float]]]:
    """Run the trainer, echo its output, and collect (epoch, top1, top5, data-wait %) lines."""
    epochs = []
    # torchrun would set this itself (one thread per rank on a small machine), with a warning.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            m = _EPOCH_LINE.match(line)
            if m:
                epochs.append((int(m[1]), float(m[2]), float(m[3]), float(m[4])))
        return proc.wait(), epochs
    finally:
        _stop(proc, "the trainer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchwire.train.demo",
        description="Serve the embedded dataset and train the small model on it with DDP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2, help="DDP processes (torchrun)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu, or auto/cuda for one GPU per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps per log line")
    p.add_argument("--endpoint", help="serve here instead of a private ipc:// socket")
    p.add_argument("--min-top1", type=float, help="exit 1 unless the last epoch reaches this %%")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Generate the dataset here, with its own message, rather than inside the server's start.
    from batchwire.pipeline.synthetic import default_dataset

    data = default_dataset()
    print(f"demo: embedded dataset in {data.train_root.parent}", flush=True)
    with tempfile.TemporaryDirectory(prefix="batchwire-demo-") as tmp:
        # No log file: the server's own warnings go to the demo's output, as they happen.
        server = PipelineServer(server_args(args), args.endpoint or f"ipc://{tmp}/server.sock")
        endpoint = server.endpoint
        try:
            print(f"demo: $ {' '.join(server.command)}", flush=True)
            server.start(timeout=120.0)
            cmd = trainer_command(endpoint, args)
            print(f"demo: $ {' '.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            code, epochs = run_trainer(cmd)
            seconds = time.perf_counter() - t0
        except KeyboardInterrupt:
            print("demo: interrupted", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 1
        finally:
            if server.stop(GRACE_S).killed:
                _say_killed("pipeline-server")
    if code != 0:
        print(f"demo: training failed (exit code {code})", file=sys.stderr)
        return code if code > 0 else 1
    if not epochs:
        print("demo: the trainer reported no validation result", file=sys.stderr)
        return 1
    _, top1, top5, wait = epochs[-1]
    print(
        f"demo: done in {seconds:.0f} s with {args.ranks} rank(s): val top1={top1:.2f}% "
        f"top5={top5:.2f}%, data-wait {wait:.1f}% of training time",
        flush=True,
    )
    if args.min_top1 is not None and top1 < args.min_top1:
        print(f"demo: top-1 {top1:.2f}% is below --min-top1 {args.min_top1:g}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
