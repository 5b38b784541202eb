"""Servers found by DNS: ``dns+tcp://NAME:PORT`` stands for every A/AAAA record of NAME.

A Kubernetes headless Service (or any DNS name with one record per server) names the whole
fleet: the loader connects to ``tcp://ADDRESS:PORT`` for each address, re-resolves the name
every `RESOLVE_EVERY_S` seconds (and at once after a connection is lost), and hands the new
set to the core (`fleet.Fleet.on_endpoints`): a new address joins the batch assignment, one
whose record went away drains. This module is the shell's part: the core never resolves.

Resolution runs on a thread of its own: a DNS server that is slow to answer must not stall
the consumer's thread, which only picks the latest answer up (`Discovery.take`).

Which resolver: the system's (``getaddrinfo``: /etc/hosts, nsswitch, the search domains of a
pod's resolv.conf), unless ``BATCHWIRE_DNS_SERVER=HOST[:PORT]`` names a DNS server to ask
directly (dnspython; for tests with a private dnsmasq, and setups whose fleet name lives on a
server the system resolver does not ask). A name with no records when the loader starts is an
error naming DNS; one that later resolves to nothing (a DNS hiccup, every pod restarting) keeps
the servers the loader has, and says so once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from batchwire.client.errors import ServerUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "SCHEME",
    "Discovery",
    "DnsError",
    "is_dns_endpoint",
    "parse_dns_endpoint",
    "resolve_dns_endpoint",
]

SCHEME = "dns+tcp://"
RESOLVE_EVERY_S = 5.0
DNS_TIMEOUT_S = 2.0
DNS_SERVER_ENV = "BATCHWIRE_DNS_SERVER"

#: (name, port) -> addresses; injectable for tests of the shell.
Resolve = Callable[[str, int], list[str]]


class DnsError(ValueError):
    """A dns+tcp:// name that cannot be resolved (no such name, no records, no answer)."""


def is_dns_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(SCHEME)


def parse_dns_endpoint(endpoint: str) -> tuple[str, int]:
    """``dns+tcp://NAME:PORT`` -> (NAME, PORT); ValueError for anything else."""
    if not is_dns_endpoint(endpoint):
        raise ValueError(f"not a {SCHEME}NAME:PORT endpoint: {endpoint!r}")
    name, colon, port = endpoint[len(SCHEME) :].rpartition(":")
    if not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r}: expected {SCHEME}NAME:PORT, e.g. {SCHEME}data.svc:5555")
    return name.strip("[]"), int(port)


def tcp_endpoint(address: str, port: int) -> str:
    """The tcp:// endpoint of one resolved address (IPv6 in brackets)."""
    ip = ipaddress.ip_address(address)
    return f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}"


def system_resolve(name: str, port: int) -> list[str]:
    """Every address of ``name`` by the system resolver (A and AAAA, via getaddrinfo)."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DnsError(exc.strerror or str(exc)) from None
    except UnicodeError as exc:
        raise DnsError(str(exc)) from None
    return sorted({str(info[4][0]).split("%")[0] for info in infos})


def dnspython_resolver(server: str) -> Resolve:
    """A resolver asking ``server`` (``HOST[:PORT]``, port 53 by default) for A and AAAA."""
    import dns.exception
    import dns.resolver

    host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [host or server]
    resolver.port = int(port) if port else 53
    resolver.lifetime = DNS_TIMEOUT_S

    def resolve(name: str, _port: int) -> list[str]:
        addresses: set[str] = set()
        errors: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = resolver.resolve(name, rdtype, search=False)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue
            except dns.exception.DNSException as exc:
                errors.append(f"{rdtype}: {exc}")
                continue
            addresses.update(r.to_text() for r in answer)
        if not addresses and errors:
            raise DnsError(f"asking {server}: {'; '.join(errors)}")
        return sorted(addresses)

    return resolve


def default_resolver() -> Resolve:
    server = os.environ.get(DNS_SERVER_ENV, "").strip()
    return dnspython_resolver(server) if server else system_resolve


def resolve_dns_endpoint(endpoint: str, resolve: Resolve | None = None) -> list[str]:
    """The tcp:// endpoints ``endpoint`` (dns+tcp://) stands for now; `DnsError` if none."""
    name, port = parse_dns_endpoint(endpoint)
    addresses = (resolve or default_resolver())(name, port)
    if not addresses:
        raise DnsError("the name has no A or AAAA records")
    return [tcp_endpoint(a, port) for a in addresses]


class Discovery:
    """The endpoints a loader's list stands for, kept current by a resolver thread.

    ``endpoints`` mixes plain ones (kept as they are) and dns+tcp:// names. `initial`
    resolves once, now, raising `ServerUnavailable` (naming DNS) for a name with no records;
    `start` then re-resolves every ``interval`` seconds (sooner after `kick`); `take` returns
    the new endpoint list when it changed since the last `take`, else None.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        resolve: Resolve | None = None,
        interval: float | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.names = [e for e in self.endpoints if is_dns_endpoint(e)]
        for name in self.names:
            parse_dns_endpoint(name)  # a malformed one is the caller's ValueError, now
        self.interval = RESOLVE_EVERY_S if interval is None else float(interval)
        self._resolve = resolve or default_resolver()
        self._per_name: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._changed = False
        self._empty_said: set[str] = set()
        self._thread: threading.Thread | None = None

    def initial(self) -> list[str]:
        """Resolve every name now; a name with no records is an error (naming DNS)."""
        for name in self.names:
            try:
                self._per_name[name] = resolve_dns_endpoint(name, self._resolve)
            except DnsError as exc:
                raise ServerUnavailable(
                    name,
                    f"cannot find the servers of {name}: DNS lookup failed ({exc}); check the "
                    f"name (a Kubernetes headless Service's name, say), or ${DNS_SERVER_ENV}",
                ) from None
        return self.current()

    def current(self) -> list[str]:
        """Plain endpoints and every name's addresses, in list order, without duplicates."""
        out: list[str] = []
        with self._lock:
            for e in self.endpoints:
                out.extend(self._per_name.get(e, []) if is_dns_endpoint(e) else [e])
        return list(dict.fromkeys(out))

    def start(self) -> None:
        if self.names and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="batchwire-dns", daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """Resolve again now (a server was lost: perhaps it was replaced at another address)."""
        self._wake.set()

    def take(self) -> list[str] | None:
        with self._lock:
            changed, self._changed = self._changed, False
        return self.current() if changed else None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=DNS_TIMEOUT_S * 2 + 1)
            self._thread = None

    def resolve_once(self) -> None:
        """One round over the names (the thread's work; tests call it directly)."""
        for name in self.names:
            try:
                found = resolve_dns_endpoint(name, self._resolve)
            except DnsError as exc:
                if name not in self._empty_said:
                    self._empty_said.add(name)
                    log.warning(
                        "%s resolves to no server now (%s); keeping the %d server(s) it had",
                        name,
                        exc,
                        len(self._per_name.get(name, [])),
                    )
                continue
            except Exception:  # a resolver bug must not end discovery; say it and go on
                log.exception("resolving %s failed", name)
                continue
            self._empty_said.discard(name)
            with self._lock:
                if found != self._per_name.get(name):
                    self._per_name[name] = found
                    self._changed = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.resolve_once()
