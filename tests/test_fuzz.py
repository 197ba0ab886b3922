"""Fuzzing a live server: random plans and raw request bytes never give INTERNAL, and the server keeps serving."""

from __future__ import annotations

import math
from typing import Any

import grpc
import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.plans.validation import Limits, check
from paraminit_server.rpc.server import Running
from support import resolved, server_fixture

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


server = server_fixture(max_plan_bytes=8 << 20, max_param_bytes=4 << 20)


floats = st.one_of(st.floats(-10, 10), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308]))
seeds = st.one_of(st.integers(0, 2**64 - 1), st.just(0))


@st.composite
def inits(draw: Any, shape: list[int]) -> plan_pb2.Init | None:
    kind = draw(
        st.sampled_from(
            [
                "zeros",
                "ones",
                "uniform",
                "normal",
                "xavier_uniform",
                "kaiming_uniform",
                "flat",
                "xavier_uniform_for_shape",
                "kaiming_uniform_for_shape",
                "unset",
            ]
        )
    )
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


plans = st.lists(params(st.sampled_from(["a", "b", "c", "", "w.weight"])), min_size=0, max_size=5).map(lambda ps: plan_pb2.Plan(params=ps))


@FUZZ
@given(plan=plans)
def test_fuzz_plans_against_live_server(client: Client, plan: plan_pb2.Plan) -> None:
    report = check(plan, Limits(max_param_bytes=4 << 20, max_plan_bytes=8 << 20), resolve=False).report
    try:
        got = client.materialize(plan)
    except ParaminitError as err:
        assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err
        assert len(err.violations) == len(report.violations) >= 1
        return
    assert report.ok
    for p in resolved(plan):
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


def test_concurrent_requests_do_not_crash(client: Client) -> None:
    from concurrent.futures import ThreadPoolExecutor

    plan = plan_of([param("w", [256, 1024], {"kaimingUniformForShape": {"seed": 2}})])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: client.materialize(plan)["w"].tobytes(), range(16)))
    assert len(set(results)) == 1
