"""Shared production across a fleet (issue 23): two jobs, two servers, one production pass.

Each job is a `RemoteLoader` of world size 1 given both servers; rendezvous hashing
(`client/rendezvous.py`) has both jobs ask the same server for the same batch, so each batch
is produced once in the whole fleet and sent to both. The jobs run in threads started
together and take a short "training step" per batch, as trainers do, so the servers keep
ahead of them and each batch goes to its preferred server; --share-window 64 (more than an
epoch) keeps a job that runs a little ahead of the other within the window.

Streams are compared byte for byte with a solo run (one job, one server, --share-window 0);
production and sends are read from the servers' counters (`batches_produced_total`,
`batches_total`, summed over the fleet). Small, fast servers: 400 images of 32 px, batches
of 16 (25 per epoch).
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from batchwire.client import RemoteLoader
from serverproc import running_server, running_servers, small_server_args

pytestmark = pytest.mark.timeout(120)

SEED = 13
NUM_BATCHES = 25  # 400 images / 16
SHARED = ("--max-buffers", "256", "--share-window", "64")
STEP_S = 0.01  # each job's "training step" per batch
JOBS_DEADLINE_S = 60.0
# A loader of 2 servers (prefetch 4) keeps a budget of 8 batches (4 per server); asking the
# next epoch ahead, each server is sent share = budget // servers = 4 of its batches.
AHEAD = 8
#: Batches read per batch produced, fleet-wide, at the least: 2 with perfect sharing, 1 with
#: none. Not 1.8: on a loaded 2-core host a server that falls behind has a few of its batches
#: asked of the other (the fleet's pacing, as it should), and a fresh clone's run measured 1.72
#: (2026-11-28): 4 of 25 batches made twice. Jobs asking either server at random would give
#: about 1.33 (half their asks meet), jobs asking different servers 1.0.
MIN_SHARE_RATIO = 1.5
# How long a server hangs before it is killed: the jobs ask it for batches meanwhile, and it
# is less than the loader's heartbeat (1 s), so the kill, not silence, ends its sessions.
OWING_S = 0.2


def epochs_of(
    endpoints: list[str],
    job: str,
    epochs: tuple[int, ...],
    *,
    ahead: bool,
    on_batch: Callable[[int, int], None] | None = None,
) -> list[list[str]]:
    """One job's stream: a digest of each batch (images, labels, indices) per epoch.

    ``ahead``: ask the next epoch's batches while finishing this one (the loader's default);
    ``on_batch(epoch, i)`` runs after each batch i is taken.
    """
    out: list[list[str]] = []
    with RemoteLoader(
        endpoints,
        "train",
        rank=0,
        world_size=1,
        device="cpu",
        with_indices=True,
        timeout=30.0,
        job=job,
        prefetch_next_epoch=ahead,
    ) as loader:
        for epoch in epochs:
            loader.set_epoch(epoch)
            digests: list[str] = []
            for images, labels, indices in loader:
                h = hashlib.sha256(images.numpy().tobytes())
                h.update(labels.numpy().tobytes())
                h.update(indices.numpy().tobytes())
                digests.append(h.hexdigest())
                if on_batch is not None:
                    on_batch(epoch, len(digests) - 1)
                time.sleep(STEP_S)
            out.append(digests)
    return out


def run_jobs(jobs: list[Callable[[], list[list[str]]]]) -> list[list[list[str]]]:
    """Start the jobs together (threads); each one's stream, or its error re-raised here."""
    results: list = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # re-raised below, in the test thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOBS_DEADLINE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"jobs still running after {JOBS_DEADLINE_S} s"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def fleet_counters(servers) -> tuple[int, int, list[int]]:
    """(batches sent, batches produced) summed over the live servers, and each one's production."""
    counters = [srv.stats()["counters"] for srv in servers if srv.running]
    produced = [c["batches_produced_total"] for c in counters]
    return sum(c["batches_total"] for c in counters), sum(produced), produced


@pytest.fixture(scope="module")
def solo() -> list[list[str]]:
    """Epochs 0 and 1 of one job alone on a server that shares nothing."""
    with running_server(*small_server_args(seed=SEED), "--share-window", "0") as srv:
        return epochs_of([srv.endpoint], "solo", (0, 1), ahead=False)


