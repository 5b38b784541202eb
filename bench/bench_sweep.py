"""A sweep on one server: N jobs reading the same epochs together, their aggregate images/s.

    python -m batchwire.bench.bench_sweep [--data DIR] [--batch-size 64] [--image-size 224]
        [--epochs 2] [--jobs 1,2,4,8]

Each job is a `RemoteLoader` in its own process (a trainer that only receives uint8 batches),
all started together against one `pipeline-server` (a fresh one per row): each connects and is
welcomed, then all start reading at once (as a sweep's jobs do once set up). The aggregate rate is
the images every job received while all of them ran (from the last job's first batch to the
first job's last batch: loader processes take seconds to start on a small machine).
Shared production (--share-window) lets N jobs of the same recipe cost one pass of decoding;
the ideal is N x one job's rate while the trainers themselves keep up (on a small machine they
share the cores with the server: each receives, checks and digests its batches).

Rows: 1, 2, 4, 8 jobs of world size 1; a mixed sweep (jobs of world sizes 1, 1, 2 and 4: eight
loader processes, one batch size); one job with the default window and with --share-window 0
(what sharing costs when nothing is shared), alternated twice.

``--rows batch-sizes`` (issue 23's mixed sweep): a server with --max-batch-size 2 x --batch-size
serves jobs of world sizes 1, 1, 2 and 4 with batch sizes B, 2B, 2B and B (eight loader
processes; rounds of B, 2B, 4B, 4B samples, so no job's epoch is a single round on a small
data set): the 2-rank job's batches are the 2B job's, the 4-rank job's the B job's (shared
whole), and the B and 2B families share samples (the sample window). Rows: one
job alone (world size 1, batch B) on the same server settings, then the mixed sweep, with the
samples produced and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from batchwire.bench.data import resolve_data, server_bench_parser
from batchwire.common.launcher import PipelineServer

_JOB = textwrap.dedent(
    """
    import json, sys, time
    from batchwire.client import RemoteLoader
    ep, job, rank, ws, epochs, bs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    loader = RemoteLoader(ep, "train", rank=rank, world_size=ws, device="cpu", job=job,
                          timeout=120.0, batch_size=bs or None, normalize_on_device=False)
    loader.server_info()  # connected and welcomed: wait for the others (see run_sweep)
    print("ready", flush=True)
    sys.stdin.readline()
    times, sizes = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch, _labels in loader:
            times.append(time.time())
            sizes.append(batch.shape[0])
    loader.close()
    print(json.dumps({"times": times, "sizes": sizes}))
    """
)


def build_parser() -> argparse.ArgumentParser:
    p = server_bench_parser("bench_sweep", __doc__, batch_size=64, image_size=224)
    p.add_argument("--epochs", type=int, default=4, help="epochs each job reads")
    p.add_argument("--jobs", default="1,2,4,8", help="job counts of the world-size-1 rows")
    p.add_argument(
        "--rows",
        choices=("world-sizes", "batch-sizes"),
        default="world-sizes",
        help="world-sizes: the rows above; batch-sizes: the mixed sweep of batch sizes B and 2B",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="more pipeline-server options for every row "
        "(e.g. '--max-buffers 128 --share-window 32')",
    )
    return p


#: (job, rank, world size, batch size: 0 for the server's) of a loader process.
Rank = tuple[str, int, int, int]


def run_sweep(endpoint: str, ranks: list[Rank], epochs: int) -> tuple[int, float]:
    """Start every (job, rank, world_size, batch size) loader together; (images, aggregate
    images/s)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _JOB, endpoint, job, str(rank), str(ws), str(epochs), str(bs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for job, rank, ws, bs in ranks
    ]
    # Every loader imported torch and was welcomed before any reads: on a small machine the
    # processes take seconds to start, and a job started that late is outside the windows.
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"a job failed to start (exit {proc.wait()})")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"a job failed (exit {proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    images = sum(sum(r["sizes"]) for r in results)
    # While every job runs: from the last job's first batch to the first job's last (the
    # processes start seconds apart on a small machine, importing torch).
    start = max(r["times"][0] for r in results)
    end = min(r["times"][-1] for r in results)
    inside = sum(
        n for r in results for t, n in zip(r["times"], r["sizes"], strict=True) if start < t <= end
    )
    return images, inside / max(end - start, 1e-9)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = resolve_data(args.data)
    base = [
        *("--train", data.server_train, "--allow-outside-root"),
        *("--batch-size", str(args.batch_size), "--image-size", str(args.image_size)),
        *("--output-dtype", "uint8"),
    ]

    if args.rows == "batch-sizes":
        base += ["--max-batch-size", str(2 * args.batch_size)]
    base += args.server_args.split()

    def row(name: str, ranks: list[Rank], *extra: str) -> tuple[float, float]:
        """(aggregate images/s, server CPU ms per delivered image) of one sweep."""
        with (
            tempfile.TemporaryDirectory() as tmp,
            PipelineServer([*base, *extra], log_path=Path(tmp) / "server.log") as srv,
        ):
            cpu_before = process_cpu_s(srv.pid)
            images, rate = run_sweep(srv.endpoint, ranks, args.epochs)
            cpu_ms = 1000 * (process_cpu_s(srv.pid) - cpu_before) / max(images, 1)
            c = srv_counters(srv.endpoint)
        produced, sent = c.get("batches_produced_total") or 0, c.get("batches_total") or 0
        ratio = sent / produced if produced else 0.0
        samples = ""
        if c.get("samples_produced_total") is not None:
            samples = (
                f"; samples {c['samples_produced_total']} produced, "
                f"{c.get('samples_reused_total') or 0} reused"
            )
        print(
            f"  {name:<34} {rate:8.0f} img/s, server {cpu_ms:.3f} CPU ms per delivered image  "
            f"({images} images; {produced} batches produced, {sent} sent, share ratio "
            f"{ratio:.2f}{samples})",
            flush=True,
        )
        return rate, cpu_ms

    print(
        f"{len(data.paths)} images from {data.shown}; batch {args.batch_size}, "
        f"{args.image_size} px, uint8, {args.epochs} epochs per job; one server, each job a "
        "RemoteLoader process",
        flush=True,
    )
    rates: dict[str, float] = {}
    if args.rows == "batch-sizes":
        b, b2 = args.batch_size, 2 * args.batch_size
        one, one_cpu = row(f"1 job alone (batch {b})", [("solo", 0, 1, b)])
        mixed_b = [("a", 0, 1, b), ("b", 0, 1, b2), *(("c", r, 2, b2) for r in range(2))]
        mixed_b += [("d", r, 4, b) for r in range(4)]
        rate, cpu = row(f"world sizes 1, 1, 2, 4; batch {b}, {b2}, {b2}, {b}", mixed_b)
        print(
            f"  mixed batch sizes {rate / one:5.2f} x one job by images/s, "
            f"{one_cpu / cpu:5.2f} x by server CPU per delivered image"
        )
        return 0
    for n in (int(v) for v in args.jobs.split(",")):
        rates[f"{n} jobs"], _ = row(
            f"{n} job(s) of world size 1", [(f"j{i}", 0, 1, 0) for i in range(n)]
        )
    mixed = [("a", 0, 1, 0), ("b", 0, 1, 0), *(("c", r, 2, 0) for r in range(2))]
    mixed += [("d", r, 4, 0) for r in range(4)]
    rates["mixed"], _ = row("mixed: world sizes 1, 1, 2, 4", mixed)
    on, off = [], []
    for _ in range(2):
        on.append(row("1 job, sharing on (default window)", [("solo", 0, 1, 0)])[0])
        off.append(row("1 job, --share-window 0", [("solo", 0, 1, 0)], "--share-window", "0")[0])
    one = rates.get("1 jobs") or max(on)
    for name, rate in rates.items():
        print(f"  {name:<10} {rate / one:5.2f} x one job")
    cost = 1 - max(on) / max(off)
    print(f"  sharing on vs off, one job (best of 2 each): {100 * cost:+.1f} % slower")
    return 0


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; its threads too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def srv_counters(endpoint: str) -> dict[str, int]:
    from batchwire.wire.stats_client import fetch_stats

    return fetch_stats(endpoint, timeout=10.0).counters.to_map()


if __name__ == "__main__":
    raise SystemExit(main())
