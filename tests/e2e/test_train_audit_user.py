"""A first-week user's checks of pipeline-train and pipeline-monitor against one real server.

What a user relies on, checked against a count made here rather than against the tool's own
figures: the epoch line's val top-1 is the one a count of the val split here gets; a sweep of three
jobs on one server reports shared batches that the server's counters back; `pipeline-monitor
--once --json` keeps its documented shape and lists each job's trainer. One module-scoped
server (the embedded dataset at 32 px, ipc://). A mid-epoch resume's bit-identical weights:
test_train_data.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.sampler import PADDING_LABEL
from batchwire.train.checkpoint import load_latest
from batchwire.train.models import build_model
from serverproc import ServerProcess, running_server

BATCH = 32
BATCHES_PER_EPOCH = 46  # 1,500 embedded train images // 32 (drop_last)
VAL_IMAGES = 400  # the embedded val split
BIN = Path(sys.executable).parent
SHARED = re.compile(r"^epoch (\d+): .*shared (\d+)/(\d+) batches", re.MULTILINE)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ("--image-size", "32", "--batch-size", str(BATCH), "--seed", "0")
    with running_server(*args, "--log-level", "WARNING", endpoint="ipc") as srv:
        yield srv


def _env(job: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if job:
        env["BATCHWIRE_JOB"] = job
    return env


def _train(endpoint: str, *extra: str) -> list[str]:
    return [
        str(BIN / "pipeline-train"), "--server", endpoint, "--model", "small",
        "--device", "cpu", "--log-every", "1000", *extra,
    ]  # fmt: skip


def _run(cmd: list[str], timeout: float = 90) -> str:
    done = subprocess.run(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    return done.stdout


def _start_job(endpoint: str, i: int) -> subprocess.Popen:
    """Sweep job `i`: its own learning rate and BATCHWIRE_JOB, one epoch, no validation."""
    cmd = _train(endpoint, "--epochs", "1", "--no-val", "--lr", f"0.0{i}")
    return subprocess.Popen(
        cmd, env=_env(f"sweep{i}"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    found = load_latest(folder)
    assert found is not None, f"no checkpoint in {folder}"
    return found[1]["model"]


@pytest.mark.timeout(120)
def test_the_epoch_lines_val_top1_is_what_an_own_count_of_the_val_split_gets(
    server: ServerProcess, tmp_path: Path
) -> None:
    """The checkpointed model, scored here over the server's whole val split (padding left
    out, as a user would count), gets exactly the top-1 and sample count the epoch line says."""
    ckpt = tmp_path / "ckpt"
    before = server.stats()["counters"]
    out = _run(_train(server.endpoint, "--epochs", "1", "--checkpoint-dir", str(ckpt)))
    said = re.search(r"^epoch 0: val top1=([\d.]+)%", out, re.MULTILINE)
    assert said, out
    sent = server.stats()["counters"]["batches_total"] - before["batches_total"]
    # The epoch's batches, train and val, and no more: neither loader asked for epoch 1 ahead.
    assert sent == BATCHES_PER_EPOCH + math.ceil(VAL_IMAGES / BATCH), out
    model = build_model("small", 10)
    model.load_state_dict(_weights(ckpt))
    model.eval()
    loader = RemoteLoader(server.endpoint, "val", normalize_on_device=True, timeout=30)
    loader.set_epoch(0)
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            real = labels != PADDING_LABEL
            correct += int((model(images).argmax(1)[real] == labels[real]).sum())
            total += int(real.sum())
    loader.close()
    assert total == VAL_IMAGES
    assert float(said.group(1)) == pytest.approx(100 * correct / total, abs=0.005), out


@pytest.mark.timeout(150)
def test_a_sweep_of_three_jobs_reports_sharing_the_server_backs(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Three jobs at once, one epoch each: every epoch line counts 46 batches, the jobs'
    shared figures are backed by the server's counters, and the server produced fewer batches
    than it sent.

    The server's ``batches_shared_total`` counts a production's sends after its first; a job
    counts a batch another connected job waited for too, the first one sent included
    (docs/sweeps.md). So a production sent s >= 2 times counts s - 1 on the server and at most
    s in the jobs' lines: the jobs' sum is at most the server's shared count plus the number of
    productions sent more than once, which is at most both that count and the productions."""
    before = server.stats()["counters"]
    procs = [_start_job(server.endpoint, i) for i in (1, 2, 3)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    after = server.stats()["counters"]
    shared_by_jobs = 0
    for out in outs:
        assert "sharing on:" in out, out
        lines = SHARED.findall(out)
        assert [(e, n) for e, _, n in lines] == [("0", str(BATCHES_PER_EPOCH))], out
        shared_by_jobs += int(lines[0][1])
    sent = after["batches_total"] - before["batches_total"]
    produced = after["batches_produced_total"] - before["batches_produced_total"]
    shared = after["batches_shared_total"] - before["batches_shared_total"]
    assert sent >= 3 * BATCHES_PER_EPOCH, (sent, outs)
    assert shared_by_jobs <= shared + min(shared, produced), (shared_by_jobs, shared, produced)
    assert produced < sent, f"no batch was shared: produced {produced}, sent {sent}"


@pytest.mark.timeout(60)
def test_monitor_once_json_has_the_documented_shape_and_lists_each_job(
    server: ServerProcess,
) -> None:
    """docs/metrics.md: one object with fleet, time, dns_error, servers (endpoint, stats,
    error) and total; a single server's stats also at the top level. A connected trainer shows
    under its job's name."""
    loader_code = (
        "from batchwire.client import RemoteLoader\n"
        f"loader = RemoteLoader({server.endpoint!r}, 'train', job='audit-job', timeout=30)\n"
        "it = iter(loader); next(it); next(it); print('ready', flush=True)\n"
        "import sys; sys.stdin.read()\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", loader_code], env=_env(), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "ready"
        done = subprocess.run(
            [str(BIN / "pipeline-monitor"), server.endpoint, "--once", "--json"],
            env=_env(), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    finally:
        trainer.kill()
        trainer.wait()
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert {"fleet", "time", "dns_error", "servers", "total"} <= view.keys(), view.keys()
    assert view["fleet"] == server.endpoint and view["dns_error"] is None
    [entry] = view["servers"]
    assert entry["endpoint"] == server.endpoint and entry["error"] is None
    stats = entry["stats"]
    for key in ("counters", "clients", "stages", "throughput", "uptime_s"):
        assert view[key] == stats[key], key  # the top level: the same server's stats
    jobs = {c.get("job") for c in stats["clients"] if c["split"] == "train"}
    assert "audit-job" in jobs, stats["clients"]
