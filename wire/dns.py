"""Fleet names: ``dns+tcp://NAME:PORT`` stands for every A/AAAA record of NAME (a server each).

Parsing such a name and turning it into the ``tcp://ADDRESS:PORT`` endpoints it stands for now,
and nothing else: no thread, no retry, no loader or monitor policy. It lives in `wire` because
two sides read fleet names, the loader (`client.discovery.Discovery`, which re-resolves on a
thread and feeds the changes to its core) and ``pipeline-monitor`` (which re-resolves at every
refresh and shows every server), and the monitor may import nothing of batchwire but `wire`.
Like `wire.endpoints` (a tcp:// host name's lookup) it is about where the peers are, not what
they say, and it raises its own `DnsError`, not a client's or a monitor's exception: each caller
words the failure for its user (`lookup_failure` is the common sentence).

Which resolver: the system's (``getaddrinfo``: /etc/hosts, nsswitch, the search domains of a
pod's resolv.conf), unless ``BATCHWIRE_DNS_SERVER=HOST[:PORT]`` names a DNS server to ask
directly (dnspython, imported only then; for tests with a private dnsmasq, and setups whose
fleet name lives on a server the system resolver does not ask).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable

__all__ = [
    "DNS_SERVER_ENV",
    "DNS_TIMEOUT_S",
    "SCHEME",
    "DnsError",
    "Resolve",
    "default_resolver",
    "dnspython_resolver",
    "is_dns_endpoint",
    "lookup_failure",
    "parse_dns_endpoint",
    "parse_dns_server",
    "resolve_dns_endpoint",
    "system_resolve",
    "tcp_endpoint",
]

SCHEME = "dns+tcp://"
DNS_TIMEOUT_S = 2.0
DNS_SERVER_ENV = "BATCHWIRE_DNS_SERVER"

#: (name, port) -> addresses; injectable for tests.
Resolve = Callable[[str, int], list[str]]


class DnsError(ValueError):
    """A dns+tcp:// name that cannot be resolved (no such name, no records, no answer)."""


def is_dns_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(SCHEME)


def _port(text: str) -> int | None:
    """A TCP port 1..65535 written in ASCII digits, else None."""
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        return None
    return int(text)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def parse_dns_endpoint(endpoint: str) -> tuple[str, int]:
    """``dns+tcp://NAME:PORT`` -> (NAME, PORT); ValueError for anything else.

    NAME is a host name, or an IP address (an IPv6 one in brackets: ``dns+tcp://[::1]:5555``),
    which stands for itself.
    """
    if not is_dns_endpoint(endpoint):
        raise ValueError(f"not a {SCHEME}NAME:PORT endpoint: {endpoint!r}")
    usage = f"{endpoint!r}: expected {SCHEME}NAME:PORT, e.g. {SCHEME}data.svc:5555"
    name, colon, port_text = endpoint[len(SCHEME) :].rpartition(":")
    port = _port(port_text)
    if not colon or not name or port is None:
        raise ValueError(usage)
    if name.startswith("[") or name.endswith("]"):
        ip = _ip(name[1:-1]) if name.startswith("[") and name.endswith("]") else None
        if ip is None or ip.version != 6:
            raise ValueError(f"{usage} (only an IPv6 address goes in brackets)")
        return str(ip), port
    if ":" in name:
        raise ValueError(f"{usage} (an IPv6 address goes in brackets: {SCHEME}[::1]:5555)")
    if any(c.isspace() or c in "/@[]" for c in name):
        raise ValueError(usage)
    return name, port


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
    except UnicodeError as exc:  # an invalid IDNA label, e.g. an empty one: "a..b"
        raise DnsError(str(exc)) from None
    return sorted({str(info[4][0]).split("%")[0] for info in infos})


def parse_dns_server(server: str) -> tuple[str, int]:
    """``HOST[:PORT]`` of a DNS server (HOST an IP address, an IPv6 one bracketed when a port
    follows; port 53 by default) -> (HOST, PORT); ValueError naming the variable otherwise."""
    usage = (
        f"{DNS_SERVER_ENV}={server!r}: expected an IP address with an optional port, e.g. "
        "10.0.0.10, 127.0.0.1:5353 or [::1]:5353"
    )
    text = server.strip()
    host, port = text, 53
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and (not rest.startswith(":") or _port(rest[1:]) is None)):
            raise ValueError(usage)
        host, port = inside, (_port(rest[1:]) or 53) if rest else 53
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if _port(port_text) is None:
            raise ValueError(usage)
        port = int(port_text)
    ip = _ip(host)
    if ip is None:
        raise ValueError(usage)
    return str(ip), port


def dnspython_resolver(server: str) -> Resolve:
    """A resolver asking ``server`` (``HOST[:PORT]``, port 53 by default) for A and AAAA."""
    import dns.exception
    import dns.resolver

    host, port = parse_dns_server(server)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
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
    """dnspython asking ``$BATCHWIRE_DNS_SERVER`` when it is set, else the system resolver."""
    server = os.environ.get(DNS_SERVER_ENV, "").strip()
    return dnspython_resolver(server) if server else system_resolve


def resolve_dns_endpoint(endpoint: str, resolve: Resolve | None = None) -> list[str]:
    """The tcp:// endpoints ``endpoint`` (dns+tcp://) stands for now, in address order.

    `DnsError` if the name has none (or the resolver fails); ValueError if ``endpoint`` is not a
    dns+tcp:// name. An IP address stands for itself, without a lookup.
    """
    name, port = parse_dns_endpoint(endpoint)
    if _ip(name) is not None:
        return [tcp_endpoint(name, port)]
    addresses = (resolve or default_resolver())(name, port)
    if not addresses:
        raise DnsError("the name has no A or AAAA records")
    ips = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda ip: (ip.version, ip))
    return [tcp_endpoint(str(ip), port) for ip in ips]


def lookup_failure(endpoint: str, exc: DnsError) -> str:
    """What to tell a user whose fleet name ``endpoint`` resolved to nothing (``exc``)."""
    return (
        f"cannot find the servers of {endpoint}: DNS lookup failed ({exc}); check the name "
        f"(a Kubernetes headless Service's name, say), or ${DNS_SERVER_ENV}"
    )
