"""pipeline-bench's JSON and table carry a batchwire row's decoder fallbacks (issue 25, defect 4):
a "GPU decode" figure measured on the CPU decoder shows as such."""

from __future__ import annotations

import json

from batchwire.bench.baselines import Measured
from batchwire.bench.report import Report, Row, format_table, write_json
from batchwire.bench.rows import RowPlan, best_row, run_row

CONFIG = {
    "data": "x",
    "dataset_images": 10,
    "batch_size": 2,
    "image_size": 8,
    "device": "cuda",
    "cpu_cores": 2,
}


def test_a_rows_fallbacks_reach_the_json_and_the_table(tmp_path) -> None:
    plan = RowPlan("batchwire", "batchwire (gpu)", lambda: Measured(100, 1.0, 0.5, fallbacks=7))
    run_row(plan)
    report = Report(CONFIG, [best_row(plan), Row("dataloader", "DataLoader", 50, 1.0)])
    write_json(report, tmp_path / "bench.json")
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["fallbacks"] for r in rows] == [7, None]
    assert "batchwire (gpu): 7 images decoded on the CPU (fallbacks)" in format_table(report)
