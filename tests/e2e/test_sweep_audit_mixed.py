"""Sweep audit on real servers: a mixed sweep on one server, as users and operators see it.

Jobs of batch sizes 16 and 32, image sizes 32 and 48 px, world sizes 1 and 2 and epochs 0 and 1
read one server together (docs/sweeps.md): each gets, byte for byte, the stream the same job
gets alone from a server with --share-window 0; the server's counters, its Prometheus page and
pipeline-monitor agree with what the jobs counted; its buffers stay within --max-buffers. A job
killed (SIGKILL) mid-epoch and restarted from its state_dict finishes its exact epoch, and a
client that joins with another job's parameters and stops reading holds nobody back.
Loopback, 400 images of 32 px; loaders do not ask the next epoch ahead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from batchwire.client import RemoteLoader
from promtext import parse_metrics
from serverproc import free_tcp_endpoint, running_server, small_server_args
from sharingjobs import run_jobs

SEED = 13
SIZES = ("--max-batch-size", "32", "--max-image-size", "48")
#: name -> (RemoteLoader keywords, epoch)
JOBS: dict[str, tuple[dict, int]] = {
    "a16": ({"job": "a"}, 0),
    "b16": ({"job": "b"}, 0),
    "c32": ({"job": "c", "batch_size": 32}, 0),
    "d48": ({"job": "d", "image_size": (48, 48)}, 0),
    "w2r0": ({"job": "w", "world_size": 2, "rank": 0}, 0),
    "w2r1": ({"job": "w", "world_size": 2, "rank": 1}, 0),
    "e1": ({"job": "e"}, 1),
}
# Distinct batches among the jobs: epoch 0 at 16 (25; world size 2 reads the same), at 32 (12),
# at 48 px (25), and epoch 1 at 16 (25).
DISTINCT = 25 + 12 + 25 + 25


def _digest(images, labels, indices) -> str:
    h = hashlib.sha256(images.numpy().tobytes())
    h.update(labels.numpy().tobytes())
    h.update(indices.numpy().tobytes())
    return h.hexdigest()


def stream(endpoint: str, epoch: int, **kw) -> tuple[list[str], tuple[int, int]]:
    """One job's epoch: a digest per batch, and its `batch_totals()`."""
    loader = RemoteLoader(
        endpoint, "train", device="cpu", with_indices=True, timeout=60.0,
        prefetch_next_epoch=False, **kw,
    )  # fmt: skip
    try:
        loader.set_epoch(epoch)
        out = [_digest(*batch) for batch in loader]
        return out, loader.batch_totals()
    finally:
        loader.close()


@pytest.fixture(scope="module")
def solo() -> dict[str, list[str]]:
    """Each job alone on a server that shares nothing."""
    with running_server(*small_server_args(seed=SEED), *SIZES, "--share-window", "0") as srv:
        ref = {name: stream(srv.endpoint, epoch, **kw)[0] for name, (kw, epoch) in JOBS.items()}
        c = srv.stats()["counters"]
        assert (c["batches_shared_total"], c["samples_reused_total"]) == (0, 0)
    return ref


@pytest.fixture(scope="module")
def shared():
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    args = ("--share-window", "8", "--max-buffers", "40", "--metrics-port", str(port))
    with running_server(*small_server_args(seed=SEED), *SIZES, *args) as srv:
        srv.metrics_port = port  # type: ignore[attr-defined]
        yield srv


def _watch_buffers(srv, stop: threading.Event, peak: dict[str, int]) -> None:
    while not stop.is_set():
        buffers = srv.stats()["buffers"]
        peak["allocated"] = max(peak["allocated"], buffers["allocated"])
        peak["max"] = buffers["max"]
        stop.wait(0.02)


