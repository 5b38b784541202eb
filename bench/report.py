"""`pipeline-bench` output: the table for people, JSON for machines, a chart on request.

Ratios are against the DataLoader baseline (the recipe people use today), against DALI (the
fastest well-known alternative) and against the decode-only limit of the same files (what the
machine can decode at all: for a row on a prepared copy, the limit measured on that copy). A
row that could not run (DALI not installed, a failure) stays in every output with its reason
instead of a rate. A row on a `--prepared` copy has its original's key plus PREPARED_SUFFIX,
so the chart can put the two side by side.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASELINE_KEY = "dataloader"
DALI_KEY = "dali"
LIMIT_KEY = "decode_limit"
PREPARED_SUFFIX = "-prepared"


def prepared_key(key: str) -> str:
    """The key of `key`'s row run on a prepared copy of the data."""
    return key + PREPARED_SUFFIX


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
    #: A batchwire row's images decoded on the CPU by a GPU decoder's safety net (None: not a
    #: batchwire row): "GPU decoding" with many fallbacks measured the CPU decoder.
    fallbacks: int | None = None

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

    @property
    def prepared(self) -> bool:
        """Whether this row read a prepared copy (files with restart markers)."""
        return self.key.endswith(PREPARED_SUFFIX)

    @property
    def kind(self) -> str:
        """The row's key without the prepared suffix: an original and its twin share it."""
        return self.key.removesuffix(PREPARED_SUFFIX)


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

    def limit_ratio(self, row: Row) -> float | None:
        """`row`'s rate over the decode-only limit on the same files (original or prepared)."""
        return self.ratio(row, prepared_key(LIMIT_KEY) if row.prepared else LIMIT_KEY)

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            d = asdict(row)
            d["prepared"] = row.prepared
            d["images_per_s"] = row.images_per_s
            d["cpu_ms_per_image"] = row.cpu_ms_per_image
            d["vs_dataloader"] = self.ratio(row, BASELINE_KEY)
            d["vs_dali"] = self.ratio(row, DALI_KEY)
            d["vs_decode_limit"] = self.limit_ratio(row)
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
    if c.get("prepared"):
        head += f"\nprepared copy: {c['prepared']}"
    cols = ("row", "images", "seconds", "images/s", "vs DataLoader", "vs DALI")
    cols += ("vs decode limit", "CPU ms/img")
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
                _fmt(report.ratio(row, DALI_KEY), ".2f", "x"),
                _fmt(report.limit_ratio(row), ".2f", "x"),
                _fmt(row.cpu_ms_per_image, ".2f"),
            )
        )
        if row.skipped is not None:
            notes.append(f"  {row.name}: skipped: {row.skipped}")
        elif row.note:
            notes.append(f"  {row.name}: {row.note}")
        if row.fallbacks:
            notes.append(f"  {row.name}: {row.fallbacks} images decoded on the CPU (fallbacks)")
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
