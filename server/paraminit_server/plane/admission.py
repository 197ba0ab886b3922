"""Admission: a call takes a concurrency slot (plane/slots.py) and the server's memory budgets (plane/budget.py) are
held here, with the draining flag and the heap trim once the server is idle.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator

from paraminit_server import errors
from paraminit_server.plane.budget import MemoryBudget
from paraminit_server.plane.caller import IN_PROCESS, Caller
from paraminit_server.plane.slots import SlotQueue


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


DRAIN_RETRY_AFTER = 0.5  # a draining worker's refusal: a retry on a balanced channel reaches another worker


class Admission:
    """Concurrency limit with a fair bounded queue, plus a draining flag."""

    def __init__(
        self,
        max_concurrent: int,
        host_limit: int,
        device_limit: int | None = None,
        on_idle: Callable[[], None] = lambda: None,
        max_queued: int = 0,
        slots_per_identity: int = 0,
        queued_per_identity: int = 0,
    ) -> None:
        self._on_idle = on_idle  # drops caches before the heap is trimmed
        self.slots = SlotQueue(max_concurrent, max_queued, slots_per_identity, queued_per_identity)
        self.on_queue_wait: Callable[[float], None] = lambda seconds: None  # metrics: seconds waited for a slot
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
    def admit(self, nbytes: int, caller: Caller = IN_PROCESS) -> Iterator[None]:
        """Hold a concurrency slot for the block, queueing up to `caller.queue_wait` seconds for one.

        Raises:
            Unavailable: the server is draining.
            ResourceExhausted: no slot (see SlotQueue.acquire)."""
        if self.draining.is_set():
            raise errors.Unavailable("server is shutting down; retry on another worker", retry_after=DRAIN_RETRY_AFTER)

        def stop() -> bool:
            if self.draining.is_set():
                raise errors.Unavailable("server is shutting down; retry on another worker", retry_after=DRAIN_RETRY_AFTER)
            return caller.gone()

        waited = self.slots.acquire(caller.identity, caller.queue_wait, stop)
        self.on_queue_wait(waited)
        granted = time.monotonic()
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
            self.slots.release(caller.identity, time.monotonic() - granted)
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
