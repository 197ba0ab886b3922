"""Limits and the memory budget: per-plan and name-length limits, refusals before anything is allocated, and an
allocation failing mid-plan that frees everything."""

from __future__ import annotations

import re
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.plane.materializer import plan_memory
from paraminit_server.rpc.server import Running
from support import resolved, running_server, server_fixture, target_of

server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def test_limits_give_resource_exhausted(server: Running) -> None:
    with Client(f"127.0.0.1:{server.port}") as c, pytest.raises(ParaminitError) as info:
        c.materialize(plan_of([param("big", [1 << 29], {"zeros": {}}, "float64")]))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per-plan limit" in info.value.message


# -- names, malloc_trim after Validate ---------------------------------------------------


def test_name_length_is_limited() -> None:
    # a budget whose request size limit (materializer.max_request_bytes) lets the 100 MB plan arrive at all
    with running_server(memory_budget=4 << 30, max_concurrent=1) as r, Client(target_of(r), timeout=60) as c:
        plan = plan_of([param("n" * (100 << 20), [1], {"zeros": {}})])  # a 100 MB name
        report = c.validate(plan)
        assert not report.valid and any("bytes long; the limit is 1024" in line for line in report.lines())
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


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
            CpuBackend().fill(resolved(plan)[0], want)
            assert got.tobytes() == want.tobytes()


def test_memory_budget_refuses_without_allocating() -> None:
    # one identity may lease the whole budget here, so the budget is what refuses (its share: below)
    with running_server(memory_budget=8 << 20, max_leased_bytes_per_client=1 << 30) as r, Client(target_of(r)) as c:
        held = c.export(plan_of([param("a", [1 << 20], {"zeros": {}})]))  # 4 MiB of 8
        big = plan_of([param("b", [(6 << 20) // 4], {"zeros": {}})])
        with pytest.raises(ParaminitError) as info:
            c.export(big)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        free = 4194304 - plan_memory(big)  # the plan's own checking holds its share meanwhile
        assert re.search(rf"needs 6291456 bytes .* {free} of 8388608 are available", info.value.message)
        held.release()
        c.export(plan_of([param("b", [(6 << 20) // 4], {"zeros": {}})])).release()
    with running_server(memory_budget=8 << 20) as r, Client(target_of(r)) as c:  # the default share: 3/4
        c.export(plan_of([param("b", [(6 << 20) // 4], {"zeros": {}})])).release()
        with pytest.raises(ParaminitError, match="its share of 6291456 leasable bytes") as share:
            c.export(plan_of([param("c", [(7 << 20) // 4], {"zeros": {}})]))
        assert share.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
