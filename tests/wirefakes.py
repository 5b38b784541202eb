"""Wire messages of a tiny stream, for tests that play a server by hand or drive the client core.

The stream: batches of 2 uint8 images of 3 x 4 x 4 (96 bytes), 3 classes, one split "train".
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq
from batchwire import wire

SHAPE = [2, 3, 4, 4]
NBYTES = 2 * 3 * 4 * 4


def welcome(session: int, num_batches: int = 2, shape: list[int] = SHAPE) -> wire.Welcome:
    """The welcome of a stream of `num_batches` full batches."""
    return wire.Welcome(
        session=session,
        num_batches=num_batches,
        num_samples=shape[0] * num_batches,
        batch_size=shape[0],
        shape=shape,
        dtype="uint8",
        layout="nchw",
        mean=[0.5] * 3,
        std=[0.25] * 3,
        num_classes=3,
    )


def header(session: int, k: int, epoch: int = 0, shape: list[int] = SHAPE) -> wire.BatchHeader:
    """Batch `k`'s header; its samples are 2k and 2k + 1."""
    return wire.BatchHeader(
        session=session,
        split="train",
        epoch=epoch,
        batch_index=k,
        shape=shape,
        dtype="uint8",
        layout="nchw",
        indices=[2 * k, 2 * k + 1],
        replaced=0,
        nbytes=shape[0] * shape[1] * shape[2] * shape[3],
    )


Reply = Callable[[zmq.Socket, bytes, wire.Hello, threading.Event], None]
OnCredit = Callable[[zmq.Socket, bytes, wire.Hello, wire.Credit], None]


class RawServer:
    """A ROUTER playing a broken or hostile server: it answers each epoch-0 hello with
    ``reply(sock, identity, hello, stop)`` (on its own thread, so a reply may go on sending
    until ``stop`` is set), and each credit after one with ``on_credit(sock, identity, hello,
    credit)``. It serves one epoch only: the loader's early hello for epoch 1 (sent once epoch 0
    is delivered) stays unanswered, as a real server would never answer it with epoch-0
    batches."""

    def __init__(self, reply: Reply, on_credit: OnCredit | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.hellos: list[wire.Hello] = []
        self._reply = reply
        self._on_credit = on_credit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raw-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = wire.decode_client_message(frame)
            if isinstance(msg, wire.Hello) and msg.epoch == 0:
                self.hellos.append(msg)
                self._reply(self.sock, identity, msg, self._stop)
            elif isinstance(msg, wire.Credit) and self.hellos and self._on_credit:
                self._on_credit(self.sock, identity, self.hellos[-1], msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "raw server thread did not stop"
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
