"""``pipeline-monitor ENDPOINT``: watch a running pipeline-server from a terminal.

Live mode redraws the view every ``--interval`` seconds on the terminal's alternate screen
(rich's Live), follows a resized terminal within a quarter of a second, and restores the
terminal on Ctrl-C or SIGTERM. ``--once`` prints a single snapshot; ``--json`` prints the raw
stats instead of the view (one JSON object per line when live), for scripts, in the fleet's
shape (``servers`` and ``total``; `server_json`).

A fleet name, ``dns+tcp://NAME:PORT`` (every A/AAAA record of NAME a server, as a RemoteLoader
reads it), is re-resolved at every refresh and shows every server (`monitor.fleet`): one view
per server, stacked, under the fleet's totals; ``--json`` prints one object per refresh with one
entry per server. A name with no records exits 2 naming DNS; a server that does not answer is
shown as such while the others still show; ``--keys`` applies to every server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TextIO, TypeVar

from batchwire.monitor.bottleneck import infer_bottleneck, smooth
from batchwire.monitor.fleet import FleetPoller, FleetSnapshot, FleetWatch, ServerView
from batchwire.monitor.render import (
    FleetMonitorView,
    MonitorView,
    render,
    render_fleet,
    text_console,
)
from batchwire.wire.cli import ArgumentParser
from batchwire.wire.dns import DnsError, is_dns_endpoint, lookup_failure
from batchwire.wire.keys import ClientKeys, KeysError, client_keys
from batchwire.wire.stats import ServerStats
from batchwire.wire.stats_client import StatsClient, StatsUnavailable
from batchwire.wire.version import add_version_argument
from rich.live import Live

# Redraws per second of the live view: a resized terminal gets a frame of its size this soon.
LIVE_REFRESH_HZ = 4
# The live view infers the bottleneck from the queues averaged over this long: one snapshot
# catches each worker in one stage, a few seconds show where batches really pile up.
SMOOTH_S = 3.0
MAX_SECONDS = 86400.0  # --interval and --timeout: a day is plenty; inf would overflow zmq_poll


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pipeline-monitor",
        description="Live view of a pipeline-server: stage queues, clients, throughput, and "
        "the inferred bottleneck.",
    )
    add_version_argument(parser)
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="the server's ZeroMQ endpoint, e.g. tcp://127.0.0.1:5555, or a fleet: "
        "dns+tcp://NAME:PORT (every A/AAAA record of NAME a server)",
    )
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument(
        "--keys",
        default=None,
        help="keys folder of a server started with --keys (default: $BATCHWIRE_KEYS); "
        "for a fleet, of every server",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the raw stats as JSON (one object per line when live)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes in live mode (default: 1)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the server's answer (default: 5)",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="no ANSI colours (also off when NO_COLOR is set or not a terminal)",
    )
    return parser


def _use_color(stream: TextIO, disabled: bool) -> bool:
    return not disabled and "NO_COLOR" not in os.environ and stream.isatty()


def _use_unicode(stream: TextIO) -> bool:
    return "utf" in (getattr(stream, "encoding", None) or "").lower()


def _terminal_size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        size = shutil.get_terminal_size()
    return max(1, size.columns), max(1, size.lines)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _run_once(client: StatsClient, args: argparse.Namespace, out: TextIO) -> int:
    try:
        snapshot = client.fetch()
    except StatsUnavailable as exc:
        print(f"pipeline-monitor: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out.write(json.dumps(server_json(args.endpoint, snapshot)) + "\n")
    else:
        width = _terminal_size(out)[0] if out.isatty() else 120
        out.write(
            render(
                snapshot,
                width,
                endpoint=args.endpoint,
                color=_use_color(out, args.no_color),
                unicode=_use_unicode(out),
            )
            + "\n"
        )
    out.flush()
    return 0


def server_json(endpoint: str, snapshot: ServerStats) -> dict[str, Any]:
    """``--json`` for one server: the fleet's shape (``servers``, one entry, and ``total``), so
    one script reads a server and a fleet alike; the server's stats are also at the top level,
    as before the fleet's shape existed, for scripts written then."""
    fleet = FleetSnapshot(endpoint, [ServerView(endpoint, snapshot)], time=snapshot.time)
    return {**snapshot.to_map(), **fleet.to_map()}


