"""A fleet named by DNS (``dns+tcp://NAME:PORT``): every server it resolves to, asked at once.

`FleetPoller` resolves the name (`wire.dns`, the loader's own parsing and resolvers), keeps one
`StatsClient` per server and, at each `FleetPoller.poll`, re-resolves the name and asks every
server in parallel (one short-lived thread per server, so a server that does not answer costs
the refresh ``timeout`` once, not once per server), giving a `FleetSnapshot`: per server its
stats or why there are none. A name that resolves to nothing after it once resolved keeps the
servers it had (a DNS hiccup, every pod restarting), as the loader does, and says so.

`FleetWatch` turns successive snapshots into what the live view shows: a server's last good
stats under its latest error, and the bottleneck from a few seconds of its snapshots.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchwire.monitor.bottleneck import Bottleneck, infer_bottleneck, smooth
from batchwire.wire.dns import (
    DnsError,
    Resolve,
    default_resolver,
    parse_dns_endpoint,
    resolve_dns_endpoint,
)
from batchwire.wire.keys import ClientKeys
from batchwire.wire.stats import ServerStats
from batchwire.wire.stats_client import StatsClient, StatsUnavailable

__all__ = ["FleetPoller", "FleetSnapshot", "FleetTotals", "FleetWatch", "ServerView"]

# Beyond the request timeout, how long a refresh waits for a server's thread to hand back.
_JOIN_MARGIN_S = 2.0


@dataclass
class ServerView:
    """One server of the fleet as shown: its stats (None: none yet), why the latest request
    failed (None: it answered), and the bottleneck to show (None: inferred from ``stats``)."""

    endpoint: str
    stats: ServerStats | None = None
    error: str | None = None
    bottleneck: Bottleneck | None = None


@dataclass(frozen=True)
class FleetTotals:
    servers: int
    answering: int
    images_per_s: float
    batches_per_s: float
    bytes_per_s: float
    clients: int  # client sessions summed over the servers: a loader counts once per server

    @classmethod
    def of(cls, servers: list[ServerView]) -> FleetTotals:
        # Only the servers that answered this time: a stale figure would count a server twice
        # over (its last answer, and its share of work the others took over).
        shown = [s.stats for s in servers if s.stats is not None and s.error is None]
        return cls(
            servers=len(servers),
            answering=len(shown),
            images_per_s=sum(s.throughput.images_per_s for s in shown),
            batches_per_s=sum(s.throughput.batches_per_s for s in shown),
            bytes_per_s=sum(s.throughput.bytes_per_s for s in shown),
            clients=sum(
                len(s.clients) + (0 if s.clients_unlisted is None else s.clients_unlisted.count)
                for s in shown
            ),
        )

    def to_map(self) -> dict[str, Any]:
        return {
            "servers": self.servers,
            "answering": self.answering,
            "images_per_s": self.images_per_s,
            "batches_per_s": self.batches_per_s,
            "bytes_per_s": self.bytes_per_s,
            "clients": self.clients,
        }


@dataclass
class FleetSnapshot:
    """One refresh of the fleet: every server the name stands for, in address order."""

    name: str
    servers: list[ServerView]
    dns_error: str | None = None  # the name resolved to nothing this time (servers kept)
    time: float = field(default_factory=time.time)

    @property
    def totals(self) -> FleetTotals:
        return FleetTotals.of(self.servers)

    def to_map(self) -> dict[str, Any]:
        """``--json``: the name, one entry per server (``stats`` exactly as the server sent
        it, or null and ``error``), and the fleet's totals."""
        return {
            "fleet": self.name,
            "time": self.time,
            "dns_error": self.dns_error,
            "servers": [
                {
                    "endpoint": s.endpoint,
                    "stats": None if s.stats is None else s.stats.to_map(),
                    "error": s.error,
                }
                for s in self.servers
            ],
            "total": self.totals.to_map(),
        }


