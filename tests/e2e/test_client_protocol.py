"""RemoteLoader facing a server that breaks the protocol.

The real pipeline-server never sends these frames, so a raw ZeroMQ ROUTER socket plays a broken
(or foreign-version) server: it answers the loader's real hello with hand-made frames. Everything
that works is tested against real servers in test_remote_loader*.py.
"""

from __future__ import annotations

import itertools
import time

import msgpack
import pytest
import wirefakes
from batchwire import wire
from batchwire.client import (
    ProtocolError,
    RemoteLoader,
    ServerError,
    ServerUnavailable,
    VersionMismatch,
)
from batchwire.client.fleet import ERRORS_BEFORE_RAISING
from wirefakes import NBYTES, RawServer


def welcome(session: int) -> bytes:
    return wirefakes.welcome(session).pack()


def header(session: int, k: int) -> bytes:
    return wirefakes.header(session, k).pack()


def labels(k: int) -> bytes:
    return wire.labels_to_frame([k, k + 1]).tobytes()


def run_loader(reply) -> list:
    srv = RawServer(lambda sock, identity, hello, _stop: reply(sock, identity, hello))
    try:
        with RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, timeout=5,
            normalize_on_device=False,  # the bytes sent, which tell the batches apart
        ) as loader:  # fmt: skip
            return [tuple(t.clone() for t in b) for b in loader]
    finally:
        srv.close()


@pytest.mark.timeout(30)
def test_version_mismatch_names_both_versions():
    def reply(sock, identity, hello):
        sock.send_multipart([identity, msgpack.packb({"v": 1, "type": "welcome"})])

    with pytest.raises(VersionMismatch, match="v1") as info:
        run_loader(reply)
    assert f"v{wire.PROTOCOL_VERSION}" in str(info.value) and "tcp://127.0.0.1" in str(info.value)


@pytest.mark.timeout(30)
def test_images_frame_shorter_than_its_header_is_a_protocol_error():
    def reply(sock, identity, hello):
        sock.send_multipart([identity, welcome(hello.session)])
        sock.send_multipart([identity, header(hello.session, 0), b"\0" * 50, labels(0)])

    with pytest.raises(ProtocolError, match=f"50 bytes; its header says {NBYTES}"):
        run_loader(reply)


@pytest.mark.timeout(30)
def test_missing_labels_frame_is_a_protocol_error():
    def reply(sock, identity, hello):
        sock.send_multipart([identity, welcome(hello.session)])
        sock.send_multipart([identity, header(hello.session, 0), b"\0" * NBYTES])

    with pytest.raises(ProtocolError, match="no labels frame"):
        run_loader(reply)


@pytest.mark.timeout(30)
def test_a_stale_sessions_batches_are_dropped():
    def reply(sock, identity, hello):
        s = hello.session
        sock.send_multipart([identity, welcome(s)])
        sock.send_multipart([identity, header(s - 1, 0), b"\1" * NBYTES, labels(7)])  # stale
        sock.send_multipart([identity, header(s, 0), b"\2" * NBYTES, labels(0)])
        sock.send_multipart([identity, header(s, 1), b"\4" * NBYTES, labels(1)])

    got = run_loader(reply)
    assert [int(images.flatten()[0]) for images, _, _ in got] == [2, 4]
    assert [labels.tolist() for _, labels, _ in got] == [[0, 1], [1, 2]]
    assert [indices.tolist() for _, _, indices in got] == [[0, 1], [2, 3]]


@pytest.mark.timeout(30)
def test_a_batch_not_asked_for_is_a_protocol_error():
    """The server sends exactly the batches asked for, in order: a repeat (or any other batch)
    means the two sides no longer agree on what was asked, which is not something to guess."""

    def reply(sock, identity, hello):
        s = hello.session
        sock.send_multipart([identity, welcome(s)])
        sock.send_multipart([identity, header(s, 0), b"\2" * NBYTES, labels(0)])
        sock.send_multipart([identity, header(s, 0), b"\3" * NBYTES, labels(0)])  # again

    with pytest.raises(ProtocolError, match="sent batch 0 where its session was to send 1"):
        run_loader(reply)


@pytest.mark.timeout(30)
def test_batch_unlike_the_welcome_is_a_protocol_error():
    def reply(sock, identity, hello):
        sock.send_multipart([identity, welcome(hello.session)])
        bad = wire.BatchHeader(
            session=hello.session,
            split="train",
            epoch=0,
            batch_index=0,
            shape=[2, 3, 8, 8],
            dtype="uint8",
            layout="nchw",
            indices=[0, 1],
            nbytes=2 * 3 * 8 * 8,
        ).pack()
        sock.send_multipart([identity, bad, b"\0" * (2 * 3 * 8 * 8), labels(0)])

    with pytest.raises(ProtocolError, match="welcome promised"):
        run_loader(reply)


@pytest.mark.timeout(30)
def test_peer_that_never_answers_the_hello_times_out_naming_it():
    srv = RawServer(lambda sock, identity, hello, _stop: None)
    try:
        loader = RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=1.0
        )
        with pytest.raises(ServerUnavailable, match="did not answer the hello") as info:
            len(loader)
        assert srv.endpoint in str(info.value)
        loader.close()
    finally:
        srv.close()


def test_a_repeated_error_reply_is_raised_as_the_servers_error_after_a_few_backed_off_tries():
    """A server that welcomes every hello and then answers with the same error: the loader
    backs off and raises ServerError with the server's words, instead of re-sending its hello
    hundreds of times a second until its timeout and raising ServerUnavailable."""
    hellos = []

    def reply(sock, identity, hello):
        hellos.append(time.monotonic())
        sock.send_multipart([identity, welcome(hello.session)])
        sock.send_multipart([identity, wire.ErrorReply(message="disk on fire").pack()])

    srv = RawServer(lambda sock, identity, hello, _stop: reply(sock, identity, hello))
    try:
        with RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=30
        ) as loader:
            started = time.monotonic()
            with pytest.raises(ServerError, match="disk on fire"):
                next(iter(loader))
            took = time.monotonic() - started
    finally:
        srv.close()
    assert len(hellos) == ERRORS_BEFORE_RAISING
    gaps = [b - a for a, b in itertools.pairwise(hellos)]
    assert all(gap >= 0.2 for gap in gaps), f"no back-off between hellos: {gaps}"
    assert took < 10, "raised long before the loader's timeout"


@pytest.mark.timeout(60)
def test_transient_errors_are_asked_again_past_the_repeat_limit():
    """A batch that failed for a reason that may pass (reason "transient") is asked for again
    with back-off, however often, within the loader's timeout: a few seconds of too many open
    files on the server must not end a training run."""
    hellos = []

    def reply(sock, identity, hello):
        hellos.append(hello.session)
        sock.send_multipart([identity, welcome(hello.session)])
        if len(hellos) <= ERRORS_BEFORE_RAISING + 1:
            error = wire.ErrorReply(
                message="batch 0 failed: too many open files", reason="transient"
            )
            sock.send_multipart([identity, error.pack()])
            return
        s = hello.session
        sock.send_multipart([identity, header(s, 0), b"\2" * NBYTES, labels(0)])
        sock.send_multipart([identity, header(s, 1), b"\4" * NBYTES, labels(1)])

    got = run_loader(reply)
    assert [int(images.flatten()[0]) for images, _, _ in got] == [2, 4]
    assert len(hellos) == ERRORS_BEFORE_RAISING + 2
