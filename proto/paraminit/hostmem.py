"""Host buffers that fill fast: large ones are anonymous mappings with transparent huge pages.

A fresh 256 MiB `np.empty` costs about a page fault per 4 KiB on first touch, as
much as generating into it; with huge pages (where the kernel offers them for
anonymous memory) it is one fault per 2 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import numpy as np
import numpy.typing as npt

HUGE = 2 << 20


def host_buffer(nbytes: int) -> npt.NDArray[np.uint8]:
    """A 1-D uint8 array of nbytes; its memory goes when the last view of it does."""
    if nbytes < HUGE:
        return np.empty(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advise is not None:
        with contextlib.suppress(OSError):  # THP disabled: ordinary pages
            m.madvise(advise)
    return np.frombuffer(m, dtype=np.uint8)


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
