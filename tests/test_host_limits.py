"""Host limits the server discovers: cgroup v1/v2 memory and CPU limits (fake cgroup trees), the defaults they
give the configuration, and the default memory budget from MemAvailable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from paraminit_server.config import ServerConfig


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_limits(tmp_path: Path) -> None:
    from paraminit_server import host_limits

    proc = _tree(tmp_path / "proc", {"cgroup": "0::/kubepods/pod1/ctr\n"}) / "cgroup"
    root = _tree(
        tmp_path / "cg",
        {
            "cgroup.controllers": "cpu memory\n",
            "memory.max": "max\n",
            "cpu.max": "max 100000\n",
            # the pod's limit is looser than the container's, which binds
            "kubepods/pod1/memory.max": f"{6 << 30}\n",
            "kubepods/pod1/cpu.max": "400000 100000\n",
            "kubepods/pod1/ctr/memory.max": f"{2 << 30}\n",
            "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
        },
    )
    assert host_limits.memory_limit(root, proc) == 2 << 30
    assert host_limits.cpu_limit(root, proc) == pytest.approx(1.5)
    assert host_limits.default_memory_budget(root, proc) == 1 << 30
    # Inside a container with its own cgroup namespace the path is "/" and the files sit at the root.
    own_ns = _tree(tmp_path / "proc2", {"cgroup": "0::/\n"}) / "cgroup"
    flat = _tree(tmp_path / "cg2", {"cgroup.controllers": "cpu memory\n", "memory.max": f"{3 << 30}\n", "cpu.max": "max 100000\n"})
    assert host_limits.memory_limit(flat, own_ns) == 3 << 30
    assert host_limits.cpu_limit(flat, own_ns) is None


def test_cgroup_v1_limits(tmp_path: Path) -> None:
    from paraminit_server import host_limits

    # Docker on cgroup v1: /proc/self/cgroup names the host path, the container's own cgroup is mounted at the top.
    proc = _tree(tmp_path / "proc", {"cgroup": "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n"}) / "cgroup"
    root = _tree(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": f"{512 << 20}\n",
            "cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert host_limits.memory_limit(root, proc) == 512 << 20
    assert host_limits.cpu_limit(root, proc) == pytest.approx(0.5)
    assert host_limits.default_threads(root, proc) == (1 if (os.cpu_count() or 1) > 1 else 0)
    unlimited = _tree(
        tmp_path / "cg1",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "cpu/cpu.cfs_quota_us": "-1\n",
            "cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    assert host_limits.memory_limit(unlimited, proc) is None and host_limits.cpu_limit(unlimited, proc) is None
    assert host_limits.default_memory_budget(unlimited, proc) == 0
    # No cgroup files at all (not Linux, or masked): no limits rather than an error.
    assert host_limits.memory_limit(tmp_path / "none", tmp_path / "none") is None


def test_config_defaults_come_from_the_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paraminit_server import host_limits

    proc = _tree(tmp_path / "proc", {"cgroup": "0::/\n"}) / "cgroup"
    root = _tree(tmp_path / "cg", {"cgroup.controllers": "cpu memory\n", "memory.max": f"{2 << 30}\n", "cpu.max": "100000 100000\n"})
    monkeypatch.setattr(host_limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_limits, "PROC_CGROUP", proc)
    config = ServerConfig.from_env({})
    assert config.memory_budget == 1 << 30
    assert config.threads == (1 if (os.cpu_count() or 1) > 1 else 0)
    # Explicit settings win over the container's.
    explicit = ServerConfig.from_env({"PARAMINIT_MEMORY_BUDGET": str(3 << 20), "PARAMINIT_THREADS": "0"})
    assert explicit.memory_budget == 3 << 20 and explicit.threads == 0


def test_default_budget_counts_reclaimable_cache_as_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half of MemAvailable, not of MemFree: page cache left by an install is memory the server can have."""
    from paraminit_server.host_limits import host_memory

    # the host's free pages change from one read to the next (the suite's other worker allocates): held still here
    real_sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1234567 if name == "SC_AVPHYS_PAGES" else real_sysconf(name))
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:          250000 kB\nMemAvailable:   20000000 kB\n")
    assert host_memory(str(info))[1] == 20000000 * 1024
    info.write_text("MemTotal:       24000000 kB\nMemFree:          250000 kB\n")  # no MemAvailable: free pages
    assert host_memory(str(info))[1] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
