"""Transport alone: batches/s and GB/s through protocol v1 against a bare PUSH/PULL.

    python -m batchwire.bench.bench_transport [--batches 200] [--endpoint tcp|ipc]

Both sides move the same bytes (default 64 x 3 x 224 x 224 uint8 per batch, a 224 px uint8
wire) between a sender thread and a receiver in this process, so only the transport differs:

- ``pushpull``: a PUSH socket sends the images frame zero-copy, a PULL socket `recv_into`s a
  preallocated buffer. No header, no labels, no flow control: the ceiling.
- ``protocol``: a minimal ROUTER server that runs the server's own send path
  (`server.sender.send_batch`: msgpack header + zero-copy images + labels, buffers reused only
  when their MessageTracker is done) under credit flow control; a DEALER does hello/welcome and
  `recv_into` (pinned buffers when CUDA is available), returning one credit per batch.
- ``loader`` (with ``--loader``): the same server, received by `client.RemoteLoader` on CPU.

Nothing is decoded or augmented: the producer is not what this measures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq
from batchwire.server import protocol as p
from batchwire.server.sender import send_batch, tensor_bytes


@dataclass
class Rate:
    name: str
    batches_per_s: float
    gbytes_per_s: float


def _endpoint(kind: str, tmp: str, name: str) -> str:
    if kind == "ipc":
        return f"ipc://{tmp}/{name}.sock"
    return "tcp://127.0.0.1:*"


# ------------------------------------------------------------------------------ bare PUSH/PULL


def run_pushpull(ctx: zmq.Context, endpoint: str, shape: tuple[int, ...], n: int) -> float:
    """Seconds to move ``n`` images frames PUSH -> PULL (after a warm-up of a few)."""
    src = torch.randint(0, 256, shape, dtype=torch.uint8)
    frame = tensor_bytes(src)
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(endpoint)
    endpoint = pull.last_endpoint.decode()
    warm = 5

    def sender() -> None:
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(endpoint)
        for _ in range(n + warm):
            push.send(frame, copy=False)
        push.close(linger=-1)

    thread = threading.Thread(target=sender, name="pushpull-sender")
    thread.start()
    dst = memoryview(np.empty(frame.nbytes, dtype=np.uint8))
    for _ in range(warm):
        pull.recv_into(dst)
    t0 = time.perf_counter()
    for _ in range(n):
        size = pull.recv_into(dst)
        assert size == frame.nbytes
    elapsed = time.perf_counter() - t0
    thread.join()
    pull.close(0)
    return elapsed


# ------------------------------------------------------------------------------ protocol v1


class TransportServer(threading.Thread):
    """Answers one hello, then sends batch k for every credit with the server's send path.

    Buffers come from a small ring and are rewritten only when their tracker is done, exactly as
    the server does; their contents stay the same, since producing is not what is measured.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, shape: tuple[int, ...], n: int) -> None:
        super().__init__(name="transport-server", daemon=True)
        self.shape = list(shape)
        self.n = n
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(endpoint)
        self.endpoint = self.sock.last_endpoint.decode()
        self.labels = np.arange(shape[0], dtype=np.int64)
        self.indices = list(range(shape[0]))
        self.nbytes = p.images_nbytes(shape, "uint8")
        self.ring = [torch.randint(0, 256, shape, dtype=torch.uint8) for _ in range(8)]
        self.stop = threading.Event()

    def run(self) -> None:
        free = list(range(len(self.ring)))
        held: list[tuple[zmq.MessageTracker, int]] = []
        identity, hello, credits, k = None, None, 0, 0
        while not self.stop.is_set():  # until the receiver is done (closing looks like a crash)
            want = credits > 0 and k < self.n
            # ready to send: don't wait; waiting on trackers (no fd): short; idle: long
            if self.sock.poll(0 if want and free else 1 if want else 50):
                frames = self.sock.recv_multipart()
                msg = p.decode_client_message(frames[1])
                if isinstance(msg, p.Hello):
                    identity, hello, credits, k = frames[0], msg, msg.prefetch, msg.start_batch
                    self.sock.send_multipart([identity, p.Welcome(
                        session=msg.session, num_batches=self.n, num_samples=self.n * self.shape[0],
                        batch_size=self.shape[0], shape=self.shape, dtype="uint8", layout="nchw",
                        mean=[0.5] * 3, std=[0.5] * 3, num_classes=self.shape[0]).pack()])
                elif isinstance(msg, p.Credit):
                    credits += msg.n
                continue
            still = []
            for tracker, slot in held:
                (free.append(slot) if tracker.done else still.append((tracker, slot)))
            held = still
            while credits and free and k < self.n:
                slot = free.pop()
                header = p.BatchHeader(
                    session=hello.session, split=hello.split, epoch=hello.epoch, batch_index=k,
                    shape=self.shape, dtype="uint8", layout="nchw", indices=self.indices,
                    replaced=0, nbytes=self.nbytes)
                tracker = send_batch(self.sock, header, tensor_bytes(self.ring[slot]),
                                     self.labels, identity=identity)
                held.append((tracker, slot))
                credits -= 1
                k += 1
        self.sock.close(linger=0)