def _run_json_lines(client: StatsClient, args: argparse.Namespace, out: TextIO) -> int:
    """One JSON line per interval, polling on: a missed answer is a line too (the fleet's shape,
    ``stats`` null and ``error``, as a fleet's server that did not answer), and said on
    stderr; a script sees the outage, not a gap."""
    while True:
        started = time.monotonic()
        try:
            line = server_json(args.endpoint, client.fetch())
        except StatsUnavailable as exc:
            print(f"pipeline-monitor: {exc}", file=sys.stderr, flush=True)
            away = ServerView(args.endpoint, None, str(exc))
            line = FleetSnapshot(args.endpoint, [away]).to_map()
        out.write(json.dumps(line) + "\n")
        out.flush()
        time.sleep(max(0.0, started + args.interval - time.monotonic()))


def _run_live(client: StatsClient, args: argparse.Namespace, out: TextIO) -> int:
    """Refresh every --interval. On a terminal: rich's Live on the alternate screen, redrawn at
    the terminal's size several times a second (a resize shows at once), the terminal restored
    on exit; otherwise one frame after another, a blank line apart."""
    color = _use_color(out, args.no_color)
    view = MonitorView(args.endpoint, _use_unicode(out))
    recent: deque[ServerStats] = deque(maxlen=max(1, round(SMOOTH_S / args.interval)))
    last_ok: float | None = None

    def poll() -> None:
        nonlocal last_ok
        try:
            view.snapshot = client.fetch()
            recent.append(view.snapshot)
            view.error, last_ok = None, time.monotonic()
        except StatsUnavailable as exc:
            view.error = str(exc)
            if last_ok is not None:
                view.error += f"; last answer {time.monotonic() - last_ok:.0f} s ago"
        view.bottleneck = infer_bottleneck(smooth(recent)) if recent else None

    def sleep_until(started: float) -> None:
        time.sleep(max(0.0, started + args.interval - time.monotonic()))

    if not out.isatty():
        while True:
            started = time.monotonic()
            poll()
            text = render(
                view.snapshot,
                120,
                endpoint=args.endpoint,
                error=view.error,
                color=color,
                unicode=view.unicode,
                bottleneck=view.bottleneck,
            )
            out.write(text + "\n\n")
            out.flush()
            sleep_until(started)
    console = text_console(out, None, color)
    with Live(view, console=console, screen=True, auto_refresh=False) as live:
        next_poll = time.monotonic()
        while True:
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + args.interval
                poll()
            # The terminal's own size, read each redraw: rich would pin an exported COLUMNS or
            # LINES, and a resize must show at the next redraw.
            console.size = _terminal_size(out)
            live.refresh()
            time.sleep(max(0.0, min(1.0 / LIVE_REFRESH_HZ, next_poll - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("interval", "timeout"):  # NaN and inf fail these too
        if not 0 < getattr(args, name) <= MAX_SECONDS:
            build_parser().error(f"--{name} must be > 0 and at most {MAX_SECONDS:g} seconds")
    out = sys.stdout
    # SIGTERM takes the same clean way out as Ctrl-C: the terminal must be restored.
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        keys = client_keys(args.keys)
    except KeysError as exc:
        print(f"pipeline-monitor: {exc}", file=sys.stderr)
        return 2
    if is_dns_endpoint(args.endpoint):
        return _main_fleet(args, keys, out)
    client = StatsClient(args.endpoint, args.timeout, keys=keys)
    try:
        client.connect()
    except StatsUnavailable as exc:  # a malformed endpoint will not get better by retrying
        client.close()
        print(f"pipeline-monitor: {exc}", file=sys.stderr)
        return 2
    return _run_view(client, args, out, _run_once, _run_json_lines, _run_live)


class _StatsFeed(Protocol):
    def close(self) -> None: ...


_S = TypeVar("_S", bound=_StatsFeed)
_View = Callable[[_S, argparse.Namespace, TextIO], int]


def _run_view(
    feed: _S,
    args: argparse.Namespace,
    out: TextIO,
    once: _View[_S],
    json_lines: _View[_S],
    live: _View[_S],
) -> int:
    """The view `args` asks for (`--once`, `--json`, else live) over `feed`, then `feed`
    closed. One server's `StatsClient` and a fleet's `FleetPoller` must end the same way:
    Ctrl-C exits 0, a reader gone from the pipe (`| head`) stops quietly, and the connections
    are closed whatever happened."""
    try:
        if args.once:
            return once(feed, args, out)
        if args.json:
            return json_lines(feed, args, out)
        return live(feed, args, out)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return _reader_gone()
    finally:
        feed.close()


def _reader_gone() -> int:
    """The reader went away (`| head`): stop quietly, and keep Python from complaining about
    the unflushable stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _main_fleet(args: argparse.Namespace, keys: ClientKeys | None, out: TextIO) -> int:
    """``dns+tcp://NAME:PORT``: resolve now (no records: exit 2 naming DNS), then as for one
    server, every server of the name at every refresh."""
    try:
        poller = FleetPoller(args.endpoint, args.timeout, keys=keys)
    except ValueError as exc:  # a malformed name or $BATCHWIRE_DNS_SERVER
        print(f"pipeline-monitor: {exc}", file=sys.stderr)
        return 2
    try:
        poller.initial()
    except DnsError as exc:
        print(f"pipeline-monitor: {lookup_failure(args.endpoint, exc)}", file=sys.stderr)
        return 2
    return _run_view(poller, args, out, _fleet_once, _fleet_json_lines, _fleet_live)


def _fleet_once(poller: FleetPoller, args: argparse.Namespace, out: TextIO) -> int:
    """Every server once (the name was just resolved): 0 if any answered, else 1; the view (or
    JSON) shows each server's answer or error either way."""
    fleet = poller.poll(resolve=False)
    if args.json:
        out.write(json.dumps(fleet.to_map()) + "\n")
    else:
        width = _terminal_size(out)[0] if out.isatty() else 120
        color, unicode = _use_color(out, args.no_color), _use_unicode(out)
        text = render_fleet(fleet, width, color=color, unicode=unicode, waiting=False)
        out.write(text + "\n")
    out.flush()
    if fleet.totals.answering:
        return 0
    print(f"pipeline-monitor: no server of {args.endpoint} answered", file=sys.stderr)
    return 1


def _fleet_json_lines(poller: FleetPoller, args: argparse.Namespace, out: TextIO) -> int:
    """One JSON object per interval, one entry per server (an error in place of stats)."""
    first = True  # the name was just resolved
    while True:
        started = time.monotonic()
        out.write(json.dumps(poller.poll(resolve=not first).to_map()) + "\n")
        out.flush()
        first = False
        time.sleep(max(0.0, started + args.interval - time.monotonic()))


def _fleet_live(poller: FleetPoller, args: argparse.Namespace, out: TextIO) -> int:
    """As `_run_live`, for every server of the fleet, the name re-resolved at each refresh."""
    color, unicode = _use_color(out, args.no_color), _use_unicode(out)
    watch = FleetWatch(round(SMOOTH_S / args.interval))
    first = True  # the name was just resolved

    def poll() -> FleetSnapshot:
        nonlocal first
        fleet = watch.update(poller.poll(resolve=not first))
        first = False
        return fleet

    if not out.isatty():
        while True:
            started = time.monotonic()
            out.write(render_fleet(poll(), 120, color=color, unicode=unicode) + "\n\n")
            out.flush()
            time.sleep(max(0.0, started + args.interval - time.monotonic()))
    view = FleetMonitorView(poll(), unicode)
    console = text_console(out, None, color)
    with Live(view, console=console, screen=True, auto_refresh=False) as live:
        next_poll = time.monotonic() + args.interval
        while True:
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + args.interval
                view.fleet = poll()
            console.size = _terminal_size(out)  # as in _run_live: the terminal's own size
            live.refresh()
            time.sleep(max(0.0, min(1.0 / LIVE_REFRESH_HZ, next_poll - time.monotonic())))


if __name__ == "__main__":
    sys.exit(main())
