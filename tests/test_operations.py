"""Operating the server: metrics, JSON logs, graceful shutdown of a real `paraminit serve` process."""

from __future__ import annotations

import json
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
            text = urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics").read().decode()
            lease.release()
        assert 'paraminit_requests_total{code="OK",method="Materialize"} 2.0' in text
        assert 'paraminit_requests_total{code="INVALID_ARGUMENT",method="Materialize"} 1.0' in text
        assert 'paraminit_materialized_bytes_total{backend="cpu",dtype="bfloat16",initializer="uniform"} 2000.0' in text
        assert "paraminit_leases_active 1.0" in text and "paraminit_leased_bytes 1024.0" in text
        assert re.search(r'paraminit_materialize_seconds_count\{delivery="DELIVERY_STREAM"\} 1\.0', text)
        assert re.search(r'paraminit_materialize_seconds_count\{delivery="DELIVERY_SHM"\} 1\.0', text)
        assert re.search(r'paraminit_device_memory_bytes\{state="free"\} [1-9]', text)
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
