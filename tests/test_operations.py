"""Operating the server: metrics, JSON logs, graceful shutdown of a real `paraminit serve` process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import serve_subprocess, wait_until
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.backends.cpu import COMPILE_LINE
from paraminit_server.config import ServerConfig
from paraminit_server.server import start

BIN = Path(sys.executable).parent


def test_metrics_endpoint_counts_requests_and_bytes() -> None:
    running = start(ServerConfig(host="127.0.0.1", port=0, metrics_port=-1), warm_up_async=False)
    try:
        with Client(f"127.0.0.1:{running.port}") as c:
            c.materialize(plan_of([param("w", [1000], {"uniform": {"lo": -1, "hi": 1}}, "bfloat16")]))
            with pytest.raises(ParaminitError):
                c.materialize(plan_of([param("", [1], {"zeros": {}})]))
            lease = c.export(plan_of([param("x", [256], {"ones": {}})]))
            # A stream's latency is observed once the server's generator ends, which may be just after the client
            # has read the last chunk (whether the rejected plan counts as a stream is the service's business).
            histograms = [rf'paraminit_materialize_seconds_count\{{delivery="DELIVERY_{d}"\}} [1-9]' for d in ("STREAM", "SHM")]
            text = ""

            def scraped() -> bool:
                nonlocal text
                text = _scrape(running.metrics_port)
                return all(re.search(h, text) for h in histograms)

            assert wait_until(scraped), text
            lease.release()
        assert 'paraminit_requests_total{code="OK",method="Materialize"} 2.0' in text
        assert 'paraminit_requests_total{code="INVALID_ARGUMENT",method="Materialize"} 1.0' in text
        assert 'paraminit_materialized_bytes_total{backend="cpu",dtype="bfloat16",initializer="uniform"} 2000.0' in text
        assert "paraminit_leases_active 1.0" in text and "paraminit_leased_bytes 1024.0" in text
        # Default collectors on the private registry, the build, and no node memory posing as device memory.
        for series in ("process_resident_memory_bytes ", "process_cpu_seconds_total ", "process_open_fds ",
                       "python_gc_collections_total{", "python_info{"):
            assert re.search(rf"^{re.escape(series)}", text, re.M), series
        assert re.search(r'^paraminit_build_info\{.*backend="cpu".*version="\d[^"]*"', text, re.M)
        assert "paraminit_serving 1.0" in text
        assert "paraminit_device_memory_bytes" not in text
    finally:
        running.stop(grace=0)


def test_sigterm_drains_in_flight_stream_and_exits_zero() -> None:
    proc, target = serve_subprocess({"PARAMINIT_DRAIN_SECONDS": "30", "PARAMINIT_LOG_FORMAT": "json"},
                                    stderr=subprocess.PIPE)
    plan = plan_of([param("w", [48 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 3}})])  # 192 MiB
    result: dict[str, Any] = {}
    first_chunk = threading.Event()

    def consume() -> None:
        with Client(target) as c:
            header, chunks = c.stream(plan)
            n = 0
            for ch in chunks:
                n += len(ch.data)
                if not first_chunk.is_set():
                    first_chunk.set()
                    time.sleep(1.0)  # keep the stream in flight across the signal
            result["bytes"] = n
            result["total"] = header.data_bytes

    t = threading.Thread(target=consume)
    t.start()
    assert first_chunk.wait(60)
    proc.send_signal(signal.SIGTERM)
    with Client(target, timeout=5) as c:
        assert wait_until(lambda: c.health() == "NOT_SERVING", 5)
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan_of([param("x", [4], {"zeros": {}})]))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    t.join(120)
    assert result["bytes"] == result["total"] == 192 << 20
    assert proc.wait(60) == 0
    assert proc.stderr is not None
    lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    done = [entry for entry in lines if entry.get("method") == "Materialize" and entry.get("outcome") == "ok"]
    assert done and done[0]["bytes"] == 192 << 20 and len(done[0]["plan_digest"]) == 64


# -- metrics: device memory, serving, drain ------------------------------------------------------------------------


def _scrape(port: int) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())


def test_device_memory_only_for_device_backends() -> None:
    from prometheus_client import generate_latest

    from paraminit_server.metrics import Metrics

    class Device:
        def __init__(self, kind: str) -> None:
            self.kind = kind

    class Backend:
        def __init__(self, name: str, kind: str) -> None:
            self.name, self._kind = name, kind

        def device(self) -> Device:
            return Device(self._kind)

    free, total = [3 << 30], 16 << 30
    texts = {}
    for name, kind in (("cpu", "cpu"), ("cupy", "cuda")):
        m = Metrics()
        m.bind(inflight=lambda: 0, inflight_bytes=lambda: 0, leases=lambda: 0, leased_bytes=lambda: 0,
               memory_free=lambda: free[0], memory_total=lambda: total, backend=Backend(name, kind))
        texts[name] = generate_latest(m.registry).decode()
    def value(text: str, state: str) -> float:
        m = re.search(rf'^paraminit_device_memory_bytes\{{state="{state}"\}} (\S+)$', text, re.M)
        assert m, text
        return float(m.group(1))

    assert "paraminit_device_memory_bytes" not in texts["cpu"]
    assert value(texts["cupy"], "free") == 3 << 30 and value(texts["cupy"], "used") == 13 << 30
    free[0] = 5 << 30  # read at scrape time
    assert value(generate_latest(m.registry).decode(), "used") == 11 << 30
    assert re.search(r'^paraminit_build_info\{.*backend="cupy"', texts["cupy"], re.M)


def test_serving_gauge_follows_health_and_drain() -> None:
    running = start(ServerConfig(host="127.0.0.1", port=0, metrics_port=-1), warm_up_async=False)
    try:
        assert "paraminit_serving 1.0" in _scrape(running.metrics_port)
        running.set_serving(False)
        assert "paraminit_serving 0.0" in _scrape(running.metrics_port)
    finally:
        running.stop(grace=0)


def test_liveness_stays_serving_while_readiness_drains() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paraminit_server.server import LIVENESS_SERVICE, SERVICE_NAME

    running = start(ServerConfig(host="127.0.0.1", port=0), warm_up_async=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status(name: str) -> str:
                r = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

            assert status(SERVICE_NAME) == status(LIVENESS_SERVICE) == "SERVING"
            running.set_serving(False)  # what SIGTERM does first
            assert status(SERVICE_NAME) == "NOT_SERVING"
            assert status(LIVENESS_SERVICE) == "SERVING"
    finally:
        running.stop(grace=0)


# -- limits from fake cgroup trees ---------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_limits(tmp_path: Path) -> None:
    from paraminit_server import host_limits

    proc = _tree(tmp_path / "proc", {"cgroup": "0::/kubepods/pod1/ctr\n"}) / "cgroup"
    root = _tree(tmp_path / "cg", {
        "cgroup.controllers": "cpu memory\n",
        "memory.max": "max\n", "cpu.max": "max 100000\n",
        # the pod's limit is looser than the container's, which binds
        "kubepods/pod1/memory.max": f"{6 << 30}\n", "kubepods/pod1/cpu.max": "400000 100000\n",
        "kubepods/pod1/ctr/memory.max": f"{2 << 30}\n", "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
    })
    assert host_limits.memory_limit(root, proc) == 2 << 30
    assert host_limits.cpu_limit(root, proc) == pytest.approx(1.5)
    assert host_limits.default_memory_budget(root, proc) == 1 << 30
    # Inside a container with its own cgroup namespace the path is "/" and the files sit at the root.
    own_ns = _tree(tmp_path / "proc2", {"cgroup": "0::/\n"}) / "cgroup"
    flat = _tree(tmp_path / "cg2", {"cgroup.controllers": "cpu memory\n", "memory.max": f"{3 << 30}\n",
                                    "cpu.max": "max 100000\n"})
    assert host_limits.memory_limit(flat, own_ns) == 3 << 30
    assert host_limits.cpu_limit(flat, own_ns) is None


def test_cgroup_v1_limits(tmp_path: Path) -> None:
    from paraminit_server import host_limits

    # Docker on cgroup v1: /proc/self/cgroup names the host path, the container's own cgroup is mounted at the top.
    proc = _tree(tmp_path / "proc", {"cgroup": "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n"}) / "cgroup"
    root = _tree(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": f"{512 << 20}\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert host_limits.memory_limit(root, proc) == 512 << 20
    assert host_limits.cpu_limit(root, proc) == pytest.approx(0.5)
    assert host_limits.default_threads(root, proc) == (1 if (os.cpu_count() or 1) > 1 else 0)
    unlimited = _tree(tmp_path / "cg1", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
    })
    assert host_limits.memory_limit(unlimited, proc) is None and host_limits.cpu_limit(unlimited, proc) is None
    assert host_limits.default_memory_budget(unlimited, proc) == 0
    # No cgroup files at all (not Linux, or masked): no limits rather than an error.
    assert host_limits.memory_limit(tmp_path / "none", tmp_path / "none") is None


def test_config_defaults_come_from_the_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paraminit_server import host_limits

    proc = _tree(tmp_path / "proc", {"cgroup": "0::/\n"}) / "cgroup"
    root = _tree(tmp_path / "cg", {"cgroup.controllers": "cpu memory\n", "memory.max": f"{2 << 30}\n",
                                   "cpu.max": "100000 100000\n"})
    monkeypatch.setattr(host_limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_limits, "PROC_CGROUP", proc)
    config = ServerConfig.from_env({})
    assert config.memory_budget == 1 << 30
    assert config.threads == (1 if (os.cpu_count() or 1) > 1 else 0)
    # Explicit settings win over the container's.
    explicit = ServerConfig.from_env({"PARAMINIT_MEMORY_BUDGET": str(3 << 20), "PARAMINIT_THREADS": "0"})
    assert explicit.memory_budget == 3 << 20 and explicit.threads == 0


# -- JIT cache ------------------------------------------------------------------------------------------------------


def test_unwritable_cache_falls_back_and_seed_is_copied(tmp_path: Path) -> None:
    from paraminit_server import jit_cache

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # unwritable even for root: a path below a regular file
    seed = _tree(tmp_path / "seed", {"numba/backends_abc/cpu_kernels.fill-1.py311.nbi": "index",
                                     "numba/backends_abc/cpu_kernels.fill-1.py311.1.nbc": "code"})
    env = {"NUMBA_CACHE_DIR": str(blocker / "numba"), "PARAMINIT_JIT_CACHE_SEED": str(seed)}
    result = jit_cache.prepare_jit_cache(env)
    assert "not writable" in result.warning and env["NUMBA_CACHE_DIR"] == result.path != str(blocker / "numba")
    cache = Path(result.path)
    assert result.seeded == 2
    assert (cache / "backends_abc" / "cpu_kernels.fill-1.py311.1.nbc").read_text() == "code"
    # A writable cache keeps what it has (entries compiled here are newer than the seed's).
    (cache / "backends_abc" / "cpu_kernels.fill-1.py311.nbi").write_text("newer index")
    again = jit_cache.prepare_jit_cache({"NUMBA_CACHE_DIR": str(cache), "PARAMINIT_JIT_CACHE_SEED": str(seed)})
    assert again.warning == "" and again.seeded == 0
    assert (cache / "backends_abc" / "cpu_kernels.fill-1.py311.nbi").read_text() == "newer index"


def test_cpu_model_pin_translates_only_when_asked() -> None:
    from paraminit_server import jit_cache

    env = {"PARAMINIT_NUMBA_CPU_NAME": ""}
    jit_cache.prepare_jit_cache(env)
    assert "NUMBA_CPU_NAME" not in env and "NUMBA_CPU_FEATURES" not in env
    env = {"PARAMINIT_NUMBA_CPU_NAME": "x86-64-v3"}
    jit_cache.prepare_jit_cache(env)
    assert env["NUMBA_CPU_NAME"] == "x86-64-v3" and env["NUMBA_CPU_FEATURES"] == ""
    env = {"PARAMINIT_NUMBA_CPU_NAME": "x86-64-v3", "NUMBA_CPU_NAME": "znver4"}  # numba's own setting wins
    jit_cache.prepare_jit_cache(env)
    assert env["NUMBA_CPU_NAME"] == "znver4" and "NUMBA_CPU_FEATURES" not in env


@pytest.fixture(scope="module")
def read_only_install(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a server installed read-only, as in the image: numba may cache only under
    NUMBA_CACHE_DIR or the home directory (not next to the sources), and both are unwritable."""
    base = tmp_path_factory.mktemp("ro")
    blocker = base / "file"
    blocker.write_text("")
    return {"NUMBA_CACHE_LOCATOR_CLASSES": "UserProvidedCacheLocator,UserWideCacheLocator",
            "NUMBA_CACHE_DIR": str(blocker / "numba"), "HOME": str(blocker), "XDG_CACHE_HOME": str(blocker),
            "TMPDIR": str(base), "PARAMINIT_LOG_FORMAT": "text"}


