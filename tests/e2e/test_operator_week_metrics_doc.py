"""What docs/metrics.md and docs/sweeps.md tell an operator to scrape is what a real server serves.

One small server (a mixed train split, so the mix series exist) with one trainer connected: every
`batchwire_*` name the two pages list is on its `/metrics` page with the labels they name, and
`pipeline-monitor --once --json` has the shape docs/metrics.md gives scripts. A metric renamed or
dropped in the code, or a name typed wrong in the docs, fails here.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq
from promtext import parse_metrics
from rawclient import SERVER_ARGS, RawTrainer
from serverproc import running_server

DOCS = Path(__file__).resolve().parents[2] / "docs"
# `batchwire_name` or `batchwire_name{label,label}` / `{label=...}` as the pages write them.
DOC_METRIC = re.compile(r"`(batchwire_[a-z0-9_]+)(?:\{([a-z_, =.]+)\})?`")
TRAINER_LABELS = {"train_job", "split", "rank"}  # docs/metrics.md: a trainer's labels


def documented() -> dict[str, set[str]]:
    """Metric name -> the label names docs/metrics.md and docs/sweeps.md give it."""
    out: dict[str, set[str]] = {}
    for page in ("metrics.md", "sweeps.md"):
        for name, labels in DOC_METRIC.findall((DOCS / page).read_text()):
            names = {part.split("=")[0].strip() for part in labels.split(",") if part.strip()}
            out.setdefault(name, set()).update(names)
    return out


def series(page: dict[str, float]) -> dict[str, list[set[str]]]:
    """Metric name -> the label-name sets of its series on a scraped page."""
    out: dict[str, list[set[str]]] = {}
    for key in page:
        name, _, labels = key.partition("{")
        out.setdefault(name, []).append(set(re.findall(r"([a-z_]+)=\"", labels)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


@pytest.mark.timeout(90)
def test_every_documented_metric_is_served_with_its_labels(ctx: zmq.Context) -> None:
    from batchwire.pipeline.synthetic import default_dataset

    root = str(default_dataset().val_root)
    port = free_port()
    mix = f"mix:a=0.5@{root},b=0.5@{root}"
    with running_server(*SERVER_ARGS, "--train", mix, "--metrics-port", str(port)) as srv:
        trainer = RawTrainer(srv.endpoint, b"bw-op-week", ctx)
        trainer.start()
        trainer.credit(trainer.prefetch)
        trainer.consume(2)  # connected and credited: the per-trainer series exist
        raw = scrape(port)
        page = series(raw)
        monitor = subprocess.run(
            [sys.executable, "-m", "batchwire.monitor.cli", srv.endpoint, "--once", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        view = subprocess.run(
            [sys.executable, "-m", "batchwire.monitor.cli", srv.endpoint, "--once"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        trainer.leave()

    docs = documented()
    assert len(docs) >= 30, f"the pages' metric list was not found: {sorted(docs)}"
    for name, labels in sorted(docs.items()):
        # A histogram is served as its _bucket/_count/_sum series.
        found = page.get(name) or page.get(f"{name}_count")
        assert found, f"{name} (docs) is not on the server's /metrics page"
        assert any(labels <= have for have in found), f"{name}: labels {labels} not in {found}"
    for name, label_sets in page.items():
        if name.startswith("batchwire_client_"):
            for have in label_sets:
                assert TRAINER_LABELS <= have <= TRAINER_LABELS | {"state"}, (name, have)
    # The reasons a keyed server counts, each named on the page (0 here: no keys).
    reasons = set(re.findall(r'batchwire_handshake_failures_total\{reason="([a-z_]+)"\}', str(raw)))
    metrics_md = (DOCS / "metrics.md").read_text()
    assert reasons == {"no_keys", "wrong_server_key", "unauthorized_key", "other"}, reasons
    assert all(f"`{r}`" in metrics_md for r in reasons)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert name in page and f"`{name}`" in metrics_md, name
    assert any(name.startswith("python_gc_") for name in page)

    # docs/metrics.md: "--json prints one object per refresh: {fleet, time, dns_error,
    # servers: [{endpoint, stats, error}...], total}", and a single server's stats at the top.
    assert monitor.returncode == 0, monitor.stderr
    snap = json.loads(monitor.stdout.splitlines()[0])
    assert {"fleet", "time", "dns_error", "servers", "total"} <= snap.keys()
    assert [set(s) for s in snap["servers"]] == [{"endpoint", "stats", "error"}]
    assert snap["servers"][0]["error"] is None
    assert snap["clients"] == snap["servers"][0]["stats"]["clients"]
    # docs/sweeps.md: "Stats and Prometheus: `batches_produced_total` against `batches_total`..."
    sweeps = ("batches_produced_total", "batches_total", "batches_shared_total")
    sweeps += ("samples_produced_total", "samples_reused_total")
    for key in (*sweeps, "decode_fallbacks_total"):  # the last: docs/bad-input.md
        assert key in snap["counters"], key
        assert f"batchwire_{key}" in page, key
    assert snap["clients"][0]["sharing"] in {"off", "solo", "shared", "lagging"}
    assert view.returncode == 0, view.stderr
    assert "one client: nothing to share" in view.stdout, view.stdout
