"""A plan's own memory (parse, validation, resolution) is charged to --memory-budget before the work."""

from __future__ import annotations

import grpc
import pytest

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.plane.materializer import PLAN_PARAM_BYTES, max_request_bytes, plan_memory
from support import running_server, target_of

MiB = 1 << 20


def _plan(n: int) -> object:
    return plan_of([param(f"model.layers.{i}.w", [16], {"uniform": {"lo": -1, "hi": 1, "seed": i}}) for i in range(n)])


def test_a_plan_that_cannot_fit_is_refused_with_numbers_before_the_work() -> None:
    n = 30_000  # 64 B of tensors each (1.9 MB), but ~90 MB to check: over a 64 MiB budget
    plan = _plan(n)
    assert plan_memory(plan) > 64 * MiB > plan_memory(_plan(2_000))
    with running_server(memory_budget=64 * MiB) as r, Client(target_of(r), timeout=120) as c:
        for call in (c.materialize, c.validate, c.export):
            with pytest.raises(ParaminitError) as info:
                call(plan)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert f"plan of {n} parameters" in info.value.message and str(64 * MiB) in info.value.message
            assert str(plan_memory(plan)) in info.value.message
        assert r.plane.admission.host.reserved == 0  # nothing held after the refusals
        assert len(c.materialize(_plan(2_000))) == 2_000  # a plan that fits still runs


def test_request_size_limit_follows_the_budget() -> None:
    assert max_request_bytes(64 * MiB, 8) == 4 * MiB and max_request_bytes(1 << 40, 8) == 256 * MiB
    assert max_request_bytes(256 * MiB, 1) == 32 * MiB
    plan = _plan(80_000)  # 4.4 MB on the wire
    assert plan.ByteSize() > 4 * MiB
    with running_server(memory_budget=64 * MiB) as r, Client(target_of(r), timeout=120) as c:
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert r.plane.admission.host.reserved == 0
        assert c.health() == "SERVING"


def test_estimate_per_parameter() -> None:
    assert plan_memory(_plan(1000)) - plan_memory(_plan(0)) >= 1000 * PLAN_PARAM_BYTES
