"""pipeline-train on SIGUSR1 (issue 29 item 9): a job warned before its time limit checkpoints
the step it is at, exits 3, and the same command resumes it with nothing trained twice.

- one process: USR1 mid-epoch, exit 3, the only checkpoint is the signal's step (no periodic
  ones), and the rerun ends with exactly the weights of an uninterrupted run;
- 2 gloo ranks under torchrun where only rank 1 gets USR1: the ranks agree, both write the same
  step's checkpoint and exit 3.

Real pipeline-server processes, sockets and JPEGs (the embedded dataset at 32 px). About 20 s
for the file on 2 loaded cores (13 s and 7 s; 26 s at load 8).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from batchwire.train.checkpoint import list_checkpoints, load_latest
from serverproc import running_server

SERVER_ARGS = (
    "--image-size", "32", "--batch-size", "32", "--output-dtype", "uint8", "--scale", "0.35,1",
    "--seed", "0", "--log-level", "WARNING",
)  # fmt: skip
TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"
STEPS = 24  # well past the step the signal comes in (it is sent once step 2 is logged)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _train_args(endpoint: str, ckpt: Path) -> list[str]:
    return [
        "--server", endpoint, "--model", "small", "--device", "cpu", "--lr", "0.2",
        "--log-every", "1", "--epochs", "1", "--max-steps", str(STEPS), "--no-val",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "0",  # epoch ends only
    ]  # fmt: skip


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=90, check=False,
    )  # fmt: skip


def _signal_after(cmd: list[str], line_start: str, target=None) -> tuple[int, str]:
    """Run `cmd`; once a line starts with `line_start`, SIGUSR1 to `target(proc)` (a pid; the
    process itself by default). Returns (exit code, all output)."""
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(line_start):
                os.kill(target(proc) if target else proc.pid, signal.SIGUSR1)
                break
        lines.extend(proc.stdout)
        return proc.wait(timeout=90), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _said_step(out: str) -> int:
    """The step of rank 0's "checkpointed at step N on SIGUSR1" line (exactly one)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith("checkpointed at step ")]
    assert line.endswith(": resume with the same command"), line
    return int(line.split()[3])


@pytest.mark.timeout(150)
def test_usr1_checkpoints_the_current_step_exits_3_and_resumes_to_the_same_weights(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    with running_server(*SERVER_ARGS) as srv:
        full = _run([str(TRAIN_BIN), *_train_args(srv.endpoint, whole)])
        assert full.returncode == 0, full.stdout

        cmd = [str(TRAIN_BIN), *_train_args(srv.endpoint, parts)]
        code, out = _signal_after(cmd, "step 2 (")
        assert code == 3, out
        step = _said_step(out)
        assert 2 <= step < STEPS, out
        # Nothing trained after the step it wrote, and that step is the only checkpoint.
        assert f"step {step} (" in out and f"step {step + 1} (" not in out, out
        assert [s for s, _ in list_checkpoints(parts)] == [step]
        _, state = load_latest(parts)
        assert (state["epoch"], state["batch"], state["step"]) == (0, step, step)
        assert state["loader"][0]["next_batch"] == step
        assert "Traceback" not in out, out

        again = _run(cmd)  # the same command resumes
    assert again.returncode == 0, again.stdout
    assert f"epoch 0, batch {step}, step {step}" in again.stdout, again.stdout
    assert f"step {step} (" not in again.stdout and f"step {STEPS} (" in again.stdout

    _, a = load_latest(whole)
    _, b = load_latest(parts)
    assert a["step"] == b["step"] == STEPS
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after the resume"


def _rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker with RANK=`rank` (its children, read from /proc)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun.pid}")


@pytest.mark.timeout(150)
@pytest.mark.fresh_python  # finds the rank as torchrun's child, by its environment, in /proc
def test_usr1_to_one_rank_checkpoints_every_rank_at_the_same_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    with running_server(*SERVER_ARGS) as srv:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--no-python", str(TRAIN_BIN), *_train_args(srv.endpoint, ckpt),
        ]  # fmt: skip
        code, out = _signal_after(cmd, "step 2 (", target=lambda p: _rank_pid(p, 1))
    step = _said_step(out)
    assert 2 <= step < STEPS, out
    assert f"step {step + 1} (" not in out, out
    # torchrun reports its workers' exit codes: both ranks stopped with 3, none was killed.
    assert code == 1, out
    assert out.count("  exitcode  : 3 (pid: ") == 2, out
    assert [s for s, _ in list_checkpoints(ckpt)] == [step]
    _, state = load_latest(ckpt)
    assert (state["epoch"], state["batch"], state["world_size"]) == (0, step, 2)
    assert [s["next_batch"] for s in state["loader"]] == [step, step]
