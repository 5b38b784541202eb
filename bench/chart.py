"""`pipeline-bench --plot`: every row's images/s and CPU ms per image, in two panels.

One bar group per row kind (decode-only limit, DataLoader, DALI, batchwire ...), holding the
original files' bar and, where the run had `--prepared`, the prepared copy's bar beside it.
Both panels because they answer different questions: images/s is what a trainer gets on this
machine, CPU ms/img is the work per image, which says whether a row got faster by doing less
(it falls) or by using cores the other rows left idle (it does not), and which moves much less
with other people's load on a shared machine.

Drawn on a bare `matplotlib.figure.Figure` (no pyplot): no global backend or figure state in a
process that may draw again.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchwire.bench.report import BASELINE_KEY, Report, Row

#: The fix named when matplotlib is missing (`make bench` installs this extra).
PLOT_EXTRA = "pip install 'batchwire[bench]'"
ORIGINAL_COLOR = "#4c72b0"
PREPARED_COLOR = "#dd8452"
BAR_HEIGHT = 0.38

# (label, original row, prepared row) for one bar group; either row may be absent.
Group = tuple[str, Row | None, Row | None]


def plot_unavailable() -> str | None:
    """Why `--plot` cannot draw here (matplotlib missing, with the fix), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}"
    return None


def write_plot(report: Report, path: str | Path) -> str | None:
    """Draw `report` into the PNG `path`; returns None, or why no chart was written."""
    why = plot_unavailable()
    if why is not None:
        return why
    if not _groups(report):
        return "no row has a rate to plot"
    figure(report).savefig(path, dpi=120)
    return None


def figure(report: Report) -> Any:
    """The chart as a matplotlib Figure: images/s (with the ratio to the DataLoader) on the
    left, CPU ms per image on the right, one row kind per line, shared between the panels."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    groups = _groups(report)
    fig = Figure(figsize=(13, 1.6 + 0.8 * len(groups)), layout="constrained")
    rate_ax, cpu_ax = fig.subplots(1, 2, sharey=True)

    def rate_text(row: Row, value: float) -> str:
        ratio = report.ratio(row, BASELINE_KEY)
        return f" {value:.0f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    _panel(rate_ax, groups, lambda r: r.images_per_s, rate_text)
    _panel(cpu_ax, groups, lambda r: r.cpu_ms_per_image, lambda _r, v: f" {v:.2f}")
    rate_ax.set_title("images/s (x: vs torch DataLoader), higher is better", fontsize=10)
    cpu_ax.set_title("CPU ms per image (all processes), lower is better", fontsize=10)
    rate_ax.set_yticks(range(len(groups)), [label for label, _, _ in groups])
    rate_ax.invert_yaxis()  # once: the axis is shared, a second call would undo it
    if any(prepared is not None for _, _, prepared in groups):
        fig.legend(  # below the panels, where it can hide no bar
            handles=[
                Patch(color=ORIGINAL_COLOR, label="original files"),
                Patch(color=PREPARED_COLOR, label="prepared copy (pipeline-prepare)"),
            ],
            loc="outside lower center",
            ncols=2,
            fontsize=9,
        )
    fig.suptitle(_title(report.config))
    return fig


def _groups(report: Report) -> list[Group]:
    """One group per row kind that has a rate, in table order."""
    pairs: dict[str, list[Row | None]] = {}
    for row in report.rows:
        if row.images_per_s is not None:
            pairs.setdefault(row.kind, [None, None])[int(row.prepared)] = row
    groups = []
    for original, prepared in pairs.values():
        named = original if original is not None else prepared
        assert named is not None
        groups.append((textwrap.fill(named.name, 30), original, prepared))
    return groups


def _panel(
    ax: Any,
    groups: list[Group],
    value: Callable[[Row], float | None],
    text: Callable[[Row, float], str],
) -> None:
    """Horizontal bars of `value` per row, an original above its prepared twin, each labelled
    with `text`; a row without a value (no CPU time measured) gets no bar."""
    top = 0.0
    for i, (_, original, prepared) in enumerate(groups):
        bars = [
            (row, color, v)
            for row, color in ((original, ORIGINAL_COLOR), (prepared, PREPARED_COLOR))
            if row is not None and (v := value(row)) is not None
        ]
        for k, (row, color, v) in enumerate(bars):
            y = i + (k - (len(bars) - 1) / 2) * BAR_HEIGHT
            ax.barh(y, v, height=BAR_HEIGHT, color=color)
            ax.text(v, y, text(row, v), va="center", fontsize=8)
            top = max(top, v)
    ax.set_xlim(0, 1.35 * top if top > 0 else 1.0)


def _title(c: dict[str, Any]) -> str:
    data = Path(c["data"]).name
    return (
        f"pipeline-bench: {data} ({c['dataset_images']} images), batch {c['batch_size']}, "
        f"{c['image_size']} px, device {c['device']}, {c.get('cpu_cores', '?')} CPU cores, "
        f"{c.get('date', '')}"
    ).rstrip(", ")
