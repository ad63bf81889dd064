"""The CPU cores servex may use (its CPU affinity, bounded by its cgroup's CPU quota), and its cgroup's memory limit.

A container given ``resources.limits.cpu: 2`` on a 64-core node sees 64 CPUs in ``os.cpu_count()`` and usually in
its affinity too; only the cgroup's quota (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
in v1) says that it gets two cores' worth of time. TensorFlow sizes its thread pools from the affinity alone, so
servex passes its own count: thread pools larger than the quota make threads wait on the quota's throttling.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_dirs(root: Path, proc_self_cgroup: Path, controller: str = "cpu") -> list[Path]:
    """The cgroup folders that hold this process's ``controller`` (cpu, memory), innermost first (v2, then v1
    layouts)."""
    mounts = ("cpu,cpuacct", "cpu", "cpuacct,cpu") if controller == "cpu" else (controller,)
    dirs = []
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            dirs.append(root / relative)
        elif controller in controllers.split(","):  # v1: the controller's own hierarchy
            dirs.extend(root / mount / relative for mount in mounts)
    # Inside a container the process's own cgroup is mounted at the hierarchy's root.
    return [*dirs, root, *(root / mount for mount in mounts)]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU time this process's cgroup may take, in cores (1.5: one and a half cores); None: no quota."""
    for folder in _cgroup_dirs(root, proc_self_cgroup):
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        except (OSError, ValueError):
            try:  # v1
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
            except OSError:
                continue
        if quota in ("max", "-1"):
            continue  # this level sets no quota; an outer one may
        try:
            cores = int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            continue
        if cores > 0:
            return cores
    return None


UNLIMITED_MEMORY = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit number


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The memory this process's cgroup may use, in bytes: the smallest limit of its cgroup and of those above it,
    which bind it too (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None: no limit."""
    folders = []
    for folder in _cgroup_dirs(root, proc_self_cgroup, "memory"):
        folders.extend([folder, *(p for p in folder.parents if root in p.parents)])
    limits = []
    for folder in dict.fromkeys(folders):
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and 0 < int(text) < UNLIMITED_MEMORY:
                limits.append(int(text))
            break
    return min(limits) if limits else None


def affinity_cores() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def usable_cores(affinity: int | None = None, quota: float | None = -1.0) -> int:
    """The cores servex may use: its affinity's CPUs, bounded by the cgroup quota rounded up (at least 1)."""
    affinity = affinity_cores() if affinity is None else affinity
    quota = cgroup_cpu_limit() if quota == -1.0 else quota
    if quota is not None:
        affinity = min(affinity, math.ceil(quota))
    return max(1, affinity)
