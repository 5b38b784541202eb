"""RemoteLoader across several servers, and across a server that dies, stops or restarts.

Real pipeline-server processes (the embedded val folder, 400 real JPEGs, served as the train
split keeps epochs short); "identical" always means bit-identical images, labels and indices, in
epoch order, compared with an uninterrupted run of one server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from batchwire.client import RemoteLoader, ServerUnavailable
from loaderchecks import assert_same, rest, take
from serverproc import running_servers, small_server_args


@pytest.fixture(scope="module")
def servers():
    """Two identical servers, started side by side (each start takes seconds)."""
    with running_servers(2, *small_server_args(seed=3)) as both:
        yield both


def loader_for(endpoints, **kw) -> RemoteLoader:
    kw.setdefault("timeout", 60.0)
    return RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", with_indices=True, **kw
    )


@pytest.fixture(scope="module")
def reference(servers):
    with loader_for(servers[0].endpoint) as loader:
        return rest(iter(loader))


@pytest.mark.timeout(120)
def test_two_servers_feed_one_client_in_order_exactly_once_even_across_a_restart(
    servers, reference
):
    a, b = servers

    def sent_by_each() -> dict[str, list[int]]:
        return {srv.endpoint: [c["sent"] for c in srv.stats()["clients"]] for srv in servers}

    with loader_for([a.endpoint, b.endpoint], prefetch=4) as loader:
        it = iter(loader)
        head = take(it, 4)
        sent = sent_by_each()
        # On a loaded machine one server's connection may come up a few batches later; both
        # must have served before half the epoch is gone.
        while len(head) < 12 and not all(sum(s) > 0 for s in sent.values()):
            head += take(it, 1)
            sent = sent_by_each()
        head += take(it, 12 - len(head))
        b.kill()  # one of the two dies mid-epoch and comes back
        b.start()
        got = head + rest(it)
    assert all(sum(s) > 0 for s in sent.values()), f"a server sent nothing: {sent}"
    assert_same(got, reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("interrupt", "prefetch", "consumed"),
    [
        ("kill", 4, 10),  # SIGKILL: no shutdown message, batches in flight are lost
        ("stop", 2, 12),  # SIGTERM: the server says `shutdown` to its clients and exits 0
    ],
)
def test_server_restarted_mid_epoch_loses_and_repeats_nothing(
    servers, reference, interrupt, prefetch, consumed
):
    a, _ = servers
    with loader_for(a.endpoint, prefetch=prefetch) as loader:
        it = iter(loader)
        head = take(it, consumed)
        getattr(a, interrupt)()
        a.start()
        got = head + rest(it)
    assert_same(got, reference)


@pytest.mark.timeout(120)
def test_loader_started_before_its_server_waits_for_it(servers, reference):
    """Trainers often start before the server is up: the first hello waits for it."""
    a, _ = servers
    a.kill()
    starter = threading.Thread(target=a.start, name="server-start")
    with loader_for(a.endpoint) as loader:
        starter.start()
        try:
            got = rest(iter(loader))
        finally:
            starter.join()
    assert_same(got, reference)


@pytest.mark.timeout(60)
def test_stalled_server_gets_a_new_hello_and_the_stale_session_is_dropped(
    servers, reference, caplog
):
    """A server that keeps its connection but goes silent (SIGSTOP) is only noticed by the
    heartbeat: the loader re-sends hello (new session) until it answers again."""
    a, _ = servers
    with loader_for(a.endpoint, heartbeat=0.3) as loader:
        it = iter(loader)
        head = take(it, 5)
        os.kill(a.pid, signal.SIGSTOP)
        resume = threading.Timer(1.5, os.kill, (a.pid, signal.SIGCONT))  # a 1.5 s outage
        resume.start()
        try:
            with caplog.at_level(logging.INFO, logger="batchwire.client"):
                got = head + rest(it)
        finally:
            resume.cancel()
            os.kill(a.pid, signal.SIGCONT)
    assert "it gets a new hello" in caplog.text
    assert_same(got, reference)


@pytest.mark.timeout(60)
def test_server_that_never_returns_raises_naming_it(servers):
    _, b = servers  # the module's last test: b stays dead
    with loader_for(b.endpoint, timeout=2.0) as loader:
        it = iter(loader)
        take(it, 3)
        b.kill()
        with pytest.raises(ServerUnavailable, match="went away") as info:
            rest(it)
    assert b.endpoint in str(info.value)
