"""Prometheus metrics of a real pipeline-server, scraped over HTTP while a trainer consumes."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
import zmq
from promtext import parse_metrics
from rawclient import SERVER_ARGS, RawTrainer, wait_for
from serverproc import running_server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "batchwire.json"
# Metric names in PromQL: ours and the process collector's (label names and functions differ).
METRIC_NAME = re.compile(r"\b((?:batchwire|process)_[a-z0-9_]+)\b")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_metric_names() -> dict[str, set[str]]:
    """Panel title -> the metric names its PromQL queries (deploy/grafana/batchwire.json)."""
    board = json.loads(DASHBOARD.read_text())
    assert board["panels"] and board["uid"] == "batchwire", "a Grafana dashboard model"
    out: dict[str, set[str]] = {}
    for panel in board["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if panel["type"] == "row":
            continue
        assert exprs, f"panel {panel['title']!r} queries nothing"
        names = {n for e in exprs for n in METRIC_NAME.findall(e)}
        assert names, f"panel {panel['title']!r}: no batchwire_/process_ metric in {exprs}"
        out[panel["title"]] = names
    return out


def check_dashboard_queries(scraped: dict[str, float]) -> None:
    """Every metric a dashboard panel queries is on a real server's page (with a trainer)."""
    have = {key.split("{", 1)[0] for key in scraped}
    board = json.loads(DASHBOARD.read_text())
    for variable in board["templating"]["list"]:  # the server picker's query too
        assert set(METRIC_NAME.findall(json.dumps(variable))) <= have, variable["name"]
    for title, names in dashboard_metric_names().items():
        missing = names - have
        assert not missing, f"panel {title!r} queries metrics the server does not serve: {missing}"


def scrape(port: int) -> dict[str, float]:
    """GET /metrics -> {'name{labels}': value}, comment lines skipped."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(resp.read().decode())


@pytest.mark.timeout(120)
def test_metrics_move_while_a_trainer_consumes(ctx: zmq.Context) -> None:
    port = free_port()
    with running_server(*SERVER_ARGS, "--metrics-port", str(port)) as srv:
        trainer = RawTrainer(srv.endpoint, b"bw-m0", ctx)
        trainer.start()
        trainer.credit(trainer.prefetch)
        trainer.consume(2)
        first = scrape(port)
        trainer.consume(4)
        # The server counts a batch before handing it to ZeroMQ: after 6 received, all 6 count;
        # the batches asked for since the first scrape make the counters move past it.
        second = wait_for(
            lambda: (
                (m := scrape(port))["batchwire_batches_total"] > first["batchwire_batches_total"]
                and m
            ),
            "the counters to move",
        )
        trainer.leave()

        stage_names = [s["name"] for s in srv.stats()["stages"]]
        for metrics in (first, second):
            for name in stage_names:
                assert f'batchwire_queue_depth{{stage="{name}"}}' in metrics
                assert metrics[f'batchwire_queue_capacity{{stage="{name}"}}'] > 0
        for counter in (
            "batchwire_images_total",
            "batchwire_batches_total",
            "batchwire_bytes_total",
        ):
            assert second[counter] > first[counter] > 0, counter
        assert second["batchwire_batches_total"] >= 6
        assert second["batchwire_images_total"] == 4 * second["batchwire_batches_total"]
        for counter in (
            "batchwire_replaced_samples_total",
            "batchwire_bad_samples_total",
            "batchwire_errors_total",
            "batchwire_malformed_messages_total",
        ):
            assert counter in second
        assert second["batchwire_uptime_seconds"] > first["batchwire_uptime_seconds"]
        assert second["process_resident_memory_bytes"] > 0  # the process collector

        # A client is named by (job, split, rank), which outlive its connection's id.
        labels = 'rank="0",split="train",train_job=""'
        assert f"batchwire_client_ready{{{labels}}}" in second
        assert f"batchwire_client_credits{{{labels}}}" in second
        assert second[f"batchwire_client_sent_batches_total{{{labels}}}"] >= 6
        # The trainer's own figures travelled with its credits into the server's metrics.
        assert 0.0 <= second[f"batchwire_client_data_wait_ratio{{{labels}}}"] <= 1.0
        check_dashboard_queries(second)

        # After the trainer left, its series disappear at the next scrape.
        wait_for(lambda: not srv.stats()["clients"], "the trainer to be dropped")
        assert f"batchwire_client_ready{{{labels}}}" not in scrape(port)
        total = "batchwire_batches_produced_total"
        last = [scrape(port)]

        def settled() -> dict | None:  # two scrapes in a row agree: no batch finishing now
            now = scrape(port)
            done = now[total] == last[0][total] and now
            last[0] = now
            return done

        quiet = wait_for(settled, "production to settle")

        # Every batch produced went through the producing stages, each timed into the histogram
        # (produced, not sent: a batch re-sent from the share window after a re-hello is sent
        # twice and produced once). Read once production has settled: one scrape
        # collects the histogram and the counters one after the other, and batches finishing
        # in between count in the later one only.
        produced = quiet["batchwire_batches_produced_total"]
        for stage in ("read", "decode", "augment"):
            count = f'batchwire_stage_latency_seconds_count{{stage="{stage}"}}'
            assert quiet.get(count, 0) >= produced - 1 > 0, stage
