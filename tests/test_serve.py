"""The server process: `paraminit serve` / `paraminit-server` flags, exit codes and startup errors, health and
reflection, readiness during warm-up, Unix-socket addresses, and graceful drain at SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paraminit import dtypes, exitcodes
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.config import ServerConfig
from paraminit_server.rpc.server import Running, start
from support import run_cli, scanner_seed, serve_subprocess, server_fixture, target_of, wait_until

BIN = Path(sys.executable).parent


# -- serve and exit codes -------------------------------------------------------------------------------------------


def test_serve_help_lists_the_server_flags_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "serve", "--help")
    assert code == 0
    for flag in ("--port", "--backend", "--device", "--safetensors-dirs", "PARAMINIT_PORT"):
        assert flag in out, flag
    assert re.search(r"^\s*64\s+usage error", out, re.M) and re.search(r"^\s*0\s+a clean drain", out, re.M)


@pytest.mark.parametrize("binary", [["paraminit-server"], ["paraminit", "serve"]])
def test_both_binaries_share_the_usage_exit_code_and_document_it(binary: list[str]) -> None:
    exe = [str(BIN / binary[0]), *binary[1:]]
    bogus = subprocess.run([*exe, "--bogus"], capture_output=True, text=True, timeout=60)
    assert bogus.returncode == exitcodes.USAGE == 64, bogus.stderr
    assert "--bogus" in bogus.stderr
    bad_choice = subprocess.run([*exe, "--backend", "tpu"], capture_output=True, text=True, timeout=60)
    assert bad_choice.returncode == 64, bad_choice.stderr
    helped = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "exit codes:" in helped.stdout and re.search(r"^\s*64\s", helped.stdout, re.M)


def test_bad_environment_variable_is_a_usage_error() -> None:
    import os

    done = subprocess.run(
        [str(BIN / "paraminit"), "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PARAMINIT_SLAB_BYTES": "lots"},
    )
    assert done.returncode == 64 and "PARAMINIT_SLAB_BYTES" in done.stderr and "Traceback" not in done.stderr


def test_paraminit_serve_takes_the_server_flags_and_serves() -> None:
    proc = subprocess.Popen(
        [str(BIN / "paraminit"), "serve", "--port", "0", "--backend", "cpu", "--host", "127.0.0.1", "--drain-seconds", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        assert m, line + (proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
        done = subprocess.run(
            [str(BIN / "paraminit"), "health", "--target", f"127.0.0.1:{m.group(1)}", "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.stdout.strip() in ("SERVING", "NOT_SERVING"), done.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


HEADER_PLAN = plan_of([param("weight_one", [8, 8], {"uniform": {"lo": -1, "hi": 1, "seed": 1}}), param("bias_two", [8], {"zeros": {}})])


# -- Unix sockets, uploads drain at SIGTERM; startup errors -----------------------


def _server(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "paraminit-server"), "--backend", "cpu", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_unix_socket_host_prints_a_usable_address(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    proc = _server(["--host", f"unix:{sock}"])
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = line.split("listening on ", 1)[1].split()[0]
        assert address == f"unix:{sock}", line
        assert oct(sock.stat().st_mode & 0o777) == "0o600"  # the server's user only
        with Client(address) as c:
            c.wait_ready(300)
            assert c.materialize(HEADER_PLAN)["bias_two"].tolist() == [0.0] * 8
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_uploads_in_flight_drain_at_shutdown() -> None:
    """Shutdown (what SIGTERM runs) waits up to --drain-seconds for an upload in flight, not grpc's 1 s."""
    r = start(ServerConfig(host="127.0.0.1", port=0, backend="cpu", drain_seconds=60), warm_up_async=False)
    values = np.arange(1 << 20, dtype=np.float32)
    raw = values.tobytes()
    go = threading.Event()
    result: list[Any] = []

    def chunks() -> Any:
        yield pb.PayloadChunk(
            dtype=dtypes.by_name("float32").enum,
            count=values.size,  # type: ignore[arg-type]
            data=raw[: 1 << 20],
        )
        assert go.wait(60)
        for off in range(1 << 20, len(raw), 1 << 20):
            yield pb.PayloadChunk(data=raw[off : off + (1 << 20)])

    def upload() -> None:
        with Client(target_of(r)) as c:
            try:
                result.append(c.transport.call(c.stub.UploadPayload, chunks()))
            except ParaminitError as err:
                result.append(err)

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        assert wait_until(lambda: r.plane.sources._uploads == 1, 30)
        stopper = threading.Thread(target=r.stop)
        stopper.start()
        assert not wait_until(lambda: not stopper.is_alive(), 3.0)  # still draining the upload
        with Client(target_of(r), timeout=5) as probe, pytest.raises(ParaminitError):
            probe.validate(HEADER_PLAN)  # new work is refused meanwhile
    finally:
        go.set()
        uploader.join(60)
    stopper.join(60)
    assert not stopper.is_alive()
    assert not isinstance(result[0], ParaminitError), result[0]
    assert result[0].count == values.size


