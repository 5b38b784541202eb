"""Fleet audit, DNS (docs/clusters.md, "Servers found by DNS"): what tests/e2e/test_discovery.py
leaves out, for real, with a private dnsmasq and servers on 127.0.0.2/3/4.

- a name resolving to three servers spreads one loader's epoch over all three;
- a name that later resolves to nothing keeps the servers the loader has (a warning, once);
- a DNS server that stops answering: at start, an error naming DNS within the lookup's own bound
  (2 s for A, 2 s for AAAA), and mid-run, nothing stalls: the epoch goes on, `close` is bounded;
- hostile records: a huge TTL does not pin the old answer (the loader re-reads the name), a name
  with hundreds of records of which one is a server still trains, and a name pointing at a port
  that is not batchwire's is a clear `ServerUnavailable` within the loader's timeout.

One dnsmasq and three servers for the module; each test sets the records it needs.
"""

from __future__ import annotations

import http.server
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from batchwire.bench.bench_fleet import DNSMASQ, Dnsmasq, free_port
from batchwire.client import RemoteLoader, ServerUnavailable, discovery
from batchwire.wire import dns as wire_dns
from serverproc import ServerProcess, running_server, small_server_args

pytestmark = pytest.mark.skipif(
    DNSMASQ is None, reason="dnsmasq is not installed (scripts/setup.sh installs dnsmasq-base)"
)
NAME = "fleet.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
# A lookup asks for A, then AAAA, each bounded by DNS_TIMEOUT_S; the slack is a loaded machine's.
LOOKUP_BOUND_S = 2 * wire_dns.DNS_TIMEOUT_S + 2.0


@pytest.fixture(scope="module")
def dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    """One dnsmasq for the module, asked by this process's loaders, re-read every 0.3 s."""
    d = Dnsmasq(tmp_path_factory.mktemp("dns"), NAME)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(wire_dns.DNS_SERVER_ENV, d.server)
        mp.setattr(discovery, "RESOLVE_EVERY_S", 0.3)
        try:
            yield d
        finally:
            d.proc.send_signal(signal.SIGCONT)  # a test that stopped it and failed
            d.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[int, list[ServerProcess]]]:
    """Three small servers on one port of 127.0.0.2/3/4: (port, servers)."""
    args = small_server_args(seed=5)
    port = free_port(HOSTS)
    with (
        running_server(*args, endpoint=f"tcp://{HOSTS[0]}:{port}") as a,
        running_server(*args, endpoint=f"tcp://{HOSTS[1]}:{port}") as b,
        running_server(*args, endpoint=f"tcp://{HOSTS[2]}:{port}") as c,
    ):
        yield port, [a, b, c]


def sent(srv: ServerProcess) -> int:
    return srv.stats()["counters"]["batches_total"]


def loader_for(port: int, timeout: float = 20.0) -> RemoteLoader:
    return RemoteLoader(
        f"dns+tcp://{NAME}:{port}", "train", rank=0, world_size=1, device="cpu",
        timeout=timeout, prefetch_next_epoch=False, with_indices=True,
    )  # fmt: skip


def epoch_indices(loader: RemoteLoader, at=None, pace: float = 0.0) -> list[int]:
    """One epoch's sample indices; ``at(k)`` runs after batch k; ``pace`` s per batch."""
    out: list[int] = []
    for k, (_, _, idx) in enumerate(loader):
        out.extend(idx.tolist())
        if at is not None:
            at(k)
        time.sleep(pace)
    return out


@pytest.mark.timeout(60)
def test_a_name_of_three_servers_spreads_the_epoch_over_all_three(dns, fleet):
    port, servers = fleet
    dns.set(*HOSTS)
    before = [sent(s) for s in servers]
    with loader_for(port) as loader:
        indices = epoch_indices(loader, pace=0.02)
        assert len(indices) == len(set(indices)) == 400  # the embedded val split, once each
        share = [sent(s) - b for s, b in zip(servers, before, strict=True)]
    # 25 batches: an even split is ~8 each; a third of that rules out one server carrying it.
    assert min(share) >= 3, f"batches per server {share}: not spread over the name's servers"


@pytest.mark.timeout(60)
def test_a_name_that_later_resolves_to_nothing_keeps_the_servers(dns, fleet, caplog):
    port, _ = fleet
    dns.set(HOSTS[0], HOSTS[1])
    caplog.set_level(logging.WARNING, logger="batchwire.client.discovery")
    with loader_for(port) as loader:
        loader.set_epoch(0)

        def empty(k: int) -> None:
            if k == 2:
                dns.set()  # every pod restarting, say

        indices = epoch_indices(loader, empty, pace=0.1)  # 25 x 0.1 s: several re-resolutions
        assert sorted(indices) == list(range(400)), "lost or repeated samples"
        said = [r.getMessage() for r in caplog.records if "resolves to no server now" in r.message]
        assert len(said) == 1, said
        assert "keeping the 2 server(s) it had" in said[0]


@pytest.mark.timeout(60)
def test_a_dns_server_that_stops_answering_at_start_is_a_bounded_dns_error(dns):
    dns.set(HOSTS[0])
    dns.proc.send_signal(signal.SIGSTOP)
    try:
        loader = loader_for(5555, timeout=1.0)
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match=r"DNS lookup failed.*timed out"):
            next(iter(loader))
        took = time.monotonic() - started
        loader.close()
    finally:
        dns.proc.send_signal(signal.SIGCONT)
    assert took < LOOKUP_BOUND_S, f"a silent DNS server held the loader {took:.1f} s"


