"""Helpers shared by the tests (`from support import ...`): plans from vectors.json, poisoned buffers,
servers in process and in subprocesses, the CLI in process. Fixtures and hooks stay in conftest.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_client import Client, cli
from paraminit_server.config import ServerConfig
from paraminit_server.plans import validation
from paraminit_server.plans.columns import ParamTable
from paraminit_server.rpc.server import Running, start

VECTORS = json.loads((Path(__file__).parent / "vectors.json").read_text())
CASES: list[dict[str, Any]] = VECTORS["cases"]


def import_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk meets (each closed by its first repeated module)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(g):
        if name not in state:
            visit(name, [name])
    return found


def resolved(plan: plan_pb2.Plan, sources: Any = None) -> ParamTable:
    """A valid plan's resolved table, from the check's one sweep (validation.check)."""
    got = validation.check(plan, None, sources)
    assert got.params is not None, [str(v) for v in got.report.violations]
    return got.params


def digest_of(plan: plan_pb2.Plan, sources: Any = None) -> str:
    """A plan's digest, as the check's sweep gives it (with `sources`: the content its references use)."""
    return validation.check(plan, None, sources, resolve=False).digest


def vector_cases() -> list[Any]:
    """Every case of vectors.json as pytest params, named by the case."""
    return [pytest.param(c, id=c["name"]) for c in CASES]


def case_param(case: dict[str, Any]) -> plan_pb2.Param:
    p = plan_pb2.Param(name=case["name"], shape=case["shape"], dtype=dtypes.by_name(case["dtype"]).enum)
    json_format.ParseDict(case["init"], p.init)
    for lo, hi in case.get("region", []):
        p.region.add(start=lo, stop=hi)
    return p


def poisoned(n: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A buffer full of NaN (0xFFFF.. bit patterns) so an unwritten element never passes."""
    out = np.empty(n, dtype=dtype)
    out.view(np.uint8).fill(0xFF)
    return out


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll until predicate() is truthy; False once the timeout passes (assert on the result)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@contextlib.contextmanager
def running_server(instance: Any = None, **config: Any) -> Iterator[Running]:
    """An in-process server on a free loopback port, SERVING when entered, stopped (leases freed) on exit.
    `instance`: a backend object to use instead of the one config.backend names."""
    config.setdefault("backend", "cpu")
    running = start(ServerConfig(host="127.0.0.1", port=0, **config), backend=instance, warm_up_async=False)
    try:
        yield running
    finally:
        running.stop(grace=0)


def server_fixture(scope: Any = "module", **config: Any) -> Any:
    """A `server` fixture for a test module: `server = server_fixture(max_plan_bytes=...)`."""

    @pytest.fixture(scope=scope)
    def server() -> Iterator[Running]:
        with running_server(**config) as running:
            yield running

    return server


def target_of(running: Running) -> str:
    return f"127.0.0.1:{running.port}"


def serve_subprocess(env: dict[str, str] | None = None, stderr: Any = None) -> tuple[Any, str]:
    """A real `paraminit-server` process on a free loopback port, waited on until SERVING."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "paraminit-server")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if stderr is None else stderr,
        text=True,
        env={**os.environ, "PARAMINIT_PORT": "0", "PARAMINIT_BACKEND": "cpu", **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on [\d.]+:(\d+)", line)
    assert m, line
    target = f"127.0.0.1:{m.group(1)}"
    with Client(target, timeout=5) as c:

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"paraminit-server exited with {proc.returncode} before SERVING")
            try:
                return c.health() == "SERVING"
            except Exception:
                return False

        assert wait_until(up, 300, 0.05), "paraminit-server not SERVING after 300 s"
    return proc, target


def scanner_seed(root: Path) -> Path:
    """A kernel-cache seed (PARAMINIT_JIT_CACHE_SEED) holding the plan scanner's compiled kernels and nothing else,
    copied from this process's cache: a server given it and an empty NUMBA_CACHE_DIR compiles every fill kernel
    but not the scanner (which has its own cold-compile test, test_jit_cache.py)."""
    import shutil

    from numba.core.caching import _CacheLocator

    from paraminit_server.plans import scanner, scanner_kernels

    scanner.warm_up()  # loads (or compiles) the scanner into this process's cache
    source = Path(scanner_kernels.count._cache._cache_path)
    where = root / "numba" / _CacheLocator.get_suitable_cache_subpath(scanner_kernels.__file__)
    where.mkdir(parents=True)
    copied = [shutil.copy2(f, where) for f in source.glob("scanner_kernels.*.nb[ic]")]
    assert any(str(f).endswith(".nbi") for f in copied), f"no scanner kernels cached in {source}"
    return root


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """cli.main in this process: (exit code, stdout, stderr); argparse exits become codes."""
    try:
        code = cli.main(list(argv))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def fake_madvise(code: int, calls: list[int] | None = None) -> Callable[[int, int, int], int]:
    """A stand-in for libc's madvise (paraminit.hostmem._madvise's result) that fails with errno `code`, or
    succeeds doing nothing when `code` is 0; each call's length goes into `calls`."""

    def madvise(addr: int, n: int, advice: int) -> int:
        if calls is not None:
            calls.append(n)
        ctypes.set_errno(code)
        return -1 if code else 0

    return madvise
