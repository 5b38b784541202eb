"""Shared production on a real server: jobs of a sweep get their exact streams, produced once.

Each job is a `RemoteLoader` (in a thread, or a child process where it is SIGSTOPped). Its
batches are compared byte for byte with the same job's solo run on a server with
--share-window 0; the server's counters (`batches_produced_total`, `batches_total`) say how
many batches were produced and sent. Small, fast servers: 400 images of 32 px, batches of 16
(25 per epoch), a window large enough that threads started together never fall out of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from batchwire.client import RemoteLoader
from serverproc import running_server, small_server_args
from sharingjobs import run_jobs

SEED = 11
NUM_BATCHES = 25  # 400 images / 16
SHARED = ("--max-buffers", "256", "--share-window", "64")


def digests(endpoint: str, split: str, epochs: tuple[int, ...], **kw) -> list[str]:
    """One job's stream: a digest of each batch (images, labels, indices) over ``epochs``."""
    loader = RemoteLoader(endpoint, split, device="cpu", with_indices=True, timeout=60.0, **kw)
    out: list[str] = []
    try:
        for epoch in epochs:
            loader.set_epoch(epoch)
            for images, labels, indices in loader:
                h = hashlib.sha256(images.numpy().tobytes())
                h.update(labels.numpy().tobytes())
                h.update(indices.numpy().tobytes())
                out.append(h.hexdigest())
    finally:
        loader.close()
    return out


def counters(srv) -> dict[str, int]:
    return srv.stats()["counters"]


@pytest.fixture(scope="module")
def solo():
    """Reference streams from a server that shares nothing."""
    args = (*small_server_args(seed=SEED, val=True), "--share-window", "0")
    with running_server(*args) as srv:
        ep = srv.endpoint
        ref = {
            "train": digests(ep, "train", (0, 1), job="solo"),
            "val": digests(ep, "val", (0,), job="solo"),
            "ws2": [digests(ep, "train", (0,), rank=r, world_size=2, job="solo2") for r in (0, 1)],
        }
        c = counters(srv)
        assert c["batches_shared_total"] == 0
        # Produced but never sent: the next-epoch batches each of the 4 loaders asks ahead at its
        # last epoch's end (at most its budget, prefetch 4) before it closes.
        assert c["batches_total"] <= c["batches_produced_total"] <= c["batches_total"] + 4 * 4
    return ref


@pytest.fixture()
def shared():
    with running_server(*small_server_args(seed=SEED, val=True), *SHARED) as srv:
        yield srv


@pytest.mark.parametrize("jobs", [2, 4])
def test_jobs_of_a_sweep_get_their_solo_streams_produced_once(solo, shared, jobs) -> None:
    ep = shared.endpoint

    def job(i: int) -> Callable[[], list[str]]:
        # The val loader reads one epoch, so it asks nothing ahead: epoch 1 of val would be
        # produced for no one, once per job whose close cancelled it before the next job asked.
        return lambda: (
            digests(ep, "train", (0, 1), job=f"j{i}")
            + digests(ep, "val", (0,), job=f"j{i}", prefetch_next_epoch=False)
        )

    streams = run_jobs([job(i) for i in range(jobs)])
    for stream in streams:
        assert stream == solo["train"] + solo["val"]
    c = counters(shared)
    # Each batch produced once. Next-epoch batches asked ahead are counted too: a train
    # loader's prefetch of epoch 2 (4) per job, shared unless a job closed its train loader,
    # cancelling the ones in production, before the next job asked (seen under load in CI-like
    # runs).
    assert 3 * NUM_BATCHES <= c["batches_produced_total"] <= 3 * NUM_BATCHES + 4 * jobs
    assert c["batches_total"] >= jobs * 3 * NUM_BATCHES
    assert c["batches_shared_total"] >= (jobs - 1) * 3 * NUM_BATCHES


def test_world_sizes_one_and_two_share_their_batches(solo, shared) -> None:
    ep = shared.endpoint
    # No loader asks epoch 1 ahead, so every batch produced is one of epoch 0's. (With asking
    # ahead, each of the 3 loaders may ask up to 4 of epoch 1's, and a job that closes first
    # cancels its own: CI once counted 30.)
    once = {"prefetch_next_epoch": False}
    streams = run_jobs(
        [
            lambda: digests(ep, "train", (0,), job="one", **once),
            *(
                (lambda r=r: digests(ep, "train", (0,), rank=r, world_size=2, job="two", **once))
                for r in (0, 1)
            ),
        ]
    )
    assert streams[0] == solo["train"][:NUM_BATCHES]
    assert streams[1:] == solo["ws2"]
    # world size 2, rank r, batch k is world size 1's batch 2k + r: nothing produced twice.
    assert counters(shared)["batches_produced_total"] == NUM_BATCHES


