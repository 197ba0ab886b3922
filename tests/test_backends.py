"""The CPU backend's threading: large fills split into spans over its own threads, concurrent callers, no numba
threading layer, and a forked child that fills with threads of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

PROBE = textwrap.dedent("""
    import os, threading, numba, numpy as np
    from paraminit_client import param, plan_of
    from paraminit_server.plans.validation import check
    from paraminit_server.backends import cpu
    from paraminit_server.backends.cpu import CpuBackend
    n = (1 << 20) + 12345  # not a whole number of spans
    p = check(plan_of([param("w", [n], {"normal": {"std": 1.0, "seed": 3}})])).params[0]
    want = np.full(n, np.nan, np.float32); CpuBackend(threads=1).fill(p, want)
    assert not np.isnan(want).any()
    spans = []
    run = cpu.POOL.run
    def counting(threads, count, work):
        spans.append((threads, count)); run(threads, count, work)
    cpu.POOL.run = counting
    b = CpuBackend(threads=2)
    got = np.full(n, np.nan, np.float32); b.fill(p, got)
    assert got.tobytes() == want.tobytes() and spans and spans[0][0] == 2 and spans[0][1] > 2, spans
    outs = [np.full(n, np.nan, np.float32) for _ in range(8)]
    threads = [threading.Thread(target=b.fill, args=(p, o)) for o in outs]  # concurrent callers
    [t.start() for t in threads]; [t.join() for t in threads]
    assert all(o.tobytes() == want.tobytes() for o in outs)
    pid = os.fork()
    if pid == 0:  # the parent's helper threads are gone here: the child must make its own, not wait on them
        child = np.full(n, np.nan, np.float32); b.fill(p, child)
        os._exit(0 if child.tobytes() == want.tobytes() else 3)
    assert os.waitpid(pid, 0)[1] == 0
    try:
        layer = numba.threading_layer()
    except ValueError:  # numba raises this while no parallel kernel has run
        layer = "none"
    print(layer)
""")


@pytest.mark.parametrize("env", [{}, {"NUMBA_THREADING_LAYER": "tbb"}])
def test_large_fills_use_the_backends_threads(env: dict[str, str]) -> None:
    """Bytes equal a one-thread fill whatever the threads, callers or process; and no numba threading layer is
    started, so a layer that cannot load (TBB is not installed here) cannot fail a fill."""
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, "NUMBA_NUM_THREADS": "2", **env}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "none"


@pytest.mark.slow
def test_background_compiles_let_fills_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's warm-up (background) compiles nothing while a fill is asking for kernels, nor for QUIET_SECONDS
    after: a request waits for at most the compile already under way, not for the warm-up's list."""
    import threading

    import numba
    import numpy as np

    from paraminit_server.backends import cpu

    monkeypatch.setattr(cpu, "QUIET_SECONDS", 30.0)  # far longer than this test: only the order is checked
    compiles = cpu._Compiles()

    def request(x: Any) -> Any:
        return x + 1

    def warm(x: Any) -> Any:
        return x + 2

    fg, bg = numba.njit(request), numba.njit(warm)
    arg = (np.zeros(3, np.float32),)
    assert compiles.ensure(fg, arg)
    assert fg.overloads and not bg.overloads
    background = threading.Thread(target=compiles.ensure, args=(bg, arg), kwargs={"background": True})
    background.start()
    background.join(1.0)
    assert background.is_alive() and not bg.overloads  # within the quiet time of the request's compile
    with compiles.turn:
        compiles.last = -cpu.QUIET_SECONDS  # the request is long gone
        compiles.turn.notify_all()  # else the warm-up sees it at its next look, QUIET_SECONDS / 4 later
    background.join(60)
    assert not background.is_alive() and bg.overloads


FORK_PROBE = textwrap.dedent("""
    import os, signal, threading, time, numpy as np
    from paraminit_client import param, plan_of
    from paraminit_server.plans.validation import check
    from paraminit_server.backends import cpu
    from paraminit_server.backends.cpu import CpuBackend
    n = (1 << 20) + 7
    p = check(plan_of([param("w", [n], {"uniform": {"lo": -1, "hi": 1, "seed": 5}})])).params[0]
    b = CpuBackend(threads=2)
    want = np.full(n, np.nan, np.float32); b.fill(p, want)
    held, release = threading.Event(), threading.Event()
    def holder():  # another thread is inside a fill (its pool and compile locks held) when the fork happens
        with cpu.POOL.lock, cpu.COMPILES.lock:
            held.set(); release.wait()
    t = threading.Thread(target=holder); t.start(); held.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child that hangs ends here with SIGALRM, not never
        got = np.full(n, np.nan, np.float32); b.fill(p, got)
        os._exit(0 if got.tobytes() == want.tobytes() else 3)
    release.set(); t.join()
    print(os.waitpid(pid, 0)[1])
""")


def test_a_fork_during_a_fill_leaves_the_child_usable() -> None:
    """A fork while another thread holds the fill pool's and the compile locks: the child starts with fresh ones
    (os.register_at_fork) and fills, instead of waiting forever on locks whose holders it does not have."""
    done = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0"  # not 3 (wrong bytes) nor SIGALRM's 14 (hung)


EXIT_PROBE = textwrap.dedent("""
    import atexit, numpy as np
    from paraminit_client import param, plan_of
    from paraminit_server.plans.validation import check
    from paraminit_server.backends.cpu import CpuBackend
    n = (1 << 21) + 3
    p = check(plan_of([param("w", [n], {"normal": {"std": 1.0, "seed": 9}})])).params[0]
    b = CpuBackend(threads=2)
    want = np.full(n, np.nan, np.float32); CpuBackend(threads=1).fill(p, want)
    def at_exit():  # runs after concurrent.futures stopped taking work: a fill still completes, on this thread
        got = np.full(n, np.nan, np.float32); b.fill(p, got)
        print("same" if got.tobytes() == want.tobytes() else "different", flush=True)
    atexit.register(at_exit)
""")


def test_a_fill_during_interpreter_exit_completes_on_the_calling_thread() -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "cannot schedule new futures" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "same"
