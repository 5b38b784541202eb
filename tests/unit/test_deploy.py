"""The cluster recipes in deploy/, read in-process (no child process: kubectl's rendering and
`bash -n` are tests/e2e/test_deploy_render.py). Kubernetes: each kustomization rendered by
tests/deploy_manifests.py, checked against the real API schemas (the `kubernetes-validate` package
carries them: offline, strict, no unknown field passes), no placeholder left; what a real cluster
needs (non-root on a read-only root filesystem with the folders it writes as volumes, the
trainers' checkpoints on a claim and their pods replaced when lost, /dev/shm, no fixed replica
count under the autoscaler, CUDA images for GPU pods); and the settings that must agree across
files do: the drain fits the grace period, the trainers' DNS name is the headless Service's, the
NetworkPolicy admits the trainers' label, the HPA's metric is one the server exports, every server
flag exists. Slurm: the #SBATCH lines are sbatch options, GPUs are asked for, and the recipe
requeues itself at its time limit. The real Slurm run is scripts/slurm_check.sh (bench/RESULTS.md
says why it is not here).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import deploy_manifests as dm
import pytest
import yaml

SLURM = dm.ROOT / "deploy" / "slurm"
# The oldest Kubernetes still in common use and the newest schema the package carries.
VERSIONS = ("1.29.0", None)
PLACEHOLDER = re.compile(r"CHANGEME|REPLACE_ME|TODO|FIXME|<[A-Z_]+>|\$\{[A-Z_]+\}")

kv = pytest.importorskip("kubernetes_validate")


@pytest.mark.parametrize("folder", dm.KUSTOMIZATIONS)
def test_every_listed_file_exists_and_nothing_is_left_unlisted(folder: str) -> None:
    k = dm.kustomization(folder)
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    listed = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", [])]
    for entry in listed:
        assert (dm.K8S / folder / entry).exists(), f"{folder}/kustomization.yaml lists {entry}"
    here = {p.name for p in (dm.K8S / folder).glob("*.yaml")} - {"kustomization.yaml"}
    assert here <= set(listed), f"{folder}: files no kustomization uses: {here - set(listed)}"


@pytest.mark.parametrize("folder", dm.KUSTOMIZATIONS)
def test_rendered_manifests_pass_the_api_schemas_strictly(folder: str) -> None:
    docs = dm.render(folder)
    assert docs
    for doc in docs:
        for version in VERSIONS:
            kv.validate(doc, version or kv.latest_version(), strict=True)
        assert not PLACEHOLDER.search(yaml.safe_dump(doc)), f"placeholder in {doc['kind']}"


def test_the_validator_rejects_a_misspelt_field() -> None:
    """The check above has teeth: a field the API does not know fails."""
    deployment = dm.by_kind(dm.render("base"))["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, VERSIONS[0], strict=True)


def test_raw_files_have_no_placeholders() -> None:
    for path in dm.K8S.rglob("*.yaml"):
        text = "\n".join(ln.split("#", 1)[0] for ln in path.read_text().splitlines())
        assert not PLACEHOLDER.search(text), path


# --- what a real cluster needs ---------------------------------------------------------------


@pytest.mark.parametrize("check", dm.CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("folder", dm.KUSTOMIZATIONS)
def test_cluster_properties(folder: str, check: Callable[[list[dict[str, Any]]], None]) -> None:
    check(dm.render(folder))


def test_trainer_checkpoints_on_a_claim_and_lost_pods_replaced() -> None:
    dm.check_trainer_job(dm.render("trainer"))


def test_the_namespace_enforces_pod_security_restricted() -> None:
    labels = dm.by_kind(dm.render("base"))["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dm.pod_specs(docs)[0][1]


def _broken(folder: str, edit: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    docs = copy.deepcopy(dm.render(folder))
    edit(docs)
    return docs


@pytest.mark.parametrize(
    ("folder", "check", "edit"),
    [
        ("base", dm.check_non_root_read_only,
         lambda d: _pod(d)["containers"][0]["securityContext"].pop("readOnlyRootFilesystem")),
        ("trainer", dm.check_non_root_read_only,
         lambda d: _pod(d)["securityContext"].update(runAsUser=0)),
        ("base", dm.check_writable_folders,
         lambda d: _pod(d)["containers"][0]["volumeMounts"].pop()),
        ("base", dm.check_writable_folders,
         lambda d: _pod(d)["containers"][0]["volumeMounts"].append(
             {"name": "tmp", "mountPath": "/opt/batchwire"})),
        ("base", dm.check_no_replicas_under_autoscaler,
         lambda d: dm.by_kind(d)["Deployment"]["spec"].update(replicas=2)),
        ("trainer", dm.check_gpu_pods_run_cuda_images,
         lambda d: _pod(d)["containers"][0].update(image="batchwire-trainer:latest")),
        ("overlays/gpu", dm.check_gpu_pods_run_cuda_images,
         lambda d: _pod(d)["containers"][0].update(image="batchwire-trainer-cuda:latest")),
        ("trainer", dm.check_trainer_job,
         lambda d: dm.by_kind(d)["Job"]["spec"].update(backoffLimit=0)),
        ("trainer", dm.check_trainer_job,
         lambda d: _pod(d)["volumes"][1].update(persistentVolumeClaim=None, emptyDir={})),
        ("trainer", dm.check_trainer_job,
         lambda d: _pod(d)["containers"][0]["volumeMounts"].pop(2)),
    ],
)  # fmt: skip
def test_the_property_checks_have_teeth(folder: str, check: Callable, edit: Callable) -> None:
    """Each check fails on a recipe that lacks its property (the old recipes lacked them all)."""
    with pytest.raises((AssertionError, KeyError, TypeError)):
        check(_broken(folder, edit))


# --- settings that must agree ----------------------------------------------------------------


def _server_container(folder: str) -> dict[str, Any]:
    return _pod([dm.by_kind(dm.render(folder))["Deployment"]])["containers"][0]


@pytest.mark.parametrize("folder", ["base", "overlays/gpu"])
def test_server_flags_exist_and_the_drain_fits_the_grace_period(folder: str) -> None:
    from batchwire.server.app import STOP_DEADLINE_S
    from batchwire.server.cli import build_parser
    from batchwire.server.config import ServerConfig

    pod = dm.by_kind(dm.render(folder))["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = vars(build_parser().parse_args(container["args"]))  # an unknown flag exits
    args.pop("config", None)
    settings = {k: v for k, v in args.items() if k not in ("train", "val")}
    drain = float(settings.get("drain_timeout", ServerConfig.drain_timeout))
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    # preStop, then the drain, then the stop's own deadline (server/app.py STOP_DEADLINE_S).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + STOP_DEADLINE_S + 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    metrics = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert args["metrics_port"] == metrics and args["metrics_host"] == "0.0.0.0"
    assert args["keys"] == "/keys"  # every interface: keys, never --insecure
    assert not args.get("insecure")


def test_gpu_overlay_asks_for_a_gpu() -> None:
    container = _server_container("overlays/gpu")
    assert container["resources"]["limits"][dm.GPU] == "1"
    assert "--device=cuda" in container["args"]
    assert "--device=cuda" not in _server_container("base")["args"]


def test_trainers_use_the_headless_services_dns_name_and_pass_the_network_policy() -> None:
    base = dm.by_kind(dm.render("base"))
    service, policy = base["Service"], base["NetworkPolicy"]
    assert service["spec"]["clusterIP"] == "None"
    namespace = service["metadata"]["namespace"]
    data_port = next(p for p in service["spec"]["ports"] if p["name"] == "data")["port"]
    name = f"dns+tcp://{service['metadata']['name']}.{namespace}.svc.cluster.local:{data_port}"
    trainer = dm.by_kind(dm.render("trainer"))["Job"]["spec"]["template"]
    assert f"--server={name}" in trainer["spec"]["containers"][0]["args"]
    admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert admitted.items() <= trainer["metadata"]["labels"].items()
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] == data_port
    selector = base["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector


def test_the_autoscalers_metric_is_one_the_server_exports() -> None:
    from batchwire.server.telemetry import Telemetry

    hpa = dm.by_kind(dm.render("base"))["HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    text = Telemetry().prometheus_text().decode()
    assert f"\n{metric} 0.0" in text  # no trainers: nobody waits


# --- Slurm -----------------------------------------------------------------------------------

KNOWN_SBATCH = {
    "job-name", "output", "error", "time", "nodes", "ntasks", "ntasks-per-node", "cpus-per-task",
    "mem", "mem-per-cpu", "gres", "gpus", "gpus-per-node", "partition", "constraint", "signal",
    "account", "qos", "exclusive", "hetjob", "chdir", "requeue", "open-mode",
}  # fmt: skip


def _components(lines: list[str]) -> list[dict[str, str]]:
    """The #SBATCH options of each heterogeneous component, in order."""
    components: list[dict[str, str]] = [{}]
    for ln in lines:
        if not ln.startswith("#SBATCH"):
            continue
        option = ln.split()[1]
        if option == "hetjob":  # the next heterogeneous component starts here
            components.append({})
            continue
        name, _, value = option[2:].partition("=")
        components[-1][name] = value
    return components


