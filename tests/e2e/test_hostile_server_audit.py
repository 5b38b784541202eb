"""RemoteLoader against a hostile or broken server (the client side of docs/security.md).

A trainer may point its loader at an endpoint it does not control, or one server of its fleet
may be broken. A raw ZeroMQ ROUTER plays that server (test_client_protocol.py covers frames of
the wrong size, stale sessions and batches not asked for); a real pipeline-server plays the
honest one of a fleet. What must hold: a clear error naming the server (or the fleet goes on
without it), never a hang past the timeout, never an allocation sized by a value the server
chose, never a batch the trainer did not ask for.
"""

from __future__ import annotations

import resource
import time

import pytest
import torch
import wirefakes
import zmq
from batchwire import wire
from batchwire.client import ProtocolError, RemoteLoader, ServerUnavailable
from batchwire.wire.raw_client import RawClient
from loaderchecks import assert_same, rest
from serverproc import running_server, small_server_args
from wirefakes import NBYTES, RawServer

pytestmark = pytest.mark.timeout(60)


def rss_mib() -> float:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def huge_welcome(session: int, shape: list[int], views: list[list[int]] | None = None) -> bytes:
    m = wirefakes.welcome(session).to_map()
    m["shape"], m["batch_size"] = shape, shape[0]
    if views:
        m["views"] = views
    return wire.pack(m)


WELCOMES = {
    # Sides past any image: 65536 x 3 x 65536^2 bytes (3 PiB), float16 scratch of twice that.
    "sides": ([65536, 3, 1 << 16, 1 << 16], None),
    # Sides a hello may ask for, a batch of 12 TiB.
    "bytes": ([4096, 3, 16384, 16384], None),
    # A 32 x 32 first view, then 63 views of 16384 x 16384: 6 TiB in one frame.
    "views": ([128, 3, 32, 32], [[32, 32]] + [[16384, 16384]] * 63),
}


@pytest.mark.parametrize("case", WELCOMES)
def test_a_welcome_announcing_terabytes_is_a_protocol_error_naming_the_server(case):
    """The loader sizes its buffers from the first welcome (a float16 scratch batch on the CPU,
    pinned slots on CUDA): before, such a welcome reached torch, which tried to allocate it
    (a RuntimeError naming no server; a smaller claim would have been allocated)."""
    shape, views = WELCOMES[case]

    def reply(sock, identity, hello, stop):
        sock.send_multipart([identity, huge_welcome(hello.session, shape, views)])

    before = rss_mib()
    with RawServer(reply) as srv:
        started = time.monotonic()
        with (
            RemoteLoader(
                srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=5,
                dtype=torch.float16,
            ) as loader,
            pytest.raises(ProtocolError) as info,
        ):  # fmt: skip
            next(iter(loader))
        took = time.monotonic() - started
    assert srv.endpoint in str(info.value)
    assert took < 4, f"took {took:.1f} s: the error must come with the welcome"
    assert rss_mib() - before < 64, "memory grew with what the welcome claimed"


def test_a_flood_of_unsolicited_messages_still_times_out_naming_the_server():
    """Stats replies, stale welcomes and stale errors as fast as the server can send them,
    never a batch, for as long as the loader listens (up to 30 s): it gives up at its 2 s
    timeout, naming the server, instead of spinning in its receive loop while the flood lasts
    (it reads at most `MAX_RECV_PER_TURN` messages of a server before it looks at its clock;
    a loaded machine, slower than the flood, took 6.5-12.9 s before that bound)."""
    frames: list[bytes] = []

    def reply(sock, identity, hello, stop):
        s = hello.session
        sock.send_multipart([identity, wirefakes.welcome(s).pack()])
        frames[:] = [
            wirefakes.welcome(s - 1).pack(),
            wire.ErrorReply(message="old", session=s - 1).pack(),
            wirefakes.header(s - 1, 0).pack(),
        ]
        sent, until = 0, time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < until:
            for f in frames:
                try:
                    sock.send_multipart([identity, f], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        frames.append(str(sent).encode())

    with RawServer(reply) as srv:
        started = time.monotonic()
        with (
            RemoteLoader(srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=2)
            as loader,
            pytest.raises(ServerUnavailable) as info,
        ):  # fmt: skip
            next(iter(loader))
        took = time.monotonic() - started
    assert srv.endpoint in str(info.value)
    assert took < 10, f"a 2 s timeout took {took:.1f} s under a flood"


@pytest.mark.parametrize("bad", [[10**12, 0], [0, -5]])
def test_a_label_no_class_has_is_a_protocol_error_naming_the_server(bad):
    """The welcome says 3 classes: a label of 10**12 (or -5, not the padding's -100) is no
    class id; handed out, it trains on garbage or trips a CUDA assert in the loss."""
    got = []

    def reply(sock, identity, hello, stop):
        s = hello.session
        sock.send_multipart([identity, wirefakes.welcome(s).pack()])
        labels = wire.labels_to_frame(bad).tobytes()
        sock.send_multipart([identity, wirefakes.header(s, 0).pack(), b"\1" * NBYTES, labels])

    with (
        RawServer(reply) as srv,
        RemoteLoader(srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=3)
        as loader,
        pytest.raises(ProtocolError) as info,
    ):  # fmt: skip
        got.extend(b[1].tolist() for b in loader)
    assert got == []
    assert srv.endpoint in str(info.value) and "is neither a class id" in str(info.value)


# --------------------------------------------------------------------------- a fleet of two


@pytest.fixture(scope="module")
def honest():
    """One real server, and its whole epoch as a loader on it alone hands it out."""
    with running_server(*small_server_args(seed=3)) as srv:
        with fleet_loader([srv.endpoint]) as loader:
            reference = rest(iter(loader))
        yield srv, reference


def fleet_loader(endpoints: list[str], **kw) -> RemoteLoader:
    kw.setdefault("timeout", 10.0)
    return RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", with_indices=True,
        normalize_on_device=False, heartbeat=0.5, **kw,
    )  # fmt: skip


