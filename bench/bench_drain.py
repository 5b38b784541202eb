"""Drain time on SIGTERM with 4 trainers mid-epoch: how long a server takes to leave a fleet
without losing a batch, and what the trainers notice.

    python -m batchwire.bench.bench_drain [--data DIR] [--batch-size 32] [--image-size 128]

Two servers (--drain-timeout 10) serve four RemoteLoaders, ranks 0..3 of one job, each
iterating in its own thread. A third of the way into the epoch the first server gets SIGTERM.
Reported: the drain as the server logs it (SIGTERM to every client told and every sent batch
let go), SIGTERM to process exit, the longest wait any trainer had for a batch around it
(against its median wait), and whether every rank's epoch came complete, exactly once and in
order (the batches the draining server had asked of it move to the other server).
"""

from __future__ import annotations

import argparse
import itertools
import re
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from batchwire.bench.data import resolve_data
from batchwire.client import RemoteLoader
from batchwire.common.launcher import PipelineServer
from batchwire.pipeline.sampler import ShardSampler

RANKS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_drain", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--data", default=None, help="images (default: the embedded dataset's train)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=5)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.data is None:
        from batchwire.pipeline.synthetic import default_dataset

        data = str(default_dataset().train_root)
    else:
        data = str(resolve_data(args.data).server_train)
    server_args = (
        *("--train", data, "--batch-size", str(args.batch_size)),
        *("--image-size", str(args.image_size), "--output-dtype", "uint8"),
        *("--seed", str(args.seed), "--producers", "2", "--drain-timeout", "10"),
    )
    with tempfile.TemporaryDirectory(prefix="bw-drain-") as tmp:
        a = PipelineServer(server_args, log_path=Path(tmp) / "a.log")
        b = PipelineServer(server_args, log_path=Path(tmp) / "b.log")
        with a, b:
            got: dict[int, list[list[int]]] = {r: [] for r in range(RANKS)}
            times: dict[int, list[float]] = {r: [] for r in range(RANKS)}
            errors: list[BaseException] = []
            num_batches: dict[int, int] = {}
            third = threading.Barrier(RANKS + 1)
            sigterm_at: list[float] = []

            def trainer(rank: int) -> None:
                try:
                    with RemoteLoader(
                        [a.endpoint, b.endpoint], "train", rank=rank, world_size=RANKS,
                        device="cpu", with_indices=True, prefetch=4, timeout=60.0,
                        normalize_on_device=False,
                    ) as loader:  # fmt: skip
                        num_batches[rank] = len(loader)
                        for k, batch in enumerate(loader):
                            times[rank].append(time.monotonic())
                            got[rank].append(batch[2].tolist())
                            if k == len(loader) // 3:
                                third.wait(60)
                except BaseException as exc:  # reported, not raised in a thread
                    errors.append(exc)
                    third.abort()

            threads = [threading.Thread(target=trainer, args=(r,)) for r in range(RANKS)]
            for t in threads:
                t.start()
            third.wait(120)
            sigterm_at.append(time.monotonic())
            assert a._proc is not None
            a._proc.send_signal(signal.SIGTERM)
            code = a._proc.wait(30)
            exit_s = time.monotonic() - sigterm_at[0]
            for t in threads:
                t.join(120)
            log = a.log()
    drained = re.search(r"drained in ([0-9.]+) s", log)
    exact = True
    from batchwire.pipeline.dataset import open_dataset

    n = len(open_dataset(data))
    for rank in range(RANKS):
        plan = ShardSampler(
            n, args.batch_size, seed=args.seed, shuffle=True, drop_last=True, rank=rank,
            world_size=RANKS,
        )  # fmt: skip
        want = [list(plan.plan(0, k).indices) for k in range(plan.num_batches)]
        exact &= got[rank] == want
    gaps = []
    around = []
    for rank in range(RANKS):
        ts = times[rank]
        d = [t1 - t0 for t0, t1 in itertools.pairwise(ts)]
        gaps += d
        around += [
            t1 - t0
            for t0, t1 in itertools.pairwise(ts)
            if sigterm_at[0] - 1 <= t1 <= sigterm_at[0] + exit_s + 1
        ]
    print(f"data: {n} images, batch {args.batch_size}, {args.image_size}px, {RANKS} ranks")
    print(f"exit code {code}; errors seen by trainers: {len(errors)} {errors[:1]}")
    print(f"drain (server's log): {drained.group(1) if drained else 'not logged'} s")
    print(f"SIGTERM to process exit: {exit_s:.2f} s")
    print(
        f"trainer wait per batch: median {statistics.median(gaps) * 1000:.0f} ms, "
        f"longest around the drain {max(around or [0]) * 1000:.0f} ms"
    )
    print(f"every rank's epoch exactly once and in order: {exact}")
    return 0 if exact and not errors and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