class FleetPoller:
    """Resolve ``name`` and ask each of its servers for stats (``keys`` for every one).

    `initial` resolves once and raises `DnsError` if the name has no records; `poll`
    re-resolves (unless ``resolve=False``) and asks every server. ValueError at construction
    for a malformed name or ``$BATCHWIRE_DNS_SERVER``.
    """

    def __init__(
        self,
        name: str,
        timeout: float,
        *,
        keys: ClientKeys | None = None,
        resolve: Resolve | None = None,
        make_client: Callable[[str], StatsClient] | None = None,
    ) -> None:
        parse_dns_endpoint(name)
        self.name = name
        self.timeout = float(timeout)
        self.endpoints: list[str] = []
        self._resolve = resolve or default_resolver()
        self._make_client = make_client or (lambda ep: StatsClient(ep, self.timeout, keys=keys))
        self._clients: dict[str, StatsClient] = {}
        self._asking: dict[str, threading.Thread] = {}  # the thread using each client now

    def initial(self) -> list[str]:
        self.endpoints = resolve_dns_endpoint(self.name, self._resolve)
        return self.endpoints

    def refresh(self) -> str | None:
        """Resolve again; None, or what went wrong (the servers it had are kept)."""
        try:
            self.endpoints = resolve_dns_endpoint(self.name, self._resolve)
        except DnsError as exc:
            n = len(self.endpoints)
            return (
                f"DNS: {self.name} resolves to no server now ({exc}); showing the {n} "
                f"server{'s' if n != 1 else ''} it had"
            )
        for gone in set(self._clients) - set(self.endpoints):
            self._clients.pop(gone).close()
        return None

    def poll(self, *, resolve: bool = True) -> FleetSnapshot:
        dns_error = self.refresh() if resolve else None
        views = {ep: ServerView(ep) for ep in self.endpoints}

        def ask(view: ServerView, client: StatsClient) -> None:
            try:
                view.stats = client.fetch()
            except StatsUnavailable as exc:
                view.error = str(exc)
            except Exception as exc:  # say it on that server's view; the others still show
                view.error = f"{type(exc).__name__}: {exc}"

        for ep, view in views.items():
            client = self._clients.get(ep)
            if client is None:
                client = self._clients[ep] = self._make_client(ep)
            thread = threading.Thread(target=ask, args=(view, client), daemon=True)
            thread.start()
            self._asking[ep] = thread
        deadline = time.monotonic() + self.timeout + _JOIN_MARGIN_S
        for ep in views:
            thread = self._asking.pop(ep)
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # never seen: fetch is bounded by the timeout. Leave its
                # client to that thread (a socket is used by one thread at a time).
                self._clients.pop(ep, None)
                views[ep].stats, views[ep].error = None, f"no answer from {ep} (still waiting)"
        return FleetSnapshot(self.name, list(views.values()), dns_error)

    def close(self) -> None:
        """Close every client no thread is using (Ctrl-C or SIGTERM may come while servers are
        asked: a socket in use stays open, for the process exit to take)."""
        for ep, client in self._clients.items():
            thread = self._asking.get(ep)
            if thread is None or not thread.is_alive():
                client.close()
        self._clients.clear()


class FleetWatch:
    """What the live view shows from one refresh to the next: per server the last good stats
    (under the latest error, with how long ago that answer came) and the bottleneck inferred
    from the last ``keep`` snapshots."""

    def __init__(self, keep: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep = max(1, keep)
        self._clock = clock
        self._last: dict[str, tuple[ServerStats, float]] = {}
        self._recent: dict[str, deque[ServerStats]] = {}

    def update(self, snapshot: FleetSnapshot) -> FleetSnapshot:
        now = self._clock()
        shown = []
        for view in snapshot.servers:
            ep = view.endpoint
            recent = self._recent.setdefault(ep, deque(maxlen=self.keep))
            stats, error = view.stats, view.error
            if stats is not None:
                self._last[ep] = (stats, now)
                recent.append(stats)
            elif ep in self._last:
                stats, when = self._last[ep]
                error = f"{error}; last answer {now - when:.0f} s ago"
            bottleneck = infer_bottleneck(smooth(recent)) if recent else None
            shown.append(ServerView(ep, stats, error, bottleneck))
        for gone in set(self._last) - {v.endpoint for v in snapshot.servers}:
            del self._last[gone]
        for gone in set(self._recent) - {v.endpoint for v in snapshot.servers}:
            del self._recent[gone]
        return FleetSnapshot(snapshot.name, shown, snapshot.dns_error, snapshot.time)
