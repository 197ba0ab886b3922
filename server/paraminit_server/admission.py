"""Admission: a concurrency limit, host and device memory budgets, and the draining flag.

Requests reserve the memory they will hold before allocating it: a stream its
few slabs (on the backend) and their encoded copies (on the host), an export its
whole buffer for as long as the lease lives, an upload its payload. A plan that
cannot be admitted fails fast with RESOURCE_EXHAUSTED (or waits a bounded time
when the client's deadline leaves room) and allocates nothing. On the CPU
backend host and backend memory are one budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator

from paraminit_server import errors


def _malloc_trim() -> Callable[[], None]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return lambda: None

    def trim_all() -> None:
        trim(0)

    return trim_all


trim_heap = _malloc_trim()  # give freed slab memory back to the OS once the server is idle
TRIM_AFTER_IDLE = 1.0  # seconds without a materialization before freed heap goes back to the OS


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")


class Reservation:
    """Bytes held against the budget until release(), which is idempotent."""

    def __init__(self, budget: MemoryBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self._released = False

    def release(self) -> None:
        with self._budget._cond:
            if not self._released:
                self._released = True
                self._budget.reserved -= self.nbytes
                self._budget._cond.notify_all()


class MemoryBudget:
    def __init__(self, limit: int, name: str = "host") -> None:
        self.limit = limit
        self.name = name
        self.reserved = 0
        self._cond = threading.Condition()

    def reserve(self, nbytes: int, wait: float = 0.0, what: str = "request") -> Reservation:
        if nbytes > self.limit:
            raise errors.ResourceExhausted(f"{what} needs {nbytes} bytes of {self.name} memory; the budget is {self.limit}")
        deadline = time.monotonic() + max(0.0, wait)
        with self._cond:
            while self.reserved + nbytes > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.ResourceExhausted(
                        f"{what} needs {nbytes} bytes of {self.name} memory, {self.limit - self.reserved} of "
                        f"{self.limit} are available now; retry later")
                self._cond.wait(left)
            self.reserved += nbytes
        return Reservation(self, nbytes)


class Admission:
    """Concurrency limit plus a draining flag: refuse rather than queue without bound."""

    def __init__(self, max_concurrent: int, host_limit: int, device_limit: int | None = None,
                 on_idle: Callable[[], None] = lambda: None) -> None:
        self._on_idle = on_idle  # drops caches before the heap is trimmed
        self._sem = threading.BoundedSemaphore(max_concurrent)
        self.max_concurrent = max_concurrent
        self.host = MemoryBudget(host_limit, "host")
        # the backend's own memory: a separate budget on a device, the host budget on the CPU
        self.backend = self.host if device_limit is None else MemoryBudget(device_limit, "device")
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.idle = threading.Condition(self._lock)
        self._busy_epoch = 0  # bumped by every admission, so a pending trim knows the server was busy since
        self._trim_timer: threading.Timer | None = None

    @contextlib.contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        if self.draining.is_set():
            raise errors.Unavailable("server is shutting down; retry on another worker")
        if not self._sem.acquire(blocking=False):
            raise errors.ResourceExhausted(
                f"server is at its limit of {self.max_concurrent} concurrent materializations; retry later")
        with self._lock:
            self.in_flight += 1
            self.in_flight_bytes += nbytes
            self._busy_epoch += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
                self.in_flight_bytes -= nbytes
                idle = self.in_flight == 0
                self.idle.notify_all()
            self._sem.release()
            if idle:
                self._trim_later()

    def _trim_later(self) -> None:
        """Trim the heap once the server has stayed idle TRIM_AFTER_IDLE seconds: back-to-back streams (a
        sharded trainer, a loop) reuse the pages the last one touched instead of faulting in fresh ones
        (~14k faults per 256 MiB stream measured when every stream trimmed at its end). One timer at a time,
        however many calls end."""
        with self._lock:
            if self._trim_timer is not None:
                return
            timer = self._trim_timer = threading.Timer(TRIM_AFTER_IDLE, self._trim_if_idle, (self._busy_epoch,))
        timer.daemon = True
        timer.start()

    def _trim_if_idle(self, epoch: int) -> None:
        with self._lock:
            self._trim_timer = None
            if self.in_flight:
                return  # the next idle moment starts the wait again
            recently_busy = self._busy_epoch != epoch
        if recently_busy:
            self._trim_later()  # idle now, but not for the whole wait
            return
        self._on_idle()
        trim_heap()

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout)
