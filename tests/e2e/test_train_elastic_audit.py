"""Audit of pipeline-train's elastic restart (a mid-epoch checkpoint resumed at another world
size), as users and operators meet it: real pipeline-server, real pipeline-train, gloo ranks
under torchrun, the embedded dataset at 32 px (1,500 images: 46 batches of 32 at 1 rank, 23 at
2 ranks; train drops the last incomplete round).

One job history is run once (a module fixture) and checked by several tests: a crash, then
shrinking, then growing, with --accum-steps 2: 2 ranks write a checkpoint each step
(--checkpoint-every 1) and lose rank 1 after step 2 (--fail-at-step, before that step's
checkpoint), so both ranks' index records hold batches the model does not carry; 1 process
resumes from the step-1 checkpoint (rank 0 must cut rank 1's record too), stops inside the pass;
1 process resumes again inside that pass (same world size, a state with start_sample > 0); 2
ranks finish the epoch (an odd number of rounds: a short last group).

Tried too on 2026-11-28 and passing, not kept for the suite's time (about 12 s more): growing
1 -> 2 into the next epoch with --resize-schedule (the 2-rank pass's padding, the next epoch a
whole 2-rank one at its size; the warm-up's lr, now tests/unit/test_train_parts.py's), and a
crash inside a resumed pass under torchrun --max-restarts=1 (the record cut is the unit test's).

Runtime on this 2-core machine (shared): about 9 s for the file.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.synthetic import default_dataset
from batchwire.train.checkpoint import checkpoint_path, load_latest
from batchwire.train.record import read_record, record_path
from serverproc import running_server

BATCH, SEED, LR = 32, 0, 0.2
SERVER_ARGS = (
    "--image-size", "32", "--max-image-size", "32", "--batch-size", str(BATCH),
    "--output-dtype", "uint8", "--scale", "0.35,1", "--seed", str(SEED), "--log-level", "WARNING",
)  # fmt: skip
TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"
NUM_SAMPLES = len(open_dataset(default_dataset().train_root).paths)


def _env() -> dict[str, str]:
    """A clean single-process environment (no inherited torchrun variables), 1 thread each."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _train(endpoint: str, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    """pipeline-train on `ranks` processes (torchrun with gloo ranks above 1, no restarts)."""
    launcher = [str(TRAIN_BIN)] if ranks == 1 else _torchrun(ranks, restarts=0)
    return subprocess.run(
        launcher + _args(endpoint, *extra), env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, check=False,
    )  # fmt: skip


def _args(endpoint: str, *extra: str) -> list[str]:
    return [
        "--server", endpoint, "--model", "small", "--device", "cpu", "--lr", str(LR),
        "--log-every", "1", "--no-val", *extra,
    ]  # fmt: skip


def _torchrun(ranks: int, restarts: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", f"--max-restarts={restarts}", "--no-python", str(TRAIN_BIN),
    ]  # fmt: skip


def _sampler(world: int, rank: int) -> ShardSampler:
    return ShardSampler(
        NUM_SAMPLES, BATCH, seed=SEED, shuffle=True, drop_last=True, rank=rank, world_size=world
    )


def _epoch_samples(epoch: int, world: int) -> list[int]:
    """The samples epoch `epoch` trains when started at `world` ranks, sorted."""
    return sorted(
        i
        for r in range(world)
        for s in [_sampler(world, r)]
        for k in range(s.num_batches)
        for i in s.plan(epoch, k).indices.tolist()
    )


def _records(rec: Path) -> dict[int, list[dict]]:
    """Each rank's index record (ranks 0 and 1: the most either history runs)."""
    return {r: read_record(record_path(rec, r)) for r in (0, 1) if record_path(rec, r).exists()}


def _trained(lines: list[dict], epoch: int) -> list[int]:
    """The samples the records show trained in `epoch`, sorted (padding, -1, left out)."""
    return sorted(i for r in lines if r["epoch"] == epoch for i in r["indices"] if i >= 0)


def _curve_step(out: str) -> int:
    found = re.findall(r"following this run's curve from step (\d+)", out)
    assert len(found) == 1, out
    return int(found[0])


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with running_server(*SERVER_ARGS) as srv:
        yield srv.endpoint


# --------------------------------------------------------------------------- growing 1 -> 2


# ------------------------------------------- crash at 2 ranks, 1 -> 1 inside a pass, 1 -> 2


@dataclass
class Shrunk:
    runs: list[subprocess.CompletedProcess]
    ckpt: Path
    rec: Path
    logs: Path
    old: Path  # a copy of the step-1 checkpoint (2 ranks, batch 2), before any resume