@pytest.fixture()
def two():
    with running_servers(2, *small_server_args(seed=SEED), *SHARED) as servers:
        yield servers


def test_two_jobs_on_two_servers_share_one_pass(solo, two) -> None:
    eps = [srv.endpoint for srv in two]
    streams = run_jobs([lambda i=i: epochs_of(eps, f"job{i}", (0,), ahead=False) for i in range(2)])
    assert streams == [solo[:1], solo[:1]]
    sent, produced, per_server = fleet_counters(two)
    assert sent == 2 * NUM_BATCHES  # nothing asked ahead: every batch sent was taken
    assert all(per_server), f"one server did all the work: {per_server}"
    assert sent / produced > MIN_SHARE_RATIO, (
        f"{produced} batches produced ({per_server} per server) for {sent} sent: the jobs asked "
        "different servers for the same batches"
    )


def test_the_next_epoch_asked_ahead_is_shared_too(solo, two) -> None:
    """Two epochs with the next one asked ahead (the default): the batches of epoch 1 asked
    while epoch 0 ends go to their preferred servers as well, so both jobs' early asks meet."""
    eps = [srv.endpoint for srv in two]
    streams = run_jobs(
        [lambda i=i: epochs_of(eps, f"job{i}", (0, 1), ahead=True) for i in range(2)]
    )
    assert streams == [solo, solo]
    _, produced, per_server = fleet_counters(two)
    # The jobs read 2 x 2 x 25 batches. Near the end of epoch 1 each also asked AHEAD batches
    # of epoch 2 early (produced long before it closes, shared like the others when both
    # jobs ask the same server, never read): epochs 0 and 1 cost `produced - AHEAD`.
    read = 2 * 2 * NUM_BATCHES
    assert read / (produced - AHEAD) > MIN_SHARE_RATIO, (
        f"{produced} batches produced ({per_server} per server) for 2 jobs x 2 epochs of "
        f"{NUM_BATCHES}, at most {AHEAD} of epoch 2 asked ahead"
    )


def test_a_server_killed_mid_epoch_both_jobs_complete_exactly(solo, two) -> None:
    """Both jobs reach batch 8; one server hangs (SIGSTOP) while they go on, so that it owes
    them batches, then is SIGKILLed; both finish the epoch on the other: every batch exactly
    once, in order, byte-identical to the solo run."""
    kill_at = 8
    eps = [srv.endpoint for srv in two]
    reached = threading.Barrier(3, timeout=30)  # both jobs at kill_at, and the test thread
    go_on = threading.Event()  # set once the server hangs

    def on_batch(epoch: int, i: int) -> None:
        if i == kill_at:
            reached.wait()
            assert go_on.wait(30), "the server was not stopped"

    def job(i: int) -> Callable[[], list[list[str]]]:
        return lambda: epochs_of(eps, f"job{i}", (0,), ahead=True, on_batch=on_batch)

    done: list = []  # the streams, or the error that ended run_jobs

    def run() -> None:
        try:
            done.extend(run_jobs([job(0), job(1)]))
        except BaseException as exc:  # re-raised below, in the test thread
            done.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        reached.wait()
    except threading.BrokenBarrierError:
        runner.join(JOBS_DEADLINE_S)
        raise AssertionError(f"the jobs did not reach batch {kill_at}: {done}") from None
    victim = two[1]
    os.kill(victim.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    go_on.set()  # the jobs go on, asking the hung server for its preferred batches
    time.sleep(OWING_S)
    victim.kill()
    runner.join(JOBS_DEADLINE_S + 5)
    elapsed = time.monotonic() - t0
    assert not runner.is_alive(), "the jobs did not finish"
    for r in done:
        if isinstance(r, BaseException):
            raise r
    assert done == [solo[:1], solo[:1]], "a job's stream differs from its solo run"
    # Failover is the connection dropping (or the silence), not the loader's 30 s timeout.
    assert elapsed < 15.0, f"the jobs took {elapsed:.1f} s to finish on the survivor"
    assert two[0].running
