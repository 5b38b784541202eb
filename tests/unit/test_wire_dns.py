"""wire/dns.py: fleet names (``dns+tcp://NAME:PORT``) parsed, resolved through an injected or
the system resolver, and the DNS server of ``$BATCHWIRE_DNS_SERVER`` parsed. No DNS server is
asked here (tests/e2e/test_discovery.py runs a real dnsmasq)."""

from __future__ import annotations

import pytest
from batchwire.wire import dns


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("dns+tcp://fleet.test:5555", ("fleet.test", 5555)),
        ("dns+tcp://batchwire.data.svc.cluster.local:1", ("batchwire.data.svc.cluster.local", 1)),
        ("dns+tcp://data:65535", ("data", 65535)),
        ("dns+tcp://data.:05555", ("data.", 5555)),  # a fully qualified name; leading zeros
        ("dns+tcp://10.0.0.7:5555", ("10.0.0.7", 5555)),
        ("dns+tcp://[::1]:5555", ("::1", 5555)),
        ("dns+tcp://[2001:DB8::1]:80", ("2001:db8::1", 80)),
    ],
)
def test_names_that_parse(endpoint: str, expected: tuple[str, int]) -> None:
    assert dns.is_dns_endpoint(endpoint)
    assert dns.parse_dns_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint",
    [
        "dns+tcp://fleet.test",  # no port
        "dns+tcp://fleet.test:",  # empty port
        "dns+tcp://:5555",  # no name
        "dns+tcp://fleet.test:0",
        "dns+tcp://fleet.test:65536",
        "dns+tcp://fleet.test:-1",
        "dns+tcp://fleet.test:+80",
        "dns+tcp://fleet.test:http",
        "dns+tcp://fleet.test:５５５５",  # non-ASCII digits: str.isdigit says yes, a port no
        "dns+tcp://fleet.test:5555/path",
        "dns+tcp://fleet test:5555",
        "dns+tcp://user@fleet.test:5555",
        "dns+tcp://::1:5555",  # an IPv6 address without brackets: where does the port start?
        "dns+tcp://[::1:5555",
        "dns+tcp://[fleet.test]:5555",  # brackets hold an IPv6 address only
        "dns+tcp://[10.0.0.7]:5555",
    ],
)
def test_malformed_names_are_value_errors_showing_the_form(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"expected dns\+tcp://NAME:PORT") as info:
        dns.parse_dns_endpoint(endpoint)
    assert not isinstance(info.value, dns.DnsError), "a typo is not a DNS failure"


def test_other_schemes_are_not_fleet_names() -> None:
    for endpoint in ("tcp://fleet.test:5555", "ipc:///tmp/s", "DNS+TCP://x:1", " dns+tcp://x:1"):
        assert not dns.is_dns_endpoint(endpoint)
    with pytest.raises(ValueError, match="not a dns"):
        dns.parse_dns_endpoint("tcp://fleet.test:5555")


def test_resolution_gives_tcp_endpoints_in_address_order() -> None:
    asked = []

    def resolve(name: str, port: int) -> list[str]:
        asked.append((name, port))
        return ["127.0.0.10", "::1", "127.0.0.2", "127.0.0.2", "fe80::1"]

    got = dns.resolve_dns_endpoint("dns+tcp://fleet.test:5555", resolve)
    assert asked == [("fleet.test", 5555)]
    assert got == [
        "tcp://127.0.0.2:5555",  # numeric order, not the strings' (".10" before ".2")
        "tcp://127.0.0.10:5555",
        "tcp://[::1]:5555",
        "tcp://[fe80::1]:5555",
    ]


def test_a_name_without_records_is_a_dns_error() -> None:
    with pytest.raises(dns.DnsError, match="no A or AAAA records"):
        dns.resolve_dns_endpoint("dns+tcp://fleet.test:5555", lambda name, port: [])

    def failing(name: str, port: int) -> list[str]:
        raise dns.DnsError("asking 127.0.0.1:53: timed out")

    with pytest.raises(dns.DnsError, match="timed out"):
        dns.resolve_dns_endpoint("dns+tcp://fleet.test:5555", failing)


def test_an_address_stands_for_itself_without_a_lookup() -> None:
    def never(name: str, port: int) -> list[str]:
        raise AssertionError("asked the resolver for an IP address")

    assert dns.resolve_dns_endpoint("dns+tcp://10.0.0.7:5555", never) == ["tcp://10.0.0.7:5555"]
    assert dns.resolve_dns_endpoint("dns+tcp://[::1]:5555", never) == ["tcp://[::1]:5555"]


def test_the_system_resolver() -> None:
    assert dns.system_resolve("127.0.0.3", 5555) == ["127.0.0.3"]
    assert "127.0.0.1" in dns.system_resolve("localhost", 5555)
    with pytest.raises(dns.DnsError):
        dns.system_resolve("nosuchhost.invalid", 5555)  # RFC 2606: never resolves
    with pytest.raises(dns.DnsError):
        dns.system_resolve("a..b", 5555)  # an empty IDNA label


def test_tcp_endpoints_bracket_ipv6() -> None:
    assert dns.tcp_endpoint("10.1.2.3", 7) == "tcp://10.1.2.3:7"
    assert dns.tcp_endpoint("2001:db8:0::1", 7) == "tcp://[2001:db8::1]:7"
    with pytest.raises(ValueError):
        dns.tcp_endpoint("fleet.test", 7)


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        (" 10.0.0.10 ", ("10.0.0.10", 53)),
        ("::1", ("::1", 53)),
        ("[::1]", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
    ],
)
def test_dns_servers_that_parse(server: str, expected: tuple[str, int]) -> None:
    assert dns.parse_dns_server(server) == expected


@pytest.mark.parametrize(
    "server",
    ["dns.example", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:99999", "[::1]:x", "[::1", "[::1]5"],
)
def test_malformed_dns_servers_name_the_variable(server: str) -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_DNS_SERVER="):
        dns.parse_dns_server(server)
    with pytest.raises(ValueError, match="BATCHWIRE_DNS_SERVER="):
        dns.dnspython_resolver(server)


def test_the_default_resolver_follows_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dns.DNS_SERVER_ENV, raising=False)
    assert dns.default_resolver() is dns.system_resolve
    monkeypatch.setenv(dns.DNS_SERVER_ENV, "  ")
    assert dns.default_resolver() is dns.system_resolve
    monkeypatch.setenv(dns.DNS_SERVER_ENV, "127.0.0.1:5353")
    assert dns.default_resolver() is not dns.system_resolve  # dnspython's, built, not asked


def test_the_failure_sentence_names_dns_the_name_and_the_variable() -> None:
    text = dns.lookup_failure("dns+tcp://fleet.test:5555", dns.DnsError("no A records"))
    assert "dns+tcp://fleet.test:5555" in text and "DNS lookup failed (no A records)" in text
    assert "$BATCHWIRE_DNS_SERVER" in text


def test_wire_dns_imports_nothing_else_of_batchwire() -> None:
    import ast
    from pathlib import Path

    imported: list[str] = []
    for node in ast.walk(ast.parse(Path(dns.__file__).read_text())):  # function-level ones too
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    assert "dns.resolver" in imported  # the walk sees the lazy imports
    assert not [m for m in imported if m.startswith("batchwire")], imported
