"""Fleet audit, deploy/ (docs/clusters.md, "Run on a cluster"): the Kubernetes manifests' own
command lines, run for real, where tests/unit/test_deploy.py parses them.

The server Deployment's args (base and the GPU overlay's, less ``--device=cuda``) start a real
pipeline-server, with only what a laptop must change: the dataset (the embedded one), loopback
in place of every interface, free ports, a keys folder made here, and batches small enough for
a shared machine. Every probe of the manifest then answers 200 on the port it names, the
autoscaler's metric is on that port, and the data port serves a keyed client. The trainer Job's
args parse as pipeline-train's own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import deploy_manifests as dm
import pytest
import requests
from batchwire.pipeline.synthetic import default_dataset
from serverproc import running_server

HOST = "127.0.0.2"
# Flags a laptop replaces (value), or drops (None); every other flag runs as written.
SMALL = {
    "--batch-size": "16", "--image-size": "32", "--producers": "1", "--max-buffers": "4",
    "--bind": None, "--device": None,
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def container(folder: str, kind: str) -> dict[str, Any]:
    doc = dm.by_kind(dm.render(folder))[kind]
    return doc["spec"]["template"]["spec"]["containers"][0]


def local_args(args: list[str], keys: Path, metrics_port: int) -> list[str]:
    """The manifest's ``--flag=value`` args with the laptop's replacements (`SMALL`, paths)."""
    root = default_dataset().val_root
    here = {
        "--train": str(root), "--val": str(root), "--keys": str(keys),
        "--metrics-host": HOST, "--metrics-port": str(metrics_port), **SMALL,
    }  # fmt: skip
    out: list[str] = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        assert eq, f"{arg!r}: the manifests write --flag=value"
        value = here.get(flag, value)
        if value is not None:
            out.append(f"{flag}={value}")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("folder", ["base", "overlays/gpu"])
def test_the_server_deployments_args_run_and_answer_every_probe(folder, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([str(Path(sys.executable).parent / "pipeline-keys"), str(keys)], check=True)
    spec = container(folder, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    metrics_port = free_port()
    args = local_args(spec["args"], keys, metrics_port)
    with running_server(*args, endpoint=f"tcp://{HOST}:{free_port()}") as srv:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = spec[kind]["httpGet"]
            assert ports[get["port"]] == int(spec_flag(spec, "--metrics-port")), kind
            reply = requests.get(f"http://{HOST}:{metrics_port}{get['path']}", timeout=5)
            assert reply.status_code == 200, (kind, reply.text)
            assert reply.json()["status"] == "ok", (kind, reply.text)
        metric = dm.by_kind(dm.render("base"))["HorizontalPodAutoscaler"]["spec"]["metrics"][0]
        text = requests.get(f"http://{HOST}:{metrics_port}/metrics", timeout=5).text
        assert f"\n{metric['pods']['metric']['name']} " in text
        assert srv.stats()["counters"]["batches_total"] == 0  # the data port, with the keys
        assert ports["data"] == int(spec_flag(spec, "--bind").rpartition(":")[2])


def spec_flag(spec: dict[str, Any], flag: str) -> str:
    """The value the manifest gives ``flag`` (``--flag=value``)."""
    return next(a.partition("=")[2] for a in spec["args"] if a.partition("=")[0] == flag)


def test_the_trainer_jobs_args_are_pipeline_trains_own() -> None:
    from batchwire.train.cli import parse_config

    args = container("trainer", "Job")["args"]
    cfg = parse_config(args[args.index("pipeline-train") + 1 :])
    assert cfg.servers == ["dns+tcp://batchwire.data.svc.cluster.local:5555"]
    assert (cfg.keys, cfg.checkpoint_dir, cfg.checkpoint_every) == ("/keys", "/checkpoints", 1000)
