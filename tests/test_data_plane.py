"""The data plane yields layouts and host slabs; the gRPC service layer alone encodes messages."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import crc32c
import numpy as np
import pytest
import reference

from paraminit import wire
from paraminit.spans import ByteSpans
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import param, plan_of
from paraminit_server import errors
from paraminit_server.backends import choice
from paraminit_server.config import ServerConfig
from paraminit_server.plane import materializer
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.materializer import Materializer, StreamStart
from paraminit_server.rpc.service import InitServiceHandlers
from support import resolved

POISON = 0xAB
SMALL_SLABS = {"slab_bytes": 64 << 10, "chunk_bytes": 8 << 10}  # 64 KiB slabs: many more slabs than the ring holds


@pytest.fixture(scope="module")
def plane() -> Iterator[Materializer]:
    plane = Materializer(ServerConfig(backend="cpu", metrics_port=0, **SMALL_SLABS), choice.create("cpu"))
    yield plane
    plane.close()


def uniform_plan(n: int, seed: int) -> Any:
    return plan_of(
        [
            param("w", [n], {"uniform": {"lo": -1, "hi": 1, "seed": seed}}),
            param("b", [333], {"normal": {"std": 0.5, "seed": seed + 1}}, "bfloat16"),
        ]
    )


def expected_data(plan: Any, start: StreamStart) -> np.ndarray[Any, Any]:
    data = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
    for pl, rp in zip(start.layout.placements, resolved(plan), strict=True):
        data[pl.offset : pl.offset + pl.param.nbytes] = reference.materialize(rp).reshape(-1).view(np.uint8)
    return data


def test_stream_yields_a_start_then_host_slabs_that_a_keeping_consumer_owns(plane: Materializer) -> None:
    plan = uniform_plan(96 * 1024, 3)
    items = list(plane.stream(plan, Caller()))  # every slab kept to the end: none may be reused under it
    start, slabs = items[0], items[1:]
    assert isinstance(start, StreamStart) and start.digest
    assert len(slabs) > materializer.PREFETCH + 2
    data = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
    at = 0
    for item in slabs:
        assert isinstance(item, tuple)
        offset, slab = item
        assert isinstance(slab, np.ndarray) and slab.dtype == np.uint8 and offset == at  # in order, no gaps
        data[offset : offset + len(slab)] = slab
        at += len(slab)
    assert at == start.layout.data_bytes
    np.testing.assert_array_equal(data, expected_data(plan, start))
    assert plane.admission.host.reserved == 0 and plane.admission.in_flight == 0


def test_empty_tensors_sharing_an_offset_leave_no_tensor_unfilled(plane: Materializer) -> None:
    """The stream layout puts wider dtypes first, so an empty float64 tensor later in the plan lies at the offset of
    an earlier float32 one: each slab's tensors are still all found (the slab search needs ascending ends; in plan
    order the empty tensor's end fell below the float32's, and the float32's bytes were sent unwritten). The ring
    is dirtied by another plan first, so bytes left unwritten cannot pass for zeros."""
    list(plane.stream(uniform_plan(4096, 9), Caller()))
    plan = plan_of(
        [
            param("w", [5], {"uniform": {"lo": -1, "hi": 1, "seed": 1}}),
            param("a", [1, 0], {"ones": {}}, "float64"),
            param("b", [3], {"normal": {"std": 1.0, "seed": 2}}, "float16"),
            param("c", [0], {"zeros": {}}, "float64"),
        ]
    )
    start, *slabs = plane.stream(plan, Caller())
    assert isinstance(start, StreamStart)
    assert start.layout.offsets[0] == start.layout.offsets[1] == start.layout.offsets[3]  # w, a and c start together
    data = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
    for item in slabs:
        assert isinstance(item, tuple)
        offset, slab = item
        data[offset : offset + len(slab)] = slab
    np.testing.assert_array_equal(data, expected_data(plan, start))


def test_byte_spans_find_every_tensor_of_a_range_whatever_empty_tensors_share_its_offset() -> None:
    """paraminit.spans, the search both a server's slabs and a client's chunks use: table order w, a (empty), b,
    c (empty), with a and c at w's offset and one more empty tensor at b's end."""
    spans = ByteSpans([0, 0, 20, 0, 26], [20, 0, 6, 0, 0])
    assert spans.overlapping(0, 8).tolist() == [0]
    assert spans.overlapping(16, 24).tolist() == [0, 2]
    assert spans.overlapping(20, 26).tolist() == [2]
    assert spans.overlapping(26, 32).tolist() == []
    assert (np.diff(spans.begins) >= 0).all() and (np.diff(spans.ends) >= 0).all()


def test_lent_slabs_come_from_a_ring_and_are_whole_until_the_next_is_asked_for(plane: Materializer) -> None:
    plan = uniform_plan(96 * 1024, 5)
    it = plane.stream(plan, Caller(), lend=True)
    start = next(it)
    assert isinstance(start, StreamStart)
    data = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
    buffers: set[int] = set()
    count = 0
    for item in it:
        assert isinstance(item, tuple)
        offset, slab = item
        buffers.add(slab.__array_interface__["data"][0])
        data[offset : offset + len(slab)] = slab
        count += 1
    assert count > materializer.PREFETCH + 2
    assert len(buffers) <= materializer.PREFETCH + 2  # the ring was reused, not fresh memory per slab
    np.testing.assert_array_equal(data, expected_data(plan, start))


def test_concurrent_encoded_streams_keep_every_message_intact(plane: Materializer) -> None:
    """Two concurrent streams through the service layer, each encoding borrowed slabs; every message kept by
    the consumer until the end decodes, carries its data's CRC32C, and equals the reference."""
    handlers = InitServiceHandlers(plane)
    plans = [uniform_plan(96 * 1024, s) for s in (7, 8)]
    kept: list[list[Any]] = [[], []]
    failed: list[BaseException] = []

    def run(i: int) -> None:
        try:
            kept[i] = list(handlers.stream(pb.MaterializeRequest(plan=plans[i], chunk_bytes=8 << 10), Caller()))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed
    for i in (0, 1):
        header, messages = kept[i][0], kept[i][1:]
        assert isinstance(header, pb.MaterializeResponse) and header.WhichOneof("msg") == "header"
        start = next(x for x in plane.stream(plans[i], Caller()) if isinstance(x, StreamStart))
        out = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
        for raw in messages:
            assert isinstance(raw, bytes)
            c = wire.decode_response(raw)
            assert isinstance(c, wire.Chunk) and crc32c.crc32c(c.data) == c.crc32c
            assert len(c.data) <= 8 << 10
            out[c.offset : c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)
        np.testing.assert_array_equal(out, expected_data(plans[i], start))


