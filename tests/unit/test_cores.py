"""available_cores: affinity and cgroup CPU quotas, read from fake cgroup trees of real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from batchwire.common.cores import _available_cores, available_cores, cgroup_cpu_quota


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(text)
    return proc


def test_v2_quota_of_own_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/cpu.max", "150000 100000\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.5)


def test_v2_max_means_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "user.slice/cpu.max", "max 100000\n")
    proc = _proc(tmp_path, "0::/user.slice\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_v2_parent_quota_bounds_child(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "kubepods/cpu.max", "50000 100000\n")
    _write(root / "kubepods/pod1/cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/ctr/cpu.max", "400000 100000\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(0.5)


def test_v2_container_sees_own_cgroup_at_root(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the host's path, absent in the mount."""
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "200000 100000\n")
    proc = _proc(tmp_path, "0::/system.slice/docker-abc.scope\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(2.0)


def test_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct"
    _write(cpu / "cpu.cfs_quota_us", "-1\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    _write(cpu / "docker/abc/cpu.cfs_quota_us", "250000\n")
    _write(cpu / "docker/abc/cpu.cfs_period_us", "100000\n")
    (root / "memory").mkdir()
    proc = _proc(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(2.5)


def test_v1_unlimited(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu/cpu.cfs_period_us", "100000\n")
    proc = _proc(tmp_path, "1:cpu:/\n2:cpuacct:/\n0::/\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_hybrid_reads_v1_cpu_controller(tmp_path: Path) -> None:
    """On a hybrid host the v2 tree (`unified`) has no cpu controller; the v1 one has the quota."""
    root = tmp_path / "cgroup"
    _write(root / "cpu/cpu.cfs_quota_us", "100000\n")
    _write(root / "cpu/cpu.cfs_period_us", "100000\n")
    _write(root / "unified/cgroup.procs", "")
    proc = _proc(tmp_path, "1:cpu:/\n0::/\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.0)


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent_proc") is None
    proc = _proc(tmp_path, "garbage\n0::/x\n")
    assert cgroup_cpu_quota(tmp_path / "absent", proc) is None


def test_malformed_cpu_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "lots\n")
    assert cgroup_cpu_quota(root, _proc(tmp_path, "0::/\n")) is None


def test_quota_rounds_up_and_is_at_least_one(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    root = tmp_path / "cgroup"
    proc = _proc(tmp_path, "0::/\n")
    _write(root / "cpu.max", "10000 100000\n")  # 0.1 CPU
    assert _available_cores(root, proc) == 1
    _write(root / "cpu.max", "100001 100000\n")  # just over 1 CPU
    assert _available_cores(root, proc) == min(2, affinity)
    _write(root / "cpu.max", f"{100000 * (affinity + 8)} 100000\n")  # more than the CPU set
    assert _available_cores(root, proc) == affinity
    _write(root / "cpu.max", "max 100000\n")
    assert _available_cores(root, proc) == affinity


def test_available_cores_within_affinity() -> None:
    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))
