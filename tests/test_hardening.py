"""Hostile input and faults: limits reserved atomically, overflowing indices, pooled memory, deadlines, framing.

Each test here names the hardening item it covers; the others live in test_security.py,
test_payloads.py and test_reliability.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import reference

from conftest import running_server, target_of, wait_until
from paraminit import dtypes, wire
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import plan as planlib
from paraminit_server.config import ServerConfig

MiB = 1 << 20


def _region_param(shape: list[int], region: list[tuple[int, int]], seed: int = 9) -> plan_pb2.Param:
    p = param("w", shape, {"uniform": {"lo": -1, "hi": 1, "seed": seed}})
    for lo, hi in region:
        p.region.add(start=lo, stop=hi)
    return p


# -- item 8: lease limits are reserved before allocation -------------------------------------


def test_concurrent_exports_cannot_overshoot_lease_limits() -> None:
    """8 concurrent 16 MiB exports against 2 leases per client and 64 MiB: at most 2 are granted."""
    with running_server(max_leases_per_client=2, max_leased_bytes=64 * MiB, max_concurrent=8) as r, \
            Client(target_of(r)) as c:
        plan = plan_of([param("w", [4 * MiB], {"ones": {}})])  # 16 MiB
        start = threading.Barrier(8)

        def one(_: int) -> Any:
            start.wait()
            try:
                return c.export(plan)
            except ParaminitError as err:
                return err

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        leases = [x for x in results if not isinstance(x, ParaminitError)]
        refused = [x for x in results if isinstance(x, ParaminitError)]
        try:
            assert len(leases) == 2, [str(e) for e in refused]
            assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
            assert r.plane.leases.leased_bytes() == 2 * 16 * MiB
            assert all(np.all(lease.arrays["w"] == 1.0) for lease in leases)
        finally:
            for lease in leases:
                lease.release()
        assert wait_until(lambda: r.plane.leases.leased_bytes() == 0)
        c.export(plan).release()  # the slots of refused exports were given back


# -- item 9: flat indices near 2^63 -------------------------------------------------------------


@pytest.mark.parametrize("shape", [[2**64 - 1, 2**64 - 1], [2**40, 2**40], [2**21, 2**42]])
def test_full_tensors_of_2_63_elements_or_more_are_refused(shape: list[int]) -> None:
    with running_server() as r, Client(target_of(r)) as c:
        plan = plan_of([_region_param(shape, [(0, 1), (0, 1)])])
        report = c.validate(plan)
        assert not report.valid
        assert any("2^63 elements or more" in line for line in report.lines())
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("shape,rows", [
    ([2**40, 2**22], [0, 2**24, 2**39, 2**40 - 1]),  # 2^62 elements: the rows the old kernel wrapped onto row 0
    ([2**40, 2**23 - 1], [2**40 - 1]),  # 2^63 - 2^40 elements: the last row ends just under 2^63
])
def test_rows_near_2_63_get_their_own_global_index(shape: list[int], rows: list[int]) -> None:
    with running_server() as r, Client(target_of(r)) as c:
        got = {}
        for row in rows:
            p = _region_param(shape, [(row, row + 1), (shape[1] - 5, shape[1])])
            plan = plan_of([p])
            assert c.validate(plan).ok
            out = c.materialize(plan)["w"]
            want = reference.materialize(planlib.resolve(plan)[0])
            assert out.tobytes() == want.tobytes(), row
            g = reference.global_indices(planlib.resolve(plan)[0])
            assert int(g[0]) == row * shape[1] + shape[1] - 5  # exact, no wrap
            got[row] = out.tobytes()
        assert len(set(got.values())) == len(rows)  # no two rows repeat each other


# -- item 10: only explicitly released segments are pooled --------------------------------------


def test_expired_lease_memory_is_never_lent_again() -> None:
    plan = plan_of([param("w", [64 * 1024], {"uniform": {"lo": -1, "hi": 1, "seed": 3}})])  # 256 KiB
    with running_server(shm_pool_bytes=64 * MiB) as r, Client(target_of(r)) as a, Client(target_of(r)) as b:
        held = a.export(plan, ttl_seconds=0.2)
        mine = held.arrays["w"]  # A keeps its mapping past the expiry
        assert wait_until(lambda: not r.plane.leases.list(), 10)
        assert r.plane.exports.pool.nbytes == 0  # expired: closed, not pooled
        other = b.export(plan)
        try:
            theirs = other.arrays["w"]
            before = theirs.copy()
            mine[:] = 12345.0  # A writes through its stale mapping
            assert np.array_equal(theirs, before)  # B does not see it
            assert other.info.shm.segment_name != held.info.shm.segment_name
        finally:
            other.release()
        # an explicit Release does pool the buffer (the optimisation still works)
        assert wait_until(lambda: r.plane.exports.pool.nbytes == other.info.shm.size)
        del mine, theirs
        held.stop_renewing()


# -- item 18: calls without a deadline are refused at once when memory is short -------------------


def test_no_deadline_call_is_refused_at_once() -> None:
    """admission_wait is 10 minutes; a no-deadline call that cannot be admitted must not wait for it."""
    with running_server(memory_budget=8 * MiB, admission_wait=600.0) as r, Client(target_of(r)) as c:
        held = c.export(plan_of([param("a", [MiB], {"zeros": {}})]))  # 4 MiB of 8
        done: list[BaseException] = []

        def call() -> None:
            try:
                c.export(plan_of([param("b", [(6 * MiB) // 4], {"zeros": {}})]))
            except ParaminitError as err:
                done.append(err)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        assert wait_until(lambda: bool(done), 60), "a call without a deadline waited for --admission-wait"
        assert isinstance(done[0], ParaminitError) and done[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.release()


def test_caller_wait_is_zero_without_deadline() -> None:
    """grpc reports about 9.2e18 s remaining for a call without a deadline; that is not a deadline."""
    with running_server(admission_wait=5.0) as r:
        class Ctx:
            def __init__(self, remaining: float | None) -> None:
                self.remaining = remaining

            def time_remaining(self) -> float | None:
                return self.remaining

            def invocation_metadata(self) -> tuple[()]:
                return ()

            def auth_context(self) -> dict[str, list[bytes]]:
                return {}

            def peer(self) -> str:
                return "ipv4:10.0.0.1:1234"

            def is_active(self) -> bool:
                return True

        assert r.servicer.caller(Ctx(9.2e18)).wait == 0.0  # type: ignore[arg-type]
        assert r.servicer.caller(Ctx(None)).wait == 0.0  # type: ignore[arg-type]
        assert r.servicer.caller(Ctx(4.0)).wait == 2.0  # type: ignore[arg-type]


# -- item 19: chunks fit stock clients' 4 MiB receive limit ---------------------------------------


def test_max_chunk_leaves_room_for_framing() -> None:
    limit = 4 * MiB  # grpcio's and grpc-js's default receive limit
    assert ServerConfig().max_chunk_bytes + 64 <= limit
    piece = memoryview(bytes(ServerConfig().max_chunk_bytes))
    message = wire.encode_chunk(2**63, piece, 0xFFFFFFFF)  # the largest offset and CRC varints
    assert len(message) + 5 <= limit  # + the gRPC length prefix
    with running_server() as r:
        info = Client(target_of(r)).info()
        assert info.limits.max_chunk_bytes == ServerConfig().max_chunk_bytes
        # a stock client with default options asks for 4 MiB chunks of a 12 MiB plan
        with grpc.insecure_channel(target_of(r)) as ch:
            call = ch.unary_stream("/paraminit.v1.InitService/Materialize",
                                   request_serializer=pb.MaterializeRequest.SerializeToString,
                                   response_deserializer=pb.MaterializeResponse.FromString)
            plan = plan_of([param("w", [3 * MiB], {"uniform": {"lo": -1, "hi": 1, "seed": 4}})])
            responses = list(call(pb.MaterializeRequest(plan=plan, chunk_bytes=4 * MiB), timeout=60))
        chunks = [m.chunk for m in responses if m.WhichOneof("msg") == "chunk"]
        assert sum(len(ch.data) for ch in chunks) == 12 * MiB
        assert max(len(ch.data) for ch in chunks) <= info.limits.max_chunk_bytes
        data = b"".join(ch.data for ch in chunks)
        header = responses[0].header
        (t,) = header.tensors
        want = reference.materialize(planlib.resolve(plan)[0])
        assert data[t.offset:t.offset + t.nbytes] == want.tobytes()
        assert dtypes.by_enum(t.dtype) is not None
