"""Prometheus metrics on their own HTTP port; one registry per server so tests can run several.

The registry is private, so the process, platform and GC collectors that prometheus_client puts in its global
registry are added to it explicitly: without them there is no `process_resident_memory_bytes` to size pods by.
`paraminit_requests_total` is the counter to take rate() of (dashboards, alerts, the request-rate HPA); the
in-flight gauges are instantaneous and miss sub-second requests between scrapes.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
QUEUE_WAIT_BUCKETS = (0.0, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # 0: admitted without waiting
# Stays clear of Prometheus itself (9090), Alertmanager (9093), the node exporter (9100) and the OpenTelemetry
# Prometheus exporter (9464), which commonly share a pod or a host with the server. Images and manifests use it.
DEFAULT_PORT = 9478


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.build = Info("paraminit_build", "version of the server and of the libraries its results depend on", registry=r)
        self.build.info(self._build_labels(""))
        self.requests = Counter("paraminit_requests", "RPCs by method and status code", ["method", "code"], registry=r)
        self.bytes = Counter("paraminit_materialized_bytes", "bytes materialized", ["backend", "dtype", "initializer"], registry=r)
        self.latency = Histogram(
            "paraminit_materialize_seconds", "Materialize latency by delivery", ["delivery"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.inflight = Gauge("paraminit_inflight_requests", "materializations in progress", registry=r)
        # the scaling signal: calls waiting for a concurrency slot, and how long they waited
        self.queued = Gauge("paraminit_queued_requests", "calls waiting for a concurrency slot", registry=r)
        self.queue_wait = Histogram(
            "paraminit_queue_wait_seconds", "time admitted calls waited for a concurrency slot", buckets=QUEUE_WAIT_BUCKETS, registry=r
        )
        self.refusals = Counter(
            "paraminit_refusals",
            "calls refused for load (RESOURCE_EXHAUSTED, UNAVAILABLE) by method and reason",
            ["method", "reason"],
            registry=r,
        )
        self.inflight_bytes = Gauge("paraminit_inflight_bytes", "bytes of materializations in progress", registry=r)
        self.leases = Gauge("paraminit_leases_active", "live zero-copy leases", registry=r)
        self.leased_bytes = Gauge("paraminit_leased_bytes", "bytes held by live leases", registry=r)
        self.serving = Gauge(
            "paraminit_serving", "1 while the InitService reports SERVING (warm, not draining)", registry=r
        )  # set by the server with its health status
        self.device_memory: Gauge | None = None  # only for device backends; see bind()
        self._http: Any = None

    @staticmethod
    def _build_labels(backend: str) -> dict[str, str]:
        return {
            "version": _version("paraminit"),
            "revision": os.environ.get("PARAMINIT_REVISION", ""),
            "backend": backend,
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "numba": _version("numba"),
            "grpcio": _version("grpcio"),
        }

    def bind(
        self,
        inflight: Callable[[], float],
        inflight_bytes: Callable[[], float],
        leases: Callable[[], float],
        leased_bytes: Callable[[], float],
        memory_free: Callable[[], float],
        memory_total: Callable[[], float],
        backend: Any = None,
        queued: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """Gauges read live state at scrape time instead of being kept in sync by hand.

        Device memory is exported only for a device backend (`backend.device().kind != "cpu"`): on the CPU backend
        it would be the node's memory, which process_resident_memory_bytes and the container limit describe better.
        """
        self.inflight.set_function(inflight)
        self.queued.set_function(queued)
        self.inflight_bytes.set_function(inflight_bytes)
        self.leases.set_function(leases)
        self.leased_bytes.set_function(leased_bytes)
        if backend is not None:
            self.build.info(self._build_labels(str(backend.name)))
            if backend.device().kind != "cpu" and self.device_memory is None:
                self.device_memory = Gauge("paraminit_device_memory_bytes", "device (GPU) memory", ["state"], registry=self.registry)
                self.device_memory.labels("free").set_function(memory_free)
                self.device_memory.labels("used").set_function(lambda: memory_total() - memory_free())
                self.device_memory.labels("total").set_function(memory_total)

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
