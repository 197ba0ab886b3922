"""The client's transport, chosen once: threads sharing one in-process Client, close(), fork(), one error type."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

from paraminit.v1 import plan_pb2
from paraminit.violations import Violation
from paraminit_client import (
    Client,
    ClientClosed,
    InvalidArgument,
    ParaminitError,
    PlanFileError,
    load_plan,
    param,
    plan_of,
)
from paraminit_client.errors import FileAccessError, violation_from_text
from paraminit_client.grpc_transport import GrpcTransport
from paraminit_client.local_transport import LocalTransport
from paraminit_server.backends import shm
from support import poisoned

THREADS, CALLS = 12, 30


def _segments() -> set[str]:
    """Segments of every process of this user (a forked child's or a subprocess's included)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("paraminit-")}


def _own_segments() -> set[str]:
    """This process's segments: parallel test runs on one host do not see each other's."""
    return {f for f in _segments() if f.startswith(f"paraminit-{shm.instance_tag()}-")}


def mixed_plan() -> plan_pb2.Plan:
    return plan_of(
        [
            param("w", [96, 64], {"kaimingUniformForShape": {"seed": 11}}),
            param("e", [40, 16], {"normal": {"std": 0.02, "seed": 12}}, "bfloat16"),
            param("h", [7], {"uniform": {"lo": -2, "hi": 2, "seed": 13}}, "float16"),
            param("d", [8, 8], {"normal": {"mean": 1, "std": 3, "seed": 14}}, "float64"),
            param("b", [64], {"zeros": {}}),
        ]
    )


def test_twelve_threads_share_one_client_beyond_the_concurrency_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """More threads than concurrency slots: in process the extra calls wait for a slot, none is refused."""
    monkeypatch.setenv("PARAMINIT_MAX_CONCURRENT", "2")  # 12 threads against 2 slots: most calls must wait
    plan = mixed_plan()
    with Client() as c:
        assert isinstance(c.transport, LocalTransport)
        want = c.materialize(plan)
        digest = c.validate(plan).plan_digest
        header, chunks = c.stream(plan)
        want_stream = bytes(header.safetensors_prefix) + b"".join(bytes(ch.data) for ch in chunks)
        assert np.count_nonzero(want["w"]) > 0.99 * want["w"].size
        errors: list[BaseException] = []
        mismatches: list[str] = []
        start = threading.Barrier(THREADS)

        def work(k: int) -> None:
            start.wait()
            for i in range(CALLS):
                try:
                    kind = (k + i) % 5
                    if kind == 0:
                        report = c.validate(plan)
                        got = {"digest": np.frombuffer(report.plan_digest.encode(), np.uint8)} if report.ok else {}
                        ref = {"digest": np.frombuffer(digest.encode(), np.uint8)}
                    elif kind == 1:
                        got, ref = c.materialize(plan), want
                    elif kind == 2:
                        got = {n: poisoned(a.size, a.dtype).reshape(a.shape) for n, a in want.items()}
                        c.materialize_into(plan, got)
                        ref = want
                    elif kind == 3:
                        h, parts = c.stream(plan)
                        raw = bytes(h.safetensors_prefix) + b"".join(bytes(p.data) for p in parts)
                        got = {"stream": np.frombuffer(raw, np.uint8)}
                        ref = {"stream": np.frombuffer(want_stream, np.uint8)}
                    else:
                        with c.export(plan) as lease:
                            got = {n: a.copy() for n, a in lease.arrays.items()}
                        ref = want
                    if set(got) != set(ref) or any(got[n].tobytes() != ref[n].tobytes() for n in ref):
                        mismatches.append(f"thread {k} call {i} kind {kind}")
                except BaseException as exc:  # every failure is reported, not just the first
                    errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, [str(e) for e in errors[:5]]
        assert not mismatches, mismatches[:5]
        assert c.leases() == []