@pytest.fixture(scope="module")
def shrunk(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Shrunk:
    tmp = tmp_path_factory.mktemp("shrunk")
    ckpt, rec, logs, old = tmp / "ckpt", tmp / "rec", tmp / "logs", tmp / "old"
    common = [
        "--epochs", "1", "--accum-steps", "2", "--warmup-epochs", "0", "--checkpoint-dir",
        str(ckpt), "--record-indices", str(rec), "--log-dir", str(logs),
    ]  # fmt: skip
    crash = _train(endpoint, 2, *common, "--checkpoint-every", "1", "--fail-at-step", "2")
    old.mkdir()
    shutil.copy(checkpoint_path(ckpt, 1), old)
    runs = [
        crash,
        _train(endpoint, 1, *common, "--max-steps", "4"),  # pass from 128: 6 batches
        _train(endpoint, 1, *common, "--max-steps", "5"),  # pass from 320: 2 batches
        _train(endpoint, 2, *common),  # pass from 384: 17 rounds, 9 steps
    ]
    return Shrunk(runs, ckpt, rec, logs, old)


@pytest.mark.timeout(200)
def test_a_crash_then_1_rank_then_2_with_accumulation_trains_each_sample_once(
    shrunk: Shrunk,
) -> None:
    """Rank 1 dies after step 2; its record (and rank 0's) holds batches 2-3, after the step-1
    checkpoint. The 1-process restart cuts both files back (no rank of it owns rank 1's), and
    every later pass starts at the global position its checkpoint holds: 128, 320, 384."""
    crash, shrink, again, regrow = shrunk.runs
    assert crash.returncode != 0 and "--fail-at-step 2: rank 1 kills itself" in crash.stdout
    for run in (shrink, again, regrow):
        assert run.returncode == 0, run.stdout
    assert "written mid-epoch by 2 ranks; this run has 1" in shrink.stdout, shrink.stdout
    assert "epoch 0, batch 2, step 1" in shrink.stdout, shrink.stdout
    assert "epoch 0, batch 6, step 4" in again.stdout, again.stdout
    assert "written mid-epoch by 1 ranks; this run has 2" in regrow.stdout, regrow.stdout
    assert "epoch 0, batch 2, step 5" in regrow.stdout, regrow.stdout

    records = _records(shrunk.rec)
    for rank in (0, 1):
        first = [r["batch"] for r in records[rank] if "pass" not in r]
        assert first == [0, 1], f"rank {rank}'s record was not cut to the checkpoint: {first}"
    passes = [(r.get("pass"), r["batch"]) for r in records[0] if "pass" in r]
    assert passes == [(128, k) for k in range(6)] + [(320, 0), (320, 1)] + [
        (384, k) for k in range(17)
    ]
    assert [r["batch"] for r in records[1] if "pass" in r] == list(range(17))
    assert _trained(records[0] + records[1], 0) == _epoch_samples(0, world=2)


@pytest.mark.timeout(200)
def test_the_regrown_pass_ends_the_epoch_with_a_short_last_group_on_the_share_curve(
    shrunk: Shrunk,
) -> None:
    """17 rounds at --accum-steps 2: 9 optimizer steps, the last of one micro-batch; the run
    ends at step 5 + 9, epoch 1 of 1; the curve resumed at 384 / 1,472 of 12 steps = 3.13.
    Its step lines count the pass's 17 batches (the progress bar's total), not the 23 of a
    whole 2-rank epoch, so the log does not show an epoch that ended at batch 17 of 23."""
    regrow = shrunk.runs[-1]
    assert regrow.returncode == 0, regrow.stdout
    assert _curve_step(regrow.stdout) == 3
    assert "step 14 (epoch 0 batch 17/17)" in regrow.stdout, regrow.stdout
    _, state = load_latest(shrunk.ckpt)
    assert (state["epoch"], state["batch"], state["world_size"], state["step"]) == (1, 0, 2, 14)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.timeout(200)
def test_each_restart_follows_its_own_cosine_curve_from_the_share_trained(shrunk: Shrunk) -> None:
    """--warmup-epochs 0: the curve is a cosine from --lr to 0 over the run's steps. The
    1-process runs (23 steps an epoch at --accum-steps 2) start at 128 / 1,472 of it = step 2;
    the 2-rank run (12 steps) at 384 / 1,472 = step 3.13, i.e. 3, and ends at 0 on its last
    step. Each step's learning rate is its own curve's, whatever the optimizer state held."""
    for run in shrunk.runs[1:]:
        assert run.returncode == 0, run.stdout
    assert _curve_step(shrunk.runs[1].stdout) == 2
    with open(shrunk.logs / "steps.csv") as f:
        lrs = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}  # the last run's
    want = {s: LR / 2 * (1 + math.cos(math.pi * (s + 1) / 23)) for s in range(2, 6)}
    want.update({s: LR / 2 * (1 + math.cos(math.pi * (s - 2) / 12)) for s in range(6, 15)})
    off = {s: (lrs[s], w) for s, w in want.items() if not math.isclose(lrs[s], w, abs_tol=1e-9)}
    assert not off, f"(logged, this run's curve) by step: {off}"


@pytest.mark.timeout(200)
def test_a_checkpoint_without_the_elastic_keys_resumes_at_another_world_size(
    endpoint: str, shrunk: Shrunk
) -> None:
    """A checkpoint written before RemoteLoader's state had `start_sample` and
    `epoch_world_size` (the loader itself reads such states as the epoch's own pass at the
    saved world size) resumes on 1 process like a new one: no traceback."""
    path = checkpoint_path(shrunk.old, 1)
    state = torch.load(path, map_location="cpu", weights_only=True)
    for loader_state in state["loader"]:
        del loader_state["start_sample"], loader_state["epoch_world_size"]
    torch.save(state, path)
    run = _train(
        endpoint, 1, "--epochs", "1", "--accum-steps", "2", "--checkpoint-dir", str(shrunk.old),
        "--max-steps", "2",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout
    assert "written mid-epoch by 2 ranks; this run has 1: the rest of epoch 0" in run.stdout
    assert "Traceback" not in run.stdout, run.stdout
    _, state = load_latest(shrunk.old)
    assert (state["epoch"], state["batch"], state["step"]) == (0, 2, 2)
    assert state["loader"][0]["start_sample"] == 2 * 2 * BATCH
