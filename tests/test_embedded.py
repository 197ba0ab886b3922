"""Client() with no target: the data plane in this process, with a server's bytes, errors and leases."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.rpc.server import Running
from support import poisoned, resolved, server_fixture, target_of

server = server_fixture()


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("paraminit-")}


def mixed_plan() -> plan_pb2.Plan:
    return plan_of(
        [
            param("w", [300, 70], {"kaimingUniformForShape": {"seed": 5}}),
            param("e", [33, 8], {"normal": {"std": 0.02, "seed": 6}}, "bfloat16"),
            param("h", [5], {"uniform": {"lo": -2, "hi": 2, "seed": 7}}, "float16"),
            param("d", [8, 8], {"normal": {"mean": 1, "std": 3, "seed": 8}}, "float64", region=[(2, 5), (1, 7)]),
            param("s", [], {"ones": {}}),
        ]
    )


@pytest.fixture(scope="module")
def local() -> Any:
    with Client() as c:
        yield c


def test_no_sockets_and_same_bytes_as_a_server(local: Client, server: Running) -> None:
    assert local.in_process and local.target == "in-process"
    before = set(threading.enumerate())
    got = local.materialize(mixed_plan())
    new = [t.name for t in set(threading.enumerate()) - before]
    assert not any(n.startswith(("paraminit-rpc", "grpc")) for n in new), new
    with Client(target_of(server)) as remote:
        want = remote.materialize(mixed_plan())
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert got[name].tobytes() == want[name].tobytes(), name
    assert np.count_nonzero(got["w"]) > 0.99 * got["w"].size


def test_materialize_into_writes_the_callers_arrays(local: Client) -> None:
    plan = mixed_plan()
    want = local.materialize(plan)
    outputs = {k: poisoned(v.size, v.dtype).reshape(v.shape) for k, v in want.items()}
    keep = {k: v.__array_interface__["data"][0] for k, v in outputs.items()}
    local.materialize_into(plan, outputs)
    for k, v in outputs.items():
        assert v.__array_interface__["data"][0] == keep[k]  # in place, not replaced
        assert v.tobytes() == want[k].tobytes(), k


def test_materialize_into_refuses_wrong_arrays_at_both_doors(local: Client, server: Running) -> None:
    """Missing, misshapen, wrong item size, read-only or strided (writes would land in a copy): refused in process
    and over a stream alike, with the same message, before a byte of the caller's arrays is written."""
    plan = plan_of([param("w", [4, 4], {"ones": {}}), param("b", [3], {"ones": {}})])
    readonly = np.zeros((4, 4), np.float32)
    readonly.flags.writeable = False

    def b() -> np.ndarray[Any, Any]:
        return poisoned(3, np.float32)

    cases = [
        ({}, "no output array for parameter 'w'"),
        ({"w": poisoned(16, np.float32).reshape(4, 4)}, "no output array for parameter 'b'"),
        ({"w": poisoned(20, np.float32).reshape(4, 5), "b": b()}, "shape [4, 4] with 4-byte items, got [4, 5] float32"),
        ({"w": poisoned(16, np.float32).reshape(2, 8), "b": b()}, "shape [4, 4] with 4-byte items, got [2, 8] float32"),
        ({"w": poisoned(16, np.float64).reshape(4, 4), "b": b()}, "shape [4, 4] with 4-byte items, got [4, 4] float64"),
        ({"w": poisoned(32, np.float32).reshape(4, 8)[:, ::2], "b": b()}, "C-contiguous array of shape [4, 4]"),
        ({"w": readonly, "b": b()}, "writable C-contiguous array"),
    ]
    with Client(target_of(server)) as remote:
        for outputs, words in cases:
            before = {k: v.tobytes() for k, v in outputs.items()}
            messages = []
            for door in (local, remote):
                with pytest.raises(ParaminitError) as info:
                    door.materialize_into(plan, outputs)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                messages.append(info.value.message)
                assert {k: v.tobytes() for k, v in outputs.items()} == before  # nothing written
            assert messages[0] == messages[1] and words in messages[0], messages
        good = {"w": poisoned(16, np.float32).reshape(4, 4), "b": poisoned(3, np.float32)}
        remote.materialize_into(plan, good)
        assert all(bool((v == 1).all()) for v in good.values())


