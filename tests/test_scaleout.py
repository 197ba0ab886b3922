"""One plan split across three `paraminit serve` workers gives one worker's bytes, even when a worker dies."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from paraminit.regions import box_of
from paraminit.v1 import plan_pb2
from paraminit_client import Client, param, plan_of, scaleout
from paraminit_client.arrays import numpy_dtype
from support import serve_subprocess

BIN = Path(sys.executable).parent


@pytest.fixture()
def workers() -> Iterator[list[tuple[subprocess.Popen[str], str]]]:
    procs = [serve_subprocess({"PARAMINIT_CHUNK_BYTES": "65536"}) for _ in range(3)]
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def big_plan() -> plan_pb2.Plan:
    return plan_of(
        [
            param("emb", [4096, 512], {"normal": {"std": 0.02, "seed": 1}}, "bfloat16"),
            param("w1", [2048, 1024], {"kaimingUniformForShape": {"seed": 2}}),
            param("w2", [1024, 2048], {"uniform": {"lo": -0.1, "hi": 0.1, "seed": 3}}, "float16"),
            param("shard", [64, 64, 8], {"xavierUniformForShape": {"seed": 4}}, "float64", region=[(8, 40), (0, 64), (2, 6)]),
            param("b", [1024], {"zeros": {}}),
            param("scalar", [], {"ones": {}}),
        ]
    )


def test_split_is_byte_identical(workers: list[tuple[subprocess.Popen[str], str]]) -> None:
    plan = big_plan()
    with Client(workers[0][1]) as one:
        want = one.materialize(plan)
    landed: list[int] = []
    with Client([t for _, t in workers], split_bytes=1 << 20) as many:
        got = many.materialize(plan, progress=landed.append)
    assert list(got) == list(want)
    total = sum(a.nbytes for a in want.values())
    assert total <= sum(landed) < 2 * total and len(landed) > len(plan.params)  # every chunk (and its padding), once
    for name in want:
        assert got[name].shape == want[name].shape and got[name].tobytes() == want[name].tobytes(), name


def test_worker_killed_mid_plan_is_retried(workers: list[tuple[subprocess.Popen[str], str]]) -> None:
    plan = big_plan()
    with Client(workers[0][1]) as one:
        want = one.materialize(plan)
    victim = workers[1]
    clients = [Client(t) for _, t in workers]
    killed: list[int] = []

    sizes = [int(np.prod([b - a for a, b in box_of(p)])) * numpy_dtype(p.dtype).itemsize for p in plan.params]
    out, views = scaleout.assemble(plan, sizes, [numpy_dtype(p.dtype) for p in plan.params])
    for arr in out.values():
        arr.reshape(-1).view(np.uint8)[:] = 0xA5  # poisoned: every byte below must be written by a stream

    def fetch(c: Client, part: scaleout.Part) -> None:
        if c.target == victim[1] and not killed:
            _header, chunks = c.stream(part.plan)
            next(chunks)  # the stream is in flight ...
            victim[0].send_signal(signal.SIGKILL)  # ... when its worker dies
            killed.append(victim[0].wait(10))
            list(chunks)
            raise AssertionError("a dead worker's stream cannot complete")
        c.materialize_into(part.plan, views(part))  # one target: one stream, in place

    try:
        parts = scaleout.split_plan(plan, sizes, 3, split_bytes=1 << 20)
        scaleout.run_parts(parts, clients, fetch)
    finally:
        for c in clients:
            c.close()
    assert killed == [-signal.SIGKILL]
    for name in want:
        assert out[name].tobytes() == want[name].tobytes(), name
