"""The service on the GPU backend: STREAM bytes equal the CPU backend's, and CUDA_IPC between two processes.

Skipped without CuPy or a CUDA device. A CUDA IPC handle cannot be opened in the
process that created it, so the client side runs in a child process.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import json_format

from conftest import running_server
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.server import Running

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
try:
    if cp.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
except Exception:  # no driver
    pytest.skip("no usable CUDA driver", allow_module_level=True)

PLAN = plan_of([param("w", [512, 300], {"kaimingUniformForShape": {"seed": 1}}),
                param("e", [1000, 64], {"uniform": {"lo": -2, "hi": 2, "seed": 2}}, "bfloat16"),
                param("h", [333], {"xavierUniform": {"fanIn": 3, "fanOut": 4, "seed": 3}}, "float16"),
                param("d", [8, 8, 8], {"ones": {}}, "float64", region=[(1, 3), (0, 8), (2, 5)])])


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Running, Running]]:
    with running_server(backend="cupy") as gpu, running_server() as cpu:
        yield gpu, cpu


def test_stream_matches_cpu(servers: tuple[Running, Running]) -> None:
    gpu, cpu = servers
    with Client(f"127.0.0.1:{gpu.port}") as g, Client(f"127.0.0.1:{cpu.port}") as c:
        assert g.info().backend == "cupy" and g.info().device.uuid
        a, b = g.materialize(PLAN), c.materialize(PLAN)
    for name in b:
        assert a[name].tobytes() == b[name].tobytes(), name


def test_cuda_ipc_in_a_second_process(servers: tuple[Running, Running]) -> None:
    gpu, cpu = servers
    with Client(f"127.0.0.1:{cpu.port}") as c:
        want = {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in c.materialize(PLAN).items()}
    code = textwrap.dedent(f"""
        import hashlib, sys
        import cupy
        from google.protobuf import json_format
        from paraminit.v1 import plan_pb2
        from paraminit_client import Client
        plan = json_format.Parse({json_format.MessageToJson(PLAN)!r}, plan_pb2.Plan())
        with Client("127.0.0.1:{gpu.port}") as c, c.export(plan, delivery="cuda_ipc") as lease:
            for t in lease.info.tensors:
                assert t.offset % 256 == 0
                print(t.name, hashlib.sha256(cupy.asnumpy(lease.arrays[t.name]).tobytes()).hexdigest())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = dict(line.split() for line in out.stdout.splitlines())
    assert got == want
    with Client(f"127.0.0.1:{gpu.port}") as g:
        assert g.leases() == []


def test_shm_is_refused_on_gpu(servers: tuple[Running, Running]) -> None:
    gpu, _ = servers
    with Client(f"127.0.0.1:{gpu.port}") as g, pytest.raises(ParaminitError) as info:
        g.export(PLAN, delivery="shm")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION

