"""wire/endpoints.py: a tcp:// endpoint's host and port picked out, and a host name nothing
resolves refused at once naming DNS (libzmq would retry it quietly for ever). Only the system
resolver is asked, for names that never leave the machine: localhost, IP literals, and the
RFC 2606 ``.invalid`` domain, which never resolves."""

from __future__ import annotations

import pytest
from batchwire.wire.endpoints import UnresolvableHost, check_resolvable, tcp_host_port


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://server.example:5555", ("server.example", "5555")),
        ("tcp://10.0.0.7:1", ("10.0.0.7", "1")),
        ("tcp://[::1]:5555", ("::1", "5555")),  # brackets of an IPv6 literal dropped
        ("tcp://[2001:db8::1]:80", ("2001:db8::1", "80")),
        ("tcp://eth0;server.example:5555", ("server.example", "5555")),  # a source interface
        ("tcp://10.0.0.1:4000;[::1]:5555", ("::1", "5555")),  # the part after the last ';'
        ("tcp://*:5555", ("*", "5555")),
        ("tcp://:5555", ("", "5555")),
        ("tcp://host:", ("host", "")),
        ("tcp://host:http", ("host", "http")),
    ],
)
def test_tcp_endpoints_give_host_and_port(endpoint: str, expected: tuple[str, str]) -> None:
    assert tcp_host_port(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///tmp/batchwire.sock",
        "inproc://x:1",
        "dns+tcp://fleet.test:5555",  # a fleet name: wire/dns.py's
        "TCP://host:5555",  # libzmq's transport names are lower case
        "tcp:/host:5555",
        "host:5555",
        "tcp://host",  # no port
        "",
    ],
)
def test_other_transports_and_portless_endpoints_are_not_tcp_targets(endpoint: str) -> None:
    assert tcp_host_port(endpoint) is None
    check_resolvable(endpoint)  # nothing to look up: libzmq judges these itself


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://localhost:5555",
        "tcp://127.0.0.1:5555",
        "tcp://[::1]:5555",
        "tcp://lo;localhost:5555",
        "tcp://*:5555",  # a bind address, not a destination
        "tcp://:5555",
        # A bad port is libzmq's to refuse, never reported as a name DNS cannot resolve.
        "tcp://localhost:http",
        "tcp://localhost:99999999999999999999",
        "tcp://localhost:５５５５",  # non-ASCII digits: str.isdigit says yes, getaddrinfo no
        "tcp://localhost:5555/path",
    ],
)
def test_names_that_resolve_and_ip_addresses_pass(endpoint: str) -> None:
    check_resolvable(endpoint)


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("tcp://nosuchhost.invalid:5555", "nosuchhost.invalid"),
        ("tcp://eth0;nosuchhost.invalid:5555", "nosuchhost.invalid"),
        ("tcp://[nosuchhost.invalid]:5555", "nosuchhost.invalid"),
        ("tcp://a..b:5555", "a..b"),  # an empty IDNA label: a UnicodeError inside the codec
        ("tcp://" + "x" * 64 + ".invalid:5555", "x" * 64 + ".invalid"),  # a label over 63
        ("tcp://no such host.invalid:5555", "no such host.invalid"),
    ],
)
def test_a_name_nothing_resolves_is_an_error_naming_dns(endpoint: str, host: str) -> None:
    with pytest.raises(UnresolvableHost) as info:
        check_resolvable(endpoint)
    err = info.value
    assert isinstance(err, ValueError)  # what the CLIs' argument checks catch
    assert (err.endpoint, err.host) == (endpoint, host)
    text = str(err)
    assert f"cannot resolve the host name {host!r} of {endpoint}: DNS lookup failed (" in text
    assert text.endswith("check the name (or use the server's IP address)")
    assert err.__cause__ is None and err.__suppress_context__  # one line, not a gaierror chain


def test_the_message_keeps_the_resolvers_reason() -> None:
    err = UnresolvableHost("tcp://h.invalid:1", "h.invalid", "Name or service not known")
    assert "DNS lookup failed (Name or service not known)" in str(err)
