"""Admission: a concurrency limit with a fair bounded queue, host and device memory budgets, and the draining flag.

Requests reserve the memory they will hold before allocating it: a stream its
few slabs (on the backend) and their encoded copies (on the host), an export its
whole buffer for as long as the lease lives, an upload its payload. A plan that
cannot be admitted fails fast with RESOURCE_EXHAUSTED (or waits a bounded time
when the client's deadline leaves room) and allocates nothing. On the CPU
backend host and backend memory are one budget.

A call that finds every concurrency slot taken waits in a queue for as long as
its caller allows (Caller.queue_wait: part of its deadline, capped by the
server's --max-queue-wait); slots go round-robin across identities and in
arrival order within one, so one caller with many threads cannot starve
another. Refusals say when a retry makes sense (errors.*.retry_after, which the
transport passes on as retry pushback).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import random
import threading
import time
from collections.abc import Callable, Iterator

from paraminit_server import errors
from paraminit_server.ledger import Claim, Ledger
from paraminit_server.plane.caller import IN_PROCESS, Caller


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


Reservation = Claim  # bytes held against a MemoryBudget until release()


class MemoryBudget:
    """Bytes of one memory (host or device) that requests hold while they run, against a limit."""

    def __init__(self, limit: int, name: str = "host") -> None:
        self.limit = limit
        self.name = name
        self.ledger = Ledger(name)

    @property
    def reserved(self) -> int:
        """Bytes held now."""
        return self.ledger.total

    def reserve(self, nbytes: int, wait: float = 0.0, what: str = "request") -> Claim:
        """Hold `nbytes` until the claim is released, waiting up to `wait` seconds for others to give some back.

        Raises:
            ResourceExhausted: more than the whole budget (at once), or not available within `wait`."""
        if nbytes > self.limit:
            raise errors.ResourceExhausted(f"{what} needs {nbytes} bytes of {self.name} memory; the budget is {self.limit}")

        def refusal(ledger: Ledger, n: int, holder: str) -> errors.ResourceExhausted | None:
            if ledger.total + n <= self.limit:
                return None
            return errors.ResourceExhausted(
                f"{what} needs {n} bytes of {self.name} memory, {self.limit - ledger.total} of {self.limit} are available now; retry later",
                retry_after=errors.MEMORY_RETRY_AFTER,
                reason="memory",
            )

        return self.ledger.claim(nbytes, what, refusal, wait)


DRAIN_RETRY_AFTER = 0.5  # a draining worker's refusal: a retry on a balanced channel reaches another worker
WAIT_SLICE = 0.25  # a queued call looks at least this often whether its caller left or the server is draining


class _Waiter:
    __slots__ = ("granted", "identity", "wake")

    def __init__(self, identity: str, lock: threading.Lock) -> None:
        self.identity = identity
        self.granted = False
        self.wake = threading.Condition(lock)


class SlotQueue:
    """`slots` concurrency slots; callers that find none free queue, at most `max_queued` of them.

    A freed slot goes straight to the next waiter: identities take turns (round-robin, in the order they
    joined the queue) and each identity's calls go in arrival order. While anyone waits no slot is free, so a
    newcomer cannot overtake the queue. Refusals raise ResourceExhausted with a retry hint sized from how
    long slots have recently been held."""

    def __init__(self, slots: int, max_queued: int = 0, slots_per_identity: int = 0, queued_per_identity: int = 0) -> None:
        """Args:
        slots: concurrency slots.
        max_queued: calls that may wait in line.
        slots_per_identity: slots one identity may hold at once; 0: all but a quarter (at least one), so a
            caller with many threads, or with stalled calls, never holds every slot.
        queued_per_identity: places in line one identity may take; 0: half of them (at least one).
        """
        self.slots = slots
        self.max_queued = max_queued
        self.per_identity = slots_per_identity or max(1, slots - max(1, slots // 4))
        self.queued_per_identity = queued_per_identity or max(1, max_queued // 2)
        self._lock = threading.Lock()
        self._free = slots
        self._held: collections.Counter[str] = collections.Counter()  # slots each identity holds
        self._lines: collections.OrderedDict[str, collections.deque[_Waiter]] = collections.OrderedDict()
        self.queued = 0
        self._held_for = 0.1  # moving average of how long a slot is held (seconds), for the retry hint

    def _retry_after(self, ahead: int) -> float:
        """Roughly when a slot frees for someone behind `ahead` waiters, jittered so refused callers spread."""
        turns = ahead / max(1, self.slots) + 1
        return min(10.0, max(0.05, self._held_for * turns)) * random.uniform(0.5, 1.5)

    def _refuse(self, reason: str, message: str, ahead: int) -> errors.ResourceExhausted:
        return errors.ResourceExhausted(message, retry_after=self._retry_after(ahead), reason=reason)

    def acquire(self, identity: str, wait: float, stop: Callable[[], bool] = lambda: False) -> float:
        """Take a slot, waiting up to `wait` seconds in line; returns the seconds waited.

        Raises:
            ResourceExhausted: no slot and no wait allowed (reason "busy"), the queue full ("queue_full"), or
                no slot within `wait` ("queue_timeout").
            Unavailable: the server started draining while the call waited.
            Cancelled: `stop()` turned true (the caller went away) while the call waited."""
        started = time.monotonic()
        with self._lock:
            capped = self._held[identity] >= self.per_identity
            if self._free > 0 and not capped:  # a free slot while others wait: they are at their share
                self._free -= 1
                self._held[identity] += 1
                return 0.0
            if wait <= 0:
                if capped:
                    raise self._refuse(
                        "identity_share",
                        f"this client holds {self._held[identity]} of the "
                        f"{self.slots} concurrency slots, its share; retry later (give the call a "
                        "deadline to wait in line)",
                        self.queued,
                    )
                raise self._refuse(
                    "busy",
                    f"server is at its limit of {self.slots} concurrent materializations; "
                    "retry later (give the call a deadline to wait in line)",
                    self.queued,
                )
            if self.queued >= self.max_queued:
                raise self._refuse(
                    "queue_full",
                    f"server is at its limit of {self.slots} concurrent materializations and {self.max_queued} queued calls; retry later",
                    self.queued,
                )
            mine = len(self._lines.get(identity, ()))
            if mine >= self.queued_per_identity:
                raise self._refuse(
                    "identity_share",
                    f"this client has {mine} calls waiting for a concurrency "
                    f"slot, its share of the {self.max_queued} places in line; retry later",
                    self.queued,
                )
            me = _Waiter(identity, self._lock)
            self._lines.setdefault(identity, collections.deque()).append(me)
            self.queued += 1
            deadline = started + wait
            try:
                while not me.granted:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._refuse(
                            "queue_timeout",
                            f"no concurrency slot within {wait:.1f} s (limit {self.slots}, {self.queued} queued); retry later",
                            self.queued,
                        )
                    if stop():
                        raise errors.Cancelled("client cancelled or deadline passed while queued")
                    me.wake.wait(min(left, WAIT_SLICE))
            except BaseException:
                if me.granted:  # the slot arrived as we gave up: pass it on
                    self._give_back(identity)
                    self._grant_next()
                else:
                    self._leave(me)
                raise
            return time.monotonic() - started

    def _leave(self, me: _Waiter) -> None:
        line = self._lines[me.identity]
        line.remove(me)
        self.queued -= 1
        if not line:
            del self._lines[me.identity]

    def _grant_next(self) -> None:
        """Hand a slot to the oldest waiter of the next identity below its share, or free it (lock held)."""
        identity = next((i for i in self._lines if self._held[i] < self.per_identity), None)
        if identity is None:
            self._free += 1
            return
        line = self._lines[identity]
        me = line.popleft()
        self.queued -= 1
        if line:
            self._lines.move_to_end(identity)  # its other calls wait for the other identities' turns
        else:
            del self._lines[identity]
        self._held[identity] += 1
        me.granted = True
        me.wake.notify()

    def _give_back(self, identity: str) -> None:
        self._held[identity] -= 1
        if self._held[identity] <= 0:
            del self._held[identity]

    def release(self, identity: str, held_for: float = 0.0) -> None:
        """Give `identity`'s slot back (to the next waiter, if any); `held_for` seconds feed the retry hint."""
        with self._lock:
            self._held_for += 0.2 * (held_for - self._held_for)
            self._give_back(identity)
            self._grant_next()

    def waiting(self) -> list[str]:
        """The identities in line, in the order they would be served now (for tests and debugging)."""
        with self._lock:
            lines = [list(line) for line in self._lines.values()]
        order: list[str] = []
        while any(lines):
            for line in lines:
                if line:
                    order.append(line.pop(0).identity)
        return order


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
