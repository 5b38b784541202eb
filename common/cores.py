"""`available_cores()`: how many CPUs this process may keep busy.

`os.cpu_count()` is the host's count. In a CPU-limited container or Kubernetes pod (`--cpus=2`,
`resources.limits.cpu: 2`) the process may run on every host core but gets only a quota of CPU
time per period from its cgroup; sizing thread pools by the host's count there starts dozens
of threads that the kernel throttles in turn, slower than a pool of the right size. So the
answer is the smallest of the CPU affinity (`taskset`, cpusets) and the cgroup quota, rounded
up (a quota of 1.5 CPUs keeps 2 threads busy half the time each), and at least 1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def available_cores() -> int:
    """The number of CPUs this process may use: affinity and cgroup CPU quota, at least 1."""
    return _available_cores(CGROUP_ROOT, PROC_SELF_CGROUP)


def _available_cores(cgroup_root: Path, proc_cgroup: Path) -> int:
    cores = _affinity_cores()
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _affinity_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(cgroup_root: Path, proc_cgroup: Path) -> float | None:
    """The CPU quota (in CPUs, e.g. 1.5) of the cgroup `proc_cgroup` names, None without one.

    `proc_cgroup` is a /proc/<pid>/cgroup file (`hierarchy:controllers:path` lines) and
    `cgroup_root` where the hierarchies are mounted. cgroup v1's `cpu` controller (a line whose
    controllers include `cpu`, mounted at `<root>/cpu,cpuacct` or `<root>/cpu`) is read where
    present, as on a hybrid host the quota lives there; else cgroup v2 (`0::path`, mounted at
    the root). A parent's quota also bounds its children, so the process's cgroup and each of
    its ancestors are read and the smallest quota wins; folders that do not exist are skipped,
    which also covers a container that sees its own cgroup as the mount's root while
    /proc/self/cgroup names the host's path.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    if v1_path is not None:
        mount = _v1_cpu_mount(cgroup_root)
        return None if mount is None else _smallest(mount, v1_path, _v1_quota)
    if v2_path is not None:
        return _smallest(cgroup_root, v2_path, _v2_quota)
    return None


def _v1_cpu_mount(cgroup_root: Path) -> Path | None:
    """The folder of the v1 `cpu` controller: `cpu,cpuacct`, `cpu` or any co-mount naming it."""
    try:
        entries = sorted(cgroup_root.iterdir())
    except OSError:
        return None
    for entry in entries:
        if "cpu" in entry.name.split(",") and entry.is_dir() and not entry.is_symlink():
            return entry
    return None


def _smallest(mount: Path, path: str, read_quota: Callable[[Path], float | None]) -> float | None:
    """The smallest quota on `mount/path` and its ancestors up to `mount`."""
    folder = mount / path.strip("/")
    found: float | None = None
    while True:
        quota = read_quota(folder)
        if quota is not None:
            found = quota if found is None else min(found, quota)
        if folder == mount:
            return found
        folder = folder.parent


def _v2_quota(folder: Path) -> float | None:
    """cgroup v2 `cpu.max`: "max 100000" (no limit) or "<quota> <period>" in microseconds."""
    text = _read(folder / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_quota(folder: Path) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: no limit) over `cpu.cfs_period_us`."""
    quota = _read(folder / "cpu.cfs_quota_us")
    period = _read(folder / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(file: Path) -> str | None:
    try:
        return file.read_text().strip()
    except OSError:
        return None
