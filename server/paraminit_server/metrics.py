"""Prometheus metrics on their own HTTP port; one registry per server so tests can run several."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("paraminit_requests", "RPCs by method and status code", ["method", "code"], registry=r)
        self.bytes = Counter("paraminit_materialized_bytes", "bytes materialized",
                             ["backend", "dtype", "initializer"], registry=r)
        self.latency = Histogram("paraminit_materialize_seconds", "Materialize latency by delivery", ["delivery"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("paraminit_inflight_requests", "materializations in progress", registry=r)
        self.inflight_bytes = Gauge("paraminit_inflight_bytes", "bytes of materializations in progress", registry=r)
        self.leases = Gauge("paraminit_leases_active", "live zero-copy leases", registry=r)
        self.leased_bytes = Gauge("paraminit_leased_bytes", "bytes held by live leases", registry=r)
        self.device_memory = Gauge("paraminit_device_memory_bytes", "backend memory", ["state"], registry=r)
        self._http: Any = None

    def bind(self, inflight: Callable[[], float], inflight_bytes: Callable[[], float], leases: Callable[[], float],
             leased_bytes: Callable[[], float], memory_free: Callable[[], float], memory_total: Callable[[], float]) -> None:
        """Gauges read live state at scrape time instead of being kept in sync by hand."""
        self.inflight.set_function(inflight)
        self.inflight_bytes.set_function(inflight_bytes)
        self.leases.set_function(leases)
        self.leased_bytes.set_function(leased_bytes)
        self.device_memory.labels("free").set_function(memory_free)
        self.device_memory.labels("used").set_function(lambda: memory_total() - memory_free())

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
