"""``pipeline-monitor ENDPOINT``: watch a running pipeline-server from a terminal.

Live mode redraws the view every ``--interval`` seconds on the terminal's alternate screen
(rich's Live), follows a resized terminal within a quarter of a second, and restores the
terminal on Ctrl-C or SIGTERM. ``--once`` prints a single snapshot; ``--json`` prints the raw
stats instead of the view (one JSON object per line when live), for scripts.
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
from typing import TextIO

from batchwire.monitor.bottleneck import infer_bottleneck, smooth
from batchwire.monitor.render import MonitorView, render, text_console
from batchwire.wire.keys import KeysError, client_keys
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
    parser = argparse.ArgumentParser(
        prog="pipeline-monitor",
        description="Live view of a pipeline-server: stage queues, clients, throughput, and "
        "the inferred bottleneck.",
    )
    add_version_argument(parser)
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="the server's ZeroMQ endpoint, e.g. tcp://127.0.0.1:5555",
    )
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument(
        "--keys",
        default=None,
        help="keys folder of a server started with --keys (default: $BATCHWIRE_KEYS)",
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
        out.write(json.dumps(snapshot.to_map()) + "\n")
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


def _run_json_stream(client: StatsClient, args: argparse.Namespace, out: TextIO) -> int:
    """One JSON line per interval; a missed answer goes to stderr and polling goes on."""
    while True:
        started = time.monotonic()
        try:
            out.write(json.dumps(client.fetch().to_map()) + "\n")
            out.flush()
        except StatsUnavailable as exc:
            print(f"pipeline-monitor: {exc}", file=sys.stderr, flush=True)
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
    client = StatsClient(args.endpoint, args.timeout, keys=keys)
    try:
        client.connect()
    except StatsUnavailable as exc:  # a malformed endpoint will not get better by retrying
        client.close()
        print(f"pipeline-monitor: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            return _run_once(client, args, out)
        if args.json:
            return _run_json_stream(client, args, out)
        return _run_live(client, args, out)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining
        # about the unflushable stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