def test_a_mixed_sweep_gets_its_solo_streams_and_the_figures_agree(solo, shared) -> None:
    ep = shared.endpoint
    before = shared.stats()["counters"]
    stop, peak = threading.Event(), {"allocated": 0, "max": 0}
    watcher = threading.Thread(target=_watch_buffers, args=(shared, stop, peak))
    watcher.start()
    try:
        names = list(JOBS)
        results = run_jobs([lambda n=n: [json.dumps(stream(ep, JOBS[n][1], **JOBS[n][0]))]
                            for n in names])  # fmt: skip
    finally:
        stop.set()
        watcher.join(10)
    got = {n: json.loads(r[0]) for n, r in zip(names, results, strict=True)}
    for name in names:
        assert got[name][0] == solo[name], f"{name} did not get its solo stream"
    # Batches of another size, image size or epoch are other batches: never shared.
    for name in ("c32", "d48", "e1"):
        assert got[name][1][1] == 0, (name, got[name][1])
    c = shared.stats()["counters"]
    delta = {k: c[k] - before[k] for k in c}
    received = sum(got[n][1][0] for n in names)
    assert delta["batches_total"] == received == sum(len(solo[n]) for n in names)
    # Each production sent at least once: the sends after the first are the rest.
    assert delta["batches_produced_total"] >= DISTINCT
    assert delta["batches_shared_total"] == delta["batches_total"] - delta["batches_produced_total"]
    assert sum(got[n][1][1] for n in names) <= 2 * delta["batches_shared_total"]
    assert 0 < peak["allocated"] <= peak["max"] <= 40
    # Prometheus and pipeline-monitor say what the stats say.
    url = f"http://127.0.0.1:{shared.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        metrics = parse_metrics(resp.read().decode())
    for key in ("batches_total", "batches_produced_total", "batches_shared_total",
                "samples_reused_total", "samples_produced_total"):  # fmt: skip
        assert metrics[f"batchwire_{key}"] == c[key], key
    monitor = Path(sys.executable).parent / "pipeline-monitor"
    shown = subprocess.run(
        [str(monitor), "--once", "--no-color", ep], capture_output=True, text=True, timeout=60,
        check=True,
    ).stdout  # fmt: skip
    line = next(x for x in shown.splitlines() if x.startswith("sharing"))
    assert re.search(
        rf"produced {c['batches_produced_total']:,}\s+sent {c['batches_total']:,}", line
    )
    samples = c["samples_reused_total"] + c["samples_produced_total"]
    assert f"samples reused {c['samples_reused_total']:,} of {samples:,}" in shown


_CHILD = textwrap.dedent(
    """
    import hashlib, os, pickle, sys
    from batchwire.client import RemoteLoader
    ep, state, save_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    loader = RemoteLoader(ep, "train", device="cpu", with_indices=True, timeout=60.0,
                          job="crash", prefetch_next_epoch=False)
    if os.path.exists(state):
        loader.load_state_dict(pickle.load(open(state, "rb")))
    for n, (images, labels, indices) in enumerate(loader, 1):
        h = hashlib.sha256(images.numpy().tobytes())
        h.update(labels.numpy().tobytes())
        h.update(indices.numpy().tobytes())
        if n == save_at:
            pickle.dump(loader.state_dict(), open(state + ".tmp", "wb"))
            os.replace(state + ".tmp", state)
        print(h.hexdigest(), flush=True)
    loader.close()
    """
)


def test_a_job_killed_mid_epoch_and_restarted_finishes_its_epoch_exactly(
    solo, shared, tmp_path
) -> None:
    ep, state = shared.endpoint, str(tmp_path / "state.pkl")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, ep, state, "8"], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert child.stdout is not None
        first = [child.stdout.readline().strip() for _ in range(10)]
        t0 = time.monotonic()
        others: dict[str, list] = {}
        readers = threading.Thread(
            target=lambda: others.update(
                r=run_jobs([lambda i=i: stream(ep, 0, job=f"o{i}")[0] for i in (0, 1)])
            )
        )
        readers.start()
        os.kill(child.pid, signal.SIGKILL)  # mid-epoch, with batches asked and in flight
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    rest = subprocess.run(
        [sys.executable, "-c", _CHILD, ep, state, "0"], capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    readers.join(60)
    elapsed = time.monotonic() - t0
    assert first[:8] + rest == solo["a16"]  # saved after batch 8: 9 and 10 come again
    assert others["r"] == [solo["a16"]] * 2
    assert elapsed < 30.0, f"the others and the restart took {elapsed:.1f} s"


def test_a_client_posing_as_another_job_gets_only_its_own_and_holds_nobody(solo, shared) -> None:
    """A client with job a's name and parameters reads two batches and stops, connected: it
    got what it would get alone, and job a still reads its whole epoch exactly, promptly."""
    ep = shared.endpoint
    poser = RemoteLoader(ep, "train", device="cpu", with_indices=True, timeout=60.0, job="a")
    try:
        it = iter(poser)
        assert [_digest(*next(it)) for _ in range(2)] == solo["a16"][:2]
        t0 = time.monotonic()
        own, _ = stream(ep, 0, job="a")
        elapsed = time.monotonic() - t0
    finally:
        poser.close()
    assert own == solo["a16"]
    assert elapsed < 10.0, f"job a took {elapsed:.1f} s beside a client that stopped reading"
