"""pipeline-train on a CUDA device, against a real pipeline-server (the GPU check runs these; they
skip without CUDA): bf16 autocast by default, fp16 with its GradScaler, channels-last, and a
checkpoint resumed exactly. The CPU suite trains the same loop (tests/e2e/test_train.py); what
only a GPU shows is here: the loader's device batches, autocast and the scaler on CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire.train.checkpoint import load_latest
from serverproc import running_server

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SERVER_ARGS = (
    "--image-size", "32", "--batch-size", "32", "--output-dtype", "uint8", "--seed", "0",
    "--log-level", "WARNING",
)  # fmt: skip
#: The CLI through this interpreter: the GPU check installs batchwire into a site on PYTHONPATH,
#: whose console scripts are not beside `sys.executable`.
TRAIN = [sys.executable, "-c", "import sys; from batchwire.train.cli import main; sys.exit(main())"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [*TRAIN, *args], env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=180, check=False,
    )  # fmt: skip


def _finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.timeout(240)
def test_pipeline_train_on_cuda_steps_checkpoints_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with running_server(*SERVER_ARGS) as srv:
        args = [
            "--server", srv.endpoint, "--model", "small", "--device", "cuda", "--lr", "0.2",
            "--log-every", "1", "--epochs", "1", "--no-val", "--channels-last",
            "--checkpoint-dir", str(ckpt),
        ]  # fmt: skip
        first = _run([*args, "--max-steps", "3"])
        assert first.returncode == 0, first.stdout
        assert re.search(r"1 rank\(s\) on cuda", first.stdout), first.stdout
        assert "step 3 (epoch 0 batch 3/" in first.stdout, first.stdout
        _, state = load_latest(ckpt)
        assert (state["epoch"], state["batch"], state["step"]) == (0, 3, 3)
        assert state["scaler"] is None and _finite(state)  # bf16 autocast needs no scaler

        second = _run([*args, "--max-steps", "5", "--amp", "fp16"])
        assert second.returncode == 0, second.stdout
        assert "epoch 0, batch 3, step 3" in second.stdout, second.stdout
        assert "step 3 (" not in second.stdout  # nothing before the checkpoint is trained again
        _, state = load_latest(ckpt)
        assert (state["epoch"], state["batch"], state["step"]) == (0, 5, 5)
        assert state["scaler"] and _finite(state)  # fp16: the GradScaler's state is saved
