"""Shared helpers for the benchmark scripts: timing, tables, a `paraminit serve` subprocess."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
PIDS: dict[str, int] = {}  # target -> pid of the serve subprocess behind it


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def fill_gbps(nbytes: int = 256 << 20) -> float:
    """This host's ndarray.fill bandwidth, GB/s (best of 3 over fresh pages touched once): tells hosts apart."""
    import numpy as np

    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(0)
    return a.nbytes / best_of(lambda: a.fill(1), 3) / 1e9


def cpu_model() -> str:
    """The host's CPU model (/proc/cpuinfo) and whether it has AVX-512: machines of one kind differ in both."""
    model, flags = "unknown CPU", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    return f"{model}, {'AVX-512' if ' avx512f' in flags else 'AVX2' if ' avx2' in flags else 'no AVX2'}, {os.cpu_count()} cores"


def host_line() -> str:
    """One line that tells hosts apart, printed above every bench table: CPU model and ndarray.fill GB/s."""
    return f"host: {cpu_model()}; ndarray.fill {fill_gbps():.2f} GB/s"


def table(rows: list[tuple[str, float]], nbytes: int, ref_names: list[str]) -> None:
    """Print GB/s and the ratio of each row to each named reference row."""
    by_name = dict(rows)
    head = f"{'what':<44} {'GB/s':>8}" + "".join(f" {'x ' + r:>18}" for r in ref_names)
    print(head)
    print("-" * len(head))
    for name, seconds in rows:
        line = f"{name:<44} {nbytes / seconds / 1e9:>8.2f}"
        for r in ref_names:
            line += f" {by_name[r] / seconds:>18.2f}" if r in by_name else f" {'-':>18}"
        print(line)


@functools.cache
def warm_kernel_cache() -> None:
    """Compile every CPU kernel into the disk cache, once per bench process, before a server starts: a CPU server
    serves as soon as its cached kernels are loaded and compiles what the cache lacks in the background, which
    would run beside (and slow) the calls a bench times. `prebuild --cpu` shares the compiling out between the
    cores; a warm cache only loads (a second or two)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "paraminit_server.prebuild", "--cpu"], check=True, stdout=subprocess.DEVNULL)
    if time.perf_counter() - t0 > 5:
        print(f"kernel cache: compiled in {time.perf_counter() - t0:.0f} s before the first server")


@contextmanager
def serve(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A `paraminit serve` subprocess on a free loopback port, with the kernel cache complete (warm_kernel_cache);
    yields its target once SERVING."""
    full_env = {**os.environ, "PARAMINIT_PORT": "0", "PARAMINIT_BACKEND": "cpu", **(env or {})}
    if full_env["PARAMINIT_BACKEND"] == "cpu":
        warm_kernel_cache()
    # `python -m paraminit_server`, not the console script: it runs from a source tree on PYTHONPATH too
    proc = subprocess.Popen([sys.executable, "-m", "paraminit_server", *args], stdout=subprocess.PIPE, text=True, env=full_env)
    try:
        assert proc.stdout is not None
        m = re.search(r":(\d+) ", proc.stdout.readline())
        if not m:
            raise RuntimeError("server did not report its port")
        target = f"127.0.0.1:{m.group(1)}"
        PIDS[target] = proc.pid
        from paraminit_client import Client

        with Client(target) as c:
            c.wait_ready(120)
        yield target
    finally:
        proc.terminate()
        proc.wait(30)


def bench_param(init: str, dtype_enum: int, rows: int, cols: int, region: tuple[tuple[int, int], ...] = ()) -> Any:
    """A [rows, cols] paraminit.v1.Param with the benchmarks' fixed settings for each initializer."""
    from paraminit.v1 import plan_pb2

    p = plan_pb2.Param(name=f"{init}_{dtype_enum}", shape=[rows, cols], dtype=dtype_enum)
    i = p.init
    if init == "uniform":
        i.uniform.lo, i.uniform.hi, i.uniform.seed = -0.05, 0.05, 1
    elif init == "normal":
        i.normal.mean, i.normal.std, i.normal.seed = 0.0, 0.02, 2
    elif init == "truncated_normal":  # +-2 sigma: one element in 22 needs another candidate
        t = i.truncated_normal
        t.mean, t.std, t.lo, t.hi, t.seed = 0.0, 0.02, -0.04, 0.04, 7
    elif init == "xavier_uniform":
        i.xavier_uniform.fan_in, i.xavier_uniform.fan_out, i.xavier_uniform.seed = cols, rows, 3
    elif init == "kaiming_uniform":
        i.kaiming_uniform.fan_in, i.kaiming_uniform.seed = cols, 4
    elif init in ("xavier_uniform_for_shape", "kaiming_uniform_for_shape"):
        getattr(i, init).seed = 5 if init.startswith("xavier") else 6
    else:
        getattr(i, init).SetInParent()
    for a, b in region:
        p.region.add(start=a, stop=b)
    return p
