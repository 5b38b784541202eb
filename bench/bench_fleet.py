"""One loader, two servers of unequal speed: throughput against the sum of each alone, and the
time to recover after one is killed.

    python -m batchwire.bench.bench_fleet [--data DIR] [--batch-size 32] [--images 1024]
    python -m batchwire.bench.bench_fleet --grow [--phase 20] [--resolve-every 5]

Each server is pinned to its own core (so "each alone" and "both" use the same CPU per
server); the slow one is stopped for half of every 100 ms (SIGSTOP/SIGCONT), a stand-in for a
busier or older host. The loader runs here, unpinned, and only receives uint8 batches.

Rows: fast alone, slow alone, both (the loader asks whichever server has room), and the sum
of the two alone, which "both" should approach. With fixed shares (each server a fixed half
of every epoch, as before protocol v2) "both" could not exceed twice the slow server's rate.
Then recovery: both servers unthrottled, the second SIGKILLed a third of the way into the
epoch; reported: the longest wait for a batch around the kill, and whether the epoch came
complete and in order.

``--grow`` (issue 24: an elastic fleet found by DNS) measures instead what adding servers
mid-run buys: a private dnsmasq on 127.0.0.1 answers for one fleet name (as
tests/e2e/test_discovery.py does: no /etc/hosts edit, no root), three servers listen on
127.0.0.2/3/4 (loopback only), and one loader reads ``dns+tcp://NAME:PORT``. The name starts
with one server; a phase later the second is added to DNS, a phase after that the third. A
thread asks every server for its sent-batch counter every `SAMPLE_S`; printed per added server:
seconds from the DNS change (the record answering) until its first batch, and until it carries
its share (in some one-second window it sent at least ``--share-tolerance`` of 1/N of the
batches all servers sent), and images/s at the loader before and after (the after rate from
that moment to the end of its phase). The servers are started before the run, so the figures
are the loader's re-resolve (every ``--resolve-every`` s, the loader's default 5) and take-up,
not a server's start.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchwire.bench.data import resolve_data, server_bench_parser
from batchwire.client import RemoteLoader, discovery
from batchwire.common.launcher import PipelineServer
from batchwire.wire.dns import DNS_SERVER_ENV, DnsError, dnspython_resolver
from batchwire.wire.stats_client import StatsClient, StatsUnavailable


def build_parser() -> argparse.ArgumentParser:
    p = server_bench_parser("bench_fleet", __doc__, batch_size=32, image_size=224)
    p.add_argument("--images", type=int, default=1024, help="images timed per row")
    p.add_argument("--prefetch", type=int, default=4, help="the loader's prefetch (budget)")
    p.add_argument("--slow-duty", type=float, default=0.5, help="share of time the slow one stops")
    grow = p.add_argument_group("--grow: servers added to a DNS fleet name mid-run")
    grow.add_argument("--grow", action="store_true", help="run this instead (needs dnsmasq)")
    grow.add_argument(
        "--phase", type=float, default=20.0, metavar="S", help="seconds per fleet size (20)"
    )
    grow.add_argument(
        "--resolve-every",
        type=float,
        default=discovery.RESOLVE_EVERY_S,
        metavar="S",
        help=f"the loader's re-resolve interval (default: its own, {discovery.RESOLVE_EVERY_S:g})",
    )
    grow.add_argument(
        "--share-tolerance",
        type=float,
        default=0.8,
        metavar="F",
        help="a new server carries its share once it sends F x 1/N of a second's batches (0.8)",
    )
    return p


DNSMASQ = shutil.which("dnsmasq") or (
    "/usr/sbin/dnsmasq" if Path("/usr/sbin/dnsmasq").exists() else None
)
GROW_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
GROW_NAME = "fleet.bench"
SAMPLE_S = 0.25  # how often --grow asks each server for its counters
WINDOW_S = 1.0  # the window a share is judged over


def free_port(hosts: tuple[str, ...], kind: int = socket.SOCK_STREAM) -> int:
    """A port free on every one of ``hosts`` (loopback addresses) a moment ago."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no common free port")