def test_a_closed_client_refuses_every_call_and_exports_nothing() -> None:
    plan = mixed_plan()
    c = Client()
    assert c.materialize(plan)["w"].size == 96 * 64
    before = _own_segments()
    c.close()
    c.close()  # twice is fine
    for call in (
        lambda: c.materialize(plan),
        lambda: c.export(plan),
        lambda: c.validate(plan),
        lambda: c.stream(plan),
        lambda: c.upload_payload(np.ones(4, np.float32)),
        c.leases,
        c.info,
    ):
        with pytest.raises(ClientClosed) as info:
            call()
        assert isinstance(info.value, ParaminitError) and info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "closed" in info.value.message
    with pytest.raises(ParaminitError):
        c.wait_ready(timeout=0.2)
    assert _own_segments() <= before


def test_a_closed_remote_client_refuses_calls() -> None:
    c = Client("127.0.0.1:9")  # nothing is sent: the channel connects lazily
    assert isinstance(c.transport, GrpcTransport) and not c.in_process
    c.close()
    with pytest.raises(ClientClosed):
        c.validate(mixed_plan())
    with pytest.raises(ClientClosed):
        c.materialize(mixed_plan())


FORK_SCRIPT = """
    import json, os, sys
    from paraminit_client import Client, param, plan_of

    plan = plan_of([param("w", [256, 64], {"normal": {"std": 1, "seed": 3}}), param("b", [64], {"ones": {}})])
    out = {}

    def same(lease, want):
        return all(lease.arrays[k].tobytes() == want[k].tobytes() for k in want)

    def wait(pid):
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    c = Client()
    want = c.materialize(plan)
    lease = c.export(plan)
    name = lease.info.shm.segment_name
    out["segment"] = name
    # child 1 exits through sys.exit: atexit hooks and the finalizers it inherited run, in the child
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    out["child_exit"] = wait(pid)
    out["after_exit"] = [os.path.exists("/dev/shm/" + name), same(lease, want)]
    # child 2 releases its copy of the lease and leaves the parent's `with Client()` block, after making
    # and using its own Client()
    with c:
        pid = os.fork()
        if pid == 0:
            code = 0
            with Client() as mine:
                got = mine.materialize(plan)
                if any(got[k].tobytes() != want[k].tobytes() for k in want):
                    code = 3
                with mine.export(plan) as own:
                    if not same(own, want) or own.info.shm.segment_name == name:
                        code = 4
            if lease.release() is not False:
                code = 5
            try:
                c.materialize(plan)
                code = 6  # the parent's in-process data plane is not the child's to use
            except Exception as exc:
                if type(exc).__name__ != "ClientClosed":
                    code = 7
            sys.exit(code)
        out["child_with"] = wait(pid)
        out["after_with"] = [os.path.exists("/dev/shm/" + name), same(lease, want)]
        out["leases"] = [s.lease.lease_id for s in c.leases()] == [lease.lease_id]
    out["after_close"] = os.path.exists("/dev/shm/" + name)
    print(json.dumps(out))
"""


