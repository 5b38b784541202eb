"""An honest trainer beside clients that re-send a hello every second and never read (issue 28,
item 7): its images/s alone, then among them, in one run against one server.

    python -m batchwire.bench.bench_rehello [--data DIR] [--clients 30] [--seconds 8]

One `pipeline-server` process (its defaults: 3 producers, --prefetch-depth 4) on a loopback
tcp:// port. The honest trainer is a real CPU `RemoteLoader` (prefetch 4, raw uint8 batches)
that reads every batch; it is timed for ``--seconds`` after a short warm-up, first
alone, then as a new trainer starting among ``--clients`` hostile clients that have run for
``--settle`` seconds (the steady state: a new hostile client is a new client, served as any
until its hellos ask again for what it was sent). Each hostile client is a plain pyzmq DEALER
(its own identity) that, every second, sends a new hello (a new session of the same stream: an
epoch of its own, the first ``--window`` batches) and a credit carrying stats only, and never
calls recv: its libzmq still takes the frames off the socket into its receive queue (up to the
default 1000 messages), so at the transport level it looks like a reader. Printed per round
(``--rounds``; the hostile clients disconnect after each): the solo rate, the rate among the
hostile clients, their ratio, and what the server produced and sent meanwhile (the trainer's
batches and the rest, the hostile clients', some of them sent again from the server's window of
batches without being produced again); then the median ratio (the machine's load moves single
rows).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from batchwire.bench.data import resolve_data, server_bench_parser
from batchwire.client import RemoteLoader
from batchwire.common.launcher import PipelineServer
from batchwire.wire import Credit, Hello
from batchwire.wire.stats_client import fetch_stats

WARMUP_BATCHES = 3
LOADER_TIMEOUT_S = 120.0  # before the fix a trainer among them waited long for a batch
HOSTILE_PREFIX = b"rehello-"
# Each hostile client asks for an epoch of its own (the trainer's are 0, 1, ...), so no two share
# a batch (--share-window would otherwise produce each batch once for all of them).
FIRST_EPOCH = 100_000
# Each row of the trainer starts at an epoch of its own, so no row is served batches another
# row had made (the server's window of batches).
EPOCHS_PER_ROW = 1000


def build_parser() -> argparse.ArgumentParser:
    p = server_bench_parser("bench_rehello", __doc__, batch_size=32, image_size=128)
    p.add_argument("--seconds", type=float, default=8.0, help="seconds timed per row")
    p.add_argument("--clients", type=int, default=30, help="hostile clients")
    p.add_argument("--window", type=int, default=4, help="batches each hostile hello asks for")
    p.add_argument(
        "--settle", type=float, default=10.0, help="seconds of hostile clients before timing"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of (alone, among them)")
    return p


class Rehellos:
    """``n`` DEALERs that each send a hello (a new session, the same batches) and a stats-only
    credit every second, from one thread, and never read."""

    def __init__(self, endpoint: str, n: int, window: int) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for i in range(n):
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = HOSTILE_PREFIX + b"%02d" % i
            sock.connect(endpoint)
            self.socks.append(sock)
        self.window = window
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        credit = Credit(stats={"images_per_s": 0.0}).pack()
        for session in itertools.count(1):
            for i, sock in enumerate(self.socks):
                hello = Hello(
                    split="train", rank=0, world_size=1, epoch=FIRST_EPOCH + i,
                    batches=tuple(range(self.window)), session=session,
                ).pack()  # fmt: skip
                for frame in (hello, credit):
                    with contextlib.suppress(zmq.Again):  # its queue is full: no matter
                        sock.send(frame, zmq.NOBLOCK)
            if self._stop.wait(1.0):
                return

    def __enter__(self) -> Rehellos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


def honest_rate(endpoint: str, seconds: float, first_epoch: int) -> tuple[float, int, float]:
    """A new trainer's images/s over ``seconds`` after a warm-up of a few batches, from epoch
    ``first_epoch`` on: (rate, images timed, seconds)."""
    with RemoteLoader(
        endpoint, "train", rank=0, world_size=1, device="cpu", prefetch=4,
        normalize_on_device=False, timeout=LOADER_TIMEOUT_S,
    ) as loader:  # fmt: skip
        seen = timed = 0
        t0 = 0.0
        for epoch in range(10_000):  # bounded; the row ends on time
            loader.set_epoch(first_epoch + epoch)
            for batch, _labels in loader:
                seen += 1
                if seen == WARMUP_BATCHES:
                    t0 = time.perf_counter()
                elif seen > WARMUP_BATCHES:
                    timed += len(batch)
                    if (took := time.perf_counter() - t0) >= seconds:
                        return timed / took, timed, took
    raise RuntimeError("the loader ran out of epochs")


def counters(endpoint: str) -> tuple[int, int]:
    """Batches the server has (sent, produced) since it started, to anyone."""
    c = fetch_stats(endpoint, timeout=10.0).counters
    return c.batches_total, c.batches_produced_total or 0


@dataclass
class Round:
    """One round: the trainer alone, then among the hostile clients."""

    solo: tuple[float, int, float]  # (images/s, images timed, seconds)
    among: tuple[float, int, float]
    sent: int  # batches the server sent while the trainer was among them
    produced: int  # batches it produced meanwhile
    trainer: int  # batches the trainer took meanwhile

    @property
    def ratio(self) -> float:
        return self.among[0] / self.solo[0]


def one_round(endpoint: str, args: argparse.Namespace, r: int) -> Round:
    """A solo row, then the hostile clients for ``--settle`` s and a row among them; they
    disconnect at the end (the server drops their sessions and forgets them)."""
    solo = honest_rate(endpoint, args.seconds, 2 * r * EPOCHS_PER_ROW)
    with Rehellos(endpoint, args.clients, args.window):
        time.sleep(args.settle)
        sent0, produced0 = counters(endpoint)
        among = honest_rate(endpoint, args.seconds, (2 * r + 1) * EPOCHS_PER_ROW)
        sent1, produced1 = counters(endpoint)
    trainer = WARMUP_BATCHES + among[1] // args.batch_size
    return Round(solo, among, sent1 - sent0, produced1 - produced0, trainer)


def _row(rate: tuple[float, int, float]) -> str:
    return f"{rate[0]:7.1f} images/s ({rate[1]} images in {rate[2]:.1f} s)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = resolve_data(args.data)
    server_args = (
        *("--train", data.server_train, "--allow-outside-root"),
        *("--batch-size", str(args.batch_size)),
        *("--image-size", str(args.image_size), "--output-dtype", "uint8"),
    )
    print(
        f"data: {data.shown} ({len(data.paths)} images), batch {args.batch_size}, "
        f"{args.image_size} px uint8; {args.clients} hostile clients, hello every 1 s asking "
        f"for {args.window} batches, never reading, for {args.settle:g} s before each row "
        "among them"
    )
    rounds = []
    with (
        tempfile.TemporaryDirectory(prefix="bw-rehello-") as tmp,
        PipelineServer(server_args, log_path=Path(tmp) / "server.log") as srv,
    ):
        for r in range(args.rounds):
            rounds.append(one_round(srv.endpoint, args, r))
            got = rounds[-1]
            print(f"round {r + 1}: the trainer alone        {_row(got.solo)}")
            print(f"         among the hostile clients  {_row(got.among)}")
            print(
                f"         ratio {got.ratio:.2f}; meanwhile the server produced {got.produced} "
                f"batches and sent {got.sent}: {got.trainer} to the trainer, about "
                f"{got.sent - got.trainer} to the hostile clients",
                flush=True,
            )
    median = statistics.median(r.ratio for r in rounds)
    print(f"median ratio over {len(rounds)} round(s): {median:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
