"""Prometheus metrics of a running server: requests, bytes and latencies, leases, the build, the serving gauge,
and device memory only for device backends."""

from __future__ import annotations

import re
import urllib.request

import pytest

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.config import ServerConfig
from paraminit_server.rpc.server import start
from support import wait_until


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
        for series in (
            "process_resident_memory_bytes ",
            "process_cpu_seconds_total ",
            "process_open_fds ",
            "python_gc_collections_total{",
            "python_info{",
        ):
            assert re.search(rf"^{re.escape(series)}", text, re.M), series
        assert re.search(r'^paraminit_build_info\{.*backend="cpu".*version="\d[^"]*"', text, re.M)
        assert "paraminit_serving 1.0" in text
        assert "paraminit_device_memory_bytes" not in text
    finally:
        running.stop(grace=0)


# -- metrics: device memory, serving, drain ------------------------------------------------------------------------


def _scrape(port: int) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())


def test_device_memory_only_for_device_backends() -> None:
    from prometheus_client import generate_latest

    from paraminit_server.rpc.metrics import Metrics

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
        m.bind(
            inflight=lambda: 0,
            inflight_bytes=lambda: 0,
            leases=lambda: 0,
            leased_bytes=lambda: 0,
            memory_free=lambda: free[0],
            memory_total=lambda: total,
            backend=Backend(name, kind),
        )
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
