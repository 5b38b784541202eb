"""Resolve a tcp:// endpoint's host name before connecting: a name that does not resolve is an
error at once, naming DNS.

libzmq resolves a connect's host name in its own I/O thread and, when that fails, retries
quietly for ever: a typo in a host name looked like a server that is not running (a minute of
silence, then advice to start one there). `check_resolvable` asks the resolver once, up front,
the way libzmq will (``getaddrinfo``); an IP address or ``ipc://`` never costs a lookup.
"""

from __future__ import annotations

import socket

__all__ = ["UnresolvableHost", "check_resolvable", "tcp_host_port"]


class UnresolvableHost(ValueError):
    """The endpoint's host name has no address (DNS or /etc/hosts): waiting will not help."""

    def __init__(self, endpoint: str, host: str, reason: str) -> None:
        self.endpoint, self.host = endpoint, host
        super().__init__(
            f"cannot resolve the host name {host!r} of {endpoint}: DNS lookup failed ({reason}); "
            "check the name (or use the server's IP address)"
        )


def tcp_host_port(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a ``tcp://`` endpoint to connect to, None for other transports.

    ``tcp://SOURCE;HOST:PORT`` (a source interface) gives the part after ``;``; brackets of an
    IPv6 literal are dropped.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return None
    target = rest.rsplit(";", 1)[-1]
    host, colon, port = target.rpartition(":")
    if not colon:
        return None
    return host.strip("[]"), port


def check_resolvable(endpoint: str) -> None:
    """Raise `UnresolvableHost` if ``endpoint`` is tcp:// to a host name nothing resolves."""
    parsed = tcp_host_port(endpoint)
    if parsed is None:
        return
    host, _port = parsed
    if not host or host == "*":
        return  # not a destination: libzmq refuses it with its own error
    try:
        # The host alone: getaddrinfo's refusal of a port ("99999999999", "５５５５") would read
        # as a name DNS cannot resolve; a bad port is libzmq's to refuse, with its own error.
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UnresolvableHost(endpoint, host, exc.strerror or str(exc)) from None
    except UnicodeError as exc:  # an invalid IDNA label, e.g. an empty one: "a..b"
        raise UnresolvableHost(endpoint, host, str(exc)) from None
