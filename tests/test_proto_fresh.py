"""The committed generated contract code equals what `make proto` produces now."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    if shutil.which("protoc-gen-mypy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mypy-protobuf is not installed")
    src = ROOT / "proto"
    protos = sorted(str(p.relative_to(src)) for p in (src / "paraminit/v1").glob("*.proto"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(src),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            "--include_source_info",
            f"--descriptor_set_out={tmp_path / 'contract.binpb'}",
            *protos,
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    stale = []
    for proto in protos:
        stem = proto.removesuffix(".proto")
        for suffix in GENERATED:
            fresh = (tmp_path / (stem + suffix)).read_bytes()
            committed = (src / (stem + suffix)).read_bytes()
            if fresh != committed:
                stale.append(stem + suffix)
    if (tmp_path / "contract.binpb").read_bytes() != (src / "paraminit/v1/contract.binpb").read_bytes():
        stale.append("paraminit/v1/contract.binpb")
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