@pytest.mark.parametrize(
    "args,env",
    [
        (["--backend", "foo"], {}),
        (["--log-format", "jsonx"], {}),
        ([], {"PARAMINIT_BACKEND": "foo"}),
        ([], {"PARAMINIT_LOG_FORMAT": "jsonx"}),
        (["--backend", "cupy"], {}),
        (["--port", "TAKEN"], {}),
        (["--host", "unix:/tmp/" + "x" * 120], {}),
    ],
)
def test_startup_errors_are_one_line_and_non_zero(args: list[str], env: dict[str, str]) -> None:
    if "cupy" in args and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        cmd = [str(BIN / "paraminit-server"), *args] if "--backend" in args else [str(BIN / "paraminit-server"), "--backend", "cpu", *args]
        if env:
            cmd = [str(BIN / "paraminit-server"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PARAMINIT_PORT": "0", **env})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("paraminit-server: error:")


def test_sigterm_drains_in_flight_stream_and_exits_zero() -> None:
    proc, target = serve_subprocess({"PARAMINIT_DRAIN_SECONDS": "30", "PARAMINIT_LOG_FORMAT": "json"}, stderr=subprocess.PIPE)
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


def test_liveness_stays_serving_while_readiness_drains() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paraminit_server.rpc.server import LIVENESS_SERVICE, SERVICE_NAME

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
            running.set_serving(True)
            assert status(SERVICE_NAME) == "SERVING"
            running.plane.admission.draining.set()  # a drain has begun (as stop() begins it) ...
            running.set_serving(False)
            running.set_serving(True)  # ... so a warm-up finishing now changes nothing
            assert status(SERVICE_NAME) == "NOT_SERVING"
    finally:
        running.stop(grace=0)


server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def test_info_health_reflection(server: Running, client: Client) -> None:
    info = client.info()
    assert info.backend == "cpu" and info.device.kind == "cpu"
    assert set(info.dtypes) == {
        plan_pb2.DTYPE_FLOAT32,
        plan_pb2.DTYPE_FLOAT64,
        plan_pb2.DTYPE_FLOAT16,
        plan_pb2.DTYPE_BFLOAT16,
        plan_pb2.DTYPE_FLOAT8_E4M3FN,
        plan_pb2.DTYPE_FLOAT8_E5M2,
    }
    assert client.health() == "SERVING"
    assert client.health("paraminit.v1.InitService") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        names = {s.name for s in resp.list_services_response.service}
    assert {"paraminit.v1.InitService", "grpc.health.v1.Health"} <= names


def test_health_reports_not_serving_before_warm_up() -> None:
    gate = threading.Event()

    class Slow(CpuBackend):
        def preload(self) -> None:  # a CPU server serves once its cached kernels are loaded
            gate.wait(10)

        def warm_up(self) -> None:
            gate.wait(10)

    running = start(ServerConfig(host="127.0.0.1", port=0), backend=Slow())  # warm-up in the background
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            gate.set()
            assert running.ready.wait(10)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop(grace=0)


def test_cpu_server_serves_while_uncached_kernels_compile() -> None:
    """Loading the cached kernels is what a CPU server waits for; compiling the rest goes on while it serves."""
    gate = threading.Event()

    class Compiling(CpuBackend):
        def warm_up(self) -> None:
            gate.wait(30)

    running = start(ServerConfig(host="127.0.0.1", port=0), backend=Compiling())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert wait_until(lambda: stub.Check(health_pb2.HealthCheckRequest()).status == serving, 30, 0.05)
            assert not gate.is_set() and not running.ready.is_set()  # still "compiling"
            gate.set()
            assert running.ready.wait(10)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == serving
    finally:
        gate.set()
        running.stop(grace=0)


@pytest.mark.slow
def test_calls_wait_for_a_cold_compile_outside_the_line(tmp_path: Path) -> None:
    """On an empty kernel cache, calls queued behind one that compiles are not refused for their time in line:
    each waits for the kernels it needs before it takes a slot (one slot and a 1 s wait in line here; the first
    compile takes several seconds, so before, every call but one ended RESOURCE_EXHAUSTED). The plan scanner, which
    loads before SERVING, comes from a seed as in the image."""
    env = {
        "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
        "PARAMINIT_JIT_CACHE_SEED": str(scanner_seed(tmp_path / "seed")),
        "PARAMINIT_MAX_CONCURRENT": "1",
        "PARAMINIT_MAX_QUEUE_WAIT": "1",
    }
    proc, target = serve_subprocess(env)
    plan = plan_of([param("w", [64, 64], {"uniform": {"lo": -1.0, "hi": 1.0, "seed": 9}})])
    outcomes: list[object] = []

    def call() -> None:
        try:
            with Client(target, timeout=240) as c:
                outcomes.append(c.materialize(plan)["w"].copy())
        except ParaminitError as exc:
            outcomes.append(exc)

    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert len(outcomes) == 3
    assert all(isinstance(o, np.ndarray) for o in outcomes), [str(o) for o in outcomes]
    assert list((tmp_path / "cache").glob("plans_*/scanner_kernels.*.nbi"))  # the seed was copied in
    first = outcomes[0]
    assert isinstance(first, np.ndarray) and first.std() > 0.5 and all(np.array_equal(first, o) for o in outcomes)


def test_a_unix_socket_server_serves_metrics_on_loopback(tmp_path: Path) -> None:
    """`--host unix:PATH --metrics-port -1`: the metrics endpoint needs a TCP address and takes loopback (it
    failed with "Name or service not known" and left the socket file behind)."""
    import urllib.request

    sock = tmp_path / "pi.sock"
    proc = subprocess.Popen(
        [str(BIN / "paraminit"), "serve", "--host", f"unix:{sock}", "--metrics-port", "-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"metrics=127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=30) as r:
            assert b"paraminit_build_info" in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0 and not sock.exists()
