"""The GPU check's CUDA test set must be able to pass on the lent machine: one H100, nvJPEG
working, no DALI (gpu_check.sh's step 4, "a skip is a failure, except DALI's absence").

A CUDA test there may skip only where the check should fail anyway (CUDA or nvJPEG did not come
up) or for DALI's absence. A test that skips on a healthy single-GPU machine (it needs a second
GPU, or has nothing to check because nvJPEG works) turns the whole step into FAIL before anything
is wrong. Read statically on this CPU machine: each test of `-m cuda` over gpu_check.sh's file
list, its skipif reasons and the `pytest.skip(...)` calls in its body.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Skips that mean the check should fail anyway (no CUDA, no nvJPEG) or DALI's absence.
ALLOWED = re.compile(
    r"needs a CUDA device|no CUDA device|needs CUDA \(pinned"
    r"|nvJPEG decode unavailable|DALI|nvidia\.dali"
)

PLUGIN = """
import inspect, json, os, re

def pytest_collection_finish(session):
    rows = []
    for item in session.items:
        reasons = [m.kwargs.get("reason", "") for m in item.iter_markers("skipif")]
        fn = getattr(item, "function", None)
        body = inspect.getsource(fn) if fn is not None else ""
        reasons += re.findall(r"pytest\\.skip\\(\\s*f?[\\"']([^\\"']*)", body)
        rows.append({"test": item.nodeid, "skips": reasons})
    with open(os.environ["GPU_REVIEW_OUT"], "w") as f:
        json.dump(rows, f)
"""


def cuda_step() -> tuple[str, list[str]]:
    """The marker expression and the files of gpu_check.sh's "CUDA tests" step (read from the
    script itself, so a fix there is what this checks)."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    step = script.split('run_step "CUDA tests"', 1)[1].split("run_step", 1)[0]
    marks = re.search(r"-- -m (\"[^\"]+\"|'[^']+'|\S+)", step)
    assert marks is not None, step
    return marks.group(1).strip("\"'"), re.findall(r"tests/\S+\.py", step)


@pytest.fixture(scope="module")
def cuda_set(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each test the step's `-m` selects in those files: its id and its skip reasons."""
    marks, files = cuda_step()
    tmp = tmp_path_factory.mktemp("cuda_set")
    (tmp / "gpu_review_plugin.py").write_text(PLUGIN)
    out = tmp / "items.json"
    env = {**os.environ, "GPU_REVIEW_OUT": str(out), "PYTHONPATH": f"{tmp}:{ROOT / 'tests'}"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "gpu_review_plugin",
         "-p", "no:cacheprovider", "-m", marks, *files],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_cuda_set_is_collected_from_the_scripts_files(cuda_set: list[dict]) -> None:
    marks, files = cuda_step()
    assert "cuda" in marks
    assert "tests/e2e/test_server_cuda.py" in files and len(files) >= 10, files
    assert len(cuda_set) > 20, cuda_set
    assert {r["test"].split("::")[0] for r in cuda_set} <= set(files)


def test_no_cuda_test_of_the_check_skips_on_a_healthy_single_gpu(cuda_set: list[dict]) -> None:
    bad = [(r["test"], s) for r in cuda_set for s in r["skips"] if not ALLOWED.search(s)]
    assert not bad, f"skips a healthy single-GPU machine takes (step 4 then FAILs): {bad}"
