"""Admission queues within the caller's deadline: arrival order, fairness across identities, bounded queue,
refusals with gRPC retry pushback, and the client's gRPC retry policy in effect."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_client.client import SERVICE_CONFIG
from paraminit_server import errors
from paraminit_server.plane.slots import SlotQueue
from paraminit_server.rpc.status import PUSHBACK
from support import running_server, target_of, wait_until

MiB = 1 << 20
LONG = 120.0  # a wait that never runs out in these tests: slots are handed over by the test itself


def _queue_in_order(q: SlotQueue, arrivals: list[tuple[str, str]], granted: list[str]) -> list[threading.Thread]:
    """Start one thread per (identity, name), each queued before the next starts; each records its name when it
    gets the slot and hands the slot on at once."""
    threads = []
    for k, (ident, name) in enumerate(arrivals):

        def take(ident: str = ident, name: str = name) -> None:
            q.acquire(ident, LONG)
            granted.append(name)
            q.release(ident)

        t = threading.Thread(target=take, daemon=True)
        t.start()
        assert wait_until(lambda k=k: q.queued == k + 1), f"{name} did not queue"
        threads.append(t)
    return threads


def test_slots_go_round_robin_across_identities_and_in_arrival_order_within_one() -> None:
    q = SlotQueue(1, max_queued=16)
    assert q.acquire("holder", 0) == 0.0  # the one slot, held by the test
    granted: list[str] = []
    # a greedy identity arrives first with three calls, then two others
    arrivals = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]
    threads = _queue_in_order(q, arrivals, granted)
    expected = ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert q.waiting() == [n[0] for n in expected]
    assert granted == []  # nobody overtook the holder
    q.release("holder")
    for t in threads:
        t.join(LONG)
    assert granted == expected
    assert q.queued == 0
    assert q.acquire("x", 0) == 0.0  # the slot came back free


def test_a_freed_slot_goes_to_the_waiter_not_to_a_newcomer() -> None:
    q = SlotQueue(1, max_queued=4)
    q.acquire("h", 0)
    granted: list[str] = []
    done = threading.Event()

    def waiter() -> None:
        q.acquire("a", LONG)
        granted.append("waiter")
        done.wait(LONG)
        q.release("a")

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    assert wait_until(lambda: q.queued == 1)
    q.release("h")  # handed to the waiter inside release(), whether or not its thread has woken yet
    with pytest.raises(errors.ResourceExhausted) as exc:
        q.acquire("newcomer", 0)
    assert exc.value.reason == "busy" and exc.value.retry_after is not None and exc.value.retry_after > 0
    assert wait_until(lambda: granted == ["waiter"])
    done.set()
    t.join(LONG)
    assert q.acquire("newcomer", 0) == 0.0


def test_queue_is_bounded_and_refusals_say_when_to_retry() -> None:
    q = SlotQueue(1, max_queued=1)
    q.acquire("h", 0)
    granted: list[str] = []
    threads = _queue_in_order(q, [("a", "queued")], granted)
    with pytest.raises(errors.ResourceExhausted) as full:
        q.acquire("b", LONG)
    assert full.value.reason == "queue_full" and full.value.retry_after is not None and full.value.retry_after > 0
    q.release("h")
    threads[0].join(LONG)
    assert granted == ["queued"]


def test_a_wait_that_runs_out_or_a_caller_that_leaves_gives_up_its_place() -> None:
    q = SlotQueue(1, max_queued=4)
    q.acquire("h", 0)
    with pytest.raises(errors.ResourceExhausted) as timeout:
        q.acquire("a", 0.01)  # the slot is never released while it waits
    assert timeout.value.reason == "queue_timeout"
    with pytest.raises(errors.Cancelled):
        q.acquire("a", LONG, stop=lambda: True)
    assert q.queued == 0 and q.waiting() == []
    q.release("h")
    assert q.acquire("a", 0) == 0.0


def test_one_identity_never_holds_every_slot_nor_every_place_in_line() -> None:
    """Per-identity shares: with 4 slots one identity runs at most 3 at once (its other calls wait, or are refused
    without a deadline), so another identity is served at once; and it takes at most half the places in line."""
    q = SlotQueue(4, max_queued=4)
    assert (q.per_identity, q.queued_per_identity) == (3, 2)
    for _ in range(3):
        assert q.acquire("greedy", 0) == 0.0
    with pytest.raises(errors.ResourceExhausted) as capped:
        q.acquire("greedy", 0)
    assert capped.value.reason == "identity_share"
    granted: list[str] = []
    threads = _queue_in_order(q, [("greedy", "g4"), ("greedy", "g5")], granted)
    with pytest.raises(errors.ResourceExhausted) as line:
        q.acquire("greedy", LONG)
    assert line.value.reason == "identity_share" and "places in line" in str(line.value)
    assert q.acquire("other", 0) == 0.0  # the slot the greedy identity may not take is there for others
    assert granted == []
    q.release("other")  # a free slot, but the greedy one is at its share: nobody of it is served
    assert q.waiting() == ["greedy", "greedy"] and granted == []
    q.release("greedy")  # now below its share: its oldest waiter gets the slot, and hands it on to the next
    for t in threads:
        t.join(LONG)
    assert granted == ["g4", "g5"]
    q.release("greedy")
    q.release("greedy")
    assert [q.acquire(name, 0) for name in ("a", "b", "c", "d")] == [0.0] * 4


def test_one_identitys_leases_leave_bytes_for_the_others() -> None:
    from paraminit_server.plane.leases import LeaseTable

    table = LeaseTable(1000, 64, 60.0, 60.0, max_bytes_per_owner=500)
    try:
        first = table.reserve("greedy", 400)
        with pytest.raises(errors.ResourceExhausted, match="share of 500 leasable bytes") as share:
            table.reserve("greedy", 200)
        assert share.value.reason == "identity_share"
        other = table.reserve("other", 500)  # what the greedy identity could not take
        first.release()
        assert table.reserve("greedy", 500).nbytes == 500
        other.release()
    finally:
        table.close()


# -- through the server -------------------------------------------------------------------------------------------


def _plan(seed: int, n: int) -> Any:
    return plan_of([param("w", [n], {"uniform": {"lo": -1, "hi": 1, "seed": seed}})])


def _digest(arrays: dict[str, np.ndarray[Any, Any]]) -> str:
    return hashlib.sha256(np.ascontiguousarray(arrays["w"]).tobytes()).hexdigest()


def test_callers_beyond_the_limit_are_served_in_turn_with_correct_bytes() -> None:
    """4 callers x 4 calls, STREAM and SHM alternating, on one slot: every call served, byte for byte."""
    n = MiB // 4  # 1 MiB of float32 per call
    with Client() as local:
        expected = {s: _digest(local.materialize(_plan(s, n))) for s in range(4)}
        assert len(set(expected.values())) == 4
    with running_server(max_concurrent=1, max_queued=8, metrics_port=-1) as r:
        got: list[tuple[int, str]] = []
        failures: list[BaseException] = []

        def caller(seed: int) -> None:
            try:
                with Client(target_of(r), timeout=LONG) as c:
                    for k in range(4):
                        if k % 2 == 0:
                            got.append((seed, _digest(c.materialize(_plan(seed, n)))))
                        else:
                            with c.export(_plan(seed, n)) as lease:
                                got.append((seed, _digest(dict(lease.arrays))))
            except BaseException as exc:  # reported below
                failures.append(exc)

        threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * LONG)
        assert not failures
        assert len(got) == 16 and all(d == expected[s] for s, d in got)
        assert r.metrics is not None
        waits = r.metrics.registry.get_sample_value("paraminit_queue_wait_seconds_count")
        assert waits is not None and waits >= 16  # every admitted call is observed, waited or not


def test_a_queued_call_waits_for_the_slot_and_one_without_deadline_is_refused_with_pushback() -> None:
    plan = _plan(7, 4096)
    with Client() as local:
        expected = _digest(local.materialize(plan))
    with running_server(max_concurrent=1, max_queued=4, metrics_port=-1) as r:
        adm = r.plane.admission
        results: list[str] = []
        with adm.admit(0):  # the test holds the only slot

            def queued_call() -> None:
                with Client(target_of(r), timeout=LONG) as c:
                    results.append(_digest(c.materialize(plan)))

            t = threading.Thread(target=queued_call)
            t.start()
            assert wait_until(lambda: adm.slots.queued == 1)
            # a call without a deadline is refused at once (no retries on this raw channel), with a pushback
            with grpc.insecure_channel(target_of(r), options=[("grpc.enable_retries", 0)]) as ch:
                stub = pb_grpc.InitServiceStub(ch)
                with pytest.raises(grpc.RpcError) as busy:
                    list(stub.Materialize(pb.MaterializeRequest(plan=plan)))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(busy.value.trailing_metadata() or ())
            assert int(trailers[PUSHBACK]) > 0
            assert results == []  # still waiting behind the held slot
        t.join(LONG)
        assert results == [expected]
        assert r.metrics is not None
        assert r.metrics.registry.get_sample_value("paraminit_refusals_total", {"method": "Materialize", "reason": "busy"}) == 1


def test_a_refusal_no_retry_can_fix_tells_clients_not_to_retry() -> None:
    with (
        running_server(max_plan_bytes=1024) as r,
        grpc.insecure_channel(target_of(r), options=[("grpc.enable_retries", 0)]) as ch,
        pytest.raises(grpc.RpcError) as over,
    ):
        list(pb_grpc.InitServiceStub(ch).Materialize(pb.MaterializeRequest(plan=_plan(1, 4096))))
    assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(over.value.trailing_metadata() or ())[PUSHBACK] == "-1"


# -- the client's retry policy is gRPC's own, from the service config -------------------------------------------


class _RefusingFirst:
    """A stand-in InitService: the first `refusals` attempts of each RPC fail with `code` (and a pushback
    trailer when given), later attempts succeed. Counts attempts."""

    def __init__(self, refusals: int, code: grpc.StatusCode, pushback: str | None) -> None:
        self.refusals, self.code, self.pushback = refusals, code, pushback
        self.attempts: dict[str, int] = {"GetInfo": 0, "Materialize": 0}
        self.lock = threading.Lock()

    def _refuse(self, method: str, context: grpc.ServicerContext) -> bool:
        with self.lock:
            self.attempts[method] += 1
            refuse = self.attempts[method] <= self.refusals
        if refuse:
            if self.pushback is not None:
                context.set_trailing_metadata(((PUSHBACK, self.pushback),))
            context.abort(self.code, "busy")
        return refuse

    def get_info(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        self._refuse("GetInfo", context)
        return pb.GetInfoResponse(version="stand-in")

    def materialize(self, request: pb.MaterializeRequest, context: grpc.ServicerContext) -> Iterator[pb.MaterializeResponse]:
        self._refuse("Materialize", context)
        yield pb.MaterializeResponse(header=pb.StreamHeader(plan_digest="stand-in"))


@pytest.fixture()
def stand_in() -> Iterator[tuple[grpc.Server, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_insecure_port("127.0.0.1:0")
    yield server, port
    server.stop(0)


def _serve(server: grpc.Server, impl: _RefusingFirst) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "paraminit.v1.InitService",
                {
                    "GetInfo": grpc.unary_unary_rpc_method_handler(
                        impl.get_info,
                        request_deserializer=pb.GetInfoRequest.FromString,
                        response_serializer=pb.GetInfoResponse.SerializeToString,
                    ),
                    "Materialize": grpc.unary_stream_rpc_method_handler(
                        impl.materialize,
                        request_deserializer=pb.MaterializeRequest.FromString,
                        response_serializer=pb.MaterializeResponse.SerializeToString,
                    ),
                },
            ),
        )
    )
    server.start()


@pytest.mark.parametrize(("code", "pushback"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, "1"), (grpc.StatusCode.UNAVAILABLE, None)])
def test_client_retries_refusals_by_grpc_retry_policy(
    stand_in: tuple[grpc.Server, int], code: grpc.StatusCode, pushback: str | None
) -> None:
    server, port = stand_in
    impl = _RefusingFirst(2, code, pushback)
    _serve(server, impl)
    with Client(f"127.0.0.1:{port}", timeout=LONG) as c:
        assert c.info().version == "stand-in"
        streamed = list(c.stub.Materialize(pb.MaterializeRequest(), timeout=LONG))
    assert [m.header.plan_digest for m in streamed] == ["stand-in"]
    assert impl.attempts == {"GetInfo": 3, "Materialize": 3}


def test_client_stops_at_a_negative_pushback_and_after_max_attempts(stand_in: tuple[grpc.Server, int]) -> None:
    server, port = stand_in
    impl = _RefusingFirst(1, grpc.StatusCode.RESOURCE_EXHAUSTED, "-1")
    _serve(server, impl)
    with Client(f"127.0.0.1:{port}", timeout=LONG) as c:
        with pytest.raises(ParaminitError) as refused:
            c.info()
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert impl.attempts["GetInfo"] == 1  # the server said a retry cannot help
        impl.refusals, impl.pushback = 100, "1"
        with pytest.raises(ParaminitError):
            c.info()
    policy = SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]
    assert impl.attempts["GetInfo"] == 1 + policy["maxAttempts"]


def test_the_documented_service_config_is_the_clients() -> None:
    """Other languages copy the README's service config: it must be the one the Python client uses."""
    import json
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", readme, re.S) if "retryPolicy" in b]
    assert blocks == [SERVICE_CONFIG]


