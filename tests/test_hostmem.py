"""Host memory helpers: huge-page buffers, and heap reuse for megabyte messages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

from paraminit.hostmem import HUGE, PREFAULT_BLOCK, host_buffer, prefault

FAULTS = textwrap.dedent("""
    import queue, resource, sys, threading
    from paraminit.hostmem import tune_malloc_for_streams
    changed = tune_malloc_for_streams() if sys.argv[1] == "tune" else False
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    q = queue.Queue(maxsize=4)
    def produce(n):  # what a stream does: 1 MiB messages made on one thread, dropped on another
        for _ in range(n):
            q.put(b"x" * (1 << 20))
        q.put(None)
    def run(n):
        t = threading.Thread(target=produce, args=(n,))
        t.start()
        while q.get() is not None:
            pass
        t.join()
    run(20)
    before = faults()
    run(300)
    print(changed, faults() - before)
""")


def _faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], env={**base, **(env or {})}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_tuned_heap_reuses_megabyte_messages() -> None:
    changed, tuned = _faults("tune")
    _, plain = _faults("plain")
    assert changed == "True"
    assert tuned < plain  # glibc versions differ in how much they reuse untuned; tuned must do better


def test_explicit_malloc_settings_win() -> None:
    changed, _ = _faults("tune", {"MALLOC_ARENA_MAX": "2"})
    assert changed == "False"


def test_host_buffers() -> None:
    for n in (0, 100, HUGE, 3 * HUGE + 5):
        buf = host_buffer(n)
        assert buf.dtype == np.uint8 and buf.shape == (n,) and buf.flags.writeable and buf.flags.c_contiguous
        buf[:] = 0xA5
        assert n == 0 or (buf[0] == 0xA5 and buf[-1] == 0xA5)


def test_prefault_keeps_contents_while_a_writer_runs() -> None:
    """The helper faults pages in without writing them: what the writer put before, during and after stays."""
    assert prefault(host_buffer(HUGE - 1)) is None  # small buffers: nothing to do
    n = 3 * PREFAULT_BLOCK + 12345
    buf = host_buffer(n)
    head = np.arange(HUGE, dtype=np.uint64).view(np.uint8)[:HUGE]
    buf[:HUGE] = head  # written before the helper starts
    t = prefault(buf)
    buf[n - HUGE:] = 0xA5  # written while it may run
    if t is not None:
        t.join(60)
        assert not t.is_alive()
    assert np.array_equal(buf[:HUGE], head)
    assert (buf[n - HUGE:] == 0xA5).all()
    assert not buf[HUGE:n - HUGE].any()  # never-written pages read as zeros, as fresh anonymous memory does
