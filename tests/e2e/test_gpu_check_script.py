"""scripts/gpu_check.sh run as a process, on this machine without a GPU: it stops at once
(exit 2) without a GPU or without a CUDA torch, steps it had no time for are "NOT RUN", never
passed, and its pytest step fails a test skipped for want of CUDA (real pytest runs).

These start our own script and interpreters, so they are end-to-end tests; the kit's lists are
checked in-process by tests/unit/test_gpu_kit.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

spec = importlib.util.spec_from_file_location("gpu_steps", SCRIPTS / "gpu_steps.py")
gpu_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_steps)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The two scripts in a folder of their own: whatever they do happens there, not here."""
    (tmp_path / "scripts").mkdir()
    for name in ("gpu_check.sh", "gpu_steps.py"):
        shutil.copy(SCRIPTS / name, tmp_path / "scripts" / name)
    return tmp_path


def run_check(checkout: Path, *args: str, path: str, timeout: float = 30):
    env = {
        **os.environ,
        "PATH": path,
        "PYTHON": sys.executable,
        "OUT": str(checkout / "out"),
        "GPU_CHECK_WORK": str(checkout / "work"),
        "GPU_KIT": str(checkout / "nokit"),
    }
    started = time.monotonic()
    run = subprocess.run(
        ["bash", str(checkout / "scripts" / "gpu_check.sh"), *args],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=checkout,
    )  # fmt: skip
    return run, time.monotonic() - started


def path_without_nvidia_smi(tmp: Path) -> str:
    """PATH with bash, coreutils and friends linked in, and no nvidia-smi."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "timeout", "tee", "date", "mkdir", "rm", "grep", "cat", "dirname"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_without_a_gpu_it_stops_at_once_and_names_cpu(checkout: Path) -> None:
    run, took = run_check(checkout, path=path_without_nvidia_smi(checkout), timeout=15)
    assert run.returncode == 2, run.stdout + run.stderr
    assert took < 10
    assert "no GPU here (no nvidia-smi)" in run.stderr and "--cpu" in run.stderr
    assert not (checkout / "out").exists() and not (checkout / ".venv-gpu").exists()


def test_nvidia_smi_without_cuda_torch_stops_too(checkout: Path) -> None:
    # A driver's nvidia-smi beside a CPU-only torch (this machine's): no GPU for the check.
    bin_dir = Path(path_without_nvidia_smi(checkout))
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    run, _ = run_check(checkout, path=str(bin_dir), timeout=30)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "torch.cuda.is_available() is false" in run.stderr and "--cpu" in run.stderr


def test_steps_with_no_time_left_are_not_run_never_passed(checkout: Path) -> None:
    run, _ = run_check(checkout, "--cpu", "--budget", "0", path=os.environ["PATH"], timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    result = json.loads((checkout / "out" / "gpu-check.json").read_text())
    statuses = {r["step"]: r["status"] for r in result["steps"]}
    assert statuses["environment"] == "NOT RUN" and statuses["CUDA tests"] == "NOT RUN"
    assert "PASS" not in statuses.values() and "REHEARSED" not in statuses.values()
    no_time = [r for r in result["steps"] if r["figures"].startswith("no time left")]
    assert len(no_time) >= 6
    table = (checkout / "out" / "gpu-check-table.txt").read_text()
    assert "NOT RUN" in table and "exit 3" in table
    assert sorted(p.name for p in (checkout / "out").iterdir()) == [
        "gpu-check-table.txt", "gpu-check.json", "gpu-check.log",
    ]  # fmt: skip


def test_only_runs_the_named_steps_and_refuses_a_name_it_does_not_know(checkout: Path) -> None:
    run, _ = run_check(
        checkout, "--cpu", "--budget", "0", "--only", " CUDA tests, kernel uint8,sanitizers",
        path=os.environ["PATH"], timeout=120,
    )  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr  # the named steps had no time
    rows = json.loads((checkout / "out" / "gpu-check.json").read_text())["steps"]
    why = {r["step"]: r["figures"] for r in rows}
    assert why["CUDA tests"].startswith("no time left")
    assert why["kernel alone"].startswith("no time left")
    assert why["CUDA build of the op"].startswith("no time left")  # always run: the tests need it
    assert why["environment"] == why["serve study"] == "not selected (--only)"
    assert why["server -> RemoteLoader"] == "not selected (--only)"
    typo, _ = run_check(checkout, "--cpu", "--only", "CUDA test", path=os.environ["PATH"])
    assert typo.returncode == 64 and "no step or row is named 'CUDA test'" in typo.stderr
    assert not (checkout / "out" / "gpu-check-table.txt").read_text().count("CUDA test'")


def test_on_a_gpu_a_skip_fails_the_step_but_dali_absence_is_not_run(tmp_path, monkeypatch):
    # Real pytest runs on two small test files: a module skipped for DALI's absence, and a test
    # skipped for want of CUDA (as a CUDA test on a machine where CUDA did not come up).
    (tmp_path / "test_dali_mod.py").write_text(
        "import pytest\n"
        "pytest.importorskip('no_such_dali', reason='NVIDIA DALI is not installed')\n"
        "def test_x():\n    pass\n"
    )
    (tmp_path / "test_cuda_mod.py").write_text(
        "import pytest\n@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_y():\n    pass\ndef test_z():\n    pass\n"
    )
    rows: dict[bool, list[list[str]]] = {}
    for cpu in (False, True):
        verdict = tmp_path / f"verdict-{cpu}.tsv"
        monkeypatch.setenv("GPU_CHECK_VERDICT", str(verdict))
        monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path))
        gpu_steps.step_pytest("CUDA tests", cpu, [str(tmp_path)])
        rows[cpu] = [line.split("\t") for line in verdict.read_text().splitlines()]
    gpu, cpu_rows = rows[False], rows[True]
    assert gpu[0][:2] == ["CUDA tests", "FAIL"] and "needs a CUDA device" in gpu[0][2]
    assert gpu[1][:2] == ["CUDA tests: DALI", "NOT RUN"] and "DALI not installed" in gpu[1][2]
    assert cpu_rows[0][:2] == ["CUDA tests", "REHEARSED"]