def test_errors_match_a_server(local: Client, server: Running) -> None:
    bad = plan_of([param("a", [2], {"uniform": {"lo": 1, "hi": 0}}), param("a", [0], {"normal": {"std": -1}})])
    with Client(target_of(server)) as remote, pytest.raises(ParaminitError) as there:
        remote.materialize(bad)
    with pytest.raises(ParaminitError) as here:
        local.materialize(bad)
    assert here.value.code == there.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert here.value.violations == there.value.violations and len(here.value.violations) == 3
    report = local.validate(bad)
    assert not report.valid and len(report.violations) == 3


def test_file_and_export(local: Client, tmp_path: Any) -> None:
    from safetensors.numpy import load_file

    plan = mixed_plan()
    want = local.materialize(plan)
    local.materialize_to_file(plan, tmp_path / "m.safetensors")
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back["w"].tobytes() == want["w"].tobytes() and back["e"].view(np.uint16).tobytes() == want["e"].view(np.uint16).tobytes()
    with local.export(plan) as lease:
        assert lease.arrays["w"].tobytes() == want["w"].tobytes()
        assert [s.lease.lease_id for s in local.leases()] == [lease.lease_id]


def test_close_and_collection_free_everything() -> None:
    c = Client()
    lease = c.export(plan_of([param("w", [1024], {"ones": {}})]))
    name = lease.info.shm.segment_name
    assert name in _segments()
    c.close()
    assert name not in _segments()
    forgotten = Client()
    name = forgotten.export(plan_of([param("w", [1024], {"ones": {}})])).info.shm.segment_name
    assert name in _segments()
    del forgotten
    gc.collect()
    assert name not in _segments()


def test_a_process_that_forgets_close_leaves_no_segment() -> None:
    code = textwrap.dedent("""
        from paraminit_client import Client, param, plan_of
        c = Client()
        lease = c.export(plan_of([param("w", [4096], {"ones": {}})]))
        print(lease.info.shm.segment_name, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip()
    assert name.startswith("paraminit-") and not os.path.exists(f"/dev/shm/{name}")


def test_both_doors_classify_a_failure_alike(caplog: pytest.LogCaptureFixture) -> None:
    """One classifier (errors.classify) for the gRPC edge and the in-process door: a MemoryError is a retryable
    RESOURCE_EXHAUSTED, anything else INTERNAL under an id the log holds with the traceback; only a caller in this
    process sees the exception's text."""
    import grpc

    from paraminit_server import errors
    from paraminit_server.embedded import InProcess
    from paraminit_server.rpc.status import status_for

    oom = status_for(MemoryError(), "Materialize")
    assert oom.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in oom.details
    assert ("grpc-retry-pushback-ms", str(round(errors.MEMORY_RETRY_AFTER * 1000))) in oom.trailing_metadata
    here = InProcess.failure(MemoryError())
    assert here.code == "RESOURCE_EXHAUSTED" and here.message.split(";")[0] == oom.details.split(";")[0]
    with caplog.at_level("ERROR", logger="paraminit.server"):
        edge = status_for(KeyError("secret-ish detail"), "Materialize")
        local = InProcess.failure(KeyError("secret-ish detail"))
    assert edge.code == grpc.StatusCode.INTERNAL and "secret-ish" not in edge.details
    assert local.code == "INTERNAL" and "KeyError" in local.message and "secret-ish detail" in local.message
    ids = [r.error_id for r in caplog.records if hasattr(r, "error_id")]
    assert len(ids) == 2 and ids[0] in edge.details and ids[1] in local.message
    assert all(r.exc_info for r in caplog.records if hasattr(r, "error_id"))
    refused = errors.ResourceExhausted("busy", retry_after=0.5, reason="busy")
    assert errors.classify(refused, "x") is refused


def test_a_call_readies_only_the_kernels_it_fills(server: Running) -> None:
    """In process nothing loads kernels ahead of the calls: validating loads none, a fill loads (or compiles) the
    kinds and dtypes it fills and no others, and its bytes are a server's."""
    from paraminit_server import embedded
    from paraminit_server.plans import plan as planlib

    inproc = embedded.InProcess.start("cpu")
    try:
        assert inproc.validate(mixed_plan()).valid
        backend: Any = inproc.plane.backend
        assert backend._ready_kinds == set() and not backend._ready_all
        spans, _digest, buf = inproc.fill(mixed_plan())
        with Client(target_of(server)) as remote:
            want = remote.materialize(mixed_plan())
        assert [s.name for s in spans] == list(want)
        for s in spans:
            assert buf[s.offset : s.offset + s.nbytes].tobytes() == want[s.name].tobytes(), s.name
        assert backend._ready_kinds == planlib.kinds_of(resolved(mixed_plan())) and not backend._ready_all
    finally:
        inproc.close()
