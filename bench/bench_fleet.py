"""One loader, two servers of unequal speed: throughput against the sum of each alone, and the
time to recover after one is killed.

    python -m batchwire.bench.bench_fleet [--data DIR] [--batch-size 32] [--images 1024]

Each server is pinned to its own core (so "each alone" and "both" use the same CPU per
server); the slow one is stopped for half of every 100 ms (SIGSTOP/SIGCONT), a stand-in for a
busier or older host. The loader runs here, unpinned, and only receives uint8 batches.

Rows: fast alone, slow alone, both (the loader asks whichever server has room), and the sum
of the two alone, which "both" should approach. With fixed shares (each server a fixed half
of every epoch, as before protocol v2) "both" could not exceed twice the slow server's rate.
Then recovery: both servers unthrottled, the second SIGKILLed a third of the way into the
epoch; reported: the longest wait for a batch around the kill, and whether the epoch came
complete and in order.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from batchwire.bench.data import resolve_data
from batchwire.client import RemoteLoader
from batchwire.common.launcher import PipelineServer

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_fleet", description=__doc__.split("\n\n")[0]
    )
    default = str(DEFAULT_DATA) if DEFAULT_DATA.is_dir() else None
    p.add_argument("--data", default=default, help="images (default: ../shared/imagenet-sample)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=1024, help="images timed per row")
    p.add_argument("--prefetch", type=int, default=4, help="the loader's prefetch (budget)")
    p.add_argument("--slow-duty", type=float, default=0.5, help="share of time the slow one stops")
    return p


class Throttle:
    """Stops a process for ``duty`` of every 100 ms while active."""

    def __init__(self, pid: int, duty: float) -> None:
        self.pid, self.duty = pid, duty
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self._stop.wait(0.1 * self.duty)
            os.kill(self.pid, signal.SIGCONT)
            self._stop.wait(0.1 * (1 - self.duty))

    def __enter__(self) -> Throttle:
        if self.duty > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        os.kill(self.pid, signal.SIGCONT)


def pin(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core`` (affinity is per thread; the server's producer
    and decode threads exist once it serves)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def images_per_s(endpoints: list[str], batches: int, batch_size: int, prefetch: int) -> float:
    """Rate of one RemoteLoader over ``batches`` batches after a warm-up of 3 (epoch 0 on)."""
    with RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", prefetch=prefetch
    ) as loader:
        done, epoch, t0 = 0, 0, 0.0
        while done < batches + 3:
            loader.set_epoch(epoch)
            for _ in loader:
                done += 1
                if done == 3:
                    t0 = time.perf_counter()
                if done == batches + 3:
                    break
            epoch += 1
        return batches * batch_size / (time.perf_counter() - t0)


def recovery(endpoints: list[str], victim: PipelineServer) -> tuple[float, int, int]:
    """(longest wait for a batch, batches yielded, batches in the epoch) with the victim killed
    a third of the way in; the batches' indices are checked to be each batch exactly once."""
    with RemoteLoader(endpoints, "train", rank=0, world_size=1, device="cpu") as loader:
        total = len(loader)
        longest, got = 0.0, 0
        t = time.perf_counter()
        for k, _ in enumerate(loader):
            now = time.perf_counter()
            if k > 0:
                longest = max(longest, now - t)
            t = now
            got += 1
            if k == total // 3:
                victim.kill()
                t = time.perf_counter()
        return longest, got, total


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = resolve_data(args.data)
    batches = max(4, args.images // args.batch_size)
    server_args = [
        *("--train", data.server_train, "--allow-outside-root"),
        *("--batch-size", str(args.batch_size)),
        *("--image-size", str(args.image_size), "--output-dtype", "uint8"),
        *("--workers", "1", "--producers", "2"),
    ]
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        fast = PipelineServer(server_args, log_path=Path(tmp) / "fast.log")
        slow = PipelineServer(server_args, log_path=Path(tmp) / "slow.log")
        with fast, slow:
            for srv, core in ((fast, cores[0]), (slow, cores[-1])):
                pin(srv.pid, core)
            rows = {
                "fast alone": images_per_s([fast.endpoint], batches, args.batch_size, args.prefetch)
            }
            with Throttle(slow.pid, args.slow_duty):
                rows["slow alone"] = images_per_s(
                    [slow.endpoint], batches, args.batch_size, args.prefetch
                )
                both = [fast.endpoint, slow.endpoint]
                rows["both"] = images_per_s(both, batches, args.batch_size, args.prefetch)
            rows["sum of the two alone"] = rows["fast alone"] + rows["slow alone"]
            print(
                f"{len(data.paths)} images from {data.shown}; batch {args.batch_size}, "
                f"{args.image_size} px, uint8, prefetch {args.prefetch}; the slow server stopped "
                f"{args.slow_duty:.0%} of the time"
            )
            for name, rate in rows.items():
                print(f"  {name:<22} {rate:8.0f} img/s")
            share = rows["both"] / rows["sum of the two alone"]
            fixed = 2 * rows["slow alone"]
            print(f"  both / sum: {share:.2f}  (fixed halves would cap 'both' near {fixed:.0f})")
            longest, got, total = recovery([fast.endpoint, slow.endpoint], slow)
            print(
                f"recovery: second server SIGKILLed a third into the epoch: longest wait "
                f"{longest * 1e3:.0f} ms, {got} of {total} batches yielded"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
