"""Host buffers that fill fast: large ones are anonymous mappings with transparent huge pages.

A fresh 256 MiB `np.empty` costs about a page fault per 4 KiB on first touch, as
much as generating into it; with huge pages (where the kernel offers them for
anonymous memory) it is one fault per 2 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

HUGE = 2 << 20


def host_buffer(nbytes: int, huge: bool = True) -> npt.NDArray[np.uint8]:
    """A 1-D uint8 array of nbytes; its memory goes when the last view of it does.

    Args:
        nbytes: its size.
        huge: ask for transparent huge pages. Where the kernel has them free that is one fault per 2 MiB, but
            where it must compact memory first (the "madvise" defrag default) a fault stalls: 0.7 s for
            256 MiB measured, against 0.12 s for plain pages. A writer as fast as the CPU (a fill) gains on
            average; one paced by the network, with prefault() ahead of it, does better with plain pages.

    Returns:
        The array (anonymous mapping from 2 MiB on).
    """
    if nbytes < HUGE:
        return np.empty(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(mmap, "MADV_HUGEPAGE", None) if huge else None  # Linux only
    if advise is not None:
        with contextlib.suppress(OSError):  # THP disabled: ordinary pages
            m.madvise(advise)
    return np.frombuffer(m, dtype=np.uint8)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, leaving their contents as they are
PREFAULT_BLOCK = 32 << 20
POPULATE_SPLIT = 32 << 20  # the least each populating thread takes


@functools.cache
def _madvise() -> Any:
    """libc's madvise through ctypes (which drops the GIL during the call), or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def populate(buf: npt.NDArray[np.uint8], threads: int = 1) -> bool:
    """Fault every page of a page-aligned mapping in, writable, before anything writes it; contents stay as they are.

    For a shared-memory segment this is where tmpfs allocates its pages, so a full /dev/shm is an error here
    instead of SIGBUS in the middle of a fill, as posix_fallocate makes it, and the faults a fill would take come
    first, from up to `threads` threads at once: 498 MB took 0.11 s to fallocate and then 0.12-0.28 s of first-touch
    faults during the fill, against 0.18 s populated from two threads (docs/PERFORMANCE.md).

    Args:
        buf: a 1-D uint8 view of the whole mapping, starting on a page.
        threads: the most threads to populate with; each takes at least POPULATE_SPLIT bytes.

    Returns:
        True when every page is in; False where the kernel lacks MADV_POPULATE_WRITE or the view does not start on
        a page, and nothing was done (the caller reserves the memory another way).

    Raises:
        OSError: ENOSPC when the memory cannot be had (the kernel says EFAULT or ENOMEM).
    """
    madvise = _madvise()
    addr, n = buf.ctypes.data, buf.nbytes
    del buf  # the caller's reference keeps it; an error's traceback must not, or its mapping could not be closed
    if madvise is None or addr % mmap.PAGESIZE or n == 0:
        return madvise is not None and n == 0
    k = max(1, min(threads, n // POPULATE_SPLIT))
    bounds = [0, *(n * i // k // mmap.PAGESIZE * mmap.PAGESIZE for i in range(1, k)), n]
    errs: list[int] = [0] * k

    def run(i: int) -> None:
        if madvise(addr + bounds[i], bounds[i + 1] - bounds[i], MADV_POPULATE_WRITE) != 0:
            errs[i] = ctypes.get_errno()

    helpers = [threading.Thread(target=run, args=(i,), name="paraminit-populate", daemon=True) for i in range(1, k)]
    for t in helpers:
        t.start()
    run(0)
    for t in helpers:
        t.join()
    failed = [e for e in errs if e]
    if failed and all(e == errno.EINVAL for e in failed):
        return False  # no such advice here
    if failed:
        raise OSError(errno.ENOSPC, f"no memory left for {n} bytes ({os.strerror(failed[0])} from MADV_POPULATE_WRITE)")
    return True


def prefault(buf: npt.NDArray[np.uint8]) -> threading.Thread | None:
    """Fault in a fresh host_buffer's pages on a helper thread, front to back, while its writer starts.

    A writer that lands a stream at network speed otherwise spends a third of its time in first-touch faults.
    MADV_POPULATE_WRITE never changes contents, so the helper may run behind or ahead of the writer; where
    the kernel lacks it (or for small buffers) this does nothing. The thread keeps `buf` alive until it ends.

    Returns:
        The started thread, or None when there is nothing to do.
    """
    madvise = _madvise()
    if buf.nbytes < HUGE or madvise is None:
        return None
    addr, n = buf.ctypes.data, buf.nbytes
    if addr % mmap.PAGESIZE:
        return None

    def run(keep: npt.NDArray[np.uint8] = buf) -> None:
        for off in range(0, n, PREFAULT_BLOCK):
            if madvise(addr + off, min(PREFAULT_BLOCK, n - off), MADV_POPULATE_WRITE) != 0:
                return  # not supported here (EINVAL), or out of memory: the writer faults as before

    t = threading.Thread(target=run, name="paraminit-prefault", daemon=True)
    t.start()
    return t


def receive_buffer(nbytes: int) -> npt.NDArray[np.uint8]:
    """A host_buffer for bytes that arrive over a connection (a stream landing in a client, an upload landing in a
    server): plain pages, faulted in by prefault()'s helper thread ahead of the writer. First-touch faults on the
    receiving thread slow the connection itself, and a writer paced by the network gains nothing from huge pages:
    an upload into huge pages faulted by its receiving thread ran some rounds at a fifth of its usual rate."""
    buf = host_buffer(nbytes, huge=False)
    prefault(buf)
    return buf


MMAP_THRESHOLD = 4 << 20  # above a stream message (at most 4 MiB), so messages come from the heap
TRIM_THRESHOLD = 64 << 20  # free heap kept for the next messages; an idle server trims the rest
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_tuned = False


def tune_malloc_for_streams() -> bool:
    """Let glibc reuse heap memory for megabyte-sized gRPC messages instead of mapping and unmapping each.

    Every 1 MiB message is a fresh bytes object on both ends; above glibc's mmap threshold each one is
    its own mapping, paid for in page faults and unmaps (measured 15-25% of STREAM throughput here).
    Process-wide and idempotent; does nothing where MALLOC_* variables already say how, or without glibc.
    Returns whether it changed anything."""
    global _tuned
    if _tuned or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
    _tuned = ok
    return ok
