"""docs/performance.md's figures table is the committed pipeline-bench runs' (bench/figures.py),
not numbers typed by hand; and the table's medians and ratios are what the rows say."""

from __future__ import annotations

import json
import re
from pathlib import Path

from batchwire.bench.figures import collect, table

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- figures: (\S+) -->\n(.*?)<!-- /figures -->", re.S)


def test_the_docs_quote_the_committed_runs() -> None:
    found = BLOCK.findall((REPO / "docs/performance.md").read_text())
    assert len(found) == 1, "docs/performance.md needs one figures block"
    pattern, quoted = found[0]
    runs = sorted(REPO.glob(pattern))
    assert len(runs) >= 2, pattern
    assert quoted == table(runs), "rerun: python -m batchwire.bench.figures " + pattern


def run(path: Path, rows: list[tuple[str, float, float | None]]) -> Path:
    path.write_text(
        json.dumps(
            {
                "config": {},
                "rows": [
                    {
                        "key": key,
                        "name": key.upper(),
                        "images_per_s": rate,
                        "cpu_ms_per_image": cpu,
                        "skipped": None if cpu is not None else "no",
                    }
                    for key, rate, cpu in rows
                ],
            }
        )
    )
    return path


def test_medians_skip_the_runs_a_row_missed_and_ratios_divide_cpu(tmp_path: Path) -> None:
    a = run(tmp_path / "a.json", [("dataloader", 100, 3.0), ("batchwire", 300, 1.0)])
    b = run(tmp_path / "b.json", [("dataloader", 200, 2.0), ("batchwire", 500, None)])
    c = run(tmp_path / "c.json", [("dataloader", 150, 4.0), ("batchwire", 400, 2.0)])
    order, figures = collect([a, b, c])
    assert order == ["dataloader", "batchwire"]
    assert figures["dataloader"].runs == 3 and figures["dataloader"].cpu_ms_per_image == 3.0
    assert figures["batchwire"].runs == 2 and figures["batchwire"].images_per_s == 350
    lines = table([a, b, c]).splitlines()
    assert lines[3] == "| BATCHWIRE | 2 | 350 | 1.50 | 2.00x | - | - |"