def test_a_forked_child_frees_nothing_of_its_parents(tmp_path: Path) -> None:
    """A child that exits (atexit, inherited finalizers) or leaves the parent's `with Client()` block leaves
    the parent's export mapped and correct; the child's own Client() works; the parent's close() frees it."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent(FORK_SCRIPT))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["child_exit"] == 0 and out["after_exit"] == [True, True], out
    assert out["child_with"] == 0, (out, run.stderr[-3000:])
    assert out["after_with"] == [True, True] and out["leases"], out
    assert out["after_close"] is False, out  # the parent's own close() does free it
    assert out["segment"] not in _segments()


# -- one error vocabulary -------------------------------------------------------------------------------------------


def test_every_client_error_is_a_paraminit_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [{"name": "w", "shape": [4], "init": {"unifrom": {}}}]}')
    with pytest.raises(ParaminitError) as info:
        load_plan(bad)
    assert isinstance(info.value, PlanFileError) and isinstance(info.value, ValueError)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unifrom" in str(info.value)
    assert [v.field for v in info.value.violations] == ["params[0].init"] and info.value.violations[0].index == -1
    with pytest.raises(ParaminitError) as missing:
        load_plan(tmp_path / "absent.json")
    assert isinstance(missing.value, FileAccessError)
    assert isinstance(missing.value, OSError) and missing.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ParaminitError) as refused:
        Client([])
    assert isinstance(refused.value, InvalidArgument) and isinstance(refused.value, ValueError)
    with Client() as c:
        with pytest.raises(ParaminitError) as wrong:
            c.export(mixed_plan(), delivery="tcp")
        assert isinstance(wrong.value, InvalidArgument)
        with pytest.raises(ParaminitError):
            c.upload_payload(np.ones(3, np.int32))
        with pytest.raises(ParaminitError):
            c.materialize_to_file(mixed_plan(), tmp_path / "no" / "such" / "dir.safetensors")


def test_plan_builders_and_adapters_raise_paraminit_errors() -> None:
    """The plan builders and the framework adapters refuse bad arguments with the client's error too."""
    from paraminit_client.plans import zip_plan

    with pytest.raises(ParaminitError) as short:
        zip_plan([("a", [2]), ("b", [3])], [plan_pb2.Init()])
    assert isinstance(short.value, InvalidArgument) and "shorter" in str(short.value)
    torch = pytest.importorskip("torch")
    from paraminit_client.distributed import materialize_region
    from paraminit_client.torch import plan_from_module

    with pytest.raises(ParaminitError, match="policy must be one of"):
        plan_from_module(torch.nn.Linear(2, 2, device="meta"), 0, policy=cast(Any, "bogus"))
    with Client() as c, pytest.raises(ParaminitError, match="ranges but"):
        materialize_region(param("w", [4, 4], {"ones": {}}), [(0, 2)], c)


def test_one_violation_type_from_validate_errors_and_both_transports() -> None:
    bad = plan_of([param("a", [2], {"uniform": {"lo": 1, "hi": 0}}), param("a", [0], {"normal": {"std": -1}})])
    with Client() as c:
        report = c.validate(bad)
        with pytest.raises(ParaminitError) as info:
            c.materialize(bad)
    assert not report.valid and all(type(v) is Violation for v in report.violations)
    assert all(type(v) is Violation for v in info.value.violations)
    assert info.value.violations == report.violations and len(report.violations) == 3
    assert report.lines() == [str(v) for v in report.violations]
    assert report.violations[0].index == 0 and report.violations[0].name == "a"


@pytest.mark.parametrize(
    "v",
    [
        Violation(3, "fc.weight", "params[3].init.normal", "std must be > 0"),
        Violation(0, "odd'): name\"", "params[0].name", "duplicate name: odd"),
        Violation(-1, "", "params", "plan needs 9 bytes, over the limit of 8", "limit"),
    ],
)
def test_a_bad_request_description_parses_back_to_its_violation(v: Violation) -> None:
    assert violation_from_text(v.field, str(v), v.category) == v
    assert violation_from_text(v.field, "something else entirely", v.category).message == "something else entirely"


def test_file_access_error_keeps_the_os_error() -> None:
    err = FileAccessError(FileNotFoundError(2, "No such file or directory", "/x/y"))
    assert err.errno == 2 and err.filename == "/x/y" and "No such file" in str(err)
    assert isinstance(err, ParaminitError) and err.code == grpc.StatusCode.NOT_FOUND
    other: Any = FileAccessError(OSError(28, "No space left on device", "/z"))
    assert other.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_lease_keeps_its_transport_when_the_client_is_gone() -> None:
    """`Client().export(plan)` without keeping the Client: the lease still holds the data plane."""
    plan = mixed_plan()
    lease = Client().export(plan)
    gc.collect()
    name = lease.info.shm.segment_name
    assert name in _segments()
    assert np.count_nonzero(lease.arrays["w"]) > 0.99 * lease.arrays["w"].size
    assert lease.release() is True
    assert name not in _segments()
