"""The client core's refusal and error rules (issue 19, item 6) against real peers.

Real `pipeline-server` processes where a real server can show the behaviour (a server full at
``--max-clients``), a raw ZeroMQ ROUTER where only a misbehaving or unlucky server can (an
error about an older session arriving after the loader re-sent its hello). The same rules are
unit-tested with a fake clock in tests/unit/test_client_fleet.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import wirefakes
import zmq
from batchwire import wire
from batchwire.client import RemoteLoader, ServerError
from batchwire.wire.raw_client import RawClient
from loaderchecks import assert_same, rest
from serverproc import running_server, running_servers, small_server_args
from wirefakes import NBYTES

pytestmark = pytest.mark.timeout(120)


def loader_for(endpoints: list[str], **kw) -> RemoteLoader:
    kw.setdefault("timeout", 30.0)
    return RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", with_indices=True, **kw
    )


@contextmanager
def occupied(endpoint: str) -> Iterator[RawClient]:
    """A raw client holding the one place of a ``--max-clients 1`` server."""
    ctx = zmq.Context()
    client = RawClient.connect(
        ctx, endpoint, split="train", rank=0, world_size=1, batches=(), session=1
    )
    try:
        client.start()
        yield client
    finally:
        client.close()
        ctx.term()


@pytest.fixture(scope="module")
def reference() -> list:
    with running_server(*small_server_args(seed=9)) as srv, loader_for([srv.endpoint]) as loader:
        return rest(iter(loader))


def batches_sent(srv) -> int:
    """Batches the server has sent anyone (the raw occupant never asks for one)."""
    return srv.stats()["counters"]["batches_total"]


def test_a_full_server_leaves_the_epoch_to_the_other_and_joins_once_it_has_room(reference):
    """Server b refuses (``--max-clients`` reached): the loader does not raise, server a
    serves the whole epoch exactly; once b has room, the loader's retried hello gets in."""
    args = (*small_server_args(seed=9), "--max-clients", "1")
    with (
        running_servers(2, *args) as (a, b),
        occupied(b.endpoint) as occupant,
        loader_for([a.endpoint, b.endpoint]) as loader,
    ):
        assert_same(rest(iter(loader)), reference)
        assert batches_sent(b) == 0  # refused: a served the whole epoch
        occupant.bye()
        for _ in range(20):  # retried with back-off (at most 4 s apart)
            loader.set_epoch(0)  # the same epoch again (else the loader moves on by itself)
            assert_same(rest(iter(loader)), reference)  # exactly
            if batches_sent(b) > 0:
                break
        else:
            pytest.fail("the loader never came back to the server that had refused it")


def test_every_server_refusing_is_one_error_naming_each():
    """A refusal that cannot clear (a split no server has), from every server: one error naming
    each. (`--max-clients` reached clears by itself: "busy", asked again within the timeout.)"""
    with (
        running_servers(2, *small_server_args(seed=9)) as (a, b),
        RemoteLoader(
            [a.endpoint, b.endpoint], "nope", rank=0, world_size=1, device="cpu"
        ) as loader,
        pytest.raises(ServerError) as info,
    ):
        len(loader)
    text = str(info.value)
    assert "every pipeline-server refused" in text
    for srv in (a, b):
        assert f"{srv.endpoint} refused: unknown split 'nope'" in text


# ---------------------------------------------------------------------- errors of older sessions


def late_error_server() -> wirefakes.RawServer:
    """A server that stays silent on the first hello (so the loader re-sends it), then answers
    the second with errors about the first session (as a server does whose read retries
    outlasted the loader's heartbeat) before welcoming it and serving every credit."""
    hellos: list[wire.Hello] = []

    def reply(sock: zmq.Socket, identity: bytes, hello: wire.Hello, _stop: object) -> None:
        hellos.append(hello)
        if len(hellos) == 1:
            return  # the first hello: silence
        for reason in ("transient", "refused", "failed"):
            error = wire.ErrorReply(
                f"old news ({reason})", reason=reason, session=hellos[0].session
            )
            sock.send_multipart([identity, error.pack()])
        sock.send_multipart([identity, wirefakes.welcome(hello.session, num_batches=3).pack()])

    def on_credit(
        sock: zmq.Socket, identity: bytes, hello: wire.Hello, credit: wire.Credit
    ) -> None:
        for k in credit.batches:
            header = wirefakes.header(hello.session, k)
            frames = [header.pack(), bytes([k]) * NBYTES, wire.labels_to_frame([k, k]).tobytes()]
            sock.send_multipart([identity, *frames])

    return wirefakes.RawServer(reply, on_credit)


def test_errors_about_an_older_session_do_not_end_the_run():
    """Issue 19's failure: the stale error was taken as a refusal of the new hello and raised."""
    srv = late_error_server()
    try:
        with RemoteLoader(
            srv.endpoint,
            "train",
            rank=0,
            world_size=1,
            device="cpu",
            with_indices=True,
            heartbeat=0.3,
            timeout=10,
            prefetch_next_epoch=False,
            normalize_on_device=False,  # the bytes sent, which tell the batches apart
        ) as loader:
            got = [tuple(t.clone() for t in b) for b in loader]
    finally:
        srv.close()
    assert len(srv.hellos) == 2 and srv.hellos[0].session != srv.hellos[1].session
    assert [int(images.flatten()[0]) for images, _, _ in got] == [0, 1, 2]
    assert [indices.tolist() for _, _, indices in got] == [[0, 1], [2, 3], [4, 5]]
