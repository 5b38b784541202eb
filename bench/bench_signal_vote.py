"""Cost of pipeline-train's SIGUSR1 vote against the cost of a training step, gloo on the CPU.

    python -m batchwire.bench.bench_signal_vote [--calls 5000] [--steps 30]

After each optimizer step every rank adds its 0/1 "got SIGUSR1" flag over the process group and
reads the sum (`Trainer._checkpoint_requested`: fill_, all_reduce, item on one int32). This times
exactly that, on 2 gloo ranks of this host (1 thread each), and, in the same processes, one
optimizer step of the smallest model pipeline-train has (`small`, batch 32 at 32 px, SGD, DDP):
the vote runs every step if it is small next to that.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from batchwire.train.distributed import exit_after_distributed, shutdown_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vote_times(calls: int) -> list[float]:
    flag = torch.zeros(1, dtype=torch.int32)
    times = []
    for k in range(calls + 200):  # the first 200 warm the connections up
        t0 = time.perf_counter()
        flag.fill_(0)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        bool(flag.item())
        if k >= 200:
            times.append(time.perf_counter() - t0)
    return times


def _step_times(steps: int) -> list[float]:
    from batchwire.train.models import build_model

    torch.manual_seed(0)
    model = DDP(build_model("small", 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    times = []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, port: int, calls: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    votes, step = _vote_times(calls), _step_times(steps)
    if rank == 0:
        votes.sort()
        median, mean = statistics.median(votes), statistics.fmean(votes)
        p90 = votes[int(0.9 * len(votes))]
        step_median = statistics.median(step)
        print(
            f"vote (2 gloo ranks, {calls} calls): median {median * 1e3:.3f} ms, "
            f"p90 {p90 * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms"
        )
        print(
            f"step (model small, batch 32 at 32 px, DDP, {steps} steps): median "
            f"{step_median * 1e3:.1f} ms; vote mean / step median = {100 * mean / step_median:.2f}%"
        )
    shutdown_distributed()
    exit_after_distributed(0)  # gloo threads that DDP used must not see the teardown


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5000, help="votes timed")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps timed")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(_free_port(), args.calls, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
