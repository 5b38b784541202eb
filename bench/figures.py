"""The figures table of docs/performance.md, made from `pipeline-bench --json` runs.

    python -m batchwire.bench.figures bench/figures/*.json

Several runs of the same rows (rounds, interleaved with other work) become one table: each row's
median images/s and median CPU ms per image over the runs that measured it, and its CPU per
image against the default DataLoader's, DALI's and the bare full decode's (CPU time per image
moves much less with a shared machine's load than images/s does). docs/performance.md holds
the output between its `figures` markers, and tests/unit/test_docs_figures.py keeps the two
equal, so the figures the docs quote are the committed runs', not numbers typed by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

#: The rows each ratio column divides by (`pipeline-bench` row keys).
BASES = (("DataLoader", "dataloader"), ("DALI", "dali"), ("bare decode", "decode_limit"))


@dataclass(frozen=True)
class Figure:
    """One row's medians over the runs that measured it."""

    name: str
    runs: int
    images_per_s: float
    cpu_ms_per_image: float


def collect(paths: list[Path]) -> tuple[list[str], dict[str, Figure]]:
    """Each row key in first-seen order and its medians; rows a run skipped do not count."""
    order: list[str] = []
    names: dict[str, str] = {}
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            key = row["key"]
            if key not in names:
                order.append(key)
                names[key] = row["name"]
            if row.get("skipped") or row.get("cpu_ms_per_image") is None:
                continue
            rates.setdefault(key, []).append(float(row["images_per_s"]))
            cpus.setdefault(key, []).append(float(row["cpu_ms_per_image"]))
    figures = {
        key: Figure(
            names[key], len(cpus[key]), statistics.median(rates[key]), statistics.median(cpus[key])
        )
        for key in order
        if key in cpus
    }
    return [key for key in order if key in figures], figures


def table(paths: list[Path]) -> str:
    """The Markdown table for `paths` (see the module doc)."""
    order, figures = collect(paths)
    head = ["row", "runs", "images/s", "CPU ms per image"]
    head += [f"CPU vs {label}" for label, _ in BASES]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for key in order:
        f = figures[key]
        cells = [f.name, str(f.runs), f"{f.images_per_s:,.0f}", f"{f.cpu_ms_per_image:.2f}"]
        for _, base in BASES:
            b = figures.get(base)
            cells.append(f"{b.cpu_ms_per_image / f.cpu_ms_per_image:.2f}x" if b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="pipeline-bench --json files")
    args = parser.parse_args(argv)
    print(table(sorted(args.runs)), end="")


if __name__ == "__main__":
    main()
