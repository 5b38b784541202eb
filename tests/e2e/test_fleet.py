"""One loader, several servers: any server produces any batch, so a lost server's batches go to
the others, a slow server produces fewer, and a server that comes back rejoins.

Real pipeline-server processes (SIGKILL for good, SIGSTOP duty cycles for a slow one);
"identical" means bit-identical images, labels and indices in epoch order, compared with an
uninterrupted run of one server.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from batchwire.client import RemoteLoader
from batchwire.wire.keys import create_keys
from loaderchecks import assert_same, rest, take
from serverproc import running_servers, small_server_args

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def servers():
    """Three plain servers."""
    with running_servers(3, *small_server_args(seed=5)) as three:
        yield three


@pytest.fixture(scope="module")
def keyed_servers(tmp_path_factory):
    """Three servers with CURVE keys: the failover path once more through encrypted sessions."""
    keys = create_keys(tmp_path_factory.mktemp("keys") / "keys")
    with running_servers(3, *small_server_args(seed=5), "--keys", str(keys)) as three:
        yield three


@pytest.fixture(autouse=True)
def all_running(servers):
    """Tests kill servers for good: the next test gets all three back."""
    yield
    for srv in servers:
        if not srv.running:
            srv.start()


def loader_for(servers, **kw) -> RemoteLoader:
    kw.setdefault("timeout", 30.0)
    keys = servers[0].args[servers[0].args.index("--keys") + 1] if servers[0].keys else None
    kw.setdefault("keys", keys)
    endpoints = [s.endpoint for s in servers]
    return RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", with_indices=True, **kw
    )


@pytest.fixture(scope="module")
def reference(servers):
    with loader_for(servers[:1]) as loader:
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append(rest(iter(loader)))
        return epochs


def sent_to_us(srv) -> int:
    """Batches the server sent our (only) client in its current session."""
    rows = srv.stats()["clients"]
    return sum(r["sent"] for r in rows)


@pytest.mark.parametrize("lost", [1, 2])
def test_servers_lost_for_good_mid_epoch_lose_nothing(servers, reference, lost):
    """1 of 2 or 2 of 3 servers SIGKILLed mid-epoch and never restarted: the survivors take
    their batches over and the epoch completes, identical, long before the loader's timeout."""
    lose_servers(servers[: lost + 1], reference)


def test_a_keyed_fleet_loses_two_servers_and_nothing_else(keyed_servers, reference):
    """The same with CURVE keys on every server (the batches are the plain servers': same data
    and seed); the killed servers stay down, nothing after this uses them."""
    lose_servers(keyed_servers, reference)


def lose_servers(fleet, reference) -> None:
    """All but the first of ``fleet`` SIGKILLed after 6 batches: the epoch and the next exact."""
    with loader_for(fleet) as loader:
        it = iter(loader)
        head = take(it, 6)
        t0 = time.monotonic()
        for srv in fleet[1:]:
            srv.kill()
        tail = rest(it)
        took = time.monotonic() - t0
        loader.set_epoch(1)
        epoch1 = rest(iter(loader))
    assert_same(head + tail, reference[0])
    assert_same(epoch1, reference[1])
    assert took < 15, f"the survivors needed {took:.1f} s to finish the epoch"


def test_a_server_that_comes_back_rejoins(servers, reference):
    """A killed server restarted mid-epoch is asked for batches again (the loader reconnects
    while it is being iterated; a trainer step of 50 ms gives the restart time to land)."""
    a, b = servers[:2]
    with loader_for([a, b], prefetch_next_epoch=False) as loader:
        it = iter(loader)
        head = take(it, 4)
        b.kill()
        middle = take(it, 4)  # from a alone
        b.start()
        epochs, rejoined = [head + middle, []], 0
        for epoch, batches in ((0, it), (1, None)):
            if batches is None:
                loader.set_epoch(epoch)
                batches = iter(loader)
            for batch in batches:
                epochs[epoch].append(tuple(t.clone() for t in batch))
                rejoined = max(rejoined, sent_to_us(b))
                time.sleep(0.05)  # the trainer's step
    assert_same(epochs[0], reference[0])
    assert_same(epochs[1], reference[1])
    assert rejoined > 0, "the restarted server was given no batch"


def test_a_slow_server_produces_fewer_and_the_data_stays_exact(servers, reference):
    """One of two servers runs 1/20 of the time (SIGSTOP/SIGCONT): batches that prefer it
    (rendezvous) pile up to its cap of 1.5 times an even share of the budget, and the loader asks
    the fast one for the rest, so the fast one produces most of the epoch."""
    fast, slow = servers[:2]
    stop = threading.Event()

    def throttle() -> None:
        while not stop.is_set():
            os.kill(slow.pid, signal.SIGSTOP)
            stop.wait(0.19)
            os.kill(slow.pid, signal.SIGCONT)
            stop.wait(0.01)

    # No next-epoch sessions: each server's stats row then counts this epoch's batches. Epoch 0
    # teaches the loader the servers' paces (its first budget is asked before any batch came);
    # epoch 1 is counted.
    with loader_for([fast, slow], prefetch_next_epoch=False) as loader:
        thread = threading.Thread(target=throttle, daemon=True)
        thread.start()
        try:
            got = [rest(iter(loader))]
            loader.set_epoch(1)
            got.append(rest(iter(loader)))
        finally:
            stop.set()
            thread.join()
            os.kill(slow.pid, signal.SIGCONT)
        by_fast, by_slow = sent_to_us(fast), sent_to_us(slow)
    assert_same(got[0], reference[0])
    assert_same(got[1], reference[1])
    assert by_fast > 2 * by_slow, (by_fast, by_slow)