def test_the_slurm_recipes_sbatch_lines_are_options() -> None:
    scripts = sorted(SLURM.glob("*.sbatch"))
    assert scripts
    for script in scripts:
        lines = script.read_text().splitlines()
        assert lines[0].startswith("#!")
        directives = [ln for ln in lines if ln.startswith("#SBATCH")]
        assert directives
        body = lines.index(next(ln for ln in lines[1:] if ln and not ln.startswith("#")))
        for ln in directives:
            assert lines.index(ln) < body, f"{ln!r} after the first command is ignored by sbatch"
            option = ln.split()[1]
            if option == "hetjob":
                continue
            assert option.startswith("--"), ln
            assert option[2:].split("=", 1)[0] in KNOWN_SBATCH, ln


def test_the_slurm_recipe_asks_for_gpus_and_requeues_itself_at_its_time_limit() -> None:
    """Trainers get GPUs without an edit; 120 s before the limit the batch shell (B:) gets USR1,
    which it traps to pass USR1 on to the trainer step (torchrun hands it to its ranks only when
    --signals-to-handle names it: they checkpoint their current step) and requeue the job; the
    trainers checkpoint to a folder the job's id names, on the shared filesystem, so the requeued
    run (same id) resumes there. The real run of all this is scripts/slurm_check.sh."""
    text = (SLURM / "batchwire.sbatch").read_text()
    servers, trainers = _components(text.splitlines())
    assert int(trainers.get("gpus-per-node") or trainers["gres"].rsplit(":", 1)[-1]) > 0
    assert "gpus-per-node" not in servers and "gres" not in servers
    signal, _, lead = servers["signal"].partition("@")
    assert signal == "B:USR1" and int(lead) >= 60
    assert "requeue" in servers and servers["open-mode"] == "append"  # both runs' output kept
    assert re.search(r"^trap \w+ USR1$", text, flags=re.MULTILINE)
    assert 'scancel --signal=USR1 "$SLURM_JOB_ID_HET_GROUP_1.1"' in text
    (handled,) = re.findall(r"--signals-to-handle=(\S+)", text)
    assert "SIGUSR1" in handled.split(",") and "SIGTERM" in handled.split(",")
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "--checkpoint-dir" in text and "$SLURM_JOB_ID}" in text