def run_protocol(ctx: zmq.Context, endpoint: str, shape: tuple[int, ...], n: int,
                 prefetch: int) -> float:
    """Seconds to receive ``n`` batches by hand (hello, recv_into, one credit per batch)."""
    warm = 5
    server = TransportServer(ctx, endpoint, shape, n + warm)
    server.start()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    sock.send(p.Hello(split="train", rank=0, world_size=1, epoch=0, start_batch=0,
                      prefetch=prefetch, shard=(0, 1), session=1).pack())
    welcome = p.decode_server_message(sock.recv())
    assert isinstance(welcome, p.Welcome), welcome
    pin = torch.cuda.is_available()
    images = torch.empty(p.images_nbytes(shape, "uint8"), dtype=torch.uint8, pin_memory=pin)
    labels = torch.empty(shape[0], dtype=torch.int64, pin_memory=pin)
    img_buf, lab_buf = memoryview(images.numpy()), memoryview(labels.numpy()).cast("B")
    credit = p.Credit(n=1).pack()
    t0 = 0.0
    for i in range(n + warm):
        if i == warm:
            t0 = time.perf_counter()
        header = p.decode_server_message(sock.recv())
        assert isinstance(header, p.BatchHeader) and header.batch_index == i, header
        assert sock.recv_into(img_buf) == header.nbytes
        assert sock.recv_into(lab_buf) == header.labels_nbytes
        sock.send(credit)
    elapsed = time.perf_counter() - t0
    server.stop.set()
    server.join(10)
    sock.close(0)
    return elapsed


def run_loader(ctx: zmq.Context, endpoint: str, shape: tuple[int, ...], n: int,
               prefetch: int) -> float:
    """Seconds for `RemoteLoader` (CPU) to yield ``n`` batches from the transport server."""
    from batchwire.client import RemoteLoader

    warm = 5
    server = TransportServer(ctx, endpoint, shape, n + warm)
    server.start()
    loader = RemoteLoader(server.endpoint, "train", rank=0, world_size=1, prefetch=prefetch,
                          device="cpu", timeout=30)
    t0 = 0.0
    try:
        for i, (images, _labels) in enumerate(loader):
            if i == warm:
                t0 = time.perf_counter()
            assert images.shape == shape
        elapsed = time.perf_counter() - t0
    finally:
        loader.close()
        server.stop.set()
        server.join(10)
    return elapsed


def _measure(paths: dict[str, Callable[[], float]], n: int, nbytes: int,
             rounds: int) -> list[Rate]:
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
    ap = argparse.ArgumentParser(prog="python -m batchwire.bench.bench_transport",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200, help="batches per measurement")
    ap.add_argument("--rounds", type=int, default=5,
                    help="measurements per row, interleaved across rows (median)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--prefetch", type=int, default=4, help="credits in flight (protocol)")
    ap.add_argument("--endpoint", choices=["tcp", "ipc"], default="tcp")
    ap.add_argument("--loader", action="store_true", help="also measure RemoteLoader (CPU)")
    args = ap.parse_args(argv)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    nbytes = p.images_nbytes(shape, "uint8")
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bw-transport-") as tmp:
        ep = lambda name: _endpoint(args.endpoint, tmp, name)  # noqa: E731
        n = args.batches
        paths = {
            "pushpull": lambda: run_pushpull(ctx, ep("pp"), shape, n),
            "protocol": lambda: run_protocol(ctx, ep("pr"), shape, n, args.prefetch),
        }
        if args.loader:
            paths["loader"] = lambda: run_loader(ctx, ep("ld"), shape, n, args.prefetch)
        rows = _measure(paths, n, nbytes, args.rounds)
    ctx.term()
    base = rows[0]
    print(f"transport, {args.endpoint}, batch {list(shape)} uint8 = {nbytes / 1e6:.2f} MB, "
          f"{args.batches} batches x {args.rounds} rounds (median), prefetch {args.prefetch}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'path':<10} {'batches/s':>10} {'GB/s':>8} {'vs pushpull':>12}")
    for r in rows:
        print(f"{r.name:<10} {r.batches_per_s:>10.1f} {r.gbytes_per_s:>8.2f} "
              f"{r.batches_per_s / base.batches_per_s:>11.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
