"""The CUDA build's architecture list and cache key (issue 25, defect 1), planned here for GPUs
this machine does not have: the detection is injected, the rest is the real planning code."""

from __future__ import annotations

import pytest
from batchwire.native import build


def test_capabilities_name_the_architectures_newest_with_ptx() -> None:
    assert build.capability_arch_list([(9, 0), (8, 0), (9, 0)]) == "8.0;9.0+PTX"
    assert build.capability_arch_list([(12, 0)]) == "12.0+PTX"
    assert build.capability_arch_list([]) is None
    # The detected list wins over torch's own, the variable over both.
    assert build.cuda_arch_list(None, [(8, 0)], ["sm_90"]) == "8.0+PTX"
    assert build.cuda_arch_list("9.0", [(8, 0)], ["sm_90"]) == "9.0"


@pytest.fixture
def forced(monkeypatch, tmp_path) -> build.CudaDecision:
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    return build.CudaDecision(True, "forced by the test")


def test_the_key_follows_the_detected_gpus(forced) -> None:
    """An A100 host and an H100 host sharing one cache get different folders; the same GPUs
    found in another order get the same one."""
    a100 = build.make_plan(cuda=forced, capabilities=lambda: [(8, 0)])
    h100 = build.make_plan(cuda=forced, capabilities=lambda: [(9, 0)])
    both = build.make_plan(cuda=forced, capabilities=lambda: [(9, 0), (8, 0)])
    again = build.make_plan(cuda=forced, capabilities=lambda: [(8, 0), (9, 0), (8, 0)])
    assert (a100.arch_list, h100.arch_list, both.arch_list) == ("8.0+PTX", "9.0+PTX", "8.0;9.0+PTX")
    assert len({a100.build_dir, h100.build_dir, both.build_dir}) == 3
    assert again.build_dir == both.build_dir
    assert f"archs={a100.arch_list}" in a100.toolchain.flags


def test_the_variable_decides_and_detection_is_not_asked(forced, monkeypatch) -> None:
    def never() -> list[tuple[int, int]]:
        raise AssertionError("TORCH_CUDA_ARCH_LIST is set: no detection")

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    plan = build.make_plan(cuda=forced, capabilities=never)
    assert plan.arch_list == "8.6"
    other = build.make_plan(cuda=forced, capabilities=lambda: [(8, 6)])  # still the variable
    assert other.build_dir == plan.build_dir


def test_without_gpus_the_key_names_the_default_or_torchs_list(forced) -> None:
    plan = build.make_plan(cuda=forced, capabilities=lambda: [])
    assert plan.arch_list and plan.arch_list.endswith("+PTX")
    assert f"archs={plan.arch_list}" in plan.toolchain.flags


def test_cpu_plans_ignore_the_gpus(forced) -> None:
    cpu = build.CudaDecision(False, "test")
    one = build.make_plan(cuda=cpu, capabilities=lambda: [(8, 0)])
    two = build.make_plan(cuda=cpu, capabilities=lambda: [(9, 0)])
    assert one.arch_list is None and one.build_dir == two.build_dir


def test_detection_here_finds_no_gpu() -> None:
    """This machine has no GPU: the real detection says so without raising (NVML absent)."""
    assert build.gpu_capabilities() == []
