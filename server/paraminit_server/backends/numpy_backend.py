"""The embedded CPU backend: numba kernels (cpu_kernels.py) over NumPy buffers."""

from __future__ import annotations

import os
import platform
import threading
from typing import Any

import numpy as np

from paraminit_server.backends import DeviceDescription
from paraminit_server.plan import Kind, ResolvedParam

_NO_VALUES = np.zeros(0, dtype=np.float64)
# Numba's parallel kernels are not safe to enter from two threads at once under its fallback
# ("workqueue") threading layer, which aborts the process. Every fill already uses all cores,
# so serializing kernel launches costs nothing and is safe under any layer.
_KERNEL_LOCK = threading.Lock()


class NumpyBackend:
    name = "numpy"

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads

    def warm_up(self) -> None:
        from paraminit_server.plan import warm_up_params

        for rp in warm_up_params():
            self.fill(rp, np.empty(rp.numel, dtype=rp.dtype.storage))

    def empty(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        from paraminit_server.backends import cpu_kernels

        n = out.shape[0]
        if n == 0:
            return
        if self._threads is not None:
            import numba

            numba.set_num_threads(max(1, min(self._threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        runs = p.runs()
        values = p.values if p.kind == Kind.FLAT and p.values is not None else _NO_VALUES
        with _KERNEL_LOCK:
            cpu_kernels.fill(out, l_begin, int(p.kind), np.uint64(p.key), p.p0, p.p1, values, p.dtype.fmt,
                             runs.outer_start, runs.outer_ext, runs.outer_stride, runs.base, runs.run_len)

    def to_host(self, buf: Any) -> Any:
        return buf

    def device(self) -> DeviceDescription:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return DeviceDescription("cpu", platform.processor() or platform.machine(), "", -1, total, free)
