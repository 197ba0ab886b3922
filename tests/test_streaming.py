"""Materialize as a stream through real sockets: bytes equal to the reference, the safetensors header, chunk
framing that fits stock clients, cancellation, failures mid-fill, and a server killed mid-stream."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import reference

from paraminit import dtypes, wire
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.config import ServerConfig
from paraminit_server.rpc.server import Running
from support import digest_of, resolved, running_server, serve_subprocess, server_fixture, target_of, wait_until

server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def mixed_plan() -> plan_pb2.Plan:
    return plan_of(
        [
            param("w", [33, 17], {"kaimingUniformForShape": {"seed": 3}}),
            param("e", [50, 8], {"normal": {"mean": 0.5, "std": 2.0, "seed": 4}}, "bfloat16"),
            param("h", [7], {"uniform": {"lo": -3, "hi": 5, "seed": 5}}, "float16"),
            param("d", [4, 5, 6], {"xavierUniformForShape": {"seed": 6}}, "float64", region=[(1, 3), (0, 5), (2, 5)]),
            param("f", [3], {"flat": {"values": [1.5, -2.25, 3e38]}}, "bfloat16"),
            param("s", [], {"ones": {}}),
        ]
    )


def expected_arrays(plan: plan_pb2.Plan) -> dict[str, np.ndarray[Any, Any]]:
    return {p.name: reference.materialize(p) for p in resolved(plan)}


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
    meta = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 64 == 0
    assert meta["__metadata__"]["plan_digest"] == header.plan_digest == digest_of(plan)
    data = raw[8 + n :]
    for name, want in expected_arrays(plan).items():
        b, e = meta[name]["data_offsets"]
        assert data[b:e] == want.tobytes()
        assert b % want.dtype.itemsize == 0


def test_cancellation_stops_generation_and_frees(server: Running, client: Client) -> None:
    plan = plan_of([param("w", [64 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])  # 256 MiB
    _header, chunks = client.stream(plan)
    for _, _c in zip(range(3), chunks, strict=False):
        pass
    chunks.close()  # type: ignore[attr-defined]  # cancels the call
    assert wait_until(
        lambda: server.plane.admission.in_flight == 0 and not any(t.name == "paraminit-fill" for t in threading.enumerate()), 1.0
    )


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05])
def test_a_call_cancelled_as_it_starts_frees_its_slot(delay: float) -> None:
    """A client that cancels right after starting a call (grpc-js does so with RST_STREAM before or just after
    the request) leaves no slot held: with one slot, the next call is served at once rather than after the
    cancelled call's deadline."""
    plan = plan_of([param("w", [64 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])  # 256 MiB
    small = plan_of([param("x", [4, 4], {"uniform": {"lo": -1, "hi": 1, "seed": 2}})])
    with running_server(max_concurrent=1, queue_wait_no_deadline=0.0) as r, Client(target_of(r)) as c:
        call = c.stub.Materialize(pb.MaterializeRequest(plan=plan), timeout=300)
        time.sleep(delay)
        call.cancel()
        assert wait_until(lambda: r.plane.admission.in_flight == 0, 10, 0.01)
        time.sleep(0.2)  # a handler that started late would hold the slot now
        assert r.plane.admission.in_flight == 0
        assert c.materialize(small)["x"].std() > 0.1


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
    plan = plan_of(
        [
            param("a", [50 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 9}}),  # 200 MiB
            param("b", [25 << 20], {"kaimingUniform": {"fanIn": 3, "seed": 2}}, "float32"),
        ]
    )  # 100 MiB
    got = client.materialize(plan)
    backend = CpuBackend()
    for p in resolved(plan):
        want = np.empty(p.numel, np.float32)
        backend.fill(p, want)
        assert hashlib.sha256(got[p.name].tobytes()).digest() == hashlib.sha256(want.tobytes()).digest()
    head = resolved(plan)[0]
    assert got["a"][:1000].tobytes() == reference.materialize(dataclasses.replace(head, region=((0, 1000),))).tobytes()


def test_unknown_delivery_is_invalid_argument(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Materialize(pb.MaterializeRequest(plan=mixed_plan(), delivery=77)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


MiB = 1 << 20


# -- chunks fit stock clients' 4 MiB receive limit ---------------------------------------


def test_max_chunk_leaves_room_for_framing() -> None:
    limit = 4 * MiB  # grpcio's and grpc-js's default receive limit
    assert ServerConfig().max_chunk_bytes + 64 <= limit
    piece = np.zeros(ServerConfig().max_chunk_bytes, dtype=np.uint8)
    message = wire.encode_chunk(2**63, piece)  # the largest offset varint (the CRC is fixed32)
    assert len(message) + 5 <= limit  # + the gRPC length prefix
    with running_server() as r:
        info = Client(target_of(r)).info()
        assert info.limits.max_chunk_bytes == ServerConfig().max_chunk_bytes
        # a stock client with default options asks for 4 MiB chunks of a 12 MiB plan
        with grpc.insecure_channel(target_of(r)) as ch:
            call = ch.unary_stream(
                "/paraminit.v1.InitService/Materialize",
                request_serializer=pb.MaterializeRequest.SerializeToString,
                response_deserializer=pb.MaterializeResponse.FromString,
            )
            plan = plan_of([param("w", [3 * MiB], {"uniform": {"lo": -1, "hi": 1, "seed": 4}})])
            responses = list(call(pb.MaterializeRequest(plan=plan, chunk_bytes=4 * MiB), timeout=60))
        chunks = [m.chunk for m in responses if m.WhichOneof("msg") == "chunk"]
        assert sum(len(ch.data) for ch in chunks) == 12 * MiB
        assert max(len(ch.data) for ch in chunks) <= info.limits.max_chunk_bytes
        data = b"".join(ch.data for ch in chunks)
        header = responses[0].header
        (t,) = header.tensors
        want = reference.materialize(resolved(plan)[0])
        assert data[t.offset : t.offset + t.nbytes] == want.tobytes()
        assert dtypes.by_enum(t.dtype) is not None


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
        CpuBackend().fill(resolved(plan)[0], want)
        assert got.view(np.uint16).tobytes() == want.tobytes()
    finally:
        proc2.terminate()
        proc2.wait(30)


@pytest.mark.slow
def test_a_slow_reader_gets_the_end_of_its_stream() -> None:
    """The producer finishes long before a reader that takes 0.6 s a slab: the end of the stream waits behind the
    queued slabs however long they take, instead of being dropped after a timed put (which ended such streams
    with "slab producer stopped without a result", an INTERNAL)."""
    import time

    from paraminit_server.plane import engine, layout

    plan = plan_of([param("w", [6 << 18], {"uniform": {"lo": -1, "hi": 1, "seed": 2}})])  # 6 MiB float32
    params = resolved(plan)
    lay = layout.stream_layout(params, digest_of(plan))
    got = []
    for lend in (False, True):
        seen = 0
        for start, slab in engine.iter_slabs(CpuBackend(), lay, 1 << 20, lambda: False, prefetch=2, lend=lend):
            assert start == seen
            seen += len(slab)
            time.sleep(0.6)
        got.append(seen)
    assert got == [lay.data_bytes, lay.data_bytes]


def test_slabs_fill_before_the_first_read() -> None:
    """The producer starts when the slab iterator is made: a stream's first slab fills while its header is
    built and sent. Closing it unread stops the producer."""
    from paraminit_server.plane import engine, layout

    plan = plan_of([param("w", [1 << 18], {"uniform": {"lo": -1, "hi": 1, "seed": 2}})])
    lay = layout.stream_layout(resolved(plan), digest_of(plan))
    started = threading.Event()

    class Recording(CpuBackend):
        def fill(self, *args: Any, **kwargs: Any) -> None:
            started.set()
            super().fill(*args, **kwargs)

    slabs = engine.iter_slabs(Recording(), lay, 1 << 18, lambda: False, prefetch=2, lend=True)
    try:
        assert started.wait(30), "nothing was filled before the first read"
    finally:
        slabs.close()
    assert not any(t.name == "paraminit-fill" and t.is_alive() for t in threading.enumerate())
    with engine.iter_slabs(CpuBackend(), lay, 1 << 18, lambda: False) as again:
        assert b"".join(bytes(s) for _, s in again) == b"".join(
            bytes(s) for _, s in engine.iter_slabs(CpuBackend(), lay, 1 << 20, lambda: False)
        )
