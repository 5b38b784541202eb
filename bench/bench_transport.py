"""Transport alone: batches/s and GB/s through the protocol against a bare PUSH/PULL.

    python -m batchwire.bench.bench_transport [--batches 200] [--endpoint tcp|ipc]

Both sides move the same bytes (default 64 x 3 x 224 x 224 uint8 per batch, a 224 px uint8
wire) from a sender process (as the server is one) to a receiver in this process, so only the
transport differs:

- ``pushpull``: a PUSH socket sends the images frame zero-copy, a PULL socket `recv_into`s a
  preallocated buffer. No header, no labels, no flow control: the ceiling.
- ``protocol``: a minimal ROUTER server that runs the server's own send path
  (`wire.send_batch`: msgpack header + zero-copy images + labels, buffers reused only
  when their MessageTracker is done) under credit flow control; a DEALER does hello/welcome and
  `recv_into` (pinned buffers when CUDA is available), returning one credit per batch.
- ``loader`` (with ``--loader``): the same server, received by `client.RemoteLoader` on CPU.
- ``+curve`` rows (with ``--keys``): the same, over a second server started with CURVE keys
  (`wire.keys`): every byte encrypted and authenticated, which is what it costs.

Nothing is decoded or augmented: the producer is not what this measures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch
import zmq
from batchwire import wire as p
from batchwire.common.cores import available_cores
from batchwire.wire import send_batch, tensor_bytes
from batchwire.wire.keys import ClientKeys, ServerKeys, create_keys
from batchwire.wire.raw_client import RawClient


@dataclass
class Rate:
    name: str
    batches_per_s: float
    gbytes_per_s: float


def _endpoint(kind: str, tmp: str, name: str) -> str:
    """A concrete endpoint both processes can use (a free port now, or a fresh ipc path)."""
    if kind == "ipc":
        return f"ipc://{tmp}/{name}.sock"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ------------------------------------------------------------------------------ senders
# Each runs in a process of its own, as the server does, so sender and receiver do not share a
# GIL; both serve every round until the parent terminates them.


def pushpull_sender(endpoint: str, nbytes: int, orders: Connection) -> None:
    """Bare pyzmq: PUSH the same zero-copy frame as many times as each order says.

    Counted, not endless: frames pushed while the receiver measures something else would pile
    up in its queue, and the next round would time a memcpy from memory instead of the wire.
    """
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(endpoint)
    frame = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    while (count := orders.recv()) is not None:
        for _ in range(count):
            push.send(frame, copy=False)


class TransportServer:
    """Answers hellos, then sends batch k for every credit with the server's send path.

    Buffers come from a small ring and are rewritten only when their tracker is done, exactly as
    the server does; their contents stay the same, since producing is not what is measured.
    A new hello (any identity) restarts the stream, so one process serves every round.
    """

    def __init__(
        self, endpoint: str, shape: tuple[int, ...], n: int, keys: str | None = None
    ) -> None:
        self.shape = list(shape)
        self.n = n
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        if keys is not None:
            ServerKeys(keys).guard(self.ctx, self.sock)
        self.sock.bind(endpoint)
        self.labels = np.arange(shape[0], dtype=np.int64)
        self.indices = list(range(shape[0]))
        self.nbytes = p.images_nbytes(shape, "uint8")
        self.ring = [torch.randint(0, 256, shape, dtype=torch.uint8) for _ in range(8)]

    def serve_forever(self) -> None:
        free = list(range(len(self.ring)))
        held: list[tuple[zmq.MessageTracker, int]] = []
        identity, hello, asked = None, None, deque()
        while True:
            want = bool(asked)
            # ready to send: don't wait; waiting on trackers (no fd): short; idle: long
            if self.sock.poll(0 if want and free else 1 if want else 50):
                frames = self.sock.recv_multipart()
                msg = p.decode_client_message(frames[1])
                if isinstance(msg, p.Hello):
                    identity, hello, asked = frames[0], msg, deque(msg.batches)
                    self.sock.send_multipart([identity, self._welcome(msg.session).pack()])
                elif isinstance(msg, p.Credit) and frames[0] == identity:
                    asked.extend(msg.batches)
                continue
            still = []
            for tracker, slot in held:
                (free.append(slot) if tracker.done else still.append((tracker, slot)))
            held = still
            while asked and free:
                k = asked.popleft()
                slot = free.pop()
                header = p.BatchHeader(
                    session=hello.session,
                    split=hello.split,
                    epoch=hello.epoch,
                    batch_index=k,
                    shape=self.shape,
                    dtype="uint8",
                    layout="nchw",
                    indices=self.indices,
                    replaced=0,
                    nbytes=self.nbytes,
                )
                tracker = send_batch(
                    self.sock, header, tensor_bytes(self.ring[slot]), self.labels, identity=identity
                )
                held.append((tracker, slot))

    def _welcome(self, session: int) -> p.Welcome:
        b = self.shape[0]
        return p.Welcome(
            session=session,
            num_batches=self.n,
            num_samples=self.n * b,
            batch_size=b,
            shape=self.shape,
            dtype="uint8",
            layout="nchw",
            mean=[0.5] * 3,
            std=[0.5] * 3,
            num_classes=b,
        )


def protocol_server(endpoint: str, shape: tuple[int, ...], n: int, keys: str | None = None) -> None:
    TransportServer(endpoint, shape, n, keys).serve_forever()


# ------------------------------------------------------------------------------ receivers

WARM = 5


def recv_pushpull(pull: zmq.Socket, orders: Connection, nbytes: int, n: int) -> float:
    """Seconds for ``n`` frames into one preallocated buffer (after a warm-up)."""
    dst = memoryview(np.empty(nbytes, dtype=np.uint8))
    orders.send(n + WARM)
    for _ in range(WARM):
        pull.recv_into(dst)
    t0 = time.perf_counter()
    for _ in range(n):
        if pull.recv_into(dst) != nbytes:
            raise RuntimeError("short frame")
    return time.perf_counter() - t0


class ProtocolReceiver:
    """The bare protocol: the wire's `RawClient` says hello, then this receives with recv_into
    into pinned buffers and gives one credit per batch (no reorder buffer, no staging)."""

    def __init__(self, sock: zmq.Socket, shape: tuple[int, ...], prefetch: int) -> None:
        self.client = RawClient(sock, batches=tuple(range(prefetch)), session=0)
        self.prefetch = prefetch
        pin = torch.cuda.is_available()
        self.images = torch.empty(
            p.images_nbytes(shape, "uint8"), dtype=torch.uint8, pin_memory=pin
        )
        self.labels = torch.empty(shape[0], dtype=torch.int64, pin_memory=pin)

    def run(self, n: int) -> float:
        self.client.start(session=self.client.hello.session + 1)  # skips an earlier round's
        sock = self.client.sock
        img = memoryview(self.images.numpy())
        lab = memoryview(self.labels.numpy()).cast("B")
        t0 = 0.0
        for i in range(n + WARM):
            if i == WARM:
                t0 = time.perf_counter()
            header = p.decode_server_message(sock.recv())
            if not isinstance(header, p.BatchHeader) or header.batch_index != i:
                raise RuntimeError(f"unexpected {header}")
            if sock.recv_into(img) != header.nbytes:
                raise RuntimeError("short images frame")
            if sock.recv_into(lab) != header.labels_nbytes:
                raise RuntimeError("short labels frame")
            if i + self.prefetch < n + WARM:
                sock.send(p.Credit(batches=(i + self.prefetch,)).pack())
        return time.perf_counter() - t0


def recv_loader(
    endpoint: str, shape: tuple[int, ...], n: int, prefetch: int, keys: str | None = None
) -> float:
    """Seconds for `RemoteLoader` (CPU) to yield ``n`` batches from the transport server."""
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        endpoint,
        "train",
        rank=0,
        world_size=1,
        prefetch=prefetch,
        device="cpu",
        normalize_on_device=False,  # the raw wire, as the figures in RESULTS.md
        timeout=60,
        keys=keys,
    )
    t0 = 0.0
    try:
        for i, (images, _labels) in enumerate(loader):
            if i == WARM:
                t0 = time.perf_counter()
            if tuple(images.shape) != shape:
                raise RuntimeError(f"unexpected shape {images.shape}")
        return time.perf_counter() - t0
    finally:
        loader.close()


def _measure(paths: dict[str, Callable[[], float]], n: int, nbytes: int, rounds: int) -> list[Rate]:
    """Median of ``rounds`` runs per path, the paths interleaved so load drifts hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(fn())
    out = []
    for name, ts in times.items():
        t = statistics.median(ts)
        out.append(Rate(name, n / t, n * nbytes / t / 1e9))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_transport", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--batches", type=int, default=200, help="batches per measurement")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="measurements per row, interleaved across rows (median)",
    )
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--prefetch", type=int, default=4, help="credits in flight (protocol)")
    ap.add_argument("--endpoint", choices=["tcp", "ipc"], default="tcp")
    ap.add_argument("--loader", action="store_true", help="also measure RemoteLoader (CPU)")
    ap.add_argument("--keys", action="store_true", help="also measure with CURVE encryption")
    args = ap.parse_args(argv)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    nbytes = p.images_nbytes(shape, "uint8")
    n = args.batches
    spawn = mp.get_context("spawn")
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bw-transport-") as tmp:
        pp_ep, pr_ep = _endpoint(args.endpoint, tmp, "pp"), _endpoint(args.endpoint, tmp, "pr")
        orders, sender_orders = spawn.Pipe()
        senders = [
            spawn.Process(target=pushpull_sender, args=(pp_ep, nbytes, sender_orders), daemon=True),
            spawn.Process(target=protocol_server, args=(pr_ep, shape, n + WARM), daemon=True),
        ]
        keys = str(create_keys(os.path.join(tmp, "keys"))) if args.keys else None
        curve_ep = _endpoint(args.endpoint, tmp, "curve")
        if keys is not None:
            curve_args = (curve_ep, shape, n + WARM, keys)
            senders.append(spawn.Process(target=protocol_server, args=curve_args, daemon=True))
        for proc in senders:
            proc.start()
        pull = ctx.socket(zmq.PULL)
        dealer = ctx.socket(zmq.DEALER)
        curve_dealer = ctx.socket(zmq.DEALER)
        try:
            pull.connect(pp_ep)
            dealer.connect(pr_ep)
            receiver = ProtocolReceiver(dealer, shape, args.prefetch)
            paths = {
                "pushpull": lambda: recv_pushpull(pull, orders, nbytes, n),
                "protocol": lambda: receiver.run(n),
            }
            if args.loader:
                paths["loader"] = lambda: recv_loader(pr_ep, shape, n, args.prefetch)
            if keys is not None:
                ClientKeys.load(keys).apply(curve_dealer)
                curve_dealer.connect(curve_ep)
                curve_receiver = ProtocolReceiver(curve_dealer, shape, args.prefetch)
                paths["protocol+curve"] = lambda: curve_receiver.run(n)
                if args.loader:
                    paths["loader+curve"] = lambda: recv_loader(
                        curve_ep, shape, n, args.prefetch, keys
                    )
            rows = _measure(paths, n, nbytes, args.rounds)
        finally:
            orders.send(None)
            for proc in senders:
                proc.terminate()
                proc.join(10)
            pull.close(0)
            dealer.close(0)
            curve_dealer.close(0)
    ctx.term()
    base = rows[0]
    print(
        f"transport, {args.endpoint}, batch {list(shape)} uint8 = {nbytes / 1e6:.2f} MB, "
        f"{args.batches} batches x {args.rounds} rounds (median), prefetch {args.prefetch}, "
        f"{available_cores()} CPUs"
    )
    print(f"{'path':<15} {'batches/s':>10} {'GB/s':>8} {'vs pushpull':>12}")
    for r in rows:
        print(
            f"{r.name:<15} {r.batches_per_s:>10.1f} {r.gbytes_per_s:>8.2f} "
            f"{r.batches_per_s / base.batches_per_s:>11.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
