"""Text rendering of a stats snapshot for the terminal: a pure function of (snapshot, size).

Lines are built as styled segments and cut to the terminal width by their visible characters,
so colour codes never get sliced in half and a narrow terminal shows a clipped, not wrapped, view.
Client columns that do not fit are dropped, least useful first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from batchwire.monitor.bottleneck import Bottleneck, infer_bottleneck, is_full
from batchwire.wire.stats import ClientRow, ServerStats

# SGR codes; applied only when colour is on.
BOLD = "1"
DIM = "2"
RED = "31"
GREEN = "32"
YELLOW = "33"
CYAN = "36"

Segment = tuple[str, str]  # (text, SGR style or "")
Line = list[Segment]

MIN_BAR = 6
MAX_BAR = 50


@dataclass(frozen=True)
class _Column:
    title: str
    width: int
    priority: int  # 1 = always shown; larger numbers are dropped first when space runs out
    align: str  # "<" or ">"


_CLIENT_COLUMNS = (
    _Column("client", 12, 1, "<"),
    _Column("split", 6, 2, "<"),
    _Column("rank", 5, 1, ">"),
    _Column("epoch", 5, 4, ">"),
    _Column("credits", 7, 3, ">"),
    _Column("ready", 7, 1, ">"),
    _Column("inflight", 8, 5, ">"),
    _Column("sent", 8, 6, ">"),
    _Column("img/s", 8, 2, ">"),
    _Column("wait", 6, 2, ">"),
    _Column("seen", 6, 5, ">"),
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


def fit(line: Line, width: int) -> Line:
    """Cut ``line`` to ``width`` visible characters."""
    out: Line = []
    left = max(0, width)
    for text, style in line:
        if left <= 0:
            break
        out.append((text[:left], style))
        left -= len(text[:left])
    return out


def to_text(line: Line, color: bool) -> str:
    if not color:
        return "".join(text for text, _ in line)
    return "".join(
        f"\x1b[{style}m{text}\x1b[0m" if style and text else text for text, style in line
    )


def _bar(depth: int, capacity: int, width: int, unicode: bool) -> Line:
    full_ch, empty_ch = ("█", "░") if unicode else ("#", ".")
    filled = 0 if capacity <= 0 else round(width * min(depth, capacity) / capacity)
    if depth > 0 and filled == 0:
        filled = 1  # a non-empty queue never looks empty
    style = YELLOW if is_full(depth, capacity) else GREEN
    return [("[", ""), (full_ch * filled, style), (empty_ch * (width - filled), DIM), ("]", "")]


def _stage_lines(
    snapshot: ServerStats, width: int, unicode: bool, bottleneck: Bottleneck
) -> list[Line]:
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
        return [[("  (the server reports no stages)", DIM)]]
    name_w = max(8, *(len(r[0]) + 1 for r in rows))
    count_w = max(len(f"{r[1]}/{r[2]}") for r in rows) + 1
    tail_w = max(len(r[3]) for r in rows) + 2
    # Row = indent + name + [bar] + space + count + tail.
    bar_w = max(MIN_BAR, min(MAX_BAR, width - 2 - name_w - 2 - 1 - count_w - tail_w))
    lines = []
    for name, depth, cap, tail in rows:
        hot = bottleneck.kind == "stage" and bottleneck.stage == name
        lines.append(
            [
                ("  ", ""),
                (f"{name:<{name_w}}", RED + ";" + BOLD if hot else BOLD),
                *_bar(depth, cap, bar_w, unicode),
                (f" {f'{depth}/{cap}':>{count_w}}", ""),
                (f"  {tail}", DIM),
            ]
        )
    return lines


def _client_cells(c: ClientRow) -> dict[str, Segment]:
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
    while len(cols) > 1 and 2 + sum(c.width + 1 for c in cols) > width:
        worst = max(c.priority for c in cols)
        if worst == 1:
            break
        # Drop the rightmost of the least useful columns first.
        idx = max(i for i, c in enumerate(cols) if c.priority == worst)
        del cols[idx]
    return cols


def _cell(text: str, col: _Column) -> str:
    if len(text) > col.width:
        text = text[: col.width - 1] + "~"
    return f"{text:{col.align}{col.width}} "


def _client_lines(clients: Sequence[ClientRow], width: int) -> list[Line]:
    cols = _client_columns(width)
    header: Line = [("  ", "")] + [(_cell(c.title, c), BOLD) for c in cols]
    lines = [header]
    for client in clients:
        cells = _client_cells(client)
        lines.append(
            [("  ", "")] + [(_cell(cells[c.title][0], c), cells[c.title][1]) for c in cols]
        )
    return lines


def render_lines(
    snapshot: ServerStats | None,
    width: int = 100,
    height: int | None = None,
    *,
    endpoint: str = "",
    error: str | None = None,
    unicode: bool = True,
    bottleneck: Bottleneck | None = None,
) -> list[Line]:
    """The frame as styled lines, each at most ``width`` visible characters.

    ``snapshot`` may be None (nothing received yet); ``error`` shows as a warning line above
    the last good snapshot, so a hiccup does not blank the screen. ``bottleneck`` defaults to
    the one inferred from ``snapshot`` alone (the live view passes one from several).
    """
    width = max(1, int(width))
    lines: list[Line] = []
    clock = time.strftime("%H:%M:%S")
    head: Line = [("batchwire monitor", BOLD), (f"  {endpoint}", CYAN)]
    if snapshot is not None:
        head.append((f"  up {human_duration(snapshot.uptime_s)}", ""))
    head.append((f"  {clock}", DIM))
    lines.append(head)
    if error:
        lines.append([("! ", RED + ";" + BOLD), (error, RED)])
    if snapshot is None:
        lines.append([("waiting for the first answer...", DIM)])
        return [fit(line, width) for line in lines]

    if bottleneck is None:
        bottleneck = infer_bottleneck(snapshot)
    style = RED + ";" + BOLD if bottleneck.kind in ("trainers", "stage") else GREEN + ";" + BOLD
    lines.append(
        [("bottleneck: ", BOLD), (bottleneck.label, style), (f"  ({bottleneck.reason})", DIM)]
    )
    lines.append([])
    lines.append([("queues", BOLD)])
    lines.extend(_stage_lines(snapshot, width, unicode, bottleneck))
    lines.append([])

    tp = snapshot.throughput
    lines.append(
        [
            ("throughput  ", BOLD),
            (
                f"{tp.images_per_s:.1f} img/s   "
                f"{tp.batches_per_s:.2f} batch/s   "
                f"{human_bytes(tp.bytes_per_s)}/s",
                "",
            ),
        ]
    )
    counters = snapshot.counters
    problems = counters.bad_total + counters.errors_total + counters.malformed_total
    lines.append(
        [
            ("counters    ", BOLD),
            (
                f"images {counters.images_total:,}  "
                f"batches {counters.batches_total:,}  "
                f"bytes {human_bytes(counters.bytes_total)}  ",
                "",
            ),
            (
                f"replaced {counters.replaced_total:,}  "
                f"bad {counters.bad_total:,}  "
                f"errors {counters.errors_total:,}  "
                f"malformed {counters.malformed_total:,}",
                YELLOW if problems else "",
            ),
        ]
    )
    if counters.decode_fallbacks_total:  # a GPU decoder sent images to the CPU: say so
        lines[-1].append((f"  CPU-decoded fallbacks {counters.decode_fallbacks_total:,}", YELLOW))
    lines.append([])

    clients = snapshot.clients
    unlisted = 0 if snapshot.clients_unlisted is None else snapshot.clients_unlisted.count
    more = f", {unlisted} more not listed" if unlisted else ""
    lines.append([(f"clients ({len(clients) + unlisted}{more})", BOLD)])
    if clients:
        client_lines = _client_lines(clients, width)
        if height is not None and len(lines) + len(client_lines) > height:
            # Keep the header row and as many clients as fit, then say how many are hidden.
            room = max(1, height - len(lines) - 1)
            hidden = len(client_lines) - room
            client_lines = [*client_lines[:room], [(f"  ... and {hidden} more", DIM)]]
        lines.extend(client_lines)
    else:
        lines.append([("  (none connected)", DIM)])
    return [fit(line, width) for line in lines]


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
    """The frame as text, one line per row, ANSI colours only when ``color``."""
    lines = render_lines(
        snapshot,
        width,
        height,
        endpoint=endpoint,
        error=error,
        unicode=unicode,
        bottleneck=bottleneck,
    )
    return "\n".join(to_text(line, color) for line in lines)