def test_a_caller_leaving_mid_stream_cancels_it_and_gives_everything_back(plane: Materializer) -> None:
    here = threading.Event()
    here.set()
    caller = Caller("leaver", active=here.is_set)
    it = plane.stream(uniform_plan(96 * 1024, 9), caller, lend=True)
    assert isinstance(next(it), StreamStart)
    next(it)
    here.clear()
    with pytest.raises(errors.Cancelled):
        for _ in it:
            pass
    assert plane.admission.host.reserved == 0 and plane.admission.in_flight == 0


def test_closing_a_stream_early_gives_everything_back(plane: Materializer) -> None:
    it = plane.stream(uniform_plan(96 * 1024, 10), Caller(), lend=True)
    next(it)
    next(it)
    it.close()
    assert plane.admission.host.reserved == 0 and plane.admission.in_flight == 0


DATA_PLANE = [
    "plane.materializer",
    "plane.engine",
    "plane.admission",
    "ledger",
    "plane.leases",
    "plane.layout",
    "errors",
    "plane.exports",
    "backends.shm",
    "plane.caller",
    "plans.payloads",
    "plans.plan",
    "plans.validation",
    "plans.files",
    "plans.orthogonal",
    "backends",
    "backends.cpu",
    "backends.choice",
    "embedded",
]


def test_the_data_plane_and_the_embedded_door_import_no_transport() -> None:
    """Loading every data-plane module and the embedded door, and streaming, filling, exporting and listing leases
    through that door, leaves grpc and the service's messages unimported: the door answers in the data plane's
    results (paraminit.results), which only the gRPC edge and the client encode."""
    modules = ", ".join(f"paraminit_server.{m}" for m in DATA_PLANE)
    code = (
        f"import sys, {modules}\n"
        "from paraminit import results\n"
        "from paraminit_server import embedded\n"
        "from paraminit.v1 import plan_pb2\n"
        "door = embedded.InProcess(embedded.data_plane())\n"
        "plan = plan_pb2.Plan()\n"
        "plan.params.add(name='w', shape=[1000]).init.ones.SetInParent()\n"
        "items = list(door.stream(plan))\n"
        "assert len(items) == 2 and isinstance(items[0], results.StreamHeader) and items[0].tensors[0].name == 'w'\n"
        "spans, digest, buf = door.fill(plan)\n"
        "assert isinstance(spans, results.SpanTable) and digest == items[0].plan_digest\n"
        "assert bytes(buf.data[:4]) == bytes.fromhex('0000803f')\n"
        "info = door.export(plan, 'shm')\n"
        "assert isinstance(info, results.ExportInfo) and info.shm_name and info.size >= 4000\n"
        "assert [s.lease.lease_id for s in door.leases()] == [info.lease.lease_id] and door.release(info.lease.lease_id)\n"
        "assert isinstance(door.info(), results.ServerInfo)\n"
        "f = door.failure(ValueError('x'))\n"
        "assert isinstance(f, results.Failure) and f.code == 'INTERNAL'\n"
        "door.close()\n"
        "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'grpc_')) or m.endswith('init_service_pb2'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
