"""pipeline-bench end to end: the real console script, a real server subprocess, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.bench.cli import main, resolve_data
from batchwire.bench.report import Report, Row, format_table, write_plot
from batchwire.pipeline.decode.dali import dali_available
from oddfiles import jpeg_bytes, smooth_image

BENCH = Path(sys.executable).with_name("pipeline-bench")


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [str(BENCH)] if BENCH.exists() else [sys.executable, "-m", "batchwire.bench.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(120)
def test_smoke_on_the_embedded_dataset(tmp_path):
    out = tmp_path / "out.json"
    proc = run_bench(
        "--images",
        "64",
        "--image-size",
        "64",
        "--warmup-batches",
        "2",
        "--json",
        str(out),
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = {row["key"]: row for row in result["rows"]}
    expected = {"decode_limit", "dataloader", "batchwire"} | (
        {"dali"} if dali_available() else set()
    )
    assert expected <= set(rows), rows.keys()
    for key in expected:
        row = rows[key]
        assert row["skipped"] is None, (key, row["skipped"])
        assert row["images"] >= 64 and row["images_per_s"] > 0, row
        assert row["vs_dataloader"] > 0 and row["vs_decode_limit"] > 0, row
    assert rows["dataloader"]["vs_dataloader"] == pytest.approx(1.0)
    assert result["config"]["image_size"] == 64 and result["config"]["batch_size"] == 64
    table = proc.stdout
    assert "images/s" in table and "vs DataLoader" in table and "batchwire" in table


@pytest.mark.timeout(60)
def test_a_flat_folder_is_one_class(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    flat = tmp_path / "flat folder"
    flat.mkdir()
    for i in range(6):
        (flat / f"img{i}.jpg").write_bytes(jpeg_bytes(smooth_image(40 + i, 50, seed=i)))
    (flat / "notes.txt").write_text("not an image")
    data = resolve_data(str(flat))
    assert len(data.paths) == 6 and set(data.labels.tolist()) == {0}
    assert Path(data.server_train).is_file()  # a list file for pipeline-server --train

    out = tmp_path / "flat.json"
    args = ["--data", str(flat), "--rows", "decode,dataloader", "--images", "8", "--batch-size"]
    args += ["4", "--image-size", "32", "--workers", "0", "--warmup-batches", "1"]
    assert main([*args, "--json", str(out)]) == 0
    assert "torch DataLoader" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["key"] for r in rows] == ["decode_limit", "dataloader"]
    assert all(r["images_per_s"] > 0 for r in rows)


def test_table_keeps_skipped_rows_with_their_reason(tmp_path):
    config = {
        "data": "x",
        "dataset_images": 3,
        "batch_size": 2,
        "image_size": 8,
        "device": "cpu",
        "cpu_cores": 2,
    }
    report = Report(
        config,
        [
            Row("decode_limit", "limit", images=100, seconds=1.0),
            Row("dataloader", "loader", images=50, seconds=1.0),
            Row("dali", "DALI", skipped="NVIDIA DALI is not installed"),
        ],
    )
    table = format_table(report)
    assert "2.00x" in table and "0.50x" in table
    assert "DALI: skipped: NVIDIA DALI is not installed" in table
    d = report.as_dict()["rows"]
    assert d[2]["images_per_s"] is None and d[2]["vs_dataloader"] is None
    why_not = write_plot(report, tmp_path / "plot.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why_not is not None and "matplotlib" in why_not
    else:
        assert why_not is None and (tmp_path / "plot.png").stat().st_size > 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(SystemExit, match="unknown rows"):
        main(["--rows", "decode,gpu-magic"])
