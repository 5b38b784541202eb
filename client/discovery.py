"""Servers found by DNS: ``dns+tcp://NAME:PORT`` stands for every A/AAAA record of NAME.

A Kubernetes headless Service (or any DNS name with one record per server) names the whole
fleet: the loader connects to ``tcp://ADDRESS:PORT`` for each address, re-resolves the name
every `RESOLVE_EVERY_S` seconds (and at once after a connection is lost), and hands the new
set to the core (`fleet.Fleet.on_endpoints`): a new address joins the batch assignment, one
whose record went away drains. This module is the shell's part: the core never resolves.

Resolution runs on a thread of its own: a DNS server that is slow to answer must not stall
the consumer's thread, which only picks the latest answer up (`Discovery.take`).

Parsing a name and asking the resolver (the system's, or ``$BATCHWIRE_DNS_SERVER`` through
dnspython) is `batchwire.wire.dns`, shared with ``pipeline-monitor``; this module adds the
loader's policy. A name with no records when the loader starts is an error naming DNS
(`ServerUnavailable`); one that later resolves to nothing (a DNS hiccup, every pod restarting)
keeps the servers the loader has, and says so once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from batchwire.client.errors import ServerUnavailable
from batchwire.wire.dns import (
    DNS_TIMEOUT_S,
    DnsError,
    Resolve,
    default_resolver,
    is_dns_endpoint,
    lookup_failure,
    parse_dns_endpoint,
    resolve_dns_endpoint,
)

log = logging.getLogger(__name__)

# Resolve is re-exported: the receiver's ``resolve=`` (tests inject one) has this type.
__all__ = ["MAX_SERVERS_PER_NAME", "RESOLVE_EVERY_S", "Discovery", "Resolve"]

RESOLVE_EVERY_S = 5.0
#: A loader holds three ZeroMQ sockets per server (its DEALER, its monitor's pair) and a context
#: 1023: a name whose records would make the loader's servers, all names and plain endpoints
#: together, more than this (a mistaken or hostile one) is refused as DNS trouble, never a
#: ZMQError.
MAX_SERVERS_PER_NAME = 256


def servers_of(name: str, resolve: Resolve) -> list[str]:
    """``name``'s endpoints now; `DnsError` for none, or for more than `MAX_SERVERS_PER_NAME`."""
    found = resolve_dns_endpoint(name, resolve)
    if len(found) > MAX_SERVERS_PER_NAME:
        raise DnsError(
            f"the name has {len(found)} addresses, more than the {MAX_SERVERS_PER_NAME} "
            "servers a loader connects to"
        )
    return found


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
                self._per_name[name] = self._servers_of(name)
            except DnsError as exc:
                raise ServerUnavailable(name, lookup_failure(name, exc)) from None
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
                found = self._servers_of(name)
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

    def _servers_of(self, name: str) -> list[str]:
        """`servers_of`, and `DnsError` where they would make the loader's servers, with its
        other names' and plain endpoints, more than `MAX_SERVERS_PER_NAME`."""
        found = servers_of(name, self._resolve)
        with self._lock:
            others = {e for n, got in self._per_name.items() if n != name for e in got}
        others.update(e for e in self.endpoints if not is_dns_endpoint(e))
        if len(others | set(found)) > MAX_SERVERS_PER_NAME:
            raise DnsError(
                f"the name has {len(found)} addresses: with the loader's {len(others)} other "
                f"servers, more than the {MAX_SERVERS_PER_NAME} a loader connects to"
            )
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.resolve_once()
