"""InitService through real sockets: an in-process server on port 0 and a `paraminit serve` subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import reference
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import running_server, serve_subprocess, server_fixture, target_of, wait_until
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, load_plan, param, plan_of
from paraminit_server import plan as planlib
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.config import ServerConfig
from paraminit_server.server import Running, start

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def mixed_plan() -> plan_pb2.Plan:
    return plan_of([
        param("w", [33, 17], {"kaimingUniformForShape": {"seed": 3}}),
        param("e", [50, 8], {"normal": {"mean": 0.5, "std": 2.0, "seed": 4}}, "bfloat16"),
        param("h", [7], {"uniform": {"lo": -3, "hi": 5, "seed": 5}}, "float16"),
        param("d", [4, 5, 6], {"xavierUniformForShape": {"seed": 6}}, "float64", region=[(1, 3), (0, 5), (2, 5)]),
        param("f", [3], {"flat": {"values": [1.5, -2.25, 3e38]}}, "bfloat16"),
        param("s", [], {"ones": {}}),
    ])


def expected_arrays(plan: plan_pb2.Plan) -> dict[str, np.ndarray[Any, Any]]:
    return {p.name: reference.materialize(p) for p in planlib.resolve(plan)}


def assert_same_bits(got: dict[str, np.ndarray[Any, Any]], want: dict[str, np.ndarray[Any, Any]]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), name


def test_materialize_matches_reference(client: Client) -> None:
    plan = mixed_plan()
    got = client.materialize(plan, chunk_bytes=64)  # many small chunks cross tensor boundaries
    assert_same_bits(got, expected_arrays(plan))
    assert str(got["e"].dtype) == "bfloat16" and got["h"].dtype == np.float16


def test_header_is_safetensors(client: Client, tmp_path: Path) -> None:
    plan = mixed_plan()
    out = tmp_path / "m.safetensors"
    header = client.materialize_to_file(plan, out)
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])
    assert (8 + n) % 64 == 0
    assert meta["__metadata__"]["plan_digest"] == header.plan_digest == planlib.digest(plan)
    data = raw[8 + n:]
    for name, want in expected_arrays(plan).items():
        b, e = meta[name]["data_offsets"]
        assert data[b:e] == want.tobytes()
        assert b % want.dtype.itemsize == 0


def test_validate_rpc(client: Client) -> None:
    report = client.validate(mixed_plan())
    assert report.ok and report.total_bytes == sum(report.param_bytes) > 0
    bad = plan_of([param("a", [3], {"uniform": {"lo": 1, "hi": 0}}), param("a", [2], {"flat": {"values": [1]}})])
    report = client.validate(bad)
    assert not report.valid and len(report.violations) == 3


def test_invalid_plan_gives_every_violation(client: Client) -> None:
    bad = plan_of([param("a", [3], {"uniform": {"lo": 1, "hi": 0}}), param("b", [2], {"flat": {"values": [1]}}),
                   param("c", [4], {"kaimingUniformForShape": {}})])
    with pytest.raises(ParaminitError) as info:
        client.materialize(bad)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in err.violations] == ["params[0].init.uniform", "params[1].init.flat.values",
                                                 "params[2].init.kaimingUniformForShape"]
    assert "initialization: uniform lower bound must not exceed the upper bound" in err.message
    assert "Traceback" not in err.message


def test_limits_give_resource_exhausted(server: Running) -> None:
    with Client(f"127.0.0.1:{server.port}") as c, pytest.raises(ParaminitError) as info:
        c.materialize(plan_of([param("big", [1 << 29], {"zeros": {}}, "float64")]))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per-plan limit" in info.value.message


def test_info_health_reflection(server: Running, client: Client) -> None:
    info = client.info()
    assert info.backend == "cpu" and info.device.kind == "cpu"
    assert set(info.dtypes) == {plan_pb2.DTYPE_FLOAT32, plan_pb2.DTYPE_FLOAT64, plan_pb2.DTYPE_FLOAT16,
                                plan_pb2.DTYPE_BFLOAT16}
    assert client.health() == "SERVING"
    assert client.health("paraminit.v1.InitService") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        names = {s.name for s in resp.list_services_response.service}
    assert {"paraminit.v1.InitService", "grpc.health.v1.Health"} <= names


def test_cancellation_stops_generation_and_frees(server: Running, client: Client) -> None:
    plan = plan_of([param("w", [64 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])  # 256 MiB
    _header, chunks = client.stream(plan)
    for _, _c in zip(range(3), chunks, strict=False):
        pass
    chunks.close()  # type: ignore[attr-defined]  # cancels the call
    assert wait_until(lambda: server.plane.admission.in_flight == 0
                      and not any(t.name == "paraminit-fill" for t in threading.enumerate()), 1.0)


def test_unexpected_error_is_internal_with_id(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(CpuBackend):
        def fill(self, p: Any, out: Any, l_begin: int = 0) -> None:
            if p.name == "boom":  # warm-up still works; the request does not
                raise RuntimeError("device fell over")
            super().fill(p, out, l_begin)

    with running_server(Broken()) as running:
        with Client(target_of(running)) as c, pytest.raises(ParaminitError) as info:
            c.materialize(plan_of([param("boom", [8], {"zeros": {}})]))
        assert info.value.code == grpc.StatusCode.INTERNAL
        error_id = re.search(r"id ([0-9a-f]{12})", info.value.message)
        assert error_id and "device fell over" not in info.value.message
        assert any(error_id.group(1) in r.getMessage() for r in caplog.records)


def test_300_mib_plan_streams_with_default_limits(client: Client) -> None:
    plan = plan_of([param("a", [50 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 9}}),  # 200 MiB
                    param("b", [25 << 20], {"kaimingUniform": {"fanIn": 3, "seed": 2}}, "float32")])  # 100 MiB
    got = client.materialize(plan)
    backend = CpuBackend()
    for p in planlib.resolve(plan):
        want = np.empty(p.numel, np.float32)
        backend.fill(p, want)
        assert hashlib.sha256(got[p.name].tobytes()).digest() == hashlib.sha256(want.tobytes()).digest()
    head = planlib.resolve(plan)[0]
    assert got["a"][:1000].tobytes() == reference.materialize(
        planlib.ResolvedParam(**{**head.__dict__, "region": ((0, 1000),)})).tobytes()


def test_cli_against_serve_subprocess(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    proc, target = serve_subprocess(stderr=subprocess.STDOUT)
    try:
        assert subprocess.run([str(BIN / "paraminit"), "health", "--target", target]).returncode == 0
        out = tmp_path / "conv.safetensors"
        r = subprocess.run([str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out),
                            "--target", target, "--summary"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "10 parameters" in r.stdout
        loaded = load_file(str(out))
        want = expected_arrays(load_plan(ROOT / "examples/conv.json"))
        assert set(loaded) == set(want)
        for name, w in want.items():
            assert loaded[name].tobytes() == w.tobytes(), name

        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"params": [
            {"name": "a", "shape": [5], "init": {"xavierUniformForShape": {"seed": 1}}},
            {"name": "b", "shape": [2], "init": {"normal": {"std": -1}}}]}))
        existing = tmp_path / "keep.safetensors"
        existing.write_bytes(b"precious")
        r = subprocess.run([str(BIN / "paraminit"), "materialize", str(bad), "-o", str(existing), "--target", target],
                           capture_output=True, text=True)
        assert r.returncode == 2
        assert "torch.runtimeInit: Xavier initialization expects at least 2 dimensions, got [5]" in r.stderr
        assert "initialization: normal standard deviation must be nonnegative" in r.stderr
        assert existing.read_bytes() == b"precious"
        assert not list(tmp_path.glob(".*.part"))

        r = subprocess.run([str(BIN / "paraminit"), "info", "--target", target], capture_output=True, text=True)
        assert r.returncode == 0 and "backend=cpu" in r.stdout
        r = subprocess.run([str(BIN / "paraminit"), "validate", str(ROOT / "examples/mlp.json"), "--target", target],
                           capture_output=True, text=True)
        assert r.returncode == 0 and "6 parameters" in r.stdout
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_health_unreachable_exits_1() -> None:
    r = subprocess.run([str(BIN / "paraminit"), "health", "--target", "127.0.0.1:1", "--timeout", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


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


def test_unknown_delivery_is_invalid_argument(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Materialize(pb.MaterializeRequest(plan=mixed_plan(), delivery=77)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_durable_file_flushes_as_it_goes(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without direct I/O the early-flush thread runs several times during a write, and the file is still
    exactly the stream."""
    from paraminit_client import filesink

    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(filesink.BufferedSink, "FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(filesink.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    monkeypatch.setattr(filesink, "DirectSink", _no_direct)
    put = filesink.BufferedSink.put

    def put_then_let_the_flusher_run(self: Any, c: Any) -> None:
        """Each MiB is taken by the flush thread before the next arrives: how often it runs does not depend on
        how the scheduler treats a loaded machine."""
        put(self, c)
        assert wait_until(lambda: self._pending < self.FLUSH_BYTES, 60, 0.001)

    monkeypatch.setattr(filesink.BufferedSink, "put", put_then_let_the_flusher_run)
    plan = plan_of([param("w", [3 << 20], {"normal": {"std": 0.02, "seed": 4}})])  # 12 MiB
    client.materialize_to_file(plan, tmp_path / "w.safetensors", chunk_bytes=1 << 20)
    from safetensors.numpy import load_file

    assert load_file(str(tmp_path / "w.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()
    assert len(syncs) >= 2


def _no_direct(*args: object) -> None:
    from paraminit_client import filesink

    raise filesink.DirectUnavailable("refused in this test")


@pytest.mark.parametrize("numel", [1, 1023, 4096 * 3 + 5, (3 << 20) // 4 + 7])
def test_durable_file_with_direct_io_is_the_stream_at_any_size(client: Client, tmp_path: Path, numel: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 KiB so the ring turns over many times; sizes that end mid-block and mid-page. The file
    (written directly, then cut to size) equals the same plan written through the page cache, byte for byte."""
    from paraminit_client import filesink

    opened: list[str] = []
    real_init = filesink.DirectSink.__init__

    def spy(self: filesink.DirectSink, path: str, prefix: bytes, total: int) -> None:
        real_init(self, path, prefix, total)
        opened.append(path)

    monkeypatch.setattr(filesink.DirectSink, "BLOCK", 64 << 10)
    monkeypatch.setattr(filesink.DirectSink, "__init__", spy)
    plan = plan_of([param("w", [numel], {"uniform": {"lo": -1, "hi": 1, "seed": 6}}),
                    param("b", [3], {"ones": {}}, "bfloat16")])
    client.materialize_to_file(plan, tmp_path / "direct.safetensors", chunk_bytes=16 << 10)
    assert len(opened) == 1, "direct I/O was not used on this file system"
    monkeypatch.setattr(filesink, "DirectSink", _no_direct)
    client.materialize_to_file(plan, tmp_path / "cached.safetensors", chunk_bytes=16 << 10)
    direct, cached = (tmp_path / "direct.safetensors").read_bytes(), (tmp_path / "cached.safetensors").read_bytes()
    assert direct == cached and len(direct) == len(cached)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cached.safetensors", "direct.safetensors"]
    from safetensors.numpy import load_file

    assert load_file(str(tmp_path / "direct.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()


def test_a_file_system_that_refuses_direct_writes_falls_back(client: Client, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT accepted at open but refused at the first write (as some file systems do): the page cache
    path writes the same file."""
    from paraminit_client import filesink

    real, refused = os.pwrite, []

    def refuse_direct(fd: int, data: object, offset: int) -> int:
        if fcntl_flags(fd) & getattr(os, "O_DIRECT", 0):
            refused.append(fd)
            raise OSError(22, "Invalid argument")
        return real(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(filesink.os, "pwrite", refuse_direct)
    plan = plan_of([param("w", [5000], {"uniform": {"lo": -1, "hi": 1, "seed": 7}})])
    client.materialize_to_file(plan, tmp_path / "w.safetensors")
    from safetensors.numpy import load_file

    assert len(refused) == 1  # the probe, once
    assert load_file(str(tmp_path / "w.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)
