"""The gRPC edge: calls that never send their request hold no worker, health answers whatever the load, calls in
flight are bounded per caller, and the servicer's synchronous code still sees cancellation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client
from paraminit_client.plans import param, plan_of
from support import running_server

ALICE = "alice-token-0123456789abcdef"
MALLORY = "mallory-token-0123456789abcdef"
PLAN = plan_of([param("w", [64], {"ones": {}})])
UNARY = ("Validate", "GetInfo", "Materialize", "Release", "Renew", "ListLeases", "Apply", "UploadPayload")


class Silent:
    """Calls on one connection that send their headers and never a request message, until `release`."""

    def __init__(self, target: str, token: str = "") -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.released = threading.Event()
        self.calls: list[Any] = []

    def _never(self) -> Iterator[bytes]:
        self.released.wait(120)
        yield from ()

    def open(self, path: str, n: int) -> None:
        call = self.channel.stream_stream(path, request_serializer=bytes, response_deserializer=bytes)
        for _ in range(n):
            self.calls.append(call(self._never(), metadata=self.metadata))

    def close(self) -> None:
        self.released.set()
        for c in self.calls:
            c.cancel()
        self.channel.close()


def _health_seconds(target: str) -> float:
    with grpc.insecure_channel(target) as ch:
        started = time.perf_counter()
        answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        return time.perf_counter() - started


def test_calls_that_never_send_their_request_hold_no_worker() -> None:
    """Far more header-only calls than workers, on every InitService method, health and reflection: health,
    GetInfo, Validate and a stream are all served at once (grpc's thread-pool server gave each silent call a
    worker until its body came, and with 4 workers nothing else was answered)."""
    with running_server(workers=4, max_stall=60) as r:
        target = f"127.0.0.1:{r.port}"
        silent = Silent(target)
        try:
            for method in UNARY:
                silent.open(f"/paraminit.v1.InitService/{method}", 6)
            silent.open("/grpc.health.v1.Health/Check", 8)
            silent.open("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", 8)
            silent.open("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", 8)
            assert _wait_in_flight(r, 6 * len(UNARY) + 16)
            assert _health_seconds(target) < 1.0
            with Client(target, timeout=10) as c:
                assert c.info().version
                assert c.validate(PLAN).ok
                assert c.materialize(PLAN)["w"].tolist() == [1.0] * 64
            with grpc.insecure_channel(target) as ch:
                asked = reflection_pb2.ServerReflectionRequest(list_services="")
                answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([asked]), timeout=5)
                names = {s.name for a in answers for s in a.list_services_response.service}
                assert "paraminit.v1.InitService" in names
        finally:
            silent.close()


def _wait_in_flight(r: Any, n: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.edge.in_flight >= n:
            return True
        time.sleep(0.01)
    return False


def test_a_call_whose_request_never_comes_ends_at_the_stall_limit() -> None:
    with running_server(max_stall=1) as r:
        silent = Silent(f"127.0.0.1:{r.port}")
        try:
            silent.open("/paraminit.v1.InitService/Validate", 1)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(silent.calls[0])
            assert info.value.code() == grpc.StatusCode.CANCELLED
            assert "--max-stall" in (info.value.details() or "")
            assert time.monotonic() - started < 10
            assert _wait_drained(r)
        finally:
            silent.close()


def test_a_unary_call_without_a_request_message_is_invalid() -> None:
    with running_server() as r, grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
        call = ch.stream_unary("/paraminit.v1.InitService/Validate", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as info:
            call(iter(()), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs a request message" in (info.value.details() or "")


def test_calls_in_flight_are_bounded_and_one_caller_leaves_room_for_others() -> None:
    """--max-rpcs 8: one identity's silent calls take at most 6; its next is refused on its headers with
    RESOURCE_EXHAUSTED, while another identity, and health, are still served."""
    with running_server(max_rpcs=8, max_stall=60, auth_tokens=f"alice:{ALICE},mallory:{MALLORY}") as r:
        target = f"127.0.0.1:{r.port}"
        silent = Silent(target, MALLORY)
        try:
            silent.open("/paraminit.v1.InitService/Validate", 6)
            assert _wait_in_flight(r, 6)
            silent.open("/paraminit.v1.InitService/GetInfo", 1)
            with pytest.raises(grpc.RpcError) as info:
                list(silent.calls[-1])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-rpcs 8" in (info.value.details() or "")
            silent.open("/grpc.health.v1.Health/Check", 20)  # health is never counted, nor refused
            assert _health_seconds(target) < 1.0
            with Client(target, token=ALICE, timeout=10) as alice:
                assert alice.validate(PLAN).ok
                assert alice.info().version
        finally:
            silent.close()
        assert _wait_drained(r)


def _wait_drained(r: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.edge.in_flight == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_client_that_cancels_a_stream_stops_its_worker() -> None:
    """The servicer runs on a worker: a client that leaves mid-stream makes its context inactive there, the
    stream's generator closes and its slot goes back (the next call on a one-slot server is served)."""
    big = plan_of([param("w", [64 << 20], {"uniform": {"lo": -1.0, "hi": 1.0}})])
    with running_server(max_concurrent=1, max_concurrent_per_client=1) as r:
        target = f"127.0.0.1:{r.port}"
        with grpc.insecure_channel(target) as ch:
            from paraminit.v1 import init_service_pb2_grpc as pb_grpc

            answers = pb_grpc.InitServiceStub(ch).Materialize(pb.MaterializeRequest(plan=big), timeout=60)
            next(answers)
            answers.cancel()
        assert _wait_drained(r)
        deadline = time.monotonic() + 10
        while r.plane.admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.plane.admission.in_flight == 0
        with Client(target, timeout=10) as c:
            assert c.materialize(PLAN)["w"].tolist() == [1.0] * 64
