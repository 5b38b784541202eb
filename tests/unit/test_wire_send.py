"""The batch send path (wire/send.py) on real sockets in this process.

What arrives is decoded with the wire's own functions (`decode_server_message`,
`labels_from_frame`) and compared with what was sent: header fields, image bytes, labels. Over
inproc a receiver's frame is the sender's memory itself, which shows that the images frame is
the buffer (not a copy) and that the returned tracker is that frame's: not done while ZeroMQ,
here the receiver, still holds it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest
import wirefakes
import zmq
from batchwire import wire

WAIT_MS = 2000


@pytest.fixture
def router_and_peers(ctx) -> tuple[zmq.Socket, dict[bytes, zmq.Socket]]:
    """A ROUTER on a loopback port and two DEALERs it has heard from (so it can route to them)."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0  # a ROUTER's sends never wait: it drops what it cannot queue
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    peers = {}
    for name in (b"a", b"b"):
        peer = peers[name] = ctx.socket(zmq.DEALER)
        peer.linger = 0
        peer.sndtimeo = WAIT_MS  # a send that would wait fails instead
        peer.routing_id = name
        peer.connect(endpoint)
        peer.send(b"hello")
    for _ in peers:
        assert router.poll(WAIT_MS)
        router.recv_multipart()
    return router, peers


@pytest.fixture
def pair(ctx) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """Two PAIR sockets over inproc: what is received is the very memory that was sent."""
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    sender.linger = receiver.linger = 0
    sender.sndtimeo = WAIT_MS
    sender.bind("inproc://send-batch")
    receiver.connect("inproc://send-batch")
    yield sender, receiver


def arrived(sock: zmq.Socket, copy: bool = True) -> list:
    assert sock.poll(WAIT_MS), "nothing arrived"
    return sock.recv_multipart(copy=copy)


def images_of(header: wire.BatchHeader, fill: int = 0) -> np.ndarray:
    return (np.arange(header.nbytes, dtype=np.uint8) + fill).reshape(header.shape)


def test_a_batch_reaches_the_peer_its_identity_names_and_decodes_as_sent(
    router_and_peers,
) -> None:
    router, peers = router_and_peers
    for name, k in ((b"b", 1), (b"a", 2)):
        header = wirefakes.header(session=9, k=k, epoch=4)
        tracker = wire.send_batch(router, header, images_of(header, k), np.array([k, 7]), name)
        head, pixels, labels = arrived(peers[name])  # its first message: nothing of the other's
        assert wire.decode_server_message(head) == header
        assert pixels == images_of(header, k).tobytes()
        assert wire.labels_from_frame(labels, header.batch_size).tolist() == [k, 7]
        tracker.wait(WAIT_MS / 1000)  # sent: the buffer is free again


def test_without_identity_the_batch_is_three_frames(router_and_peers) -> None:
    router, peers = router_and_peers
    header = wirefakes.header(session=1, k=0)
    wire.send_batch(peers[b"a"], header, images_of(header), np.array([0, 1]))
    identity, head, pixels, labels = arrived(router)
    assert identity == b"a"
    assert wire.decode_server_message(head) == header
    assert pixels == images_of(header).tobytes()
    assert wire.labels_from_frame(labels, header.batch_size).tolist() == [0, 1]


def test_a_header_packed_already_is_sent_as_it_is(pair) -> None:
    sender, receiver = pair
    header = wirefakes.header(session=2, k=5)
    wire.send_batch(sender, header.pack(), images_of(header), np.array([10, 11]))
    head, _, _ = arrived(receiver)
    assert head == header.pack()


@pytest.mark.parametrize("dtype", [">i4", "<i2", "<i8", ">u8"])
def test_labels_leave_as_little_endian_int64_whatever_they_came_as(pair, dtype) -> None:
    sender, receiver = pair
    header = wirefakes.header(session=3, k=0)
    labels = np.array([2, 300], dtype=dtype)
    wire.send_batch(sender, header, images_of(header), labels)
    _, _, frame = arrived(receiver)
    assert frame == np.array([2, 300], dtype="<i8").tobytes()
    assert wire.labels_from_frame(frame, header.batch_size).tolist() == [2, 300]


def test_multi_labels_leave_as_rows_of_int64(pair) -> None:
    sender, receiver = pair
    header = wirefakes.header(session=3, k=0)
    labels = np.array([[1, 2, -1], [0, -1, -1]], dtype=np.int32)
    wire.send_batch(sender, header, images_of(header), labels)
    _, _, frame = arrived(receiver)
    decoded = wire.labels_from_frame(frame, header.batch_size, width=3)
    assert decoded.tolist() == labels.tolist()


@pytest.mark.parametrize("view", ["array", "memoryview of a larger buffer"])
def test_the_images_frame_is_the_buffer_itself_held_until_the_tracker_says(pair, view) -> None:
    sender, receiver = pair
    header = wirefakes.header(session=4, k=1)
    buffer = np.zeros(2 * header.nbytes, dtype=np.uint8)  # a buffer pool's slot, say
    buffer[: header.nbytes] = images_of(header).ravel()
    images = buffer[: header.nbytes] if view == "array" else memoryview(buffer)[: header.nbytes]
    tracker = wire.send_batch(sender, header, images, np.array([2, 3]))
    frames = arrived(receiver, copy=False)
    pixels = np.frombuffer(frames[1].buffer, dtype=np.uint8)
    assert pixels.ctypes.data == buffer.ctypes.data  # not a copy: the buffer's own memory
    assert pixels.tobytes() == images_of(header).tobytes()
    del pixels, frames[2], frames[0]  # the header and labels frames let go, the images held
    gc.collect()
    with pytest.raises(zmq.NotDone):
        tracker.wait(0.01)  # the buffer may not be written yet
    del frames
    gc.collect()
    tracker.wait(WAIT_MS / 1000)  # ZeroMQ let go of it: now it may