def test_a_job_resumed_mid_epoch_joins_the_shared_pass(solo, shared) -> None:
    ep = shared.endpoint
    first = RemoteLoader(ep, "train", device="cpu", with_indices=True, job="resumed")
    it = iter(first)
    for _ in range(10):
        next(it)
    state = first.state_dict()
    first.close()

    def resumed() -> list[str]:
        loader = RemoteLoader(
            ep, "train", device="cpu", with_indices=True, job="resumed", prefetch_next_epoch=False
        )
        loader.load_state_dict(state)
        out = []
        for images, labels, indices in loader:
            h = hashlib.sha256(images.numpy().tobytes())
            h.update(labels.numpy().tobytes())
            h.update(indices.numpy().tobytes())
            out.append(h.hexdigest())
        loader.close()
        return out

    def fresh() -> list[str]:
        return digests(ep, "train", (0,), job="fresh", prefetch_next_epoch=False)

    full, rest = run_jobs([fresh, resumed])
    assert full == solo["train"][:NUM_BATCHES]
    assert rest == solo["train"][10:NUM_BATCHES]
    # Neither job asks epoch 1 ahead; the first loader's asked-ahead batches (up to its prefetch,
    # 4) may be cancelled by its close and produced again for the shared pass.
    assert counters(shared)["batches_produced_total"] <= NUM_BATCHES + 4


_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from batchwire.client import RemoteLoader
    ep, out = sys.argv[1], sys.argv[2]
    loader = RemoteLoader(ep, "train", device="cpu", with_indices=True, timeout=60.0,
                          job="paused", prefetch=2)
    digests = []
    for images, labels, indices in loader:
        h = hashlib.sha256(images.numpy().tobytes())
        h.update(labels.numpy().tobytes())
        h.update(indices.numpy().tobytes())
        digests.append(h.hexdigest())
        print(len(digests), flush=True)
    loader.close()
    json.dump(digests, open(out, "w"))
    """
)


def test_a_stopped_job_does_not_stall_the_others_and_finishes_exactly(
    solo, shared, tmp_path
) -> None:
    ep = shared.endpoint
    out = tmp_path / "paused.json"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, ep, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert child.stdout is not None
        while int(child.stdout.readline() or 0) < 3:  # it has started reading
            pass
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        others = run_jobs([lambda i=i: digests(ep, "train", (0,), job=f"o{i}") for i in (0, 1)])
        elapsed = time.monotonic() - t0
        paused_for = max(0.0, 4.0 - elapsed)
        time.sleep(paused_for)  # stopped at least 4 s in all
        os.kill(child.pid, signal.SIGCONT)
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
    assert others == [solo["train"][:NUM_BATCHES]] * 2
    assert elapsed < 20.0, f"the others took {elapsed:.1f} s while one job was stopped"
    assert json.loads(out.read_text()) == solo["train"][:NUM_BATCHES]


def _received_and_shared(loader: RemoteLoader) -> tuple[int, int]:
    return loader.batch_totals()


def _train_two_steps(endpoint: str) -> list[str]:
    """pipeline-train's lines for 2 steps of epoch 0 (no validation)."""
    train = Path(sys.executable).parent / "pipeline-train"
    args = ("--server", endpoint, "--model", "small", "--device", "cpu", "--no-val")
    args += ("--epochs", "1", "--max-steps", "2", "--log-every", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run(
        [str(train), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=90, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout
    return run.stdout.splitlines()


def _epoch_line(lines: list[str]) -> str:
    epoch = [line for line in lines if line.startswith("epoch 0:")]
    assert len(epoch) == 1, lines
    return epoch[0]


def test_trainers_are_told_which_batches_they_shared(shared) -> None:
    """pipeline-train alone says sharing is on and shares nothing, though the batches its probe
    loader asked for wait in the window. A job then reads the epoch alone (nothing shared: the
    trainer left), a second one reads it from the window while the first is connected (all
    shared), and pipeline-train again, now beside the first job: its 2 batches shared."""
    ep = shared.endpoint
    lone = _train_two_steps(ep)
    start = (
        f"pipeline-train: sharing on: {ep} produces each batch once for every job asking for "
        "it (--share-window 64)"
    )
    assert any(line.startswith(start) for line in lone), lone
    assert "shared 0/2 batches" in _epoch_line(lone), lone
    first = RemoteLoader(ep, "train", device="cpu", timeout=60.0, job="first")
    try:
        assert sum(1 for _ in first) == NUM_BATCHES
        assert _received_and_shared(first) == (NUM_BATCHES, 0)
        second = RemoteLoader(ep, "train", device="cpu", timeout=60.0, job="second")
        try:
            assert sum(1 for _ in second) == NUM_BATCHES
            assert _received_and_shared(second) == (NUM_BATCHES, NUM_BATCHES)
        finally:
            second.close()
        assert _received_and_shared(first) == (NUM_BATCHES, 0)  # sent before the second asked
        beside = _train_two_steps(ep)
    finally:
        first.close()
    assert "shared 2/2 batches" in _epoch_line(beside), beside
