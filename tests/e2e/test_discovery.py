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

import json
import subprocess
import time

import pytest
import torch
from batchwire.bench.bench_fleet import DNSMASQ, Dnsmasq, free_port
from batchwire.client import RemoteLoader, ServerUnavailable, discovery
from batchwire.wire import dns as wire_dns
from monitorcheck import MONITOR, check_stats
from serverproc import running_server, small_server_args

pytestmark = pytest.mark.skipif(
    DNSMASQ is None, reason="dnsmasq is not installed (scripts/setup.sh installs dnsmasq-base)"
)
NAME = "fleet.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture
def dns(tmp_path, monkeypatch):
    """A dnsmasq answering for ``NAME`` (`bench_fleet.Dnsmasq`, shared with ``--grow``),
    asked by this process's loaders and by the children it starts."""
    d = Dnsmasq(tmp_path, NAME)
    monkeypatch.setenv(wire_dns.DNS_SERVER_ENV, d.server)
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
                elif k > 3 and sent(c) == c_before:
                    # Slower steps until it serves: on a loaded host, finding, connecting and
                    # welcoming it took longer than the rest of the epoch once (a failed run).
                    time.sleep(0.2)

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


# pipeline-monitor over the same kind of name: every server, re-resolved at each refresh.


def run_monitor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*MONITOR, *args], capture_output=True, text=True, timeout=timeout)


def json_lines(proc: subprocess.Popen, until, what: str, limit: int = 60) -> dict:
    """Read the live monitor's JSON lines until ``until(doc)``; at most ``limit`` lines."""
    for _ in range(limit):
        line = proc.stdout.readline()
        assert line, f"the monitor ended before {what}: {proc.stderr.read()}"
        doc = json.loads(line)
        if until(doc):
            return doc
    raise AssertionError(f"no {what} in {limit} refreshes; the last: {doc}")


@pytest.mark.timeout(150)
def test_the_monitor_shows_every_server_of_a_dns_name(dns):
    args = small_server_args(seed=9)
    port = free_port(HOSTS)
    eps = [f"tcp://{h}:{port}" for h in HOSTS]
    fleet = f"dns+tcp://{NAME}:{port}"
    with (
        running_server(*args, endpoint=eps[0]) as a,
        running_server(*args, endpoint=eps[1]) as b,
        running_server(*args, endpoint=eps[2]),
    ):
        dns.set(HOSTS[0], HOSTS[1])
        kw = dict(rank=0, world_size=1, device="cpu", timeout=30.0)
        with RemoteLoader(fleet, "train", **kw) as loader:
            batches_of = iter(loader)
            for _ in range(4):
                next(batches_of)
            deadline = time.monotonic() + 20
            while not (a.stats()["clients"] and b.stats()["clients"]):  # each has our session
                assert time.monotonic() < deadline, "the loader has no session on each server"
                time.sleep(0.1)

            # --once --json: one entry per server, each the server's stats as it sent them.
            done = run_monitor(fleet, "--once", "--json")
            assert done.returncode == 0, done.stderr
            doc = json.loads(done.stdout)
            assert doc["fleet"] == fleet and doc["dns_error"] is None
            assert [s["endpoint"] for s in doc["servers"]] == eps[:2]
            for entry in doc["servers"]:
                assert entry["error"] is None, entry["error"]
                check_stats(entry["stats"])
                assert [c["split"] for c in entry["stats"]["clients"]] == ["train"]
            assert doc["total"]["servers"] == doc["total"]["answering"] == 2
            assert doc["total"]["clients"] == 2  # our loader, once on each server

            # The view: both stacked under the fleet's totals.
            done = run_monitor(fleet, "--once")
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            assert fleet in lines[0] and "2 servers, 2 answering" in lines[0], done.stdout
            assert lines[1].startswith("fleet total ") and "2 clients" in lines[1]
            heads = [line.split()[1] for line in lines if line.startswith("server  tcp://")]
            assert heads == eps[:2]

        # Live --json: a third server joins the name and shows up; one killed shows as not
        # answering while the others still show.
        proc = subprocess.Popen(
            [*MONITOR, fleet, "--json", "--interval", "0.3", "--timeout", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            first = json_lines(proc, lambda d: True, "a first refresh")
            assert [s["endpoint"] for s in first["servers"]] == eps[:2]
            dns.set(*HOSTS)

            def all_three(doc: dict) -> bool:
                return [s["endpoint"] for s in doc["servers"]] == eps and all(
                    s["stats"] is not None for s in doc["servers"]
                )

            json_lines(proc, all_three, "the third server")
            b.kill()

            def b_silent(doc: dict) -> bool:
                return doc["servers"][1]["stats"] is None

            doc = json_lines(proc, b_silent, "the killed server shown as not answering")
            entry = doc["servers"][1]
            assert entry["endpoint"] == eps[1]
            assert f"no answer from {eps[1]} within 1 s" in entry["error"]
            assert [s["stats"] is not None for s in doc["servers"]] == [True, False, True]
            assert doc["total"]["servers"] == 3 and doc["total"]["answering"] == 2
            proc.terminate()
            assert proc.wait(timeout=15) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        b.start()  # running_server's clean exit stops it again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--once"], ["--json"]])
def test_the_monitor_exits_2_naming_dns_for_a_name_without_records(dns, mode):
    dns.set()  # no records
    fleet = f"dns+tcp://{NAME}:5555"
    done = run_monitor(fleet, *mode)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot find the servers of {fleet}: DNS lookup failed" in done.stderr, done.stderr
    assert done.stdout == ""
