"""Servers found by DNS (issue 24 item 1), for real: a dnsmasq started here answers for one
name, servers listen on 127.0.0.2/3/4 (all of 127/8 is loopback on Linux), and a RemoteLoader
given ``dns+tcp://fleet.test:PORT`` follows the records as the test rewrites them.

Why ``BATCHWIRE_DNS_SERVER`` (dnspython asking our dnsmasq) and not a network namespace whose
resolv.conf points at it: the loader's resolver is the only thing that must differ, and the
injectable resolver needs no root, no ``unshare`` and no namespace plumbing in CI, while the
name still goes through a real DNS server and real A records, re-read on SIGHUP. What the
system resolver adds (getaddrinfo) is the default path, exercised by the unit tests.

Scenario, one loader: epoch 0 starts on two servers, a third is added to DNS mid-epoch and
serves batches; in epoch 1 one is removed from DNS mid-epoch and drains (its session ends by a
bye, not a fault); in epoch 2 one is killed mid-epoch (failover as before). Every epoch is
bit-identical to a single server's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader, ServerUnavailable, discovery
from serverproc import running_server, small_server_args

DNSMASQ = shutil.which("dnsmasq") or (
    "/usr/sbin/dnsmasq" if Path("/usr/sbin/dnsmasq").exists() else None
)
pytestmark = pytest.mark.skipif(
    DNSMASQ is None, reason="dnsmasq is not installed (scripts/setup.sh installs dnsmasq-base)"
)
NAME = "fleet.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def free_port(hosts: tuple[str, ...], kind: int = socket.SOCK_STREAM) -> int:
    """A port free on every one of ``hosts`` a moment ago."""
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


class Dns:
    """A dnsmasq answering for ``NAME`` from a hosts file the test rewrites (SIGHUP rereads)."""

    def __init__(self, folder: Path) -> None:
        self.hosts = folder / "hosts"
        self.hosts.write_text(f"127.0.0.1 {NAME}\n")  # to see it answer (no SIGHUP before)
        self.port = free_port(("127.0.0.1",), socket.SOCK_DGRAM)
        self.proc = subprocess.Popen(
            [
                str(DNSMASQ), "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.hosts}", "--listen-address=127.0.0.1",
                "--bind-interfaces", f"--port={self.port}", "--pid-file=", "--local-ttl=0",
                *(["--user=root"] if os.geteuid() == 0 else []),
                f"--log-facility={folder / 'dnsmasq.log'}",
            ],
        )  # fmt: skip
        self.server = f"127.0.0.1:{self.port}"
        resolve = discovery.dnspython_resolver(self.server)
        deadline = time.monotonic() + 10
        while True:  # answering?
            try:
                if resolve(NAME, 1):
                    break
            except discovery.DnsError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "dnsmasq did not start"
            time.sleep(0.05)

    def set(self, *addresses: str) -> None:
        """Make ``NAME`` resolve to ``addresses`` (none: no records); returns once it does."""
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))
        self.proc.send_signal(signal.SIGHUP)
        resolve = discovery.dnspython_resolver(self.server)
        deadline = time.monotonic() + 10
        while True:
            try:
                now = resolve(NAME, 1)
            except discovery.DnsError:
                now = []
            if sorted(now) == sorted(addresses):
                return
            assert time.monotonic() < deadline, f"dnsmasq still says {now}"
            time.sleep(0.02)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


@pytest.fixture
def dns(tmp_path, monkeypatch):
    d = Dns(tmp_path)
    monkeypatch.setenv(discovery.DNS_SERVER_ENV, d.server)
    monkeypatch.setattr(discovery, "RESOLVE_EVERY_S", 0.3)
    try:
        yield d
    finally:
        d.close()


def batches(loader: RemoteLoader, epoch: int, at=None, pace: float = 0.0) -> list[tuple]:
    """One epoch, cloned; ``at(k)`` runs before batch k is taken; ``pace`` s per batch."""
    loader.set_epoch(epoch)
    out = []
    for k, batch in enumerate(loader):
        out.append(tuple(t.clone() for t in batch))
        if at is not None:
            at(k)
        time.sleep(pace)
    return out


def same(a: list[tuple], b: list[tuple]) -> None:
    assert [x[2].tolist() for x in a] == [y[2].tolist() for y in b], "lost, repeated or reordered"
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), f"batch {k} differs"


def sent(srv) -> int:
    return srv.stats()["counters"]["batches_total"]


@pytest.mark.timeout(120)
def test_a_fleet_named_by_dns_grows_drains_and_fails_over(dns):
    args = small_server_args(seed=9)
    port = free_port(HOSTS)
    eps = [f"tcp://{h}:{port}" for h in HOSTS]
    with (
        running_server(*args, endpoint=eps[0]) as a,
        running_server(*args, endpoint=eps[1]) as b,
        running_server(*args, endpoint=eps[2]) as c,
    ):
        kw = dict(rank=0, world_size=1, device="cpu", with_indices=True, timeout=30.0)
        with RemoteLoader(eps[2], "train", prefetch_next_epoch=False, **kw) as solo:
            reference = [batches(solo, e) for e in range(3)]
        c_before = sent(c)

        dns.set(HOSTS[0], HOSTS[1])
        loader = RemoteLoader(f"dns+tcp://{NAME}:{port}", "train", **kw, prefetch_next_epoch=False)
        with loader:
            # Epoch 0: two servers; the third joins the DNS name after batch 3.
            def add(k: int) -> None:
                if k == 3:
                    dns.set(*HOSTS)

            same(batches(loader, 0, add, pace=0.15), reference[0])
            assert sent(c) > c_before, "the server added to DNS served nothing"
            assert sent(a) > 0 and sent(b) > 0

            # Epoch 1: server a leaves DNS after batch 3: drained (a bye), nothing lost.
            def remove(k: int) -> None:
                if k == 3:
                    dns.set(HOSTS[1], HOSTS[2])

            a_mid = None

            def remove_and_note(k: int) -> None:
                nonlocal a_mid
                remove(k)
                if k == 12:
                    a_mid = sent(a)

            same(batches(loader, 1, remove_and_note, pace=0.15), reference[1])
            assert sent(a) == a_mid, "a server removed from DNS was still asked for batches"
            assert not [r for r in a.stats()["clients"] if r["split"] == "train"], (
                "the drained server still holds our session"
            )

            # Epoch 2: server b is killed after batch 3: failover to c, as with a static list.
            def kill(k: int) -> None:
                if k == 3:
                    b.kill()

            same(batches(loader, 2, kill, pace=0.05), reference[2])
            assert "left the fleet" not in b.log()
        b.start()  # running_server's clean exit stops it again


@pytest.mark.timeout(30)
def test_a_dns_name_without_records_is_an_error_naming_dns(dns):
    dns.set()  # no records
    loader = RemoteLoader("dns+tcp://fleet.test:5555", "train", rank=0, world_size=1, device="cpu")
    with pytest.raises(ServerUnavailable, match="DNS lookup failed"):
        next(iter(loader))
    loader.close()
