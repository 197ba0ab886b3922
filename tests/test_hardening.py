"""Hostile input and faults: limits reserved atomically, overflowing indices, pooled memory, deadlines, framing.

Each test here names the hardening item it covers; the others live in test_security.py,
test_payloads.py and test_reliability.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import reference
from safetensors.numpy import save_file

from conftest import running_server, serve_subprocess, target_of, wait_until
from paraminit import dtypes, overlap, wire
from paraminit.header_checksum import header_crc32c
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import errors, files
from paraminit_server import plan as planlib
from paraminit_server.caller import Caller
from paraminit_server.config import ServerConfig
from paraminit_server.files import FileChanged
from paraminit_server.materializer import PayloadPiece
from paraminit_server.payloads import BoundSources
from paraminit_server.server import start

MiB = 1 << 20
BIN = Path(sys.executable).parent


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
    piece = np.zeros(ServerConfig().max_chunk_bytes, dtype=np.uint8)
    message = wire.encode_chunk(2**63, piece)  # the largest offset varint (the CRC is fixed32)
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


# -- checkpoints: items 1, 3, 5, 7, 14, 16 ------------------------------------------------------


def _write_raw(path: Path, header: Any, data: bytes = b"\0" * 64) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def _ckpt_plan(path: Path, tensor: str, shape: list[int], region: list[tuple[int, int]] | None = None) -> Any:
    p = param(tensor, shape, {"safetensors": {"path": str(path), "tensor": tensor}})
    for lo, hi in region or []:
        p.region.add(start=lo, stop=hi)
    return plan_of([p])


GOOD = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
MALFORMED: dict[str, tuple[Any, str]] = {
    "missing offsets": ({"w": {"dtype": "F32", "shape": [4]}}, "data_offsets must be a list of two integers"),
    "three offsets": ({"w": {**GOOD, "data_offsets": [0, 8, 16]}}, "data_offsets must be a list of two integers"),
    "string offsets": ({"w": {**GOOD, "data_offsets": ["0", "16"]}}, "data_offsets must be a list of two integers"),
    "negative offsets": ({"w": {**GOOD, "data_offsets": [-16, 0]}}, "inconsistent data_offsets"),
    "list dtype": ({"w": {**GOOD, "dtype": ["F32"]}}, "has dtype"),
    "null shape": ({"w": {**GOOD, "shape": None}}, "shape must be a list of non-negative integers"),
    "null dim": ({"w": {**GOOD, "shape": [None]}}, "shape must be a list of non-negative integers"),
    "string shape": ({"w": {**GOOD, "shape": ["4"]}}, "shape must be a list of non-negative integers"),
    "float shape": ({"w": {**GOOD, "shape": [4.0]}}, "shape must be a list of non-negative integers"),
    "NaN shape": (b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}', "not a safetensors file"),
    "list header": ([GOOD], "is a JSON list, not an object"),
    "deep nesting": (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "entry not an object": ({"w": [1, 2]}, "the entry is not a JSON object"),
    "past the end": ({"w": {**GOOD, "shape": [40], "data_offsets": [0, 160]}}, "past the end of the file"),
}


@pytest.fixture(scope="module")
def ckpt_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("hostile")
    with running_server(safetensors_dirs=str(d), memory_budget=32 * MiB) as r:
        yield r, d


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_headers_are_invalid_argument(ckpt_server: Any, case: str) -> None:
    r, d = ckpt_server
    header, expected = MALFORMED[case]
    path = _write_raw(d / f"{case.replace(' ', '_')}.safetensors", header)
    plan = _ckpt_plan(path, "w", [4])
    with Client(target_of(r), timeout=60) as c:
        report = c.validate(plan)
        assert not report.valid and any(expected in line for line in report.lines()), report.lines()
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert any(expected in v.description for v in info.value.violations)


def test_hostile_paths_are_invalid_argument(ckpt_server: Any) -> None:
    r, d = ckpt_server
    (d / "loop_a").symlink_to(d / "loop_b")
    (d / "loop_b").symlink_to(d / "loop_a")
    os.mkfifo(d / "pipe.safetensors")
    (d / "dir.safetensors").mkdir()
    cases = {str(d / "loop_a"): "symbolic link", str(d / "bad\0name"): "NUL character",
             str(d / "pipe.safetensors"): "not a regular file", str(d / "dir.safetensors"): "not a regular file",
             str(d / ("x" * 5000)): ""}
    with Client(target_of(r), timeout=30) as c:
        for path, expected in cases.items():
            plan = plan_of([param("w", [4], {"safetensors": {"path": path, "tensor": "w"}})])
            report = c.validate(plan)
            assert not report.valid and any(expected in line for line in report.lines()), (path[:80], report.lines())
            with pytest.raises(ParaminitError) as info:
                c.materialize(plan)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value


def test_fifo_never_blocks_the_server(ckpt_server: Any) -> None:
    """16 Validates naming a FIFO (nobody writes it) answer at once; health and other calls keep working."""
    r, d = ckpt_server
    fifo = d / "fifo16.safetensors"
    os.mkfifo(fifo)
    plan = plan_of([param("w", [4], {"safetensors": {"path": str(fifo), "tensor": "w"}})])
    with Client(target_of(r), timeout=20) as c, ThreadPoolExecutor(16) as pool:
        reports = list(pool.map(lambda _: c.validate(plan), range(16)))
        assert all(not rep.valid and "not a regular file" in " ".join(rep.lines()) for rep in reports)
        assert c.health() == "SERVING"


def test_checkpoint_truncated_under_the_read_is_an_error_not_a_signal(ckpt_server: Any) -> None:
    """The header is read, then the file shrinks before its data is: INVALID_ARGUMENT, never SIGBUS."""
    r, d = ckpt_server
    path = d / "shrinks.safetensors"
    save_file({"w": np.arange(1 << 16, dtype=np.float32)}, str(path))
    sources = BoundSources(r.plane.sources, "someone")
    assert sources.tensor_info(str(path), "w").shape == (1 << 16,)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(errors.InvalidRequest, match="changed while"):
        sources.tensor_values(str(path), "w")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FileChanged, match="changed while it was read"):
            files.pread_exact(fd, 0, size, "shrinks.safetensors")
    finally:
        os.close(fd)


def test_checkpoint_rewritten_during_materializes_never_kills_the_server(tmp_path: Path) -> None:
    """A real server process; a thread truncates and restores a 32 MiB checkpoint while plans read it."""
    path = tmp_path / "flapping.safetensors"
    save_file({"w": np.ones(8 * MiB, np.float32)}, str(path))
    full = path.read_bytes()
    proc, target = serve_subprocess({"PARAMINIT_SAFETENSORS_DIRS": str(tmp_path)})
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            with open(path, "r+b") as f:
                f.truncate(4096)
            with open(path, "r+b") as f:
                f.write(full)

    t = threading.Thread(target=flap, daemon=True)
    try:
        t.start()
        codes = set()
        with Client(target, timeout=60) as c:
            for _ in range(20):
                try:
                    got = c.materialize(_ckpt_plan(path, "w", [8 * MiB]))["w"]
                    assert np.all(got == 1.0)
                    codes.add("OK")
                except ParaminitError as err:
                    codes.add(err.code.name)
        stop.set()
        t.join()
        assert proc.poll() is None, f"server died with {proc.returncode}"
        assert codes <= {"OK", "INVALID_ARGUMENT"}, codes
        with Client(target) as c:
            assert c.health() == "SERVING"
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)


def test_checkpoint_region_reads_only_its_region(ckpt_server: Any) -> None:
    """A 16-byte region of a 32 MiB tensor under a 32 MiB budget: the region's values only, not the tensor's."""
    r, d = ckpt_server
    rng = np.random.default_rng(5)
    arr = rng.standard_normal((2048, 4096)).astype(np.float32)
    path = d / "big.safetensors"
    save_file({"w": arr}, str(path))
    regions = [[(7, 8), (100, 104)], [(3, 9), (5, 7)], [(2040, 2048), (0, 4096)], [(0, 1), (4095, 4096)]]
    with Client(target_of(r), timeout=60) as c:
        for region in regions:
            got = c.materialize(_ckpt_plan(path, "w", [2048, 4096], region))["w"]
            want = arr[region[0][0]:region[0][1], region[1][0]:region[1][1]]
            assert got.tobytes() == want.tobytes(), region
        # the whole tensor as binary64 (64 MiB + its 32 MiB of bytes) does not fit the budget: refused, not read
        with pytest.raises(ParaminitError) as info:
            c.materialize(_ckpt_plan(path, "w", [2048, 4096]))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "checkpoint values" in info.value.message
    assert r.plane.admission.host.reserved == 0  # every reservation went back
    tracemalloc.start()
    try:
        sources = BoundSources(r.plane.sources, "someone")
        values, compact = sources.tensor_values(str(path), "w", ((7, 8), (100, 104)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert compact and values.tolist() == arr[7, 100:104].astype(np.float64).tolist()
    assert peak < 4 * MiB, peak  # one read window, not the 96 MiB of the whole tensor


def test_headers_are_parsed_once_per_file_per_request(ckpt_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    r, d = ckpt_server
    n = 4000
    path = d / "many.safetensors"
    save_file({f"t{i}": np.full(2, i, np.float32) for i in range(n)}, str(path))
    plan = plan_of([param(f"t{i}", [2], {"safetensors": {"path": str(path), "tensor": f"t{i}"}}) for i in range(n)])
    calls: list[int] = []
    real = files.read_header
    monkeypatch.setattr(files, "read_header", lambda *a: calls.append(1) or real(*a))
    with Client(target_of(r), timeout=300) as c:
        assert c.validate(plan).ok
        assert len(calls) == 1
        got = c.materialize(plan)
        assert len(calls) == 2
    assert all(got[f"t{i}"].tolist() == [i, i] for i in range(0, n, 97))


def test_digest_covers_checkpoint_contents(ckpt_server: Any) -> None:
    r, d = ckpt_server
    path = d / "rewritten.safetensors"
    plan = _ckpt_plan(path, "w", [4, 4])
    with Client(target_of(r)) as c:
        save_file({"w": np.ones((4, 4), np.float32)}, str(path))
        first = c.validate(plan).plan_digest
        header, chunks = c.stream(plan)
        list(chunks)
        assert header.plan_digest == first  # Validate and Materialize name the same bytes alike
        save_file({"w": np.full((4, 4), 2.0, np.float32)}, str(path))  # same name, shape and size
        second = c.validate(plan).plan_digest
        assert second != first
        save_file({"w": np.ones((4, 4), np.float32)}, str(path))  # the first content again
        assert c.validate(plan).plan_digest == first
        region = _ckpt_plan(path, "w", [4, 4], [(0, 1), (0, 4)])
        before = c.validate(region).plan_digest
        arr = np.ones((4, 4), np.float32)
        arr[3, 3] = 5.0  # outside the region: the bytes used did not change
        save_file({"w": arr}, str(path))
        assert c.validate(region).plan_digest == before
        assert c.validate(plan).plan_digest != first


# -- item 4: uploads in flight count against the payload limit ----------------------------------


def test_concurrent_uploads_cannot_overshoot_the_payload_limit() -> None:
    """Four uploads of 1.5 MiB (float64, kept as uploaded) against a 4 MiB limit, all receiving at once: two fit."""
    count = (3 * MiB // 2) // 8
    go = threading.Event()
    with running_server(max_payload_bytes=4 * MiB) as r:
        plane = r.plane
        values = np.arange(count, dtype=np.float64)
        raw = values.tobytes()
        f64 = dtypes.by_name("float64").enum

        def pieces() -> Any:
            yield PayloadPiece(f64, count, raw[:4096])
            assert go.wait(60)
            yield PayloadPiece(0, 0, raw[4096:])

        results: list[Any] = []

        def upload() -> None:
            try:
                results.append(plane.upload(pieces(), Caller("uploader")))
            except errors.ResourceExhausted as exc:
                results.append(exc)

        threads = [threading.Thread(target=upload) for _ in range(4)]
        for t in threads:
            t.start()
        # the two that do not fit are refused while the other two are still receiving
        assert wait_until(lambda: sum(isinstance(x, errors.ResourceExhausted) for x in results) == 2, 30)
        assert plane.sources.used_bytes() == 2 * count * 8
        go.set()
        for t in threads:
            t.join(60)
        stored = [x for x in results if not isinstance(x, BaseException)]
        assert len(stored) == 2
        assert plane.sources.used_bytes() == 2 * count * 8 <= 4 * MiB
        assert all(np.array_equal(p.values, values) for _, p in stored)

        def failing() -> Any:  # a failed upload gives its bytes back
            yield PayloadPiece(f64, count, raw[:4096])
            raise errors.InvalidRequest("client went away")

        with pytest.raises(errors.ResourceExhausted):
            plane.upload(failing(), Caller("uploader"))  # no room while two are stored
        assert plane.sources.used_bytes() == 2 * count * 8


# -- item 6: error details stay small enough to arrive ------------------------------------------


def test_many_long_violations_arrive_as_invalid_argument() -> None:
    names = [f"model.layers.{i}.self_attention.query_key_value.weight.{'x' * 180}" for i in range(20)]
    plan = plan_of([param(n, [4], {"uniform": {"lo": 1, "hi": 0}}) for n in names]
                   + [param("y" * 10_000, [4], {"normal": {"std": -1}}),
                      param("z", [4], {"safetensors": {"path": "/" + "p" * 4000, "tensor": "t" * 4000}}),
                      param("q", [4], {"flatRef": {"payloadId": "f" * 50_000}})])
    with running_server() as r, Client(target_of(r), timeout=30) as c:
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        err = info.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
        assert err.violations and "uniform lower bound must not exceed the upper bound" in err.violations[0].description
        assert len(err.violations) == 24 and err.omitted == 0  # all of them fit the default trailer limit
        assert len(err.message.encode()) <= 400 and "invalid plan: 24 violation(s)" in err.message  # the 10k name breaks two rules
        report = c.validate(plan)  # Validate's body still carries every violation
        assert len(report.violations) == 24
        with pytest.raises(ParaminitError) as info:  # a 1 MB lease id is echoed cut short
            c.release("L" * (1 << 20))
        assert info.value.code == grpc.StatusCode.NOT_FOUND and len(info.value.message) <= 400


# -- item 17: names, malloc_trim after Validate ---------------------------------------------------


def test_name_length_is_limited() -> None:
    # a budget whose request size limit (materializer.max_request_bytes) lets the 100 MB plan arrive at all
    with running_server(memory_budget=4 << 30, max_concurrent=1) as r, Client(target_of(r), timeout=60) as c:
        plan = plan_of([param("n" * (100 << 20), [1], {"zeros": {}})])  # a 100 MB name
        report = c.validate(plan)
        assert not report.valid and any("bytes long; the limit is 1024" in line for line in report.lines())
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_validate_trims_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    from paraminit_server import admission

    trims: list[int] = []
    monkeypatch.setattr(admission, "trim_heap", lambda: trims.append(1))
    with running_server() as r:
        r.plane.validate(plan_of([param("w", [4], {"zeros": {}})]), Caller())
        assert trims == [1]


def test_heap_is_trimmed_once_after_the_server_stays_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-to-back calls keep their heap: one pending timer however many calls end, no trim while a call
    is in flight or when one came during the wait; the trim (and the message pool's release) comes once the
    server has been idle for a whole wait. Timers are fired by hand, so no timing matters."""
    from paraminit_server import admission

    timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    class Timer:
        def __init__(self, interval: float, fn: Any, args: tuple[Any, ...] = ()) -> None:
            self.entry = (interval, fn, args)
            self.daemon = False

        def start(self) -> None:
            timers.append(self.entry)

    def fire() -> None:
        _, fn, args = timers.pop(0)
        fn(*args)

    trims: list[int] = []
    idles: list[int] = []
    monkeypatch.setattr(admission, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(admission.threading, "Timer", Timer)
    adm = admission.Admission(4, 1 << 30, on_idle=lambda: idles.append(1))
    for _ in range(200):
        with adm.admit(1):
            pass
    assert len(timers) == 1 and timers[0][0] == admission.TRIM_AFTER_IDLE  # one pending, not one per call
    with adm.admit(1):
        fire()  # fires while a call is in flight: nothing, and nothing pending
        assert trims == [] and timers == []
    assert len(timers) == 1  # the call's end starts the wait again
    with adm.admit(1):
        pass
    assert len(timers) == 1  # still one
    fire()  # idle now, but a call came during the wait: wait again
    assert trims == [] and len(timers) == 1
    fire()  # a whole wait without a call
    assert trims == [1] and idles == [1] and timers == []


# -- item 13: the stream header's checksum ------------------------------------------------------


class FlipProxy:
    """A TCP proxy that flips one bit of the first server-to-client occurrence of `pattern` (at `at`)."""

    def __init__(self, upstream: int, pattern: bytes, at: int) -> None:
        self.upstream, self.pattern, self.at = upstream, pattern, at
        self.flipped = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                i = data.find(self.pattern) if flip and not self.flipped.is_set() else -1
                if i >= 0:
                    b = bytearray(data)
                    b[i + self.at] ^= 0x01
                    data = bytes(b)
                    self.flipped.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


HEADER_PLAN = plan_of([param("weight_one", [8, 8], {"uniform": {"lo": -1, "hi": 1, "seed": 1}}),
                       param("bias_two", [8], {"zeros": {}})])


@pytest.mark.parametrize("where", ["prefix", "name", "digest", "offset"])
def test_corrupted_stream_header_is_data_loss_before_anything_is_written(where: str, tmp_path: Path) -> None:
    digest = planlib.digest(HEADER_PLAN)
    patterns = {"prefix": (b'"__metadata__"', 3),  # still JSON, a renamed key
                "name": (b"weight_one", 0),  # the first occurrence is the tensor table's
                "digest": (digest[:16].encode(), 5),
                "offset": (b'"data_offsets":[0,', 16)}  # "[0," -> "[1,"
    pattern, at = patterns[where]
    with running_server() as r:
        proxy = FlipProxy(r.port, pattern, at)
        try:
            with Client(f"127.0.0.1:{proxy.port}", timeout=30) as c:
                with pytest.raises(ParaminitError) as info:
                    c.materialize_to_file(HEADER_PLAN, tmp_path / "out.safetensors")
                assert proxy.flipped.is_set()
                assert info.value.code == grpc.StatusCode.DATA_LOSS and "header checksum" in info.value.message
                assert list(tmp_path.iterdir()) == []  # not even a temporary file
        finally:
            proxy.close()
        with Client(target_of(r)) as c:  # the same stream unproxied is fine and carries the checksum
            header, chunks = c.stream(HEADER_PLAN)
            list(chunks)
            assert header.header_crc32c == header_crc32c(header) != 0


MARKED = np.arange(1, 4097, dtype=np.float32) + np.float32(0.25)  # no value is zero; the marker sits mid-chunk
MARKED_PLAN = plan_of([param("w", [4096], {"flat": {"values": [float(v) for v in MARKED]}})])


@pytest.mark.parametrize("threaded", [True, False], ids=["land-thread", "land-inline"])
@pytest.mark.parametrize("door", ["materialize", "materialize_into", "materialize_to_file", "stream"])
def test_corrupted_chunk_data_is_data_loss_on_every_client_path(door: str, threaded: bool, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One bit flipped in a chunk's data (not its header) fails each way of receiving a stream, with chunks
    landed on a helper thread or inline, and the file path leaves no file behind: every path checks each
    chunk's CRC32C exactly once, wherever it does it."""
    monkeypatch.setattr(overlap, "HELPER_MIN_CPUS", 1 if threaded else 1 << 20)
    with running_server() as r:
        proxy = FlipProxy(r.port, MARKED[3000:3002].tobytes(), 2)
        try:
            with Client(f"127.0.0.1:{proxy.port}", timeout=30) as c, pytest.raises(ParaminitError) as info:
                if door == "materialize":
                    c.materialize(MARKED_PLAN, chunk_bytes=4096)
                elif door == "materialize_into":
                    out = np.full(4096, np.nan, dtype=np.float32)
                    c.materialize_into(MARKED_PLAN, {"w": out})
                elif door == "materialize_to_file":
                    c.materialize_to_file(MARKED_PLAN, tmp_path / "out.safetensors", chunk_bytes=4096)
                else:
                    list(c.stream(MARKED_PLAN, chunk_bytes=4096)[1])
            assert proxy.flipped.is_set()
            assert info.value.code == grpc.StatusCode.DATA_LOSS and "CRC32C mismatch" in info.value.message
            assert list(tmp_path.iterdir()) == []
        finally:
            proxy.close()
        with Client(target_of(r)) as c:  # unproxied, the same plan arrives intact
            np.testing.assert_array_equal(c.materialize(MARKED_PLAN, chunk_bytes=4096)["w"], MARKED)


# -- item 17: Unix sockets, uploads drain at SIGTERM; item 22: startup errors -----------------------


def _server(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "paraminit-server"), "--backend", "cpu", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def test_unix_socket_host_prints_a_usable_address(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    proc = _server(["--host", f"unix:{sock}"])
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = line.split("listening on ", 1)[1].split()[0]
        assert address == f"unix:{sock}", line
        assert oct(sock.stat().st_mode & 0o777) == "0o600"  # the server's user only
        with Client(address) as c:
            c.wait_ready(300)
            assert c.materialize(HEADER_PLAN)["bias_two"].tolist() == [0.0] * 8
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_uploads_in_flight_drain_at_shutdown() -> None:
    """Shutdown (what SIGTERM runs) waits up to --drain-seconds for an upload in flight, not grpc's 1 s."""
    r = start(ServerConfig(host="127.0.0.1", port=0, backend="cpu", drain_seconds=60), warm_up_async=False)
    values = np.arange(1 << 20, dtype=np.float32)
    raw = values.tobytes()
    go = threading.Event()
    result: list[Any] = []

    def chunks() -> Any:
        yield pb.PayloadChunk(dtype=dtypes.by_name("float32").enum, count=values.size,  # type: ignore[arg-type]
                              data=raw[:1 << 20])
        assert go.wait(60)
        for off in range(1 << 20, len(raw), 1 << 20):
            yield pb.PayloadChunk(data=raw[off:off + (1 << 20)])

    def upload() -> None:
        with Client(target_of(r)) as c:
            try:
                result.append(c.transport.call(c.stub.UploadPayload, chunks()))
            except ParaminitError as err:
                result.append(err)

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        assert wait_until(lambda: r.plane.sources._uploads == 1, 30)
        stopper = threading.Thread(target=r.stop)
        stopper.start()
        assert not wait_until(lambda: not stopper.is_alive(), 3.0)  # still draining the upload
        with Client(target_of(r), timeout=5) as probe, pytest.raises(ParaminitError):
            probe.validate(HEADER_PLAN)  # new work is refused meanwhile
    finally:
        go.set()
        uploader.join(60)
    stopper.join(60)
    assert not stopper.is_alive()
    assert not isinstance(result[0], ParaminitError), result[0]
    assert result[0].count == values.size


@pytest.mark.parametrize("args,env", [(["--backend", "foo"], {}), (["--log-format", "jsonx"], {}),
                                      ([], {"PARAMINIT_BACKEND": "foo"}), ([], {"PARAMINIT_LOG_FORMAT": "jsonx"}),
                                      (["--backend", "cupy"], {}), (["--port", "TAKEN"], {}),
                                      (["--host", "unix:/tmp/" + "x" * 120], {})])
def test_startup_errors_are_one_line_and_non_zero(args: list[str], env: dict[str, str]) -> None:
    if "cupy" in args and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        cmd = [str(BIN / "paraminit-server"), *args] if "--backend" in args else \
            [str(BIN / "paraminit-server"), "--backend", "cpu", *args]
        if env:
            cmd = [str(BIN / "paraminit-server"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PARAMINIT_PORT": "0", **env})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("paraminit-server: error:")
