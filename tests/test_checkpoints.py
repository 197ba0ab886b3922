"""Checkpoint tensors (safetensors files) as plan sources: malformed headers and hostile paths are
INVALID_ARGUMENT, files changing under the read never kill the server, regions read only their bytes, headers
are parsed once per request, the digest covers the contents, and in-process plans read the caller's own files."""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import errors
from paraminit_server.plans import files
from paraminit_server.plans.files import FileChanged
from paraminit_server.plans.snapshot import RequestSnapshot
from support import run_cli, running_server, serve_subprocess, target_of

MiB = 1 << 20


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
    cases = {
        str(d / "loop_a"): "symbolic link",
        str(d / "bad\0name"): "NUL character",
        str(d / "pipe.safetensors"): "not a regular file",
        str(d / "dir.safetensors"): "not a regular file",
        str(d / ("x" * 5000)): "",
    }
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
    sources = RequestSnapshot(r.plane.sources, "someone")
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
            want = arr[region[0][0] : region[0][1], region[1][0] : region[1][1]]
            assert got.tobytes() == want.tobytes(), region
        # the whole tensor as binary64 (64 MiB + its 32 MiB of bytes) does not fit the budget: refused, not read
        with pytest.raises(ParaminitError) as info:
            c.materialize(_ckpt_plan(path, "w", [2048, 4096]))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "checkpoint values" in info.value.message
    assert r.plane.admission.host.reserved == 0  # every reservation went back
    tracemalloc.start()
    try:
        sources = RequestSnapshot(r.plane.sources, "someone")
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


# -- in-process plans read the caller's own files -------------------------------------------------------------------


def test_a_checkpoint_plan_materializes_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(7)
    want = {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    save_file(want, str(tmp_path / "mlp.safetensors"))
    code, plan_json, err = run_cli(capsys, "plan", "from-safetensors", str(tmp_path / "mlp.safetensors"))
    assert code == 0, err
    (tmp_path / "ck.json").write_text(plan_json)
    out = tmp_path / "x.safetensors"
    code, _, err = run_cli(capsys, "materialize", str(tmp_path / "ck.json"), "-o", str(out), "-q")
    assert code == 0, err
    got = load_file(str(out))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_an_explicit_allow_list_in_process_is_enforced_and_named(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from paraminit_client import Client, plan_from_safetensors
    from paraminit_client.errors import ParaminitError

    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(tmp_path / "ck" / "m.safetensors"))
    plan = plan_from_safetensors(tmp_path / "ck" / "m.safetensors")
    with Client(safetensors_dirs=[str(tmp_path / "ck")]) as c:
        assert np.array_equal(c.materialize(plan)["w"], np.arange(6, dtype=np.float32))
    with Client(safetensors_dirs=[str(tmp_path / "elsewhere")]) as c, pytest.raises(ParaminitError) as caught:
        c.materialize(plan)
    assert "not under an allowed directory" in caught.value.message and "elsewhere" in caught.value.message
    with pytest.raises(ValueError, match="in process only"):
        Client("127.0.0.1:1", safetensors_dirs=["/"])


def test_reading_a_local_checkpoint_fails_with_paraminit_errors(tmp_path: Path) -> None:
    """plan_from_safetensors, safetensors_header and inspect raise ParaminitErrors for files: a format error
    (still a ValueError, INVALID_ARGUMENT) and an unreadable file (still an OSError, NOT_FOUND)."""
    from paraminit_client import CheckpointFormatError, FileAccessError, ParaminitError, inspect, plans

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    missing = tmp_path / "missing.safetensors"
    for read in (plans.plan_from_safetensors, plans.safetensors_header, inspect.inspect_file, inspect.read_header):
        with pytest.raises(CheckpointFormatError) as info:
            read(bad)
        err = info.value
        assert isinstance(err, ParaminitError) and isinstance(err, ValueError), read
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and str(bad) in err.message, read
        with pytest.raises(FileAccessError) as gone:
            read(missing)
        assert isinstance(gone.value, OSError) and gone.value.code == grpc.StatusCode.NOT_FOUND, read