def honest_welcome(endpoint: str) -> wire.Welcome:
    """The honest server's welcome, as the hostile one copies it to pass as a fleet member."""
    ctx = zmq.Context()
    client = RawClient.connect(
        ctx, endpoint, split="train", rank=0, world_size=1, batches=(), session=1
    )
    try:
        return client.start()
    finally:
        client.close()
        ctx.term()


def mimic(w: wire.Welcome, session: int) -> bytes:
    m = w.to_map()
    m["session"] = session
    return wire.pack(m)


def junk_batch(w: wire.Welcome, session: int, k: int) -> list[bytes]:
    h = wire.BatchHeader(
        session=session, split="train", epoch=0, batch_index=k, shape=w.shape, dtype=w.dtype,
        layout=w.layout, indices=list(range(w.shape[0])), nbytes=w.spec.nbytes,
    )  # fmt: skip
    return [h.pack(), b"\xee" * w.spec.nbytes, wire.labels_to_frame([7] * w.shape[0]).tobytes()]


def test_a_fleet_member_that_sends_a_batch_it_was_not_asked_for_is_named(honest):
    """The hostile server passes the welcome checks (it copies the honest one's welcome), then
    answers its first credit with the epoch's last batch, asked of no server yet: the loader
    raises naming it, and what it handed out before are the honest server's batches."""
    srv, reference = honest
    w = honest_welcome(srv.endpoint)
    asked: list[int] = []

    def reply(sock, identity, hello, stop):
        sock.send_multipart([identity, mimic(w, hello.session)])

    def on_credit(sock, identity, hello, credit):
        asked.extend(credit.batches)
        last = w.num_batches - 1
        if credit.batches and last not in asked:
            sock.send_multipart([identity, *junk_batch(w, hello.session, last)])

    got = []
    with (
        RawServer(reply, on_credit) as hostile,
        fleet_loader([srv.endpoint, hostile.endpoint]) as loader,
        pytest.raises(ProtocolError) as info,
    ):
        for batch in loader:
            got.append(tuple(t.clone() for t in batch))
    assert asked, "the hostile server was never asked for a batch"
    assert hostile.endpoint in str(info.value) and srv.endpoint not in str(info.value)
    assert f"sent batch {w.num_batches - 1} where" in str(info.value)
    assert_same(got, reference[: len(got)])


def test_a_fleet_member_that_welcomes_and_stalls_leaves_the_epoch_to_the_honest_one(honest):
    """Welcomed, then silent whatever it owes (a server stalled mid-stream, or one that answers
    hellos and nothing else): the loader takes its batches back past the heartbeat, and the
    epoch comes out exactly as from the honest server alone. Before, the stalled server was
    welcomed again at once and, never having delivered (no pace: not "slow"), given the batch
    the consumer waited for again, and again at the epoch's tail while the honest server had
    moved on to the next epoch, until the loader's timeout raised ServerUnavailable."""
    srv, reference = honest
    w = honest_welcome(srv.endpoint)

    def reply(sock, identity, hello, stop):
        sock.send_multipart([identity, mimic(w, hello.session)])

    with (
        RawServer(reply) as hostile,
        fleet_loader([srv.endpoint, hostile.endpoint], timeout=6.0) as loader,
    ):
        started = time.monotonic()
        got = rest(iter(loader))
        took = time.monotonic() - started
    assert_same(got, reference)
    assert hostile.hellos, "the hostile server was never asked"
    # Each silence costs the consumer at most the stalled server's heartbeat (0.5 s, doubling
    # to 3 s): never the loader's timeout, which would raise.
    assert took < 12, f"the epoch took {took:.1f} s"
