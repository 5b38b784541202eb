"""A hostile or broken peer against a real pipeline-server (plain loopback tcp).

The standard (docs/security.md, the developers' guide): a hostile peer gets nothing it should
not have and cannot hurt other clients; bad input gets a clear error or a counted skip, never a
crash, a hang or lost data. Each test attacks what tests/e2e/test_server.py does not (seeded
msgpack fuzzing, extreme field values, another peer's identity or session, frame counts and
sizes past ZeroMQ's limit, replayed credits, connection churn), then checks that an honest
`RemoteLoader` beside the attacker still gets exactly the batches it got before the attack.
One server serves the whole module; every loop is bounded in count and time.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from batchwire import wire
from batchwire.client import RemoteLoader
from batchwire.server.lograte import MALFORMED_LINES_PER_WINDOW
from batchwire.wire.raw_client import RawClient
from rawclient import wait_for
from serverproc import ServerProcess, running_server, small_server_args

pytestmark = pytest.mark.timeout(120)

U64 = 2**64 - 1
I63 = 2**63 - 1
# The embedded val split (400 images) in batches of 16 (small_server_args).
EPOCH_BATCHES = 25


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(*small_server_args(seed=5)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[str]:
    """An honest loader's epoch 0 before any attack: what it must get during and after."""
    return honest_epoch(server)


def honest_epoch(srv: ServerProcess) -> list[str]:
    """Epoch 0 of an honest RemoteLoader, one digest per batch (images and labels)."""
    kwargs = {"rank": 0, "world_size": 1, "device": "cpu", "timeout": 30}
    with RemoteLoader(srv.endpoint, "train", prefetch_next_epoch=False, **kwargs) as loader:
        return [
            hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in loader
        ]


def hello_map(**fields: Any) -> dict[str, Any]:
    m = {"v": 2, "type": "hello", "split": "train", "rank": 0, "world_size": 1, "epoch": 0}
    m.update({"batches": [0], "session": 1, "job": "hostile"})
    m.update(fields)
    return m


def first_reply(sock: zmq.Socket, frame: bytes, timeout_s: float = 10.0) -> wire.ServerMessage:
    sock.send(frame)
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return wire.decode_server_message(sock.recv_multipart()[0])


def malformed_total(srv: ServerProcess) -> int:
    return srv.stats()["counters"]["malformed_total"]


# --------------------------------------------------------------------------- fuzzing

_BASES = (
    hello_map(batches=[0, 1], session=7),
    {"v": 2, "type": "credit", "batches": [2, 3], "stats": {"prefetch_depth": 4}},
    {"v": 2, "type": "bye"},
    {"v": 2, "type": "stats"},
)
_ODD = (
    None, True, 0, -1, I63, -(2**63), U64, 1.5, float("nan"), float("inf"), "", "x" * 70_000,
    b"\x00\xff", [], [None], [[[]]], {}, {"a": {"b": 1}}, [1] * 300, list(range(257)), ["0"],
    [-1], [0, 0],
)  # fmt: skip


def _fuzzed(rng: random.Random) -> list[bytes]:
    """One fuzzed message: a field set to an odd value or dropped, unknown fields, too many
    keys, a truncated or bit-flipped frame, random bytes, deep nesting, or extra frames."""
    m = dict(rng.choice(_BASES))
    kind = rng.randrange(9)
    if kind == 0:
        m[rng.choice(list(m))] = rng.choice(_ODD)
    elif kind == 1:
        del m[rng.choice(list(m))]
    elif kind == 2:
        m[f"unknown{rng.randrange(9)}"] = rng.choice(_ODD)
    elif kind == 3:
        m.update({f"k{i}": i for i in range(rng.choice((10, 300)))})
    frame = msgpack.packb(m, use_bin_type=True)
    if kind == 4:
        frame = frame[: rng.randrange(len(frame))]
    elif kind == 5:
        flipped = bytearray(frame)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        frame = bytes(flipped)
    elif kind == 6:
        frame = rng.randbytes(rng.randrange(200))
    elif kind == 7:
        frame = b"\x81\xa1v" + b"\x91" * rng.choice((100, 5000, 100_000)) + b"\xc0"
    frames = [frame]
    if kind == 8:
        frames.append(b"x" * rng.randrange(3))
    return frames


def _locally_malformed(frames: list[bytes]) -> bool:
    """What the server must count as malformed: not one frame the wire's decoder takes."""
    if len(frames) != 1:
        return True
    try:
        wire.decode_client_message(frames[0])
    except wire.ProtocolError:
        return True
    return False


