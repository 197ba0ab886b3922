"""Fuzzing a live server, injected faults, and processes killed mid-flight."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import running_server, serve_subprocess, server_fixture, target_of, wait_until
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import plan as planlib
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.materializer import plan_memory
from paraminit_server.server import Running
from paraminit_server.validation import Limits, validate

BIN = Path(sys.executable).parent
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


server = server_fixture(max_plan_bytes=8 << 20, max_param_bytes=4 << 20)


floats = st.one_of(st.floats(-10, 10), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308]))
seeds = st.one_of(st.integers(0, 2**64 - 1), st.just(0))


@st.composite
def inits(draw: Any, shape: list[int]) -> plan_pb2.Init | None:
    kind = draw(st.sampled_from(["zeros", "ones", "uniform", "normal", "xavier_uniform", "kaiming_uniform", "flat",
                                 "xavier_uniform_for_shape", "kaiming_uniform_for_shape", "unset"]))
    init = plan_pb2.Init()
    if kind == "unset":
        return None
    if kind == "uniform":
        init.uniform.lo, init.uniform.hi, init.uniform.seed = draw(floats), draw(floats), draw(seeds)
    elif kind == "normal":
        init.normal.mean, init.normal.std, init.normal.seed = draw(floats), draw(floats), draw(seeds)
    elif kind == "xavier_uniform":
        x = init.xavier_uniform
        x.fan_in, x.fan_out, x.seed = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)), draw(seeds)
    elif kind == "kaiming_uniform":
        init.kaiming_uniform.fan_in, init.kaiming_uniform.seed = draw(st.integers(0, 10**6)), draw(seeds)
    elif kind == "flat":
        n = int(np.prod(shape)) + draw(st.sampled_from([0, 0, 0, 1, -1]))
        init.flat.values.extend(draw(floats) for _ in range(max(0, min(n, 64))))
        init.flat.SetInParent()
    elif kind.endswith("for_shape"):
        getattr(init, kind).seed = draw(seeds)
    else:
        getattr(init, kind).SetInParent()
    return init


@st.composite
def params(draw: Any, names: Any) -> plan_pb2.Param:
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    if draw(st.booleans()) and draw(st.booleans()):
        shape = [draw(st.integers(1 << 20, 1 << 40)) for _ in range(draw(st.integers(1, 3)))]  # huge
    p = plan_pb2.Param(name=draw(names), shape=shape, dtype=draw(st.sampled_from([0, 1, 2, 3, 4, 4, 9])))
    init = draw(inits(shape))
    if init is not None:
        p.init.CopyFrom(init)
    if shape and draw(st.booleans()):
        for d in shape:
            a = draw(st.integers(0, d + 1))
            b = draw(st.integers(0, d + 1))
            p.region.add(start=a, stop=b)
        if draw(st.booleans()):
            del p.region[-1]
    return p


plans = st.lists(params(st.sampled_from(["a", "b", "c", "", "w.weight"])), min_size=0, max_size=5).map(
    lambda ps: plan_pb2.Plan(params=ps))


@FUZZ
@given(plan=plans)
def test_fuzz_plans_against_live_server(client: Client, plan: plan_pb2.Plan) -> None:
    report = validate(plan, Limits(max_param_bytes=4 << 20, max_plan_bytes=8 << 20))
    try:
        got = client.materialize(plan)
    except ParaminitError as err:
        assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err
        assert len(err.violations) == len(report.violations) >= 1
        return
    assert report.ok
    for p in planlib.resolve(plan):
        assert got[p.name].tobytes() == reference.materialize(p).tobytes()


@FUZZ
@given(raw=st.binary(max_size=512))
def test_fuzz_raw_request_bytes(server: Running, raw: bytes) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        for method, streaming in (("Materialize", True), ("Validate", False), ("Release", False), ("Apply", False)):
            path = f"/paraminit.v1.InitService/{method}"
            call = ch.unary_stream(path) if streaming else ch.unary_unary(path)
            try:
                result = call(raw, timeout=30)
                if streaming:
                    list(result)
            except grpc.RpcError as err:
                assert err.code() != grpc.StatusCode.INTERNAL, (method, raw, err.details())
                assert err.code() != grpc.StatusCode.UNKNOWN, (method, raw, err.details())


def test_truncated_request_is_invalid_argument(server: Running) -> None:
    good = pb.MaterializeRequest(plan=plan_of([param("w", [4], {"ones": {}})])).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch, pytest.raises(grpc.RpcError) as info:
        list(ch.unary_stream("/paraminit.v1.InitService/Materialize")(good[:-3]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid paraminit.v1.MaterializeRequest" in info.value.details()


def test_server_still_serves_after_fuzzing(client: Client) -> None:
    assert client.health() == "SERVING"
    assert client.materialize(plan_of([param("w", [3], {"ones": {}})]))["w"].tolist() == [1, 1, 1]


class FailingAlloc(CpuBackend):
    """Fails its Nth allocation, or its Nth fill (a backend running out of memory mid-plan)."""

    def __init__(self, where: str, fail_at: int) -> None:
        super().__init__()
        self.where = where
        self.calls = 0
        self.fail_at = fail_at
        self.armed = False  # warm-up runs unharmed

    def _tick(self, nbytes: int) -> None:
        if not self.armed:
            return
        self.calls += 1
        if self.calls == self.fail_at:
            raise MemoryError(f"cannot allocate {nbytes} bytes")

    def scratch(self, nbytes: int) -> Any:
        if self.where == "scratch":
            self._tick(nbytes)
        return super().scratch(nbytes)

    def fill(self, p: Any, out: Any, l_begin: int = 0) -> None:
        if self.where == "fill" and p.name == "w":
            self._tick(out.nbytes)
        super().fill(p, out, l_begin)


@pytest.mark.parametrize("where,fail_at", [("scratch", 1), ("fill", 3)])
def test_allocation_failure_mid_plan_frees_everything(where: str, fail_at: int) -> None:
    backend = FailingAlloc(where, fail_at)
    with running_server(backend, slab_bytes=1 << 20) as r:
        backend.armed = True
        plan = plan_of([param("w", [1 << 20], {"uniform": {"lo": -1, "hi": 1}})])  # 4 MiB = 4 slabs
        with Client(target_of(r)) as c:
            with pytest.raises(ParaminitError) as info:
                c.materialize(plan)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "out of memory" in info.value.message
            assert r.plane.admission.in_flight == 0 and r.plane.admission.host.reserved == 0
            got = c.materialize(plan)["w"]
            want = np.empty(1 << 20, np.float32)
            CpuBackend().fill(planlib.resolve(plan)[0], want)
            assert got.tobytes() == want.tobytes()


def test_memory_budget_refuses_without_allocating() -> None:
    with running_server(memory_budget=8 << 20) as r, Client(target_of(r)) as c:
        held = c.export(plan_of([param("a", [1 << 20], {"zeros": {}})]))  # 4 MiB of 8
        big = plan_of([param("b", [(6 << 20) // 4], {"zeros": {}})])
        with pytest.raises(ParaminitError) as info:
            c.export(big)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        free = 4194304 - plan_memory(big)  # the plan's own checking holds its share meanwhile
        assert re.search(rf"needs 6291456 bytes .* {free} of 8388608 are available", info.value.message)
        held.release()
        c.export(plan_of([param("b", [(6 << 20) // 4], {"zeros": {}})])).release()


def test_killed_client_lease_expires_and_segment_goes() -> None:
    proc, target = serve_subprocess()
    try:
        code = textwrap.dedent(f"""
            import os
            from paraminit_client import Client, param, plan_of
            c = Client({target!r})
            lease = c.export(plan_of([param("w", [1024], {{"ones": {{}}}})]), ttl_seconds=1.0)
            print(lease.info.shm.segment_name, flush=True)
            os.kill(os.getpid(), 9)
        """)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert child.returncode == -signal.SIGKILL
        name = child.stdout.strip()
        assert name.startswith("paraminit-") and os.path.exists(f"/dev/shm/{name}")
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{name}"), 10)
    finally:
        proc.terminate()
        proc.wait(30)


def test_server_killed_mid_stream_then_retry_gives_same_bytes() -> None:
    plan = plan_of([param("w", [16 << 20], {"normal": {"std": 1.0, "seed": 5}}, "bfloat16")])  # 32 MiB
    proc, target = serve_subprocess({"PARAMINIT_CHUNK_BYTES": "65536"})
    with Client(target) as c:
        _h, chunks = c.stream(plan)
        next(chunks)
        proc.kill()
        proc.wait(10)
        with pytest.raises(ParaminitError) as info:
            list(chunks)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    proc2, target2 = serve_subprocess()
    try:
        with Client(target2) as c:
            got = c.materialize(plan)["w"]
        want = np.empty(16 << 20, np.uint16)
        CpuBackend().fill(planlib.resolve(plan)[0], want)
        assert got.view(np.uint16).tobytes() == want.tobytes()
    finally:
        proc2.terminate()
        proc2.wait(30)


def test_concurrent_requests_do_not_crash(client: Client) -> None:
    from concurrent.futures import ThreadPoolExecutor

    plan = plan_of([param("w", [256, 1024], {"kaimingUniformForShape": {"seed": 2}})])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: client.materialize(plan)["w"].tobytes(), range(16)))
    assert len(set(results)) == 1


def test_segments_of_a_killed_server_go_at_the_next_start() -> None:
    """SIGKILL leaves five leased segments behind; the next server removes them, never a live server's."""
    live, live_target = serve_subprocess()
    proc, target = serve_subprocess()
    try:
        with Client(live_target) as other:
            kept = other.export(plan_of([param("k", [1024], {"ones": {}})]))
            with Client(target) as c:
                leases = [c.export(plan_of([param("w", [1024], {"ones": {}})])) for _ in range(5)]
                names = [f"/dev/shm/{x.info.shm.segment_name}" for x in leases]
                proc.kill()
                proc.wait(30)
                for x in leases:
                    x.stop_renewing()
            assert all(os.path.exists(n) for n in names)
            proc, target = serve_subprocess()  # the next start
            assert wait_until(lambda: not any(os.path.exists(n) for n in names), 30)
            assert os.path.exists(f"/dev/shm/{kept.info.shm.segment_name}")  # the live server's is untouched
            assert np.all(kept.arrays["k"] == 1.0)
            kept.release()
    finally:
        for p in (proc, live):
            p.terminate()
            p.wait(30)