def test_unwritable_numba_cache_only_slows_start(read_only_install: dict[str, str]) -> None:
    proc, target = serve_subprocess(read_only_install, stderr=subprocess.PIPE)
    try:
        with Client(target) as c:
            assert c.health() == "SERVING"
            out = c.materialize(plan_of([param("w", [64], {"uniform": {"lo": -1, "hi": 1, "seed": 5}})]))
            assert any(float(v) != 0.0 for v in out["w"].reshape(-1))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "is not writable" in err and "caching into" in err, err
    assert err.count(COMPILE_LINE) == 1, err  # a cold cache is not silent, and says so once


def test_cold_cli_says_it_compiles_and_reports_compiling_apart(tmp_path: Path) -> None:
    """A first materialize with an empty kernel cache prints the compile line once and reports the compile
    seconds apart from the time its throughput is computed over; the next process loads them and says nothing."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"params": [{"name": "w", "shape": [64, 64],
                                            "init": {"normal": {"std": 0.02, "seed": 3}}}]}))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    summaries = []
    for _ in range(2):
        r = subprocess.run([str(BIN / "paraminit"), "materialize", str(plan), "-o", str(tmp_path / "w.safetensors")],
                           env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr
        summaries.append((r.stdout, r.stderr))
    (cold, cold_err), (warm, warm_err) = summaries
    assert cold_err.count(COMPILE_LINE) == 1, cold_err
    m = re.search(r"in [\d.]+ s plus ([\d.]+) s compiling CPU kernels \([\d.]+ \w+/s;", cold)
    assert m and float(m.group(1)) > 0, cold
    assert COMPILE_LINE not in warm_err and "compiling" not in warm, (warm, warm_err)
    assert re.search(r"in [\d.]+ s \([\d.]+ \w+/s;", warm), warm


def test_failed_warm_up_exits_non_zero_with_one_line(read_only_install: dict[str, str]) -> None:
    """A threading layer that cannot load fails the first parallel kernel: the server must exit (and be
    restarted or reported) instead of staying up NOT_SERVING; stderr says why in one line, no traceback."""
    env = {**os.environ, **read_only_install, "PARAMINIT_PORT": "0", "PARAMINIT_BACKEND": "cpu",
           "NUMBA_THREADING_LAYER": "tbb"}
    try:
        import numba.np.ufunc.tbbpool  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("TBB is installed here, so the tbb threading layer would load")
    proc = subprocess.run([str(BIN / "paraminit-server")], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "warm-up failed" in line]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "threading layer" in errors[0].lower(), errors[0]


def test_default_budget_counts_reclaimable_cache_as_available(tmp_path: Path) -> None:
    """Half of MemAvailable, not of MemFree: page cache left by an install is memory the server can have."""
    from paraminit_server.admission import host_memory

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:          250000 kB\nMemAvailable:   20000000 kB\n")
    assert host_memory(str(info))[1] == 20000000 * 1024
    info.write_text("MemTotal:       24000000 kB\nMemFree:          250000 kB\n")  # no MemAvailable: free pages
    assert host_memory(str(info))[1] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