def _free_dns_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1: dnsmasq binds both, and exits at once
    when the TCP one is taken (a UDP-only check let a test's dnsmasq fail to start)."""
    for _ in range(50):
        port = free_port(("127.0.0.1",), socket.SOCK_DGRAM)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free for both UDP and TCP")


#: Starts of a private dnsmasq on fresh ports before its failure to start is an error.
START_ATTEMPTS = 3
#: Seconds within which a dnsmasq that could not bind its port has exited (a few ms here).
EARLY_EXIT_S = 0.1


class Dnsmasq:
    """A private dnsmasq on 127.0.0.1 answering for ``name`` from a hosts file that `set`
    rewrites (SIGHUP rereads it; TTL 0 by default, so every lookup sees the file as it is; a
    test of caching gives another ``ttl``). Ask it with ``BATCHWIRE_DNS_SERVER=`` `server`.
    Shared with tests/e2e/test_discovery.py and test_fleet_audit_dns.py."""

    def __init__(self, folder: Path, name: str, start_timeout: float = 10.0, ttl: int = 0) -> None:
        if DNSMASQ is None:
            raise RuntimeError("dnsmasq is not installed (scripts/setup.sh installs dnsmasq-base)")
        self.name = name
        self.hosts = folder / "hosts"
        self.hosts.write_text(f"127.0.0.1 {name}\n")  # to see it answer (no SIGHUP before)
        self._log = folder / "dnsmasq.log"
        for attempt in range(START_ATTEMPTS):
            self._start(ttl)
            # Another process may take the port between the check and dnsmasq's bind: dnsmasq
            # then exits at once, and another port is tried (a lookup would wait its timeout).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(EARLY_EXIT_S)
            if self.proc.poll() is not None and attempt + 1 < START_ATTEMPTS:
                continue
            try:
                self._wait_for(["127.0.0.1"], start_timeout, "dnsmasq did not start")
                return
            except BaseException:
                self.close()
                raise

    def _start(self, ttl: int) -> None:
        self.port = _free_dns_port()
        self.proc = subprocess.Popen(
            [
                DNSMASQ, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.hosts}", "--listen-address=127.0.0.1",
                "--bind-interfaces", f"--port={self.port}", "--pid-file=", f"--local-ttl={ttl}",
                *(["--user=root"] if os.geteuid() == 0 else []),
                f"--log-facility={self._log}",
            ],
        )  # fmt: skip
        self.server = f"127.0.0.1:{self.port}"
        self._resolve = dnspython_resolver(self.server)

    def lookup(self) -> list[str]:
        """What it answers for the name now (no records, or no answer: [])."""
        try:
            return self._resolve(self.name, 1)
        except DnsError:
            return []

    def set(self, *addresses: str, timeout: float = 10.0) -> None:
        """Make the name resolve to ``addresses`` (none: no records); returns once it does."""
        self.hosts.write_text("".join(f"{a} {self.name}\n" for a in addresses))
        self.proc.send_signal(signal.SIGHUP)
        self._wait_for(sorted(addresses), timeout, "dnsmasq did not take the new records")

    def _wait_for(self, addresses: list[str], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while (now := sorted(self.lookup())) != addresses:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what}: it says {now}, not {addresses}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Dnsmasq:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Throttle:
    """Stops a process for ``duty`` of every 100 ms while active."""

    def __init__(self, pid: int, duty: float) -> None:
        self.pid, self.duty = pid, duty
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self._stop.wait(0.1 * self.duty)
            os.kill(self.pid, signal.SIGCONT)
            self._stop.wait(0.1 * (1 - self.duty))

    def __enter__(self) -> Throttle:
        if self.duty > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        os.kill(self.pid, signal.SIGCONT)


