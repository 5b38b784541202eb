"""pipeline-train against a real pipeline-server: a single process, and 2 gloo ranks under torchrun
that lose a rank mid-epoch and recover from the checkpoint.

Real processes, sockets and JPEGs (the embedded dataset at 32 px). Runtime on this 2-core
machine (shared, load 6-8): about 60 s for the file (each test states its own).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.synthetic import default_dataset
from batchwire.train.checkpoint import load_latest
from batchwire.train.logbook import TENSORBOARD_MISSING
from batchwire.train.record import read_record, record_path
from serverproc import running_server

BATCH, SEED = 32, 0
SERVER_ARGS = (
    "--image-size", "32", "--batch-size", str(BATCH), "--output-dtype", "uint8",
    "--scale", "0.35,1", "--seed", str(SEED), "--log-level", "WARNING",
)  # fmt: skip
TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"


def _env() -> dict[str, str]:
    """A clean single-process environment (no inherited torchrun variables), 1 thread each."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def _train_args(endpoint: str, *extra: str) -> list[str]:
    return [
        "--server", endpoint, "--model", "small", "--device", "cpu", "--lr", "0.2",
        "--log-every", "1", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(150)
def test_single_process_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    """About 22 s on 2 cores: 3 steps, stop, then resume to step 5 from the checkpoint."""
    ckpt = tmp_path / "ckpt"
    with running_server(*SERVER_ARGS) as srv:
        logs = tmp_path / "logs"
        common = ["--epochs", "2", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)]
        first = _run([str(TRAIN_BIN), *_train_args(srv.endpoint, *common, "--max-steps", "3")], 60)
        assert first.returncode == 0, first.stdout
        said = [ln for ln in first.stdout.splitlines() if ln.startswith("pipeline-train")]
        assert said[0].startswith("pipeline-train ") and "connecting to tcp://" in said[0], said
        assert "1 rank(s) on cpu" in first.stdout
        if importlib.util.find_spec("tensorboard") is None:
            assert TENSORBOARD_MISSING in first.stdout, first.stdout
        else:
            assert list(logs.glob("events.out.tfevents.*")), "no TensorBoard events written"
        assert "step 3 (epoch 0 batch 3/46): loss" in first.stdout, first.stdout
        assert "epoch 0: val top1=" in first.stdout and "(stopped at --max-steps)" in first.stdout

        _, state = load_latest(ckpt)
        assert (state["epoch"], state["batch"], state["step"]) == (0, 3, 3)
        assert state["loader"][0]["next_batch"] == 3 and state["loader"][0]["rank"] == 0
        assert state["scaler"] is None  # AMP is off on the CPU by default

        second = _run([str(TRAIN_BIN), *_train_args(srv.endpoint, *common, "--max-steps", "5")], 60)
        assert second.returncode == 0, second.stdout
        assert "epoch 0, batch 3, step 3" in second.stdout, second.stdout
        assert "step 4 (epoch 0 batch 4/46)" in second.stdout
        assert "step 3 (" not in second.stdout  # nothing before the checkpoint is trained again
        _, state = load_latest(ckpt)
        assert (state["epoch"], state["batch"], state["step"]) == (0, 5, 5)
        with open(logs / "steps.csv") as f:  # both runs, one row per log line, one header
            assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4, 5]
        with open(logs / "epochs.csv") as f:
            epochs = list(csv.DictReader(f))
        assert [r["epoch"] for r in epochs] == ["0", "0"] and float(epochs[1]["val_top1"]) >= 0

        # The same command again (a supervisor's restart): nothing left to train.
        third = _run([str(TRAIN_BIN), *_train_args(srv.endpoint, *common, "--max-steps", "5")], 60)
        assert third.returncode == 0, third.stdout
        assert "nothing to do" in third.stdout and "step 6 (" not in third.stdout, third.stdout
        assert load_latest(ckpt)[1]["step"] == 5


@pytest.mark.timeout(200)
def test_killed_rank_resumes_from_checkpoint_and_trains_the_epoch_exactly_once(
    tmp_path: Path,
) -> None:
    """About 40 s on 2 cores. 2 gloo ranks under torchrun --max-restarts=1, gradient
    accumulation of 2; a checkpoint every 3 optimizer steps; rank 1 SIGKILLs itself after step
    5, so torchrun restarts both ranks, which resume at step 3 (batch 6). The per-rank index
    record, cut back to the checkpoint on resume, must then hold every batch of the epoch
    exactly once, with exactly the samples the sampler assigns to it.
    """
    ckpt, rec = tmp_path / "ckpt", tmp_path / "rec"
    with running_server(*SERVER_ARGS) as srv:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--max-restarts=1", "--no-python", str(TRAIN_BIN),
            *_train_args(srv.endpoint),
            "--epochs", "1", "--accum-steps", "2", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "3", "--fail-at-step", "5", "--record-indices", str(rec),
        ]  # fmt: skip
        done = _run(cmd, 180)
    out = done.stdout
    assert done.returncode == 0, out
    assert "--fail-at-step 5: rank 1 kills itself" in out, out
    assert "epoch 0, batch 6, step 3" in out, out
    assert "epoch 0: val top1=" in out

    num_samples = len(open_dataset(default_dataset().train_root).paths)
    seen: list[int] = []
    for rank in (0, 1):
        sampler = ShardSampler(
            num_samples, BATCH, seed=SEED, shuffle=True, drop_last=True, rank=rank, world_size=2
        )
        record = read_record(record_path(rec, rank))
        assert [(r["epoch"], r["batch"]) for r in record] == [
            (0, k) for k in range(sampler.num_batches)
        ], f"rank {rank} trained batches {[r['batch'] for r in record]}"
        for r in record:
            assert r["indices"] == sampler.plan(0, r["batch"]).indices.tolist()
            seen.extend(r["indices"])
    assert len(seen) == len(set(seen)) == 2 * sampler.num_batches * BATCH

    _, state = load_latest(ckpt)  # the epoch-end checkpoint
    assert (state["epoch"], state["batch"]) == (1, 0)
    assert state["step"] == -(-sampler.num_batches // 2)  # ceil: the last step has 1 micro-batch
    assert torch.isfinite(next(iter(state["model"].values()))).all()
