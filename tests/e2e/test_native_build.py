"""The build side of batchwire.native: the CUDA sources compile with plain nvcc (no GPU needed),
the CUDA decision follows the switch and the toolkit (never a GPU probe), failures name their
cause, and the `python -m batchwire.native` commands report truthfully.
"""

from __future__ import annotations

import logging
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
    decision = build.current_cuda_decision()
    assert (decision.with_cuda, decision.reason) == (False, "BATCHWIRE_CUDA=0")
    monkeypatch.setenv("BATCHWIRE_CUDA", "yes")
    with pytest.raises(build.NativeBuildError, match="must be 0 or 1"):
        build.current_cuda_decision()
    monkeypatch.delenv("BATCHWIRE_CUDA")
    decision = build.current_cuda_decision()
    if torch.version.cuda is None:
        assert not decision.with_cuda and "CPU-only" in decision.reason
        monkeypatch.setenv("BATCHWIRE_CUDA", "1")
        with pytest.raises(build.NativeBuildError, match=r"CPU-only build.*BATCHWIRE_CUDA=0"):
            build.current_cuda_decision()
    else:
        assert not decision.with_cuda or build._nvcc_path() is not None, decision.reason


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


@pytest.mark.fresh_python  # what a fresh process imports: the fork server holds batchwire's CLIs
def test_native_imports_nothing_from_pipeline():
    code = (
        "import sys, batchwire.native, batchwire.native.build, batchwire.native.__main__\n"
        "bad = [m for m in sys.modules if m.startswith('batchwire.') and "
        "not m.startswith('batchwire.native')]\n"
        "assert not bad, bad\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_cache_root_follows_the_cache_variables(monkeypatch, tmp_path):
    for var in ("BATCHWIRE_NATIVE_CACHE", "BATCHWIRE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == (tmp_path / "home/.cache/batchwire/native").resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_root() == (tmp_path / "xdg/batchwire/native").resolve()
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "bw"))
    assert build.cache_root() == (tmp_path / "bw/native").resolve()
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path / "only-builds"))
    assert build.cache_root() == tmp_path / "only-builds"


TOOLCHAIN = build.Toolchain(
    torch_version="2.13.0+cu130",
    torch_build="abc:cxx11abi=True",
    torch_cuda="13.0",
    python_abi="cpython-311:cpython-311-x86_64-linux-gnu",
    compiler="/usr/bin/c++ (c++ (Debian 12.2.0-14) 12.2.0)",
    nvcc="/usr/local/cuda/bin/nvcc (Cuda compilation tools, release 13.0, V13.0.88)",
    flags=("-O3", "|", "cuda=True", "archs=8.0;9.0"),
)


@pytest.mark.parametrize(
    "change",
    [
        {"torch_version": "2.13.0+cu128"},
        {"torch_version": "2.12.1+cu130"},
        {"torch_build": "def:cxx11abi=True"},
        {"torch_cuda": "12.8"},
        {"python_abi": "cpython-312:cpython-312-x86_64-linux-gnu"},
        {"compiler": "/usr/bin/c++ (c++ (Debian 13.1.0-1) 13.1.0)"},
        {"compiler": "/opt/gcc/bin/c++ (c++ (Debian 12.2.0-14) 12.2.0)"},
        {"nvcc": "/usr/local/cuda/bin/nvcc (Cuda compilation tools, release 13.1, V13.1.2)"},
        {"flags": ("-O2", "|", "cuda=True", "archs=8.0;9.0")},
        {"flags": ("-O3", "|", "cuda=True", "archs=9.0")},
    ],
)
def test_the_key_covers_the_toolchain(change):
    from dataclasses import replace

    key = build.cache_key(TOOLCHAIN, "sources")
    assert build.cache_key(replace(TOOLCHAIN), "sources") == key
    assert build.cache_key(replace(TOOLCHAIN, **change), "sources") != key
    assert build.cache_key(TOOLCHAIN, "other sources") != key


def test_the_key_follows_the_compiler_and_its_version(monkeypatch, tmp_path):
    """A compiler is named by its path and the version it reports; a compiler upgraded in
    place (same path) gives a new key too, although its version is remembered on disk."""
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHWIRE_CUDA", "0")
    fake = tmp_path / "bin" / "fake-c++"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'fake-c++ (Batchwire) 1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    first = build.make_plan()
    assert "1.0" in first.toolchain.compiler and str(fake) in first.toolchain.compiler
    assert build.make_plan() == first
    fake.write_text("#!/bin/sh\necho 'fake-c++ (Batchwire) 2.0'\n")
    second = build.make_plan()
    assert "2.0" in second.toolchain.compiler and second.build_dir != first.build_dir
    monkeypatch.setenv("CXX", "c++")
    assert build.make_plan().build_dir not in (first.build_dir, second.build_dir)