def _fuzz(endpoint: str, count: int, seed: int, out: dict[str, int]) -> None:
    """Send ``count`` fuzzed messages (bounded to 60 s), reading every reply."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)

    def read(wait_ms: int) -> bool:
        if not sock.poll(wait_ms):
            return False
        msg = wire.decode_server_message(sock.recv_multipart()[0])
        if isinstance(msg, wire.ErrorReply) and msg.reason == "bad-request":
            out["bad_request"] += 1
        return True

    try:
        deadline = time.monotonic() + 60
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            frames = _fuzzed(rng)
            out["malformed"] += _locally_malformed(frames)
            sock.send_multipart(frames)
            out["sent"] += 1
            while read(0):
                pass
        while time.monotonic() < deadline and read(1000):
            pass
    finally:
        sock.close(0)
        ctx.term()


def test_fuzzed_frames_are_counted_and_an_honest_loader_beside_gets_its_exact_batches(
    server, reference
):
    """Seeded fuzzing (random bytes, truncated and bit-flipped maps, deep nesting, odd values
    in every field, unknown fields, extra frames) while an honest loader streams: each malformed
    frame is answered ``bad-request`` and counted, the log stays short, the loader's batches
    are byte for byte those it got before."""
    before = malformed_total(server)
    out = {"sent": 0, "malformed": 0, "bad_request": 0}
    fuzzer = threading.Thread(target=_fuzz, args=(server.endpoint, 1500, 1, out))
    fuzzer.start()
    try:
        during = honest_epoch(server)
    finally:
        fuzzer.join(90)
    assert not fuzzer.is_alive()
    assert out["sent"] == 1500 and out["malformed"] > 1000, out
    assert during == reference
    assert out["bad_request"] == out["malformed"], out
    assert malformed_total(server) - before == out["malformed"]
    logged = server.log().count("malformed message from")
    assert logged <= MALFORMED_LINES_PER_WINDOW, logged
    assert honest_epoch(server) == reference


# --------------------------------------------------------------------------- extreme values

_EXTREMES = [
    ("epoch u64", {"epoch": U64}, "welcome"),
    ("epoch i63", {"epoch": I63}, "welcome"),
    ("session i64 min", {"session": -(2**63)}, "welcome"),
    ("session u64", {"session": U64}, "welcome"),
    ("unknown fields", {"zzz": [1, 2], "foo": {"a": 1}}, "welcome"),
    ("world_size i63", {"world_size": I63}, "refused"),
    ("world_size u64", {"world_size": U64, "rank": U64 - 1}, "refused"),
    ("start_sample u64", {"start_sample": U64}, "refused"),
    ("epoch_world_size u64", {"start_sample": 1, "epoch_world_size": U64}, "refused"),
    ("batch index u64", {"batches": [U64]}, "refused"),
    ("image_size max", {"image_size": [16384, 16384]}, "refused"),
    ("batch_size past max", {"batch_size": 10**6}, "bad-request"),
    ("batch_size 0", {"batch_size": 0}, "bad-request"),
    ("job not a string", {"job": 5}, "bad-request"),
    ("split bytes", {"split": b"train"}, "bad-request"),
    ("split 60k chars", {"split": "x" * 60_000}, "refused"),
    ("rank = world_size", {"rank": 1}, "bad-request"),
    ("257 batches", {"batches": list(range(257))}, "bad-request"),
]


@pytest.mark.parametrize(
    ("fields", "answer"), [c[1:] for c in _EXTREMES], ids=[c[0] for c in _EXTREMES]
)
def test_a_hello_with_extreme_values_is_served_or_refused_never_crashes(server, fields, answer):
    """Integers at the edges of msgpack's range in every numeric field, unknown fields, huge
    strings: a welcome, or an error of the right class short enough to read."""
    sock = server.dealer()
    try:
        reply = first_reply(sock, msgpack.packb(hello_map(**fields), use_bin_type=True))
        if answer == "welcome":
            assert isinstance(reply, wire.Welcome), reply
        else:
            assert isinstance(reply, wire.ErrorReply) and reply.reason == answer, reply
            assert len(reply.message) <= 1000
        sock.send(wire.Bye().pack())
    finally:
        sock.close(0)
    assert server.running


# --------------------------------------------------------------------------- identity


def test_another_peer_cannot_take_over_a_trainers_identity_or_session(server, ctx):
    """A ROUTER refuses a second connection with an identity in use: the spoofer's bye and
    hello never arrive and it gets no reply. A peer sending the trainer's session number,
    job, rank and epoch from its own identity opens its own session and ends only that one."""
    victim = {"session": 11, "job": "victim"}
    trainer = RawClient.connect(ctx, server.endpoint, identity=b"trainer-7", **victim)
    trainer.start()  # its connection holds the identity before the spoofer's comes
    spoof = RawClient.connect(ctx, server.endpoint, identity=b"trainer-7", **victim)
    mimic = RawClient.connect(ctx, server.endpoint, batches=(0, 1), **victim)
    try:
        assert trainer.batch()[0].batch_index == 0
        spoof.send(wire.Bye())
        spoof.send(
            wire.Hello(split="train", rank=0, world_size=1, epoch=0, batches=(5,), session=11)
        )
        spoof.send(wire.StatsRequest())
        mimic.start()
        mimic.bye()
        assert not spoof.sock.poll(1000), "a peer spoofing an identity in use got a reply"
        head, _, _ = trainer.batch()
        assert (head.batch_index, head.session) == (1, 11)
        trainer.credit([2, 3])
        assert [trainer.batch()[0].batch_index for _ in range(2)] == [2, 3]
        rows = [c for c in server.stats()["clients"] if c["job"] == "victim"]
        assert len(rows) == 1 and rows[0]["sent"] == 4, rows
        trainer.bye()
    finally:
        for c in (trainer, spoof, mimic):
            c.close()


# --------------------------------------------------------------------------- frames


def test_wrong_frame_counts_and_frames_past_zeromqs_limit_cost_the_sender_only(server, ctx):
    """1000 frames or an empty one: a bad-request naming it, counted. A 17 MiB frame (past
    the socket's 16 MiB maxmsgsize): ZeroMQ drops that connection; the server serves on."""
    sock = server.dealer()
    big = server.dealer()
    try:
        before = malformed_total(server)
        many = first_reply(sock, b"")  # an empty frame first: not msgpack
        assert isinstance(many, wire.ErrorReply) and many.reason == "bad-request", many
        sock.send_multipart([wire.StatsRequest().pack()] * 1000)
        assert sock.poll(10_000)
        reply = wire.decode_server_message(sock.recv_multipart()[0])
        assert isinstance(reply, wire.ErrorReply), reply
        assert "expected 1 control frame, got 1000" in reply.message
        big.send(b"\x00" * (17 << 20))
        assert not big.poll(1500), "a frame past maxmsgsize was answered"
        assert malformed_total(server) == before + 2
        fresh = first_reply(sock, wire.StatsRequest().pack())
        assert isinstance(fresh, wire.StatsReply)
    finally:
        sock.close(0)
        big.close(0)


# --------------------------------------------------------------------------- credits


def test_replayed_duplicated_and_out_of_epoch_credits_are_refused_and_the_session_goes_on(
    server, ctx
):
    client = RawClient.connect(ctx, server.endpoint, batches=(0,), session=3, job="credits")
    stranger = server.dealer()
    try:
        client.start()
        assert client.batch()[0].batch_index == 0
        refusals = {
            "replayed": ([0], "refused", "asked for already"),
            "beyond the epoch": ([EPOCH_BATCHES], "refused", "out of range"),
            "far beyond": ([2**63], "refused", "out of range"),
            "twice in one credit": ([1, 1], "bad-request", "lists a batch twice"),
            "negative": ([-1], "bad-request", "batch indices >= 0"),
            "257 at once": (list(range(1, 258)), "bad-request", "at most 256"),
        }
        for what, (batches, reason, needle) in refusals.items():
            frame = msgpack.packb({"v": 2, "type": "credit", "batches": batches})
            reply = first_reply(client.sock, frame)
            assert isinstance(reply, wire.ErrorReply), (what, reply)
            assert reply.reason == reason and needle in reply.message, (what, reply)
        client.credit([1, 2])
        assert [client.batch()[0].batch_index for _ in range(2)] == [1, 2]
        # A credit from a peer with no session is ignored (its re-sent hello starts one).
        stranger.send(wire.Credit(batches=(0, 1)).pack())
        assert not stranger.poll(500)
        client.bye()
    finally:
        client.close()
        stranger.close(0)


# --------------------------------------------------------------------------- churn


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_connect_hello_disconnect_cycles_leave_no_session_descriptor_or_memory(server, reference):
    """500 peers each connect, say hello (asking a batch) and vanish without a bye: every
    session goes, the descriptors come back, memory stays put, an honest loader is served."""
    fds, rss = _open_fds(server.pid), _rss(server.pid)
    ctx = zmq.Context()
    try:
        for i in range(500):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(server.endpoint)
            reply = first_reply(sock, msgpack.packb(hello_map(session=i, job="churn")))
            assert isinstance(reply, wire.Welcome), reply
            sock.close(0)
    finally:
        ctx.destroy(linger=0)

    def churn_gone() -> bool:
        return not any(c["job"] == "churn" for c in server.stats()["clients"])

    wait_for(churn_gone, "the vanished peers' sessions to go", timeout=20)
    wait_for(lambda: _open_fds(server.pid) <= fds + 2, "the descriptors to come back", 20)
    assert _rss(server.pid) - rss < 32 * 2**20, (_rss(server.pid) - rss) / 2**20
    assert honest_epoch(server) == reference
