"""The terminal view of a stats snapshot, as rich renderables: a pure function of (snapshot, size).

`frame` builds the view for a width and height (rich `Text` lines and a `Table` of clients);
`render` prints it to text (``--once``, tests), `MonitorView` redraws it at whatever size the
terminal has (the live view, through `rich.live.Live`). Rich does the terminal work that used to
be hand-written here: styles and colour codes, cropping lines to the width by their visible
characters (a narrow terminal shows a clipped, not wrapped, view), the alternate screen.
Client columns that do not fit are dropped, least useful first. A fleet (``dns+tcp://``) is
`fleet_frame`: its totals, then one `frame` per server, stacked (`render_fleet`,
`FleetMonitorView`).
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from batchwire.monitor.bottleneck import Bottleneck, infer_bottleneck, is_full
from batchwire.monitor.fleet import FleetSnapshot
from batchwire.wire.stats import ClientRow, MixStats, ServerStats
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

# rich styles
BOLD = "bold"
DIM = "dim"
RED = "red"
GREEN = "green"
YELLOW = "yellow"
CYAN = "cyan"

# Spaces at the end of a line, before any colour codes that close it: padding, not content.
_TRAILING_SPACE = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$")

MIN_BAR = 6
MAX_BAR = 50
INDENT = 2


@dataclass(frozen=True)
class _Column:
    title: str
    width: int
    priority: int  # 1 = always shown; larger numbers are dropped first when space runs out
    align: str  # "left" or "right"


_CLIENT_COLUMNS = (
    _Column("client", 12, 1, "left"),
    _Column("split", 6, 2, "left"),
    _Column("rank", 5, 1, "right"),
    _Column("epoch", 5, 4, "right"),
    _Column("credits", 7, 3, "right"),
    _Column("ready", 7, 1, "right"),
    _Column("inflight", 8, 5, "right"),
    _Column("sent", 8, 6, "right"),
    _Column("img/s", 8, 2, "right"),
    _Column("wait", 6, 2, "right"),
    _Column("seen", 6, 5, "right"),
)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _line(*parts: tuple[str, str] | str) -> Text:
    """One line of the view: never wrapped, cropped at the width."""
    text = Text(no_wrap=True, overflow="crop")
    for part in parts:
        text.append(*((part, "") if isinstance(part, str) else part))
    return text


def _wrapped_line(*parts: tuple[str, str] | str) -> Text:
    """A line whose words all matter (the bottleneck and its reason): wrapped at the width,
    never cropped, on a terminal and in a pipe alike."""
    text = _line(*parts)
    text.no_wrap, text.overflow = False, "fold"
    return text


def _bar(depth: int, capacity: int, width: int, unicode: bool) -> list[tuple[str, str]]:
    full_ch, empty_ch = ("█", "░") if unicode else ("#", ".")
    filled = 0 if capacity <= 0 else round(width * min(depth, capacity) / capacity)
    if depth > 0 and filled == 0:
        filled = 1  # a non-empty queue never looks empty
    style = YELLOW if is_full(depth, capacity) else GREEN
    return [("[", ""), (full_ch * filled, style), (empty_ch * (width - filled), DIM), ("]", "")]


def _stage_lines(
    snapshot: ServerStats, width: int, unicode: bool, bottleneck: Bottleneck
) -> list[Text]:
    rows: list[tuple[str, int, int, str]] = [
        (s.name, s.depth, s.capacity, f"{s.latency_ms:7.1f} ms") for s in snapshot.stages
    ]
    clients = snapshot.clients
    if clients and not any(name == "ready" for name, *_ in rows):
        rows.append(
            (
                "ready",
                sum(c.ready for c in clients),
                sum(c.ready_capacity for c in clients),
                f"{len(clients)} client{'s' if len(clients) != 1 else ''}",
            )
        )
    if not rows:
        return [_line(("  (the server reports no stages)", DIM))]
    name_w = max(8, *(len(r[0]) + 1 for r in rows))
    count_w = max(len(f"{r[1]}/{r[2]}") for r in rows) + 1
    tail_w = max(len(r[3]) for r in rows) + 2
    # Row = indent + name + [bar] + space + count + tail.
    bar_w = max(MIN_BAR, min(MAX_BAR, width - 2 - name_w - 2 - 1 - count_w - tail_w))
    lines = []
    for name, depth, cap, tail in rows:
        hot = bottleneck.kind == "stage" and bottleneck.stage == name
        lines.append(
            _line(
                "  ",
                (f"{name:<{name_w}}", f"{BOLD} {RED}" if hot else BOLD),
                *_bar(depth, cap, bar_w, unicode),
                f" {f'{depth}/{cap}':>{count_w}}",
                (f"  {tail}", DIM),
            )
        )
    return lines


def _client_cells(c: ClientRow) -> dict[str, tuple[str, str]]:
    wait = None if c.loader is None else c.loader.data_wait_fraction
    ready_style = YELLOW if is_full(c.ready, c.ready_capacity) else ""
    wait_cell = (
        ("-", DIM) if wait is None else (f"{100 * wait:.0f}%", RED if wait >= 0.2 else GREEN)
    )
    return {
        "client": (c.id, ""),
        "split": (c.split, ""),
        "rank": (f"{c.rank}/{c.world_size}", ""),
        "epoch": (str(c.epoch), ""),
        "credits": (str(c.credits), ""),
        "ready": (f"{c.ready}/{c.ready_capacity}", ready_style),
        "inflight": (str(c.in_flight), ""),
        "sent": (str(c.sent), ""),
        "img/s": (f"{c.images_per_s:.1f}", ""),
        "wait": wait_cell,
        "seen": (human_duration(c.last_seen_s), ""),
    }


def _client_columns(width: int) -> list[_Column]:
    cols = list(_CLIENT_COLUMNS)
    while len(cols) > 1 and INDENT + sum(c.width + 1 for c in cols) > width:
        worst = max(c.priority for c in cols)
        if worst == 1:
            break
        # Drop the rightmost of the least useful columns first.
        idx = max(i for i, c in enumerate(cols) if c.priority == worst)
        del cols[idx]
    return cols


def _cell(text: str, col: _Column) -> str:
    return text if len(text) <= col.width else text[: col.width - 1] + "~"


def _client_table(clients: Sequence[ClientRow], width: int) -> Table:
    """Header and one row per client: fixed-width columns, one space apart, never wrapped."""
    cols = _client_columns(width)
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, expand=False)
    for col in cols:
        table.add_column(
            col.title,
            width=col.width,
            justify=col.align,  # type: ignore[arg-type]
            no_wrap=True,
            overflow="crop",
            header_style=BOLD,
        )
    for client in clients:
        cells = _client_cells(client)
        table.add_row(*(Text(_cell(cells[c.title][0], c), style=cells[c.title][1]) for c in cols))
    return table


def _mix_line(mix: MixStats) -> Text:
    """``mix train: web 70.1% (w 0.70)  curated 29.9% (w 0.30)``: each part's share of the
    samples sent in the split's latest epoch (of all sent, from a server that does not say),
    against its planned share; "-" before any sample."""
    served = [
        p.served_total if p.served_this_epoch is None else p.served_this_epoch for p in mix.parts
    ]
    total = sum(served)
    shown = "  ".join(
        f"{p.name} {f'{100 * n / total:.1f}%' if total else '-'} (w {p.weight:.2f})"
        for p, n in zip(mix.parts, served, strict=True)
    )
    epoch = "" if mix.epoch is None else f"  epoch {mix.epoch}"
    return _line((f"mix {mix.split}: ", BOLD), shown, (epoch, DIM))


def _head(title: str, endpoint: str, snapshot: ServerStats | None) -> Text:
    head = _line((title, BOLD), (f"  {endpoint}", CYAN))
    if snapshot is not None:
        head.append(f"  up {human_duration(snapshot.uptime_s)}")
    head.append(f"  {time.strftime('%H:%M:%S')}", DIM)
    return head


def _error_line(error: str) -> Text:
    return _line(("! ", f"{BOLD} {RED}"), (error, RED))


def frame(
    snapshot: ServerStats | None,
    width: int = 100,
    height: int | None = None,
    *,
    endpoint: str = "",
    error: str | None = None,
    unicode: bool = True,
    bottleneck: Bottleneck | None = None,
    title: str = "batchwire monitor",
    waiting: bool = True,
) -> Group:
    """The view as one rich renderable, each line at most ``width`` visible characters.

    ``snapshot`` may be None (nothing received yet: "waiting for the first answer" unless not
    ``waiting``); ``error`` shows as a warning line above the last good snapshot, so a hiccup
    does not blank the screen. ``bottleneck`` defaults to the one inferred from ``snapshot``
    alone (the live view passes one from several). ``title`` begins the first line.
    """
    width = max(1, int(width))
    parts: list[RenderableType] = [_head(title, endpoint, snapshot)]
    if error:
        parts.append(_error_line(error))
    if snapshot is None:
        if waiting:
            parts.append(_line(("waiting for the first answer...", DIM)))
        return Group(*parts)

    if bottleneck is None:
        bottleneck = infer_bottleneck(snapshot)
    style = f"{BOLD} {RED}" if bottleneck.kind in ("trainers", "stage") else f"{BOLD} {GREEN}"
    parts.append(
        _wrapped_line(
            ("bottleneck: ", BOLD), (bottleneck.label, style), (f"  ({bottleneck.reason})", DIM)
        )
    )
    parts += [_line(), _line(("queues", BOLD))]
    parts.extend(_stage_lines(snapshot, width, unicode, bottleneck))
    parts.append(_line())

    tp = snapshot.throughput
    parts.append(
        _line(
            ("throughput  ", BOLD),
            f"{tp.images_per_s:.1f} img/s   {tp.batches_per_s:.2f} batch/s   "
            f"{human_bytes(tp.bytes_per_s)}/s",
        )
    )
    counters = snapshot.counters
    problems = counters.bad_total + counters.errors_total + counters.malformed_total
    totals = _line(
        ("counters    ", BOLD),
        f"images {counters.images_total:,}  batches {counters.batches_total:,}  "
        f"bytes {human_bytes(counters.bytes_total)}  ",
        (
            f"replaced {counters.replaced_total:,}  bad {counters.bad_total:,}  "
            f"errors {counters.errors_total:,}  malformed {counters.malformed_total:,}",
            YELLOW if problems else "",
        ),
    )
    if counters.decode_fallbacks_total:  # a GPU decoder sent images to the CPU: say so
        totals.append(f"  CPU-decoded fallbacks {counters.decode_fallbacks_total:,}", YELLOW)
    if counters.batches_produced_total:  # shared production (--share-window): one line
        states = [c.sharing for c in snapshot.clients]
        window = 0 if snapshot.buffers is None else snapshot.buffers.window_bytes or 0
        parts += [totals]
        sent_per_produced = counters.batches_total / counters.batches_produced_total
        if len(states) > 1:
            ratio = f"share ratio {sent_per_produced:.2f} (batches sent per batch produced)"
        else:
            who = "one client" if states else "no client now"
            ratio = f"sent {counters.batches_total:,} ({who}: nothing to share)"
        # Wrapped, not cropped: its client counts come last, and a lagging job is what an
        # operator reads it for (a pipe renders at 120 columns).
        totals = _wrapped_line(
            ("sharing     ", BOLD),
            f"produced {counters.batches_produced_total:,}  {ratio}  "
            f"window {human_bytes(window)}  clients: {states.count('shared')} shared, "
            f"{states.count('solo')} solo, ",
            (f"{states.count('lagging')} lagging", YELLOW if "lagging" in states else ""),
            (
                f"  samples reused {counters.samples_reused_total:,} of "
                f"{counters.samples_reused_total + (counters.samples_produced_total or 0):,}"
                if counters.samples_reused_total
                else ""
            ),
        )
    parts += [totals, *(_mix_line(mix) for mix in snapshot.mixes or ()), _line()]

    clients = list(snapshot.clients)
    unlisted = 0 if snapshot.clients_unlisted is None else snapshot.clients_unlisted.count
    more = f", {unlisted} more not listed" if unlisted else ""
    parts.append(_line((f"clients ({len(clients) + unlisted}{more})", BOLD)))
    if not clients:
        parts.append(_line(("  (none connected)", DIM)))
        return Group(*parts)
    hidden_line = None
    if height is not None and len(parts) + 1 + len(clients) > height:
        # Keep the header row and as many clients as fit, then say how many are hidden.
        room = max(1, height - len(parts) - 1)
        shown = max(0, room - 1)
        hidden_line = _line((f"  ... and {len(clients) + 1 - room} more", DIM))
        clients = clients[:shown]
    parts.append(Padding(_client_table(clients, width - INDENT), (0, 0, 0, INDENT)))
    if hidden_line is not None:
        parts.append(hidden_line)
    return Group(*parts)


def render(
    snapshot: ServerStats | None,
    width: int = 100,
    height: int | None = None,
    *,
    endpoint: str = "",
    error: str | None = None,
    color: bool = False,
    unicode: bool = True,
    bottleneck: Bottleneck | None = None,
) -> str:
    """The view as text, one line per row, ANSI colours only when ``color``."""
    view = frame(
        snapshot,
        width,
        height,
        endpoint=endpoint,
        error=error,
        unicode=unicode,
        bottleneck=bottleneck,
    )
    return _text(view, width, color)


def fleet_frame(
    fleet: FleetSnapshot,
    width: int = 100,
    height: int | None = None,
    *,
    unicode: bool = True,
    waiting: bool = True,
) -> Group:
    """A fleet's view (``dns+tcp://NAME:PORT``): a head with the fleet's totals, then every
    server's own view (`frame`), stacked in address order; a server that did not answer shows
    its error (above its last good snapshot, if any). Each server gets an even share of
    ``height`` for its client table."""
    width = max(1, int(width))
    totals = fleet.totals
    servers = f"{totals.servers} server{'s' if totals.servers != 1 else ''}"
    parts: list[RenderableType] = [
        _line(
            ("batchwire monitor", BOLD),
            (f"  {fleet.name}", CYAN),
            f"  {servers}, ",
            (
                f"{totals.answering} answering",
                "" if totals.answering == totals.servers else f"{BOLD} {YELLOW}",
            ),
            (f"  {time.strftime('%H:%M:%S')}", DIM),
        ),
        _line(
            ("fleet total ", BOLD),
            f"{totals.images_per_s:.1f} img/s   {totals.batches_per_s:.2f} batch/s   "
            f"{human_bytes(totals.bytes_per_s)}/s   {totals.clients} clients",
            ("  (summed over the servers that answered)", DIM),
        ),
    ]
    if fleet.dns_error:
        parts.append(_error_line(fleet.dns_error))
    rule = _line(("─" if unicode else "-") * width, DIM)
    n = max(1, len(fleet.servers))
    each = None if height is None else max(1, (height - len(parts)) // n - 1)
    for view in fleet.servers:
        parts.append(rule)
        parts.append(
            frame(
                view.stats,
                width,
                each,
                endpoint=view.endpoint,
                error=view.error,
                unicode=unicode,
                bottleneck=view.bottleneck,
                title="server",
                waiting=waiting,
            )
        )
    return Group(*parts)


def render_fleet(
    fleet: FleetSnapshot,
    width: int = 100,
    height: int | None = None,
    *,
    color: bool = False,
    unicode: bool = True,
    waiting: bool = True,
) -> str:
    """`fleet_frame` as text, ANSI colours only when ``color``."""
    return _text(fleet_frame(fleet, width, height, unicode=unicode, waiting=waiting), width, color)


def _text(view: RenderableType, width: int, color: bool) -> str:
    out = io.StringIO()
    console = text_console(out, width, color)
    console.print(view, crop=True, no_wrap=True, overflow="crop")
    lines = out.getvalue().rstrip("\n").split("\n")
    return "\n".join(_TRAILING_SPACE.sub(r"\1", line) for line in lines)


def text_console(file: io.TextIOBase | object, width: int | None, color: bool) -> Console:
    """A rich console writing to ``file``: colours only when ``color``, no markup or emoji
    guessing on the server's strings, ``width`` columns (None: the terminal's)."""
    return Console(
        file=file,  # type: ignore[arg-type]
        width=width,
        force_terminal=color or None,
        color_system="standard" if color else None,
        no_color=not color,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )


class MonitorView:
    """The live view's renderable: drawn afresh at the console's size each time rich refreshes
    (so a resized terminal gets a frame of its new size at the next refresh)."""

    def __init__(self, endpoint: str, unicode: bool) -> None:
        self.endpoint = endpoint
        self.unicode = unicode
        self.snapshot: ServerStats | None = None
        self.error: str | None = None
        self.bottleneck: Bottleneck | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from _frame_lines(self, options.max_width, options.height or console.height)


def _frame_lines(view: MonitorView, width: int, height: int) -> Iterator[RenderableType]:
    yield frame(
        view.snapshot,
        width,
        height,
        endpoint=view.endpoint,
        error=view.error,
        unicode=view.unicode,
        bottleneck=view.bottleneck,
    )


class FleetMonitorView:
    """The live view of a fleet: `fleet_frame` of the latest refresh at the console's size."""

    def __init__(self, fleet: FleetSnapshot, unicode: bool) -> None:
        self.fleet = fleet
        self.unicode = unicode

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield fleet_frame(
            self.fleet, options.max_width, options.height or console.height, unicode=self.unicode
        )
