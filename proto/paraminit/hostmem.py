"""Host buffers that fill fast: large ones are anonymous mappings with transparent huge pages.

A fresh 256 MiB `np.empty` costs about a page fault per 4 KiB on first touch, as
much as generating into it; with huge pages (where the kernel offers them for
anonymous memory) it is one fault per 2 MiB.
"""

from __future__ import annotations

import contextlib
import mmap

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
