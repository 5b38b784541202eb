"""The cluster recipes through the real tools: each kustomization rendered by `kubectl kustomize`
(kustomize itself) passes the API schemas strictly and every property check of
tests/deploy_manifests.py, and agrees with the in-process rendering the unit tier checks
(tests/unit/test_deploy.py); the Slurm recipe and its check parse (`bash -n`).
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import deploy_manifests as dm
import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


def kubectl_render(folder: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(dm.K8S / folder)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


@needs_kubectl
@pytest.mark.parametrize("folder", dm.KUSTOMIZATIONS)
def test_kustomize_output_passes_the_schemas_and_the_checks(folder: str) -> None:
    docs = kubectl_render(folder)
    for doc in docs:
        for version in ("1.29.0", kv.latest_version()):
            kv.validate(doc, version, strict=True)
    for check in dm.CHECKS:
        check(docs)
    if folder == "trainer":
        dm.check_trainer_job(docs)


@needs_kubectl
@pytest.mark.parametrize("folder", dm.KUSTOMIZATIONS)
def test_the_in_process_rendering_agrees_with_kustomize(folder: str) -> None:
    """Same objects, same specs, namespaces and images: what the unit tier checks is what
    `kubectl apply -k` sends (kustomize adds only its labels besides)."""

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    ours = {key(d): d for d in dm.render(folder)}
    theirs = {key(d): d for d in kubectl_render(folder)}
    assert ours.keys() == theirs.keys()
    for k, doc in theirs.items():
        assert ours[k].get("spec") == doc.get("spec"), k
        assert ours[k]["metadata"].get("namespace") == doc["metadata"].get("namespace"), k


@pytest.mark.parametrize("script", ["deploy/slurm/batchwire.sbatch", "scripts/slurm_check.sh"])
def test_the_slurm_scripts_parse(script: str) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(dm.ROOT / script)], check=True, timeout=30)