@pytest.mark.timeout(60)
def test_a_dns_server_that_stops_answering_mid_run_stalls_nothing(dns, fleet):
    port, _ = fleet
    dns.set(HOSTS[0])
    loader = loader_for(port)
    try:
        loader.set_epoch(0)

        def stop(k: int) -> None:
            if k == 2:
                dns.proc.send_signal(signal.SIGSTOP)

        # 25 batches x 0.1 s: the resolver (every 0.3 s) asks the silent server while the
        # epoch runs; its thread waits for the answer, the consumer's thread must not.
        started = time.monotonic()
        indices = epoch_indices(loader, stop, pace=0.1)
        took = time.monotonic() - started
        assert sorted(indices) == list(range(400))
        assert took < 25 * 0.1 + 2.0, f"the epoch took {took:.1f} s with DNS silent"
    finally:
        closing = time.monotonic()
        loader.close()
        closed_in = time.monotonic() - closing
        dns.proc.send_signal(signal.SIGCONT)
    assert closed_in < LOOKUP_BOUND_S + 1.0, f"close took {closed_in:.1f} s with DNS silent"


def answer_ttl(server: str) -> int:
    """The TTL of ``server``'s A answer for NAME (dnspython, as the loader asks)."""
    import dns.resolver

    host, port = wire_dns.parse_dns_server(server)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.port, resolver.lifetime = [host], port, 2.0
    return resolver.resolve(NAME, "A", search=False).rrset.ttl


@pytest.mark.timeout(30)
def test_a_huge_ttl_does_not_pin_the_old_records(tmp_path):
    with Dnsmasq(tmp_path, NAME, ttl=2**31 - 1) as dns:
        endpoint = f"dns+tcp://{NAME}:5555"
        dns.set(HOSTS[0])
        assert answer_ttl(dns.server) == 2**31 - 1  # what the test is about: the answer says so
        resolve = wire_dns.dnspython_resolver(dns.server)
        d = discovery.Discovery([endpoint], resolve=resolve)
        assert d.initial() == [f"tcp://{HOSTS[0]}:5555"]
        dns.set(HOSTS[1])  # the record changes; its TTL said "forever"
        d.resolve_once()
        assert d.take() == [f"tcp://{HOSTS[1]}:5555"], "the loader kept the record its TTL named"


@pytest.mark.timeout(60)
def test_hundreds_of_records_of_which_one_is_a_server_still_train(dns, fleet):
    port, _ = fleet
    # 199 addresses where nothing listens (127.0.1.x), and one server.
    dead = [f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(199)]
    dns.set(HOSTS[0], *dead, timeout=20)
    with loader_for(port) as loader:
        indices = epoch_indices(loader)
    assert sorted(indices) == list(range(400))


@pytest.mark.timeout(60)
def test_a_name_pointing_at_a_port_that_is_not_batchwire_is_a_clear_error(dns):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    web = http.server.ThreadingHTTPServer((HOSTS[0], 0), Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        dns.set(HOSTS[0])
        port = web.server_address[1]
        loader = loader_for(port, timeout=2.0)
        started = time.monotonic()
        with pytest.raises(ServerUnavailable) as raised:
            next(iter(loader))
        took = time.monotonic() - started
        loader.close()
    finally:
        web.shutdown()
        web.server_close()
    text = str(raised.value)
    assert f"tcp://{HOSTS[0]}:{port}" in text and "is pipeline-server running there?" in text
    assert took < 2.0 + 3.0, f"the loader gave up after {took:.1f} s, not its 2 s timeout"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["at start", "mid-run"])
def test_a_name_with_a_thousand_records_is_refused_not_a_zmq_error(dns, fleet, when):
    """1000 A records (a mistaken or hostile name): at start a `ServerUnavailable` naming DNS
    and the count; mid-run the loader keeps its servers and trains on. Before, a raw
    ZMQError (ZeroMQ's 1023 sockets per context) ended the loader, mid-epoch too."""
    port, _ = fleet
    many = [HOSTS[0], *(f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(999))]
    dns.set(*(many if when == "at start" else HOSTS[:1]), timeout=20)
    with loader_for(port) as loader:
        if when == "at start":
            with pytest.raises(ServerUnavailable, match=r"DNS lookup failed.*1000 addresses"):
                next(iter(loader))
            return
        loader.set_epoch(0)

        def grow(k: int) -> None:
            if k == 2:
                dns.set(*many, timeout=20)
                time.sleep(1.0)  # a few re-resolutions (every 0.3 s here)

        indices = epoch_indices(loader, grow, pace=0.05)
    assert sorted(indices) == list(range(400))


def test_a_dnsmasq_whose_port_was_taken_meanwhile_starts_on_another(tmp_path, monkeypatch):
    """The race the suite met (2026-11-28): a port free when checked, taken by another test's
    TCP listener before dnsmasq bound it; dnsmasq exits at once, and the helper picks another."""
    from batchwire.bench import bench_fleet

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = bench_fleet._free_dns_port
    monkeypatch.setattr(bench_fleet, "_free_dns_port", lambda: next(ports, None) or real())
    try:
        with Dnsmasq(tmp_path, NAME) as dns:
            assert dns.port != taken.getsockname()[1]
            assert dns.lookup() == ["127.0.0.1"]
    finally:
        taken.close()
