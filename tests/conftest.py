"""Shared fixtures: plans from vectors.json and a helper to poison buffers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format

from paraminit.v1 import plan_pb2

VECTORS = json.loads((Path(__file__).parent / "vectors.json").read_text())
DTYPE_ENUM = {"float32": plan_pb2.DTYPE_FLOAT32, "float64": plan_pb2.DTYPE_FLOAT64,
              "float16": plan_pb2.DTYPE_FLOAT16, "bfloat16": plan_pb2.DTYPE_BFLOAT16}


def case_param(case: dict[str, Any]) -> plan_pb2.Param:
    p = plan_pb2.Param(name=case["name"], shape=case["shape"], dtype=DTYPE_ENUM[case["dtype"]])
    json_format.ParseDict(case["init"], p.init)
    for start, stop in case.get("region", []):
        p.region.add(start=start, stop=stop)
    return p


def poisoned(n: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A buffer full of NaN (0xFFFF.. bit patterns) so an unwritten element never passes."""
    out = np.empty(n, dtype=dtype)
    out.view(np.uint8).fill(0xFF)
    return out


@pytest.fixture(scope="session")
def cpu_backend() -> Any:
    from paraminit_server.backends.numpy_backend import NumpyBackend

    return NumpyBackend()


def serve_subprocess(env: dict[str, str] | None = None, stderr: Any = None) -> tuple[Any, str]:
    """A real `paraminit serve` process on a free loopback port, waited on until SERVING."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from paraminit_client import Client

    proc = subprocess.Popen([str(Path(sys.executable).parent / "paraminit"), "serve"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL if stderr is None else stderr, text=True,
                            env={**os.environ, "PARAMINIT_PORT": "0", "PARAMINIT_BACKEND": "numpy", **(env or {})})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on [\d.]+:(\d+)", line)
    assert m, line
    target = f"127.0.0.1:{m.group(1)}"
    with Client(target) as c:
        c.wait_ready(300)
    return proc, target
