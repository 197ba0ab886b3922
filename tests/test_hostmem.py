"""Host memory: huge-page buffers, heap reuse for megabyte messages, and the heap trimmed once the server stays idle."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from paraminit import hostmem
from paraminit.hostmem import HUGE, MADV_POPULATE_WRITE, POPULATE_SPLIT, PREFAULT_BLOCK, host_buffer, populate, prefault, receive_buffer
from paraminit_client import param, plan_of
from paraminit_server.plane.caller import Caller
from support import fake_madvise, running_server, wait_until

# Reads glibc's own accounting (mallinfo2) rather than page faults: which arena a new thread gets, and so
# how many fresh pages it touches, varies from run to run; whether a message is a mapping of its own, and
# whether freed messages stay in the heap, does not.
HEAP = textwrap.dedent("""
    import ctypes, queue, sys, threading
    from paraminit.hostmem import tune_malloc_for_streams
    changed = tune_malloc_for_streams() if sys.argv[1] == "tune" else False
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print("skip"); sys.exit()
    libc.mallinfo2.restype = Info
    q = queue.Queue(maxsize=4)
    def produce(n):  # what a stream does: 1 MiB messages made on one thread, dropped on another
        for _ in range(n):
            q.put(b"x" * (1 << 20))
        q.put(None)
    mapped_before = libc.mallinfo2().hblkhd
    t = threading.Thread(target=produce, args=(300,))
    t.start()
    mapped = 0  # messages that were a mapping of their own (an mmap now, a munmap when dropped)
    while (m := q.get()) is not None:
        mapped += libc.mallinfo2().hblkhd >= mapped_before + len(m)
        del m
    t.join()
    print(changed, mapped, libc.mallinfo2().fordblks)
""")


def _heap(mode: str, env: dict[str, str] | None = None) -> tuple[str, int, int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", HEAP, mode], env={**base, **(env or {})}, capture_output=True, text=True, check=True
    ).stdout.split()
    if out == ["skip"]:
        pytest.skip("no glibc mallinfo2 here")
    return out[0], int(out[1]), int(out[2])


def test_tuned_heap_reuses_megabyte_messages() -> None:
    changed, mapped, free_kept = _heap("tune")
    assert changed == "True"
    assert mapped == 0  # every message came from the heap
    assert free_kept >= 4 << 20  # the queue held 4 at once; dropping them gave nothing back to the system


def test_untuned_heap_maps_megabyte_messages() -> None:
    """The probe above can fail: glibc's default threshold (128 KiB, raised only after a free) maps the first ones."""
    changed, mapped, _ = _heap("plain")
    assert changed == "False"
    assert mapped >= 1


def test_explicit_malloc_settings_win() -> None:
    changed, _, _ = _heap("tune", {"MALLOC_ARENA_MAX": "2"})
    assert changed == "False"


def test_host_buffers() -> None:
    for n in (0, 100, HUGE, 3 * HUGE + 5):
        buf = host_buffer(n)
        assert buf.dtype == np.uint8 and buf.shape == (n,) and buf.flags.writeable and buf.flags.c_contiguous
        buf[:] = 0xA5
        assert n == 0 or (buf[0] == 0xA5 and buf[-1] == 0xA5)


def _mapping(buf: np.ndarray[Any, Any]) -> dict[str, list[str]]:
    """The kernel's smaps fields (Rss, VmFlags, ...) of the mapping that holds buf (Linux /proc/self/smaps)."""
    addr, fields, inside = buf.ctypes.data, {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1:]
    return fields


def _vm_flags(buf: np.ndarray[Any, Any]) -> list[str]:
    return _mapping(buf).get("VmFlags", [])


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
def test_huge_pages_only_where_asked() -> None:
    """A fill's buffer asks for huge pages (hg); a stream's receive buffer does not, as a compaction stall on a
    fault would hold up the stream."""
    for huge in (True, False):
        buf = host_buffer(4 * HUGE, huge=huge)
        buf[:] = 7
        assert ("hg" in _vm_flags(buf)) == huge and buf[-1] == 7


