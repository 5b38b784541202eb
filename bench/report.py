"""`pipeline-bench` output: the table for people, JSON for machines, a bar chart on request.

Ratios are against the DataLoader baseline (the recipe people use today) and against the
decode-only limit (what the machine can decode at all); a row that could not run (DALI not
installed, a failure) stays in every output with its reason instead of a rate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASELINE_KEY = "dataloader"
LIMIT_KEY = "decode_limit"


@dataclass
class Row:
    """One measured (or skipped) configuration."""

    key: str
    name: str
    images: int = 0
    seconds: float = 0.0
    cpu_seconds: float | None = None
    skipped: str | None = None
    note: str = ""

    @property
    def cpu_ms_per_image(self) -> float | None:
        """CPU time (all threads and child processes) per image: steadier than wall time on a
        shared machine, and what bounds the rate on idle cores (cores * 1000 / this)."""
        if self.skipped is not None or self.cpu_seconds is None or self.images <= 0:
            return None
        return 1000.0 * self.cpu_seconds / self.images

    @property
    def images_per_s(self) -> float | None:
        if self.skipped is not None or self.seconds <= 0:
            return None
        return self.images / self.seconds


@dataclass
class Report:
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)

    def rate(self, key: str) -> float | None:
        for row in self.rows:
            if row.key == key:
                return row.images_per_s
        return None

    def ratio(self, row: Row, key: str) -> float | None:
        base = self.rate(key)
        own = row.images_per_s
        return None if base in (None, 0) or own is None else own / base

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            d = asdict(row)
            d["images_per_s"] = row.images_per_s
            d["cpu_ms_per_image"] = row.cpu_ms_per_image
            d["vs_dataloader"] = self.ratio(row, BASELINE_KEY)
            d["vs_decode_limit"] = self.ratio(row, LIMIT_KEY)
            rows.append(d)
        return {"config": self.config, "rows": rows}


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(report: Report) -> str:
    """A plain-text table, one line per row, skipped rows with their reason."""
    c = report.config
    head = (
        f"pipeline-bench: {c['data']} ({c['dataset_images']} images), batch {c['batch_size']}, "
        f"{c['image_size']} px, device {c['device']}, {c['cpu_cores']} CPU cores"
    )
    cols = ("row", "images", "seconds", "images/s", "vs DataLoader", "vs decode limit")
    cols += ("CPU ms/img",)
    lines = [head, ""]
    table = [cols]
    notes = []
    for row in report.rows:
        table.append(
            (
                row.name,
                str(row.images) if row.skipped is None else "-",
                _fmt(row.seconds if row.skipped is None else None, ".2f"),
                _fmt(row.images_per_s, ".0f"),
                _fmt(report.ratio(row, BASELINE_KEY), ".2f", "x"),
                _fmt(report.ratio(row, LIMIT_KEY), ".2f", "x"),
                _fmt(row.cpu_ms_per_image, ".2f"),
            )
        )
        if row.skipped is not None:
            notes.append(f"  {row.name}: skipped: {row.skipped}")
        elif row.note:
            notes.append(f"  {row.name}: {row.note}")
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for k, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [
            v.rjust(w) for v, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.as_dict(), indent=2) + "\n")


def write_plot(report: Report, path: str | Path) -> str | None:
    """A horizontal bar chart of images/s; returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    rows = [r for r in report.rows if r.images_per_s is not None]
    if not rows:
        return "no row has a rate to plot"
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    names = [r.name for r in rows][::-1]
    rates = [r.images_per_s for r in rows][::-1]
    bars = ax.barh(names, rates, color="#4c72b0")
    for bar, row in zip(bars, rows[::-1], strict=True):
        ratio = report.ratio(row, BASELINE_KEY)
        label = f"{bar.get_width():.0f}" + (f"  ({ratio:.2f}x)" if ratio is not None else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center")
    c = report.config
    ax.set_xlabel("images/s")
    ax.set_title(
        f"{Path(c['data']).name}: batch {c['batch_size']}, {c['image_size']} px, {c['device']}"
    )
    ax.set_xlim(0, max(rates) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