def test_a_stream_being_retried_when_its_server_goes_away_still_ends(stand_in: tuple[grpc.Server, int]) -> None:
    """gRPC Python's stream iterator can wait forever when a retried call fails as the server leaves (a
    draining worker); the client reads the first response so that the call's status always gets through."""
    server, port = stand_in
    impl = _RefusingFirst(10**6, grpc.StatusCode.UNAVAILABLE, None)
    _serve(server, impl)
    outcome: list[grpc.StatusCode] = []

    def call() -> None:
        with Client(f"127.0.0.1:{port}", timeout=LONG) as c:
            try:
                c.stream(_plan(1, 4))
            except ParaminitError as err:
                outcome.append(err.code)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert wait_until(lambda: impl.attempts["Materialize"] >= 1)
    server.stop(0)  # the next attempt finds no server
    t.join(LONG)
    assert outcome == [grpc.StatusCode.UNAVAILABLE]


# -- calls without a deadline are refused at once when memory is short -------------------


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


def test_a_stalled_reader_or_uploader_gives_its_slot_back_within_the_stall_limit() -> None:
    """A stream whose client stops reading, and an upload whose client stops sending, are cancelled after
    --max-stall seconds: the one slot goes back and the next caller is served (before, it was held until the
    deadline, or forever without one)."""
    import grpc as grpc_mod

    from paraminit import wire
    from paraminit.v1 import init_service_pb2 as pb
    from paraminit.v1 import init_service_pb2_grpc as pb_grpc

    with running_server(max_concurrent=1, max_queued=4, max_stall=1.0, slab_bytes=1 << 20) as r:
        channel = grpc_mod.insecure_channel(target_of(r))
        stub = pb_grpc.InitServiceStub(channel)
        try:
            big = _plan(1, 64 * MiB // 4)
            call = stub.Materialize(pb.MaterializeRequest(plan=big), timeout=120)
            assert next(call).WhichOneof("msg") == "header"  # then the client reads nothing more
            started = time.monotonic()
            with Client(target_of(r), timeout=60) as other:  # waits in line for the one slot
                got = other.materialize(_plan(2, 1024))
            assert got["w"].size == 1024 and time.monotonic() - started < 30
            with pytest.raises(grpc_mod.RpcError) as stalled:
                for _ in call:
                    pass
            assert stalled.value.code() == grpc_mod.StatusCode.CANCELLED

            go_on = threading.Event()

            def chunks() -> Any:
                yield wire.encode_payload_chunk(memoryview(bytes(4096)), 1, 4096)  # float32
                go_on.wait(60)  # the client stops sending

            upload = channel.stream_unary(
                "/paraminit.v1.InitService/UploadPayload", request_serializer=bytes, response_deserializer=pb.PayloadRef.FromString
            )
            future = upload.future(chunks(), timeout=120)
            time.sleep(0.5)
            started = time.monotonic()
            with Client(target_of(r), timeout=60) as other:
                assert other.materialize(_plan(3, 1024))["w"].size == 1024
            assert time.monotonic() - started < 30
            with pytest.raises(grpc_mod.RpcError) as idle:
                future.result(60)
            assert idle.value.code() == grpc_mod.StatusCode.CANCELLED
            go_on.set()
        finally:
            channel.close()


def test_validate_takes_a_slot_in_turn() -> None:
    """Checking a plan is work (a second of a core for a large one): Validate waits in line for a slot within
    its deadline like Materialize, and without a deadline is refused at once with a pushback when all are
    busy, so one identity's Validate calls cannot crowd out the others."""
    plan = _plan(3, 4096)
    with running_server(max_concurrent=1, max_queued=4, metrics_port=-1) as r:
        adm = r.plane.admission
        reports: list[bool] = []
        with adm.admit(0):  # the test holds the only slot

            def queued_validate() -> None:
                with Client(target_of(r), timeout=LONG) as c:
                    reports.append(c.validate(plan).ok)

            t = threading.Thread(target=queued_validate)
            t.start()
            assert wait_until(lambda: adm.slots.queued == 1)
            with grpc.insecure_channel(target_of(r), options=[("grpc.enable_retries", 0)]) as ch, pytest.raises(grpc.RpcError) as busy:
                pb_grpc.InitServiceStub(ch).Validate(pb.ValidateRequest(plan=plan))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(busy.value.trailing_metadata() or ())[PUSHBACK]) > 0
            assert reports == []  # still in line behind the held slot
        t.join(LONG)
        assert reports == [True]