def _resident_pages(buf: np.ndarray[Any, Any]) -> int:
    """How many of buf's pages are backed by memory now (mincore), whatever mapping the kernel merged it into."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    pages = -(-buf.nbytes // mmap.PAGESIZE)
    vec = np.zeros(pages, dtype=np.uint8)
    assert libc.mincore(buf.ctypes.data, buf.nbytes, vec.ctypes.data) == 0, ctypes.get_errno()
    return int(np.count_nonzero(vec & 1))


def _has_populate() -> bool:
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    madvise = hostmem._madvise()
    return madvise is not None and madvise(ctypes.addressof(ctypes.c_char.from_buffer(probe)), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")
def test_a_receive_buffer_is_plain_pages_faulted_in_ahead() -> None:
    """Bytes arriving over a connection (a client's stream, a server's upload) land in plain pages that a helper
    faults in before the writer reaches them; a buffer without the helper stays unbacked until written."""
    if not _has_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): prefault() leaves pages to the writer")
    n = 2 * PREFAULT_BLOCK
    pages = n // mmap.PAGESIZE
    untouched = host_buffer(n, huge=False)
    assert _resident_pages(untouched) < pages // 2
    buf = receive_buffer(n)
    assert wait_until(lambda: _resident_pages(buf) == pages, timeout=30), _resident_pages(buf)
    assert "hg" not in _vm_flags(buf) and not buf.any()  # plain pages, faulted in, never written


def test_prefault_keeps_contents_while_a_writer_runs() -> None:
    """The helper faults pages in without writing them: what the writer put before, during and after stays."""
    assert prefault(host_buffer(HUGE - 1)) is None  # small buffers: nothing to do
    n = 3 * PREFAULT_BLOCK + 12345
    buf = host_buffer(n)
    head = np.arange(HUGE, dtype=np.uint64).view(np.uint8)[:HUGE]
    buf[:HUGE] = head  # written before the helper starts
    t = prefault(buf)
    buf[n - HUGE :] = 0xA5  # written while it may run
    if t is not None:
        t.join(60)
        assert not t.is_alive()
    assert np.array_equal(buf[:HUGE], head)
    assert (buf[n - HUGE :] == 0xA5).all()
    assert not buf[HUGE : n - HUGE].any()  # never-written pages read as zeros, as fresh anonymous memory does


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")
def test_populate_backs_every_page_from_several_threads_and_keeps_contents() -> None:
    if not _has_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    n = 3 * POPULATE_SPLIT + 5 * mmap.PAGESIZE + 123  # uneven thirds, a partial last page
    buf = host_buffer(n, huge=False)
    mark = np.arange(4 * mmap.PAGESIZE, dtype=np.uint8)
    buf[POPULATE_SPLIT : POPULATE_SPLIT + mark.size] = mark  # written before: stays
    before = _resident_pages(buf)
    names: list[str] = []

    class Recorded(threading.Thread):  # the threads populate itself starts, and no other thread of this process
        def start(self) -> None:
            names.append(self.name)
            super().start()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hostmem, "threading", SimpleNamespace(Thread=Recorded))  # hostmem's own name, not the module
        assert populate(buf, threads=3) is True
    pages = -(-n // mmap.PAGESIZE)
    assert before < pages // 2 and _resident_pages(buf) == pages
    assert names == ["paraminit-populate"] * 2  # the caller and two helpers
    assert np.array_equal(buf[POPULATE_SPLIT : POPULATE_SPLIT + mark.size], mark)
    assert not buf[:POPULATE_SPLIT].any() and not buf[POPULATE_SPLIT + mark.size :].any()


def test_populate_says_what_the_kernel_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """EINVAL (no MADV_POPULATE_WRITE) is "not done" for the caller to reserve another way; EFAULT/ENOMEM (no
    memory left for the pages) is ENOSPC; an unaligned view is never advised."""
    calls: list[int] = []
    buf = host_buffer(2 * POPULATE_SPLIT, huge=False)
    monkeypatch.setattr(hostmem, "_madvise", lambda: fake_madvise(errno.EINVAL, calls))
    assert populate(buf, threads=2) is False and len(calls) == 2
    assert populate(buf[1:], threads=2) is False and len(calls) == 2
    for code in (errno.EFAULT, errno.ENOMEM):
        monkeypatch.setattr(hostmem, "_madvise", lambda code=code: fake_madvise(code, calls))
        with pytest.raises(OSError) as info:
            populate(buf, threads=2)
        assert info.value.errno == errno.ENOSPC and str(2 * POPULATE_SPLIT) in str(info.value)
    monkeypatch.setattr(hostmem, "_madvise", lambda: fake_madvise(0, calls))
    calls.clear()
    assert populate(buf, threads=8) is True and sorted(calls) == [POPULATE_SPLIT, POPULATE_SPLIT]


def test_validate_ends_in_the_idle_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large plan's checks leave freed heap behind as a materialization does: Validate holds a slot, so its end
    starts the same idle wait that gives the heap back (one rule, no inline trim that a timer may double)."""
    from paraminit_server.plane import admission

    waits: list[tuple[Any, int]] = []
    monkeypatch.setattr(admission.Admission, "_trim_later", lambda self: waits.append((self, threading.get_ident())))
    with running_server() as r:
        r.plane.validate(plan_of([param("w", [4], {"zeros": {}})]), Caller())
        # only this call's wait counts: the class is patched for every server in this process, and a call that ends
        # meanwhile on another thread (a stopped server's handler winding down, a stray client on this port) is not it
        assert [w for w in waits if w == (r.plane.admission, threading.get_ident())] == [(r.plane.admission, threading.get_ident())]


def test_heap_is_trimmed_once_after_the_server_stays_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-to-back calls keep their heap: one pending timer however many calls end, no trim while a call
    is in flight or when one came during the wait; the trim (and the message pool's release) comes once the
    server has been idle for a whole wait. Timers are fired by hand, so no timing matters."""
    from paraminit_server.plane import admission

    timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    class Timer:
        def __init__(self, interval: float, fn: Any, args: tuple[Any, ...] = ()) -> None:
            self.entry = (interval, fn, args)
            self.daemon = False

        def start(self) -> None:
            timers.append(self.entry)

    def fire() -> None:
        _, fn, args = timers.pop(0)
        fn(*args)

    trims: list[int] = []
    idles: list[int] = []
    monkeypatch.setattr(admission, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(admission.threading, "Timer", Timer)
    adm = admission.Admission(4, 1 << 30, on_idle=lambda: idles.append(1))
    for _ in range(200):
        with adm.admit(1):
            pass
    assert len(timers) == 1 and timers[0][0] == admission.TRIM_AFTER_IDLE  # one pending, not one per call
    with adm.admit(1):
        fire()  # fires while a call is in flight: nothing, and nothing pending
        assert trims == [] and timers == []
    assert len(timers) == 1  # the call's end starts the wait again
    with adm.admit(1):
        pass
    assert len(timers) == 1  # still one
    fire()  # idle now, but a call came during the wait: wait again
    assert trims == [] and len(timers) == 1
    fire()  # a whole wait without a call
    assert trims == [1] and idles == [1] and timers == []
