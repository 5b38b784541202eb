"""The Kubernetes recipes in deploy/kubernetes, read in-process, and the properties a real cluster
needs of them, as checks that take a kustomization's output (a list of documents).

`render` is kustomize's build for what these kustomizations use (resources, bases, strategic-merge
patches of lists keyed by `name`, `images`, `namespace`), in Python, so that the unit tier needs no
child process; tests/e2e/test_deploy_render.py runs the same checks on `kubectl kustomize`'s output
and checks that both agree.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "docker"
KUSTOMIZATIONS = ("base", "overlays/gpu", "trainer")
POD_OWNERS = ("Deployment", "Job", "StatefulSet", "DaemonSet")
GPU = "nvidia.com/gpu"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(folder: str) -> Doc:
    return load(K8S / folder / "kustomization.yaml")[0]


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kustomize applies ours: maps merge key by key, lists of maps
    that all have a `name` merge item by item on it, any other list or value is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    named = isinstance(base, list) and isinstance(patch, list)
    named = named and all(isinstance(x, dict) and "name" in x for x in base + patch)
    if named:
        out_list = list(base)
        for item in patch:
            at = next((i for i, x in enumerate(out_list) if x["name"] == item["name"]), None)
            if at is None:
                out_list.append(item)
            else:
                out_list[at] = merge(out_list[at], item)
        return out_list
    return patch


def _set_images(doc: Doc, images: list[Doc]) -> None:
    for _, spec in pod_specs([doc]):
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            for rule in images:
                if rule["name"] == name:
                    name, tag = rule.get("newName", name), rule.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def render(folder: str) -> list[Doc]:
    """The kustomization's output, in-process (see the module's docstring for what it covers)."""
    k = kustomization(folder)
    docs: list[Doc] = []
    for entry in k.get("resources", []):
        target = (K8S / folder / entry).resolve()
        docs += render(str(target.relative_to(K8S))) if target.is_dir() else load(target)
    for patch in k.get("patches", []):
        for change in load(K8S / folder / patch["path"]):
            key = (change["kind"], change["metadata"]["name"])
            at = next(i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key)
            docs[at] = merge(docs[at], change)
    for doc in docs:
        _set_images(doc, k.get("images", []))
        if "namespace" in k and doc["kind"] != "Namespace":
            doc["metadata"] = {**doc["metadata"], "namespace": k["namespace"]}
    return docs


def by_kind(docs: list[Doc]) -> dict[str, Doc]:
    return {d["kind"]: d for d in docs}


def pod_specs(docs: list[Doc]) -> list[tuple[str, Doc]]:
    """(KIND/NAME, pod spec) of every pod template."""
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in POD_OWNERS
    ]


def _mounts(container: Doc, spec: Doc) -> dict[str, Doc]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def dockerfile_env(name: str) -> dict[str, str]:
    """The ENV settings of docker/Dockerfile.NAME (what the image's processes see)."""
    text = (DOCKER / f"Dockerfile.{name}").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.+)$", text, flags=re.MULTILINE):
        env.update(word.split("=", 1) for word in shlex.split(line) if "=" in word)
    return env


# --- the checks ------------------------------------------------------------------------------


def check_non_root_read_only(docs: list[Doc]) -> None:
    """Every container: a non-root uid, no privilege escalation, no capabilities, a read-only
    root filesystem, the runtime's seccomp profile (Pod Security "restricted", plus the root)."""
    for owner, spec in pod_specs(docs):
        pod = spec.get("securityContext", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            where = f"{owner} container {c['name']}"
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod.get("runAsUser")) not in (None, 0), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where


def check_writable_folders(docs: list[Doc]) -> None:
    """With a read-only root, where a process writes must be a volume: /tmp everywhere, and the
    server's BATCHWIRE_CACHE (its image's ENV) too; the prebuilt op (BATCHWIRE_NATIVE_CACHE) must
    not be hidden under one."""
    server_env = dockerfile_env("server")
    for owner, spec in pod_specs(docs):
        for c in spec["containers"]:
            mounts = _mounts(c, spec)
            assert "emptyDir" in mounts.get("/tmp", {}), f"{owner}: /tmp is no emptyDir"
            if "pipeline-server" not in c["name"]:
                continue
            env = {**server_env, **{e["name"]: e.get("value") for e in c.get("env", [])}}
            assert "emptyDir" in mounts.get(env["BATCHWIRE_CACHE"], {}), f"{owner}: cache"
            native = env["BATCHWIRE_NATIVE_CACHE"]
            hidden = [m for m in mounts if f"{native}/".startswith(f"{m.rstrip('/')}/")]
            assert not hidden, f"{owner}: {hidden} hides the prebuilt op in {native}"


def check_trainer_job(docs: list[Doc]) -> None:
    """The trainer Job: a lost pod is replaced (backoffLimit > 0) and resumes from checkpoints on a
    claim every node mounts; DDP's /dev/shm is a memory volume of a set size."""
    job = by_kind(docs)["Job"]
    assert job["spec"]["backoffLimit"] > 0
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    mounts = _mounts(container, spec)
    shm = mounts["/dev/shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    flags = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    claim = mounts[flags["--checkpoint-dir"]]["persistentVolumeClaim"]["claimName"]
    assert int(flags["--checkpoint-every"]) > 0  # a lost pod redoes at most that many steps
    pvcs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    modes = pvcs[claim]["spec"]["accessModes"]
    assert job["spec"]["parallelism"] == 1 or "ReadWriteMany" in modes, modes


def check_no_replicas_under_autoscaler(docs: list[Doc]) -> None:
    """A Deployment an HPA scales has no `replicas`: each `kubectl apply` would reset the count."""
    targets = [d["spec"]["scaleTargetRef"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    for ref in targets:
        target = next(
            d for d in docs if (d["kind"], d["metadata"]["name"]) == (ref["kind"], ref["name"])
        )
        assert "replicas" not in target["spec"], f"{ref['kind']}/{ref['name']} fights its HPA"


def cuda_images() -> dict[str, str]:
    """Image name -> the Dockerfile docker/README.md builds it from with a CUDA torch (a
    TORCH_INDEX other than the CPU wheels)."""
    text = (DOCKER / "README.md").read_text().replace("\\\n", " ")
    found = {}
    for line in text.splitlines():
        if not line.strip().startswith("docker build"):
            continue
        words = shlex.split(line)
        args = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
        if args.get("TORCH_INDEX", CPU_TORCH_INDEX) != CPU_TORCH_INDEX:
            found[words[words.index("-t") + 1]] = words[words.index("-f") + 1]
    return found


def check_gpu_pods_run_cuda_images(docs: list[Doc]) -> None:
    """A container that asks for a GPU runs an image built with a CUDA torch, from its own
    component's Dockerfile (the CPU build would train or decode on the CPU beside the GPU); the
    component (server, trainer) is in the container's name."""
    built = cuda_images()
    for owner, spec in pod_specs(docs):
        for c in spec["containers"]:
            if GPU not in c.get("resources", {}).get("limits", {}):
                continue
            name = c["image"].rsplit("/", 1)[-1].split(":")[0]
            assert name in built, f"{owner}: {c['image']} is no CUDA build of docker/README.md"
            component = name.removeprefix("batchwire-").removesuffix("-cuda")
            assert component in c["name"], f"{owner}: container {c['name']} runs {name}"
            assert built[name] == f"docker/Dockerfile.{component}", (name, built[name])


CHECKS = (
    check_non_root_read_only,
    check_writable_folders,
    check_no_replicas_under_autoscaler,
    check_gpu_pods_run_cuda_images,
)