def pin(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core`` (affinity is per thread; the server's producer
    and decode threads exist once it serves)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def images_per_s(endpoints: list[str], batches: int, batch_size: int, prefetch: int) -> float:
    """Rate of one RemoteLoader over ``batches`` batches after a warm-up of 3 (epoch 0 on)."""
    with RemoteLoader(
        endpoints,
        "train",
        rank=0,
        world_size=1,
        device="cpu",
        prefetch=prefetch,
        normalize_on_device=False,
    ) as loader:
        done, epoch, t0 = 0, 0, 0.0
        while done < batches + 3:
            loader.set_epoch(epoch)
            for _ in loader:
                done += 1
                if done == 3:
                    t0 = time.perf_counter()
                if done == batches + 3:
                    break
            epoch += 1
        return batches * batch_size / (time.perf_counter() - t0)


def recovery(endpoints: list[str], victim: PipelineServer) -> tuple[float, int, int]:
    """(longest wait for a batch, batches yielded, batches in the epoch) with the victim killed
    a third of the way in; the batches' indices are checked to be each batch exactly once."""
    with RemoteLoader(
        endpoints, "train", rank=0, world_size=1, device="cpu", normalize_on_device=False
    ) as loader:
        total = len(loader)
        longest, got = 0.0, 0
        t = time.perf_counter()
        for k, _ in enumerate(loader):
            now = time.perf_counter()
            if k > 0:
                longest = max(longest, now - t)
            t = now
            got += 1
            if k == total // 3:
                victim.kill()
                t = time.perf_counter()
        return longest, got, total


@dataclass
class GrowRun:
    """What --grow recorded: every server's sent batches every SAMPLE_S, each batch the loader
    took, and when each DNS change answered (all `time.monotonic`)."""

    sent: list[tuple[float, list[int]]] = field(default_factory=list)
    taken: list[tuple[float, int]] = field(default_factory=list)
    first_batch: float | None = None
    changes: list[float] = field(default_factory=list)
    end: float | None = None

    def rate(self, start: float, end: float) -> float:
        """Images per second the loader took in (start, end]."""
        images = sum(n for t, n in self.taken if start < t <= end)
        return images / (end - start) if end > start else float("nan")

    def first_sent(self, i: int, since: float) -> float | None:
        """Seconds from ``since`` to the first sample showing a batch sent by server i."""
        base = next((c[i] for t, c in reversed(self.sent) if t <= since), 0)
        return next((t - since for t, c in self.sent if t > since and c[i] > base), None)

    def share_at(self, i: int, n: int, since: float, until: float, tolerance: float):
        """Seconds from ``since`` to the end of the first WINDOW_S window in which server i
        sent at least ``tolerance`` x 1/n of the batches all servers sent; None if none did
        before ``until``."""
        for j, (t, counts) in enumerate(self.sent):
            if t <= since + WINDOW_S or t > until:
                continue
            k = max((x for x in range(j) if self.sent[x][0] <= t - WINDOW_S), default=None)
            if k is None:
                continue
            delta = [a - b for a, b in zip(counts, self.sent[k][1], strict=True)]
            if sum(delta) > 0 and delta[i] >= tolerance * sum(delta) / n:
                return t - since
        return None

    def shares(self, start: float, end: float) -> list[float]:
        """Each server's fraction of the batches sent in [start, end] (nearest samples)."""
        first = min(self.sent, key=lambda s: abs(s[0] - start))[1]
        last = min(self.sent, key=lambda s: abs(s[0] - end))[1]
        delta = [a - b for a, b in zip(last, first, strict=True)]
        return [d / sum(delta) if sum(delta) else 0.0 for d in delta]


def _sample_and_grow(
    run: GrowRun,
    endpoints: list[str],
    dns: Dnsmasq,
    phase: float,
    started: threading.Event,
    stop: threading.Event,
) -> None:
    """The --grow controller thread: samples every server's counter every SAMPLE_S; one
    phase after the loader's first batch adds the second server to DNS, a phase later the
    third, a phase after that ends the run (``stop``)."""
    clients = [StatsClient(ep, timeout=1.0) for ep in endpoints]
    last = [0] * len(endpoints)
    try:
        while not stop.is_set():
            t = time.monotonic()
            for i, client in enumerate(clients):
                with contextlib.suppress(StatsUnavailable):  # else keep the last figure
                    last[i] = client.fetch().counters.batches_total
            run.sent.append((t, list(last)))
            if started.is_set() and run.first_batch is not None:
                due = run.first_batch + (len(run.changes) + 1) * phase
                if time.monotonic() >= due:
                    if len(run.changes) == len(endpoints) - 1:
                        run.end = time.monotonic()
                        stop.set()
                        break
                    dns.set(*GROW_HOSTS[: len(run.changes) + 2])
                    run.changes.append(time.monotonic())
            stop.wait(max(0.0, t + SAMPLE_S - time.monotonic()))
    finally:  # also when a DNS change failed: the loader stops, the run says so
        stop.set()
        for client in clients:
            client.close()


def grow(args: argparse.Namespace, data_shown: str, images: int, server_args: list[str]) -> int:
    """``--grow``: see the module docstring."""
    if not (args.phase > 2 * WINDOW_S and args.resolve_every > 0):
        raise SystemExit("bench_fleet: --phase must exceed 2 s and --resolve-every be > 0")
    discovery.RESOLVE_EVERY_S = args.resolve_every  # read by the loader's Discovery
    port = free_port(GROW_HOSTS)
    endpoints = [f"tcp://{h}:{port}" for h in GROW_HOSTS]
    run = GrowRun()
    started, stop = threading.Event(), threading.Event()
    with tempfile.TemporaryDirectory() as tmp, Dnsmasq(Path(tmp), GROW_NAME) as dns:
        os.environ[DNS_SERVER_ENV] = dns.server  # this process's loader asks our dnsmasq
        servers = [
            PipelineServer(server_args, ep, log_path=Path(tmp) / f"server{i}.log")
            for i, ep in enumerate(endpoints)
        ]
        with servers[0], servers[1], servers[2]:
            dns.set(GROW_HOSTS[0])
            controller = threading.Thread(
                target=_sample_and_grow,
                args=(run, endpoints, dns, args.phase, started, stop),
                daemon=True,
            )
            controller.start()
            fleet = f"dns+tcp://{GROW_NAME}:{port}"
            hard_stop = time.monotonic() + 3 * args.phase + 120  # bounds the loop whatever
            try:
                with RemoteLoader(
                    fleet,
                    "train",
                    rank=0,
                    world_size=1,
                    device="cpu",
                    prefetch=args.prefetch,
                    normalize_on_device=False,
                ) as loader:
                    for epoch in range(10_000):  # bounded; the run ends on time below
                        loader.set_epoch(epoch)
                        for batch in loader:
                            now = time.monotonic()
                            run.taken.append((now, batch[0].shape[0]))
                            if run.first_batch is None:
                                run.first_batch = now
                                started.set()
                            if stop.is_set() or now > hard_stop:
                                break
                        if stop.is_set() or time.monotonic() > hard_stop:
                            break
            finally:
                stop.set()
                controller.join(timeout=10)
    if run.first_batch is None or len(run.changes) < 2 or run.end is None:
        raise SystemExit("bench_fleet --grow: the run ended before both servers were added")
    _report_grow(run, args, data_shown, images)
    return 0


def _report_grow(run: GrowRun, args: argparse.Namespace, data_shown: str, images: int) -> None:
    assert run.first_batch is not None and run.end is not None
    warm = min(3.0, args.phase / 4)
    bounds = [run.first_batch, *run.changes, run.end]
    print(
        f"{images} images from {data_shown}; batch {args.batch_size}, {args.image_size} px, "
        f"uint8, prefetch {args.prefetch}; servers on {', '.join(GROW_HOSTS)} (one port) "
        f"added to {GROW_NAME} in dnsmasq every {args.phase:g} s; the loader re-resolves every "
        f"{args.resolve_every:g} s; a share is >= {args.share_tolerance:g} x 1/N of the "
        f"batches sent in a {WINDOW_S:g} s window"
    )
    before = run.rate(run.first_batch + warm, run.changes[0])
    print(f"  1 server : {before:7.0f} img/s at the loader (after {warm:g} s of warm-up)")
    for n, (since, until) in enumerate(itertools.pairwise(bounds[1:]), start=2):
        i = n - 1
        first = run.first_sent(i, since)
        share = run.share_at(i, n, since, until, args.share_tolerance)
        steady = since + share if share is not None else (since + until) / 2
        after = run.rate(steady, until)
        shares = " / ".join(f"{x:.2f}" for x in run.shares(steady, until)[:n])
        said = (
            f"first batch {first:.2f} s, its share {share:.2f} s after the DNS change"
            if first is not None and share is not None
            else f"first batch {first} s, its share not reached within the phase"
        )
        print(f"  {n} servers: {after:7.0f} img/s from then on ({said}; shares {shares})")
    whole = run.rate(run.first_batch, run.end)
    print(f"  whole run: {whole:.0f} img/s at the loader, {len(run.taken)} batches")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = resolve_data(args.data)
    batches = max(4, args.images // args.batch_size)
    server_args = [
        *("--train", data.server_train, "--allow-outside-root"),
        *("--batch-size", str(args.batch_size)),
        *("--image-size", str(args.image_size), "--output-dtype", "uint8"),
        *("--workers", "1", "--producers", "2"),
    ]
    if args.grow:
        return grow(args, data.shown, len(data.paths), server_args)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        fast = PipelineServer(server_args, log_path=Path(tmp) / "fast.log")
        slow = PipelineServer(server_args, log_path=Path(tmp) / "slow.log")
        with fast, slow:
            for srv, core in ((fast, cores[0]), (slow, cores[-1])):
                pin(srv.pid, core)
            rows = {
                "fast alone": images_per_s([fast.endpoint], batches, args.batch_size, args.prefetch)
            }
            with Throttle(slow.pid, args.slow_duty):
                rows["slow alone"] = images_per_s(
                    [slow.endpoint], batches, args.batch_size, args.prefetch
                )
                both = [fast.endpoint, slow.endpoint]
                rows["both"] = images_per_s(both, batches, args.batch_size, args.prefetch)
            rows["sum of the two alone"] = rows["fast alone"] + rows["slow alone"]
            print(
                f"{len(data.paths)} images from {data.shown}; batch {args.batch_size}, "
                f"{args.image_size} px, uint8, prefetch {args.prefetch}; the slow server stopped "
                f"{args.slow_duty:.0%} of the time"
            )
            for name, rate in rows.items():
                print(f"  {name:<22} {rate:8.0f} img/s")
            share = rows["both"] / rows["sum of the two alone"]
            fixed = 2 * rows["slow alone"]
            print(f"  both / sum: {share:.2f}  (fixed halves would cap 'both' near {fixed:.0f})")
            longest, got, total = recovery([fast.endpoint, slow.endpoint], slow)
            print(
                f"recovery: second server SIGKILLed a third into the epoch: longest wait "
                f"{longest * 1e3:.0f} ms, {got} of {total} batches yielded"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
