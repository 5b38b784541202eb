"""Sweep audit: a client's `sharing` state in the stats and Prometheus (docs/sweeps.md: `off`,
`solo`, `shared`, `lagging`) on a server that shares, driven in the core with a fake clock.

`off` is --share-window 0's. A client of a sharing server must not read `off` before its first
batch, nor at each new epoch (every epoch's hello is a new session): a dashboard counting
`batchwire_client_sharing{state="off"}` would see sharing go off and on at every epoch.
"""

from __future__ import annotations

from coresim import Server


def test_a_client_of_a_sharing_server_never_reads_off() -> None:
    s = Server(config={"share_window": 16})
    s.hello(b"a", batches=(), session=1)  # connected, nothing asked yet
    assert s.core.sessions[b"a"].sharing == "solo"
    s.hello(b"b", batches=(0, 1), session=1)
    s.hello(b"a", batches=(0, 1), session=2)
    s.turn(readers=(b"a", b"b"))
    assert s.core.sessions[b"a"].sharing == "shared"
    s.hello(b"a", batches=(), epoch=1, session=3)  # the next epoch, before its first batch
    assert s.core.sessions[b"a"].sharing == "shared"


def test_a_client_of_a_server_that_does_not_share_reads_off() -> None:
    s = Server(config={"share_window": 0})
    s.hello(b"a", batches=(0, 1), session=1)
    s.turn(readers=(b"a",))
    assert s.core.sessions[b"a"].sharing == "off"