def test_a_changed_source_changes_the_digest(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.cpp", tmp_path / "b.h"
    a.write_text("int a = 1;\n")
    b.write_text("#pragma once\n")
    digest = build.sources_digest([a, b])
    assert len(list((tmp_path / "cache" / "stamps").iterdir())) == 1  # remembered by stamp
    assert build.sources_digest([a, b]) == digest
    a.write_text("int a = 2;\n")  # same size
    assert build.sources_digest([a, b]) != digest


def test_cuda_decisions():
    decide = build.decide_cuda
    home = "/usr/local/cuda"
    assert decide("0", "2.13.0+cu130", "13.0", home, "13.0").with_cuda is False
    ok = decide("", "2.13.0+cu130", "13.0", home, "13.0")
    assert ok.with_cuda and ok.warning is None and "13.0" in ok.reason
    assert decide("", "2.13.0+cu128", "12.8", home, "12.4").with_cuda  # minors may differ
    assert decide("1", "2.13.0+cu130", "13.0", home, "13.0").with_cuda
    cpu_torch = decide("", "2.13.0+cpu", None, home, "13.0")
    assert not cpu_torch.with_cuda and "CPU-only build" in cpu_torch.reason
    no_toolkit = decide("", "2.13.0+cu130", "13.0", None, None)
    assert not no_toolkit.with_cuda and no_toolkit.warning is None
    with pytest.raises(build.NativeBuildError, match=r"install the CUDA toolkit 13\.0"):
        decide("1", "2.13.0+cu130", "13.0", None, None)
    with pytest.raises(build.NativeBuildError, match="must be 0 or 1"):
        decide("on", "2.13.0+cu130", "13.0", home, "13.0")


def test_mismatched_cuda_majors_build_cpu_only_or_fail_when_forced():
    mismatch = build.decide_cuda("", "2.13.0+cu130", "13.0", "/usr/local/cuda", "12.8")
    assert not mismatch.with_cuda
    assert mismatch.warning and "CUDA 12.8" in mismatch.warning and "CUDA 13.0" in mismatch.warning
    assert "BATCHWIRE_CUDA=0" in mismatch.warning
    with pytest.raises(build.NativeBuildError, match=r"major versions must match.*CUDA 13\.x"):
        build.decide_cuda("1", "2.13.0+cu130", "13.0", "/usr/local/cuda", "12.8")


def test_a_toolkit_folder_without_headers_is_named_with_its_fix(monkeypatch, tmp_path, caplog):
    """nvcc on PATH as a wrapper script (/usr/local/bin/nvcc) makes torch guess CUDA_HOME as
    /usr/local: nvcc runs there, but no CUDA header or libcudart is. The gate says so instead of
    a compile error (and builds CPU-only unless BATCHWIRE_CUDA=1)."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(build.torch.version, "cuda", "13.0")
    monkeypatch.setattr(build, "_cuda_home", lambda: str(tmp_path))
    monkeypatch.setattr(build, "nvcc_version", lambda: "13.0")
    monkeypatch.setattr(
        build, "_warn_once", lambda message: logging.getLogger("t").warning(message)
    )
    assert "include/cuda_runtime.h" in build.toolkit_headers_problem(str(tmp_path))
    monkeypatch.setenv("BATCHWIRE_CUDA", "1")
    with pytest.raises(
        build.NativeBuildError, match=r"BATCHWIRE_CUDA=1 but CUDA_HOME=.*set CUDA_HOME"
    ):
        build.current_cuda_decision()
    monkeypatch.delenv("BATCHWIRE_CUDA")
    with caplog.at_level(logging.WARNING):
        decision = build.current_cuda_decision()
    assert not decision.with_cuda and "cuda_runtime.h" in decision.reason
    assert "building the op without CUDA" in caplog.text
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    assert build.toolkit_headers_problem(str(tmp_path)) is None
    assert build.current_cuda_decision().with_cuda


def test_nvcc_version_is_parsed():
    text = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88"
    assert build.parse_nvcc_version(text) == "13.0"
    assert build.parse_nvcc_version("release 12.8, V12.8.93") == "12.8"
    assert build.parse_nvcc_version("garbage") is None
    nvcc = _nvcc()
    if nvcc:  # the real one, where a toolkit is installed
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        assert build.parse_nvcc_version(version)


def test_cuda_architectures_without_a_gpu():
    arch = build.cuda_arch_list
    assert arch("8.6", [], ["sm_80"]) == "8.6"  # the variable wins
    assert arch(" 8.6;9.0 ", [(9, 0), (9, 0)], []) == "8.6;9.0"
    assert arch(None, [(9, 0), (8, 0)], ["sm_80"]) == "8.0;9.0+PTX"  # the GPUs, named
    assert arch(None, [], ["sm_75", "sm_80", "sm_90", "sm_100a", "compute_90"]) == (
        "7.5;8.0;9.0;10.0a+PTX"
    )
    assert arch("", [], []) == build.DEFAULT_CUDA_ARCHS == "8.0;9.0+PTX"


def test_cuda_plan_without_a_gpu_has_explicit_architectures(monkeypatch, tmp_path):
    """Planned on this GPU-less machine: the arch list is explicit and part of the key."""
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    forced = build.CudaDecision(True, "forced by the test")
    plan = build.make_plan(cuda=forced)
    if torch.cuda.device_count() == 0:
        assert plan.arch_list  # from torch's list, or the default
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
        other = build.make_plan(cuda=forced)
        assert other.arch_list == "7.5" and other.build_dir != plan.build_dir
    assert [s.name for s in plan.sources] == [*build.CPU_SOURCES, *build.CUDA_SOURCES]


def test_build_errors_name_the_fix(monkeypatch, tmp_path):
    forced = build.make_plan(cuda=build.CudaDecision(True, "forced by the test"))
    assert "TORCH_CUDA_ARCH_LIST" in build._fix_for(IndexError("list index out of range"), forced)
    cpu = build.make_plan(cuda=build.CudaDecision(False, "test"))
    assert "batchwire.native info" in build._fix_for(RuntimeError("Error building"), cpu)


@pytest.mark.timeout(120)
def test_a_compile_error_is_a_native_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    source = build.CSRC / "jpeg_roi.cpp"
    spec = build.ExtensionSpec(
        "batchwire_bad_flags", (source.name,), (), ("--no-such-flag-batchwire",), (),
        python_module=True,
    )  # fmt: skip
    with pytest.raises(build.NativeBuildError, match=r"batchwire\.native info") as err:
        build.build_extension(spec)
    assert "no-such-flag" in str(err.value)
    with pytest.raises(build.NativeBuildError):  # remembered, not rebuilt
        build.build_extension(spec)


CUDA_FALLBACK_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from batchwire.native import build
plan = build.make_plan(cuda=build.CudaDecision(True, "forced by the test"))
try:
    build.build_with_fallback(plan, switch="1")
except build.NativeBuildError as exc:
    print("forced: NativeBuildError:", str(exc).splitlines()[0])
result = build.build_with_fallback(plan, switch="")
print("fallback:", result.plan.kind, "|", result.plan.cuda_reason)
"""


@pytest.mark.timeout(300)
def test_a_failed_cuda_build_falls_back_to_cpu(tmp_path):
    """The CUDA attempt fails (here: no nvcc where CUDA_HOME points) and the CPU op is built
    and loaded instead, with one warning; with BATCHWIRE_CUDA=1 the failure is an error."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    env.pop("BATCHWIRE_CUDA", None)
    run = subprocess.run(
        [sys.executable, "-c", CUDA_FALLBACK_SCRIPT], capture_output=True, text=True, env=env,
        timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "forced: NativeBuildError:" in run.stdout and "nvcc is missing" in run.stdout
    assert "fallback: CPU | CPU-only: the CUDA build failed" in run.stdout, run.stdout
    assert run.stderr.count("the CUDA build failed, building the op CPU-only") == 1, run.stderr


def test_augment_impl_is_decided_once_per_device_type(caplog):
    from batchwire import native

    cpu = native.augment_impl("cpu")
    assert cpu is native.augment_impl(torch.device("cpu"))
    assert cpu is not native.augment_batch_reference or not native.is_available()
    with caplog.at_level(logging.WARNING, logger="batchwire.native"):
        meta = native.augment_impl("meta")
        assert native.augment_impl(torch.device("meta")) is meta
    assert meta is native.augment_batch_reference
    assert [r.getMessage() for r in caplog.records].count(
        "batchwire.native: using the slow reference op on meta: the extension has no kernel "
        "for meta devices"
    ) == 1


def test_a_failed_cuda_build_is_not_retried_by_every_process(monkeypatch, tmp_path):
    """Its error is kept in the build folder: later loads go CPU-only at once (or fail, with
    BATCHWIRE_CUDA=1) and say how to retry."""
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    plan = build.make_plan(cuda=build.CudaDecision(True, "forced by the test"))
    plan.build_dir.mkdir(parents=True)
    (plan.build_dir / build.FAILED_MARKER).write_text("nvcc: error: something broke")
    with pytest.raises(build.NativeBuildError, match="failed to build earlier") as err:
        build.build_with_fallback(plan, switch="1")
    assert "something broke" in str(err.value) and f"delete {plan.build_dir}" in str(err.value)
