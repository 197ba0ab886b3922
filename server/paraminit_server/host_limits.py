"""What the host or container grants the process: its CPU quota and memory limit (cgroup v2 or v1).

Defaults sized from the node oversubscribe a container: numba would start one kernel thread per node core under a
2-core quota, and half of the node's free memory can be several times the container's limit, so admission would let
requests run into the OOM killer instead of queueing them. The cgroup files are read directly, so these defaults need
neither the Downward API nor any privilege; paths are parameters so tests can point them at fake trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 reports "no limit" as the largest page-aligned signed 64-bit value, not as a keyword.
_V1_UNLIMITED = 1 << 62


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path ("" for the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _dirs(mount: Path, own: str | None) -> Iterator[Path]:
    """The process's cgroup directory and its ancestors up to the mount: a parent's limit binds too.

    Inside a container with a private cgroup namespace the own path is "/" and the mount is the container's cgroup;
    without one (cgroup v1 Docker) the own path names a directory that may not exist under the mount, and the
    container's cgroup is bind-mounted at the mount itself, which is always visited last.
    """
    if own:
        d = mount / own.lstrip("/")
        while d != mount and mount in d.parents:
            if d.is_dir():
                yield d
            d = d.parent
    yield mount


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def memory_limit(root: Path | None = None, proc_cgroup: Path | None = None) -> int | None:
    """The tightest memory limit on this process in bytes, or None when there is none."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    own = _own_paths(proc_cgroup)
    limits: list[int] = []
    if (root / "cgroup.controllers").exists():  # v2
        for d in _dirs(root, own.get("")):
            raw = _read(d / "memory.max")
            if raw and raw != "max":
                limits.append(int(raw))
    else:
        for d in _dirs(root / "memory", own.get("memory")):
            raw = _read(d / "memory.limit_in_bytes")
            if raw and int(raw) < _V1_UNLIMITED:
                limits.append(int(raw))
    return min(limits) if limits else None


def cpu_limit(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """The tightest CFS quota in cores (quota / period), or None when there is none."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    own = _own_paths(proc_cgroup)
    limits: list[float] = []
    if (root / "cgroup.controllers").exists():  # v2: "quota period" or "max period"
        for d in _dirs(root, own.get("")):
            raw = _read(d / "cpu.max")
            if raw:
                quota, _, period = raw.partition(" ")
                if quota != "max" and period and int(period) > 0:
                    limits.append(int(quota) / int(period))
    else:
        mount = root / "cpu,cpuacct" if (root / "cpu,cpuacct").is_dir() else root / "cpu"
        for d in _dirs(mount, own.get("cpu")):
            quota_us, period_us = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            if quota_us and period_us and int(quota_us) > 0 and int(period_us) > 0:
                limits.append(int(quota_us) / int(period_us))
    return min(limits) if limits else None


def default_threads(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """Kernel threads for the CPU backend: the CPU quota rounded up, within the CPUs this process may run on;
    0 (= every core) when neither a quota nor a cpuset restricts it."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    cores = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    quota = cpu_limit(root, proc_cgroup)
    threads = min(allowed, max(1, math.ceil(quota))) if quota is not None else allowed
    return threads if threads < cores else 0


def default_memory_budget(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """Host bytes requests may hold: half of the container's memory limit, leaving the rest to the interpreter, the
    JIT, gRPC buffers and encoding copies; 0 (= half of what is free at start) when the container has no limit."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    limit = memory_limit(root, proc_cgroup)
    return limit // 2 if limit is not None else 0


def host_memory(meminfo: str = "/proc/meminfo") -> tuple[int, int]:
    """(total, available) bytes of host memory.

    Available is the kernel's MemAvailable (free pages plus the page cache it can reclaim), not MemFree: after a
    large install or file copy most memory is cache, and a budget of "half the free pages" would shrink to a few
    hundred megabytes on an idle host. MemFree only where /proc/meminfo has no MemAvailable (not Linux)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total, page * os.sysconf("SC_AVPHYS_PAGES")
