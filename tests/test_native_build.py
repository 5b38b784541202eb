"""The build side of batchwire.native: the CUDA sources compile with plain nvcc (no GPU needed),
the CUDA decision follows the switch and the toolkit (never a GPU probe), failures name their
cause, and the `python -m batchwire.native` commands report truthfully.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import batchwire.native.build as build
import pytest
import torch

CSRC = build.CSRC


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def _cuda_include(nvcc: str) -> Path:
    """The toolkit's include folder (nvcc may be a wrapper script outside the toolkit)."""
    homes = [
        os.environ.get("CUDA_HOME", ""),
        "/usr/local/cuda",
        str(Path(nvcc).resolve().parents[1]),
    ]
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home) / "include"
    pytest.fail(f"nvcc at {nvcc} but no cuda_runtime.h in {homes}: set CUDA_HOME")


@pytest.mark.timeout(240)
def test_cuda_sources_compile(tmp_path):
    """The torch-free kernel with nvcc, and the torch binding's syntax with the host compiler
    against torch's and the toolkit's headers: the two halves of the CUDA build, GPU-less."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit): the CUDA kernel cannot be compile-checked")
    kernel = subprocess.Popen(
        [nvcc, "-c", "-std=c++17", "-O3", "-arch=sm_90", f"-I{CSRC}",
         str(CSRC / "augment_kernel.cu"), "-o", str(tmp_path / "kernel.o")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    torch_include = Path(torch.__file__).parent / "include"
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        # CPU wheels ship the c10/cuda headers without this generated one.
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_include = _cuda_include(nvcc)
    binding = subprocess.Popen(
        [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-w",
         f"-I{torch_include}", f"-I{torch_include / 'torch/csrc/api/include'}",
         f"-I{cuda_include}", f"-I{tmp_path / 'stub'}", f"-I{CSRC}",
         str(CSRC / "augment_cuda.cpp")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    kernel_log, _ = kernel.communicate(timeout=200)
    binding_log, _ = binding.communicate(timeout=200)
    assert kernel.returncode == 0, kernel_log
    assert (tmp_path / "kernel.o").stat().st_size > 0
    assert binding.returncode == 0, binding_log


def test_cuda_switch_decides_the_build(monkeypatch):
    monkeypatch.setenv("BATCHWIRE_CUDA", "0")
    assert build.cuda_decision() == (False, "BATCHWIRE_CUDA=0")
    monkeypatch.setenv("BATCHWIRE_CUDA", "yes")
    with pytest.raises(build.NativeBuildError, match="must be 0 or 1"):
        build.cuda_decision()
    monkeypatch.delenv("BATCHWIRE_CUDA")
    with_cuda, reason = build.cuda_decision()
    if torch.version.cuda is None:
        assert not with_cuda and "CPU-only" in reason
        monkeypatch.setenv("BATCHWIRE_CUDA", "1")
        with pytest.raises(build.NativeBuildError, match=r"CPU-only build.*BATCHWIRE_CUDA=0"):
            build.cuda_decision()
    else:
        assert with_cuda == (build._cuda_home() is not None), reason


def test_plan_is_keyed_by_sources_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("BATCHWIRE_CUDA", "0")
    plan = build.make_plan()
    assert plan.build_dir.parent == tmp_path and plan.kind == "CPU"
    assert [s.name for s in plan.sources] == list(build.CPU_SOURCES)
    assert build.make_plan() == plan
    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-DBATCHWIRE_TEST"))
    assert build.make_plan().build_dir != plan.build_dir


def test_missing_compiler_is_named_with_a_fix(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("BATCHWIRE_CUDA", "0")
    problems = build.missing_tools(build.make_plan())
    assert len(problems) == 1
    assert "no C++ compiler" in problems[0] and "apt-get install g++" in problems[0]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchwire.native", *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_build_and_info_commands():
    built = _cli("build")
    assert built.returncode == 0, built.stderr
    assert "batchwire_native.so" in built.stdout and " s" in built.stdout
    info = _cli("info")
    assert info.returncode == 0, info.stdout + info.stderr
    assert "built:      yes" in info.stdout
    expected = "yes" if build.make_plan().with_cuda else "no"
    assert f"CUDA build: {expected}" in info.stdout


FALLBACK_SCRIPT = """
import torch
from batchwire import native
from batchwire.native.reference import augment_batch_reference
images = [torch.randint(0, 256, (20, 30, 3), dtype=torch.uint8)]
args = (images, torch.tensor([[0.0, 0.0, 20.0, 30.0]]), torch.tensor([True]),
        torch.tensor([[1.1, 0.9, 1.2, 0.0]]), torch.zeros(3), torch.ones(3))
got = native.augment_batch(*args, torch.empty(1, 3, 8, 9))
want = augment_batch_reference(*args, torch.empty(1, 3, 8, 9))
assert torch.equal(got, want)
assert not native.is_available()
print("fallback ok")
"""


@pytest.mark.timeout(120)
def test_unbuildable_extension_falls_back_to_the_reference_with_a_warning(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/c++", "BATCHWIRE_NATIVE_CACHE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr
    assert "fallback ok" in run.stdout
    assert run.stderr.count("using the slow reference op") == 1, run.stderr
    assert "no C++ compiler" in run.stderr
