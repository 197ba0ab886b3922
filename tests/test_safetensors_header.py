"""One strict safetensors header reader: hostile files get the same clean error from the server, `paraminit
inspect` and `paraminit plan from-safetensors`; good files (the safetensors library's own) read the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from paraminit import safetensors_header as sth
from paraminit_client import cli, inspect, plans
from paraminit_server import errors
from paraminit_server.plans.payloads import ValueSources
from paraminit_server.plans.snapshot import RequestSnapshot
from support import run_cli

SECRET = "SECRET_tensor_name_7c1f"  # a name in the file: errors the server sends must not quote it
W = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _file(path: Path, header: Any, data: bytes = b"\0" * 64, length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


# name -> (header, file's header length field or None, what the error says)
HOSTILE: dict[str, tuple[Any, int | None, str]] = {
    "length 2^62": ({"w": W}, 1 << 62, "header length field does not fit the file"),
    "entry is a list": ({"w": W, SECRET: [1, 2]}, None, "the entry is not a JSON object"),
    "float dims": ({"w": W, SECRET: {**W, "shape": [2.0, 2]}}, None, "shape must be a list of non-negative integers"),
    "bool dims": ({"w": W, SECRET: {**W, "shape": [True, 4]}}, None, "shape must be a list of non-negative integers"),
    "2^80 elements": ({"w": W, SECRET: {**W, "shape": [1 << 40, 1 << 40]}}, None, "more than 2^63 - 1 elements"),
    "huge dim": ({"w": W, SECRET: {**W, "shape": [0, 1 << 80]}}, None, "dimension beyond 2^63 - 1"),
    "2^65 bytes": ({"w": W, SECRET: {"dtype": "F64", "shape": [1 << 62], "data_offsets": [0, 16]}}, None, "size overflows"),
    "overlap": ({"w": W, SECRET: {**W, "data_offsets": [8, 24]}}, None, "overlap"),
    "unknown dtype": ({"w": W, SECRET: {**W, "dtype": "F31"}}, None, "not a safetensors dtype"),
    "offsets vs shape": ({"w": W, SECRET: {**W, "data_offsets": [16, 40]}}, None, "inconsistent data_offsets"),
    "past the end": ({"w": W, SECRET: {**W, "shape": [40], "data_offsets": [16, 176]}}, None, "past the end"),
    "metadata values": ({"__metadata__": {"k": 1}, "w": W}, None, "__metadata__ must be an object mapping strings"),
    "duplicate key": (b'{"w": ' + json.dumps(W).encode() + b', "w": ' + json.dumps(W).encode() + b"}", None, "one key twice"),
    "NaN": (b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}', None, "NaN is not JSON"),
    "not UTF-8": (b'{"w\xff": 1}', None, "not UTF-8"),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {
        name: _file(d / f"{name.replace(' ', '_').replace('^', '')}.safetensors", header, length=length)
        for name, (header, length, _) in HOSTILE.items()
    }


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_reader_refuses_each_hostile_file(hostile: dict[str, Path], name: str) -> None:
    with pytest.raises(sth.HeaderError) as info:
        sth.read_file(hostile[name])
    assert HOSTILE[name][2] in str(info.value) and str(hostile[name]) in str(info.value)
    assert SECRET not in info.value.describe(names=False)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_server_refuses_each_hostile_file_without_quoting_it(hostile: dict[str, Path], name: str) -> None:
    path = hostile[name]
    bound = RequestSnapshot(ValueSources(1 << 20, 60.0, [str(path.parent)]), "someone")
    with pytest.raises(errors.InvalidRequest) as info:
        bound.tensor_info(str(path), "w")
    assert info.value.code == "INVALID_ARGUMENT"
    text = str(info.value)
    assert "is not a safetensors file" in text and HOSTILE[name][2] in text, text
    assert SECRET not in text and str(1 << 62) not in text


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_inspect_and_plan_from_safetensors_exit_1_with_one_line(
    hostile: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = hostile[name]
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == cli.EXIT_ERROR and out == "", (code, out)
    assert len(err.strip().splitlines()) == 1 and "not a safetensors file" in err and HOSTILE[name][2] in err, err
    plan = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "plan", "from-safetensors", str(path), "-o", str(plan))
    assert code == cli.EXIT_ERROR and out == "" and not plan.exists(), (code, out)
    assert len(err.strip().splitlines()) == 1 and "not a safetensors file" in err and HOSTILE[name][2] in err, err


def test_commands_in_a_process_of_their_own_print_no_traceback(hostile: dict[str, Path]) -> None:
    exe = str(Path(sys.executable).parent / "paraminit")
    for argv in (["inspect", str(hostile["length 2^62"])], ["plan", "from-safetensors", str(hostile["2^80 elements"])]):
        done = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == cli.EXIT_ERROR and done.stdout == "", (argv, done.stdout)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_files_the_safetensors_library_writes_read_as_it_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "good.safetensors"
    tensors = {
        "b": np.arange(6, dtype=np.float32).reshape(2, 3) + 1,
        "a": np.arange(4, dtype=np.int64) + 7,
        "empty": np.zeros((0, 3), dtype=np.float16),
        "s": np.array(2.5, dtype=np.float64),
    }
    save_file(tensors, str(path), metadata={"plan_digest": "abc"})
    header = sth.read_file(path)
    assert header.metadata == {"plan_digest": "abc"} and set(header.tensors) == set(tensors)
    with safe_open(str(path), "np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            e = header.tensors[name]
            assert e.shape == tuple(f.get_slice(name).get_shape())
            raw = path.read_bytes()[e.start : e.start + e.nbytes]
            assert np.frombuffer(raw, dtype=tensors[name].dtype).tolist() == f.get_tensor(name).ravel().tolist()
    assert [e.name for e in header.in_file_order() if e.nbytes] == sorted(
        (n for n in tensors if tensors[n].size), key=lambda n: header.tensors[n].begin
    )
    # the three consumers accept it
    assert plans.safetensors_header(path)["b"] == {
        "dtype": "F32",
        "shape": [2, 3],
        "data_offsets": [header.tensors["b"].begin, header.tensors["b"].end],
    }
    meta, entries = inspect.read_header(path)
    assert meta == {"plan_digest": "abc"} and {e.name for e in entries} == set(tensors)
    bound = RequestSnapshot(ValueSources(1 << 20, 60.0, [str(tmp_path)]), "someone")
    info = bound.tensor_info(str(path), "b")
    assert info.shape == (2, 3) and info.nbytes == 24 and info.start == header.tensors["b"].start
    with pytest.raises(errors.InvalidRequest, match="has dtype I64"):
        bound.tensor_info(str(path), "a")
    values, compact = bound.tensor_values(str(path), "b", ((1, 2), (0, 3)))
    assert compact and values.tolist() == [4.0, 5.0, 6.0]


def test_inspect_counts_non_finite_values_per_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import ml_dtypes

    path = tmp_path / "nf.safetensors"
    bad = np.array([np.nan, 1.0, np.inf, 2.0, -np.inf, np.nan, 3.0], dtype=np.float32)
    half = np.array([1.0, np.inf, 2.0, 4.0], dtype=ml_dtypes.bfloat16)
    save_file({"bad": bad, "half": half, "clean": np.array([1.0, 3.0], dtype=np.float64)}, str(path))
    code, out, _ = run_cli(capsys, "inspect", str(path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[-3:] == ["mean", "std", "non-finite"], out  # the last column counts them
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows["bad"][-1] == "4" and rows["half"][-1] == "1" and rows["clean"][-1] == "0", out
    assert float(rows["bad"][-3]) == 2.0  # statistics over the finite values
    code, out, _ = run_cli(capsys, "inspect", str(path), "--json")
    counts = {t["name"]: t["nonfinite"] for t in json.loads(out)["tensors"]}
    assert code == 0 and counts == {"bad": 4, "half": 1, "clean": 0}


def test_a_server_answers_invalid_argument_for_each_hostile_file(hostile: dict[str, Path]) -> None:
    import grpc

    from paraminit_client import Client, ParaminitError, param, plan_of
    from support import running_server, target_of

    d = next(iter(hostile.values())).parent
    with running_server(safetensors_dirs=str(d)) as r, Client(target_of(r), timeout=60) as c:
        for name, path in hostile.items():
            plan = plan_of([param("w", [4], {"safetensors": {"path": str(path), "tensor": "w"}})])
            report = c.validate(plan)
            assert not report.valid and any(HOSTILE[name][2] in line for line in report.lines()), report.lines()
            with pytest.raises(ParaminitError) as info:
                c.materialize(plan)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
            assert SECRET not in str(info.value) and "Traceback" not in str(info.value)
