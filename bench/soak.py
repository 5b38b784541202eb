"""Soak: clients coming and going for a while; the server's resident memory must stay flat.

    python -m batchwire.bench.soak [--minutes 30] [--image-size 64]

One real `pipeline-server` on the embedded dataset. In a loop: a RemoteLoader that reads a few
batches and closes (bye), a raw client that says hello, asks for batches and vanishes without
a word (its connection simply closes), and now and then one that asks for many batches and never
reads (dropped by the server's stall and heartbeat limits). The server's RSS is read from
/proc every few seconds; printed: the first, highest and last readings after warm-up, and the
slope of a least-squares line through them (MB per hour).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import zmq
from batchwire.client import RemoteLoader
from batchwire.common.launcher import PipelineServer
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.raw_client import RawClient


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points) or 1.0
    return sum((t - mt) * (r - mr) for t, r in points) / var * 3600


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchwire.bench.soak", description=__doc__)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    root = str(default_dataset().train_root)
    server_args = [
        *("--train", root, "--batch-size", "32", "--image-size", str(args.image_size)),
        *("--output-dtype", "uint8", "--workers", "1", "--stall-timeout", "5"),
        *("--client-timeout", "10"),
    ]
    rng = random.Random(0)
    ctx = zmq.Context()
    counts = {"loaders": 0, "vanished": 0, "never_read": 0, "batches": 0}
    with (
        tempfile.TemporaryDirectory() as tmp,
        PipelineServer(server_args, log_path=Path(tmp) / "server.log") as srv,
    ):
        start = time.monotonic()
        end = start + args.minutes * 60
        points: list[tuple[float, float]] = []
        next_sample = start
        while time.monotonic() < end:
            with RemoteLoader(
                srv.endpoint,
                "train",
                rank=0,
                world_size=1,
                device="cpu",
                timeout=60,
                normalize_on_device=False,
            ) as loader:
                loader.set_epoch(rng.randrange(1000))
                for k, _ in enumerate(loader):
                    counts["batches"] += 1
                    if k == rng.randrange(2, 6):
                        break
            counts["loaders"] += 1
            ghost = RawClient.connect(ctx, srv.endpoint, batches=(0, 1), epoch=rng.randrange(99))
            ghost.send(ghost.hello)
            ghost.close()  # gone without a bye
            counts["vanished"] += 1
            if rng.random() < 0.1:
                greedy = ctx.socket(zmq.DEALER)
                greedy.linger = 0
                greedy.rcvhwm = 1
                greedy.setsockopt(zmq.RCVBUF, 4096)
                greedy.connect(srv.endpoint)
                never_reads = RawClient(greedy, batches=tuple(range(20)), session=9)
                never_reads.send(never_reads.hello)
                counts["never_read"] += 1
                time.sleep(1.0)  # reading nothing, then gone
                greedy.close(0)
            now = time.monotonic()
            if now >= next_sample:
                points.append((now - start, rss_mb(srv.pid)))
                next_sample = now + 5.0
        stats = srv.stop()
    ctx.term()
    steady = [(t, r) for t, r in points if t >= args.warmup_s] or points
    print(
        f"soak {args.minutes:g} min: {counts['loaders']} loaders came and went "
        f"({counts['batches']} batches), {counts['vanished']} clients vanished without a word, "
        f"{counts['never_read']} asked for 20 batches and never read; server exit "
        f"{stats.returncode}"
    )
    print(
        f"server RSS after {args.warmup_s:g} s warm-up: first {steady[0][1]:.0f} MB, highest "
        f"{max(r for _, r in steady):.0f} MB, last {steady[-1][1]:.0f} MB; slope "
        f"{slope_mb_per_hour(steady):+.1f} MB/hour over {len(steady)} readings"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
