"""How many CPUs this process may use (affinity, container CPU quota) and how many loader workers they allow."""

from __future__ import annotations

import math
import os

__all__ = ["MAX_AUTO_WORKERS", "auto_num_workers", "available_cpus", "cpus_reason"]

#: The most loader workers per device that ``num_workers="auto"`` chooses.
MAX_AUTO_WORKERS = 8


def _cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """CPUs a cgroup CPU quota allows this process (a container's ``--cpus``), rounded up; None without a quota.

    Reads cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` in this process's
    cgroup folder and each folder above it up to the mount; the tightest quota wins.
    """
    mounts: list[tuple[str, str, str]] = []  # (mount folder, cgroup path inside it, version)
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            mounts += [(root, path, "v2"), (os.path.join(root, "unified"), path, "v2")]
        elif "cpu" in controllers.split(","):
            mounts += [(os.path.join(root, name), path, "v1") for name in ("cpu", "cpu,cpuacct")]
    if not mounts:
        mounts = [(root, "", "v2"), (os.path.join(root, "cpu"), "", "v1")]
    limits = []
    for mount, path, version in mounts:
        names = [name for name in path.split("/") if name]
        for depth in range(len(names), -1, -1):  # this cgroup, then each parent up to the mount
            limit = _read_quota(os.path.join(mount, *names[:depth]), version)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _read_quota(folder: str, version: str) -> int | None:
    try:
        if version == "v2":
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            if quota == "max":
                return None
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may run on, not the machine's
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def available_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup CPU quota (containers) when there is one.

    Example:
        >>> available_cpus() >= 1
        True
    """
    cpus = _affinity_cpus()
    quota = _cgroup_cpu_limit()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def cpus_reason() -> str:
    """Where :func:`available_cpus`'s count comes from, for a message ("4 CPUs", or the quota and the affinity)."""
    affinity, quota = _affinity_cpus(), _cgroup_cpu_limit()
    if quota is not None and quota < affinity:
        return f"{quota} CPUs (cgroup quota; affinity allows {affinity})"
    return f"{affinity} CPUs"


def auto_num_workers(cpus: int, local_devices: int, cap: int = MAX_AUTO_WORKERS) -> int:
    """Loader workers per device: this process's CPUs shared by the local devices, one kept for the main process.

    Example:
        >>> auto_num_workers(cpus=2, local_devices=1)
        1
        >>> auto_num_workers(cpus=64, local_devices=4)
        8
        >>> auto_num_workers(cpus=4, local_devices=8)
        0
    """
    per_device = cpus // max(1, local_devices)
    return max(0, min(cap, per_device - 1))
