"""The cluster recipes in deploy/: Kubernetes manifests checked against the real API schemas
(the `kubernetes-validate` package carries them: offline, strict, no unknown field passes), the
kustomizations rendered (`kubectl kustomize` where kubectl is installed; otherwise each listed
file must exist), no placeholder left, and the settings that must agree across files do: the
drain fits the grace period, the trainers' DNS name is the headless Service's, the
NetworkPolicy admits the trainers' label, the HPA's metric is one the server exports, every
server flag exists. The Slurm recipe parses (`bash -n`) and its #SBATCH lines are sbatch options.
The real Slurm run is scripts/slurm_check.sh (bench/RESULTS.md says why it is not here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
SLURM = ROOT / "deploy" / "slurm"
KUSTOMIZATIONS = ("base", "overlays/gpu", "trainer")
# The oldest Kubernetes still in common use and the newest schema the package carries.
VERSIONS = ("1.29.0", None)
PLACEHOLDER = re.compile(r"CHANGEME|REPLACE_ME|TODO|FIXME|<[A-Z_]+>|\$\{[A-Z_]+\}")

kv = pytest.importorskip("kubernetes_validate")


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: str) -> dict[str, Any]:
    return _load(K8S / folder / "kustomization.yaml")[0]


def render(folder: str) -> list[dict[str, Any]]:
    """The kustomization's output: kubectl's own renderer where there is one; otherwise the
    listed files (resources and those of listed bases, without patches applied)."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run(
            [kubectl, "kustomize", str(K8S / folder)],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        return [d for d in yaml.safe_load_all(out) if d]
    docs: list[dict[str, Any]] = []
    for entry in _kustomization(folder).get("resources", []):
        target = (K8S / folder / entry).resolve()
        docs += render(str(target.relative_to(K8S))) if target.is_dir() else _load(target)
    return docs


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_every_listed_file_exists_and_nothing_is_left_unlisted(folder: str) -> None:
    k = _kustomization(folder)
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    listed = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", [])]
    for entry in listed:
        assert (K8S / folder / entry).exists(), f"{folder}/kustomization.yaml lists {entry}"
    here = {p.name for p in (K8S / folder).glob("*.yaml")} - {"kustomization.yaml"}
    assert here <= set(listed), f"{folder}: files no kustomization uses: {here - set(listed)}"


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_rendered_manifests_pass_the_api_schemas_strictly(folder: str) -> None:
    docs = render(folder)
    assert docs
    for doc in docs:
        for version in VERSIONS:
            kv.validate(doc, version or kv.latest_version(), strict=True)
        assert not PLACEHOLDER.search(yaml.safe_dump(doc)), f"placeholder in {doc['kind']}"


def test_the_validator_rejects_a_misspelt_field() -> None:
    """The check above has teeth: a field the API does not know fails."""
    deployment = _by_kind(render("base"))["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, VERSIONS[0], strict=True)


def test_raw_files_have_no_placeholders() -> None:
    for path in K8S.rglob("*.yaml"):
        text = "\n".join(ln.split("#", 1)[0] for ln in path.read_text().splitlines())
        assert not PLACEHOLDER.search(text), path


def _server_container(folder: str) -> dict[str, Any]:
    return _by_kind(render(folder))["Deployment"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("folder", ["base", "overlays/gpu"])
def test_server_flags_exist_and_the_drain_fits_the_grace_period(folder: str) -> None:
    from batchwire.server.cli import build_parser
    from batchwire.server.config import ServerConfig

    pod = _by_kind(render(folder))["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = vars(build_parser().parse_args(container["args"]))  # an unknown flag exits
    args.pop("config", None)
    settings = {k: v for k, v in args.items() if k not in ("train", "val")}
    drain = float(settings.get("drain_timeout", ServerConfig.drain_timeout))
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    # preStop, then the drain, then the stop's own deadline (server/app.py STOP_DEADLINE_S).
    from batchwire.server.app import STOP_DEADLINE_S

    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + STOP_DEADLINE_S + 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    metrics = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert args["metrics_port"] == metrics and args["metrics_host"] == "0.0.0.0"
    assert args["keys"] == "/keys"  # every interface: keys, never --insecure
    assert not args.get("insecure")


def test_gpu_overlay_asks_for_a_gpu() -> None:
    container = _server_container("overlays/gpu")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--device=cuda" in container["args"]
    assert "--device=cuda" not in _server_container("base")["args"]


def test_trainers_use_the_headless_services_dns_name_and_pass_the_network_policy() -> None:
    base = _by_kind(render("base"))
    service, policy = base["Service"], base["NetworkPolicy"]
    assert service["spec"]["clusterIP"] == "None"
    namespace = service["metadata"]["namespace"]
    data_port = next(p for p in service["spec"]["ports"] if p["name"] == "data")["port"]
    name = f"dns+tcp://{service['metadata']['name']}.{namespace}.svc.cluster.local:{data_port}"
    trainer = _by_kind(render("trainer"))["Job"]["spec"]["template"]
    assert f"--server={name}" in trainer["spec"]["containers"][0]["args"]
    admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert admitted.items() <= trainer["metadata"]["labels"].items()
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] == data_port
    selector = base["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector


def test_the_autoscalers_metric_is_one_the_server_exports() -> None:
    from batchwire.server.telemetry import Telemetry

    hpa = _by_kind(render("base"))["HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    text = Telemetry().prometheus_text().decode()
    assert f"\n{metric} 0.0" in text  # no trainers: nobody waits


def test_the_slurm_recipe_parses_and_its_sbatch_lines_are_options() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    scripts = sorted(SLURM.glob("*.sbatch"))
    assert scripts
    known = {
        "job-name", "output", "error", "time", "nodes", "ntasks", "ntasks-per-node",
        "cpus-per-task", "mem", "mem-per-cpu", "gres", "gpus", "gpus-per-node", "partition",
        "constraint", "signal", "account", "qos", "exclusive", "hetjob", "chdir",
    }  # fmt: skip
    for script in scripts:
        subprocess.run([bash, "-n", str(script)], check=True, timeout=30)
        lines = script.read_text().splitlines()
        assert lines[0].startswith("#!")
        directives = [ln for ln in lines if ln.startswith("#SBATCH")]
        assert directives
        body = lines.index(next(ln for ln in lines[1:] if ln and not ln.startswith("#")))
        for ln in directives:
            assert lines.index(ln) < body, f"{ln!r} after the first command is ignored by sbatch"
            option = ln.split()[1]
            if option == "hetjob":  # the next heterogeneous component starts here
                continue
            assert option.startswith("--"), ln
            assert option[2:].split("=", 1)[0] in known, ln
