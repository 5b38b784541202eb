"""pipeline-bench end to end (the real console script, a real server subprocess, real files),
and bench_decode's prepared-copy row."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.bench.chart import PLOT_EXTRA, figure, write_plot
from batchwire.bench.cli import main
from batchwire.bench.data import resolve_data
from batchwire.bench.report import Report, Row, format_table
from batchwire.native.build import cache_root
from batchwire.pipeline.decode.dali import dali_available
from oddfiles import jpeg_bytes, smooth_image
from PIL import Image

BENCH = Path(sys.executable).with_name("pipeline-bench")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--images", "8", "--batch-size", "4", "--image-size", "32", "--warmup-batches", "1"]


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


def _flat_folder(folder: Path, count: int) -> Path:
    """`count` small real JPEGs in a flat folder (one class for pipeline-bench)."""
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"img{i}.jpg").write_bytes(jpeg_bytes(smooth_image(40 + i, 56, seed=i)))
    return folder


def _restart_marker_copy(src: Path, dst: Path) -> Path:
    """`src`'s JPEGs re-encoded with a restart marker after every MCU, the layout
    pipeline-prepare writes (the bench only needs the names and sizes to match)."""
    dst.mkdir()
    for f in src.iterdir():
        with Image.open(f) as img:
            img.save(dst / f.name, "JPEG", quality=92, restart_marker_blocks=1)
    return dst


@pytest.mark.timeout(90)
def test_prepared_rows_sit_beside_their_originals(tmp_path, monkeypatch):
    # A private cache for the flat folders' list files, the suite's native builds (no rebuild).
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(cache_root()))
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    data = _flat_folder(tmp_path / "data", 6)
    prepared = _restart_marker_copy(data, tmp_path / "prepared")
    out = tmp_path / "out.json"
    args = ["--data", str(data), "--prepared", str(prepared), "--workers", "0", *TINY]
    assert main([*args, "--rows", "decode,dataloader,batchwire", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["prepared"] == str(prepared)
    rows = {row["key"]: row for row in result["rows"]}
    assert list(rows) == [
        "decode_limit",
        "decode_limit-prepared",
        "dataloader",
        "batchwire",
        "batchwire-prepared",
    ]
    for key in ("decode_limit-prepared", "batchwire-prepared"):
        twin = rows[key]
        assert twin["skipped"] is None, twin["skipped"]
        assert twin["prepared"] is True and twin["name"].endswith(" (prepared)")
        assert twin["images_per_s"] > 0 and twin["cpu_ms_per_image"] is not None
        assert twin["vs_dataloader"] > 0 and "vs_dali" in twin
        assert str(prepared) in twin["note"]
    # Its limit is the one measured on the same (prepared) files.
    assert rows["decode_limit-prepared"]["vs_decode_limit"] == pytest.approx(1.0)
    assert rows["batchwire-prepared"]["vs_decode_limit"] == pytest.approx(
        rows["batchwire-prepared"]["images_per_s"] / rows["decode_limit-prepared"]["images_per_s"]
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda p: (p / "img5.jpg").unlink(), "5 images, --data has 6"),
        (lambda p: (p / "img5.jpg").rename(p / "other.jpg"), "it lacks 'img5.jpg'"),
        (lambda p: (p / "classA").mkdir(), "--data is a flat folder, --prepared an ImageFolder"),
    ],
    ids=["fewer", "renamed", "other-kind"],
)
def test_a_prepared_copy_of_other_images_is_refused(tmp_path, monkeypatch, change, says):
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    data = _flat_folder(tmp_path / "data", 6)
    prepared = tmp_path / "prepared"
    shutil.copytree(data, prepared)
    change(prepared)
    if (prepared / "classA").is_dir():  # an ImageFolder tree needs images in its class folder
        for f in prepared.glob("*.jpg"):
            f.rename(prepared / "classA" / f.name)
    with pytest.raises(SystemExit) as refused:
        main(["--data", str(data), "--prepared", str(prepared), "--rows", "decode", *TINY])
    message = str(refused.value)
    assert says in message and "is not a prepared copy of --data" in message, message
    assert f"pipeline-prepare {data} {prepared}" in message  # and how to make a right one


def _report_with_prepared_rows() -> Report:
    config = {
        "data": "/data/imagenet-sample",
        "prepared": "/cache/prepared",
        "dataset_images": 1000,
        "batch_size": 64,
        "image_size": 224,
        "device": "cpu",
        "cpu_cores": 2,
        "date": "2026-01-02",
    }
    return Report(
        config,
        [
            Row("decode_limit", "decode-only limit", images=800, seconds=1.0, cpu_seconds=2.0),
            Row("decode_limit-prepared", "decode-only limit (prepared)", 700, 1.0, 2.1),
            Row("dataloader", "torch DataLoader", images=400, seconds=1.0, cpu_seconds=2.0),
            Row("dali", "DALI pipeline", images=600, seconds=1.0, cpu_seconds=1.9),
            Row("batchwire", "batchwire", images=1000, seconds=1.0, cpu_seconds=1.6),
            Row("batchwire-prepared", "batchwire (prepared)", 1400, 1.0, 1.1),
        ],
    )


def test_prepared_rows_in_the_table_and_json():
    report = _report_with_prepared_rows()
    table = format_table(report)
    assert "prepared copy: /cache/prepared" in table and "vs DALI" in table
    rows = {r["key"]: r for r in report.as_dict()["rows"]}
    twin = rows["batchwire-prepared"]
    assert twin["vs_dataloader"] == pytest.approx(3.5)
    assert twin["vs_dali"] == pytest.approx(1400 / 600)
    assert twin["vs_decode_limit"] == pytest.approx(2.0)  # against the prepared files' limit
    assert rows["batchwire"]["vs_decode_limit"] == pytest.approx(1.25)
    assert twin["cpu_ms_per_image"] == pytest.approx(1000 * 1.1 / 1400)


def test_plot_has_both_panels_with_prepared_bars_beside_originals(tmp_path):
    pytest.importorskip("matplotlib", reason=f"--plot needs the bench extra: {PLOT_EXTRA}")
    report = _report_with_prepared_rows()
    fig = figure(report)
    rate_ax, cpu_ax = fig.axes[:2]
    # Four row kinds; decode limit and batchwire with a prepared bar each: six bars a panel.
    assert len(rate_ax.patches) == 6 and len(cpu_ax.patches) == 6
    assert [t.get_text() for t in rate_ax.get_yticklabels()][-1] == "batchwire"
    labels = " ".join(t.get_text() for t in rate_ax.texts)
    assert "1400 (3.50x)" in labels and "400 (1.00x)" in labels
    assert "0.79" in " ".join(t.get_text() for t in cpu_ax.texts)  # 1.1 CPU s / 1400 images
    assert "batch 64, 224 px, device cpu" in fig.get_suptitle()
    assert "2026-01-02" in fig.get_suptitle()
    path = tmp_path / "chart.png"
    assert write_plot(report, path) is None
    png = path.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and b"Matplotlib" in png  # its Software text chunk


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_names_the_extra_before_measuring(tmp_path):
    blocked = (
        "import sys; sys.modules['matplotlib'] = None; "  # import matplotlib now fails
        "from batchwire.bench.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    chart = tmp_path / "chart.png"
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "--rows", "decode", *TINY, "--plot", str(chart)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode != 0
    assert "--plot needs matplotlib" in proc.stderr and PLOT_EXTRA in proc.stderr, proc.stderr
    assert "running:" not in proc.stderr and not chart.exists()


# bench_decode --prepared: the decode stage alone, on the prepared copy beside the originals.


def test_bench_decode_adds_roi_on_the_prepared_copy(tmp_path):
    from batchwire.bench import bench_decode
    from batchwire.native import jpeg_roi

    data = _flat_folder(tmp_path / "data", 4)
    prepared = _restart_marker_copy(data, tmp_path / "prepared")
    out = tmp_path / "decode.json"
    args = ["--dir", str(data), "--prepared", str(prepared), "--repeats", "1", "--no-loader"]
    assert bench_decode.main([*args, "--size", "32", "--json", str(out)]) == 0
    d = json.loads(out.read_text())["decode"]
    if not jpeg_roi.jpeg_roi_available():
        pytest.skip("the ROI decoder does not build here: no ROI rows to compare")
    assert d["roi_prepared"]["images_per_cpu_s"] > 0
    assert d["roi_prepared_speedup_cpu"] > 0 and d["roi_prepared_speedup_wall"] > 0
    # The decoder says which files take its restart-marker path: all of them.
    assert d["restart_layouts"] == {"recognised": 4, "files": 4, "not_recognised": {}}


def test_bench_decode_refuses_a_prepared_copy_missing_files(tmp_path, capsys):
    from batchwire.bench import bench_decode

    data = _flat_folder(tmp_path / "data", 4)
    prepared = _restart_marker_copy(data, tmp_path / "prepared")
    (prepared / "img2.jpg").unlink()
    with pytest.raises(SystemExit):
        bench_decode.main(["--dir", str(data), "--prepared", str(prepared), "--no-loader"])
    err = capsys.readouterr().err
    assert f"--prepared {prepared} lacks 1 of the 4 files (e.g. img2.jpg)" in err, err

    # Another picture under the right name: the originals' crops would not fit it.
    (prepared / "img2.jpg").write_bytes(jpeg_bytes(smooth_image(30, 30)))
    with pytest.raises(SystemExit, match=r"img2.jpg is 30x30, its original 56x42"):
        bench_decode.main(["--dir", str(data), "--prepared", str(prepared), "--no-loader"])


def test_bench_prepare_compares_restart_intervals_with_the_originals(tmp_path):
    from batchwire.bench import bench_prepare

    for k in range(3):  # 160 px wide at 4:2:0: 10 MCUs a row, so "up to 4" picks 2
        (tmp_path / f"img{k}.jpg").write_bytes(jpeg_bytes(smooth_image(96, 160, seed=k)))
    (tmp_path / "notes.txt").write_text("not an image")
    out = tmp_path / "prepare.json"
    assert bench_prepare.main(["--dir", str(tmp_path), "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["images"] == 3
    rows = result["rows"]
    assert list(rows) == ["original", "up to 1", "up to 2", "up to 4 (auto)", "up to 8"]
    assert rows["up to 2"]["size_ratio"] == rows["up to 4 (auto)"]["size_ratio"]  # both pick 2
    assert rows["up to 1"]["size_ratio"] > rows["up to 2"]["size_ratio"]  # more markers
    assert all(r["cpu_ms_per_image"] > 0 for r in rows.values())
