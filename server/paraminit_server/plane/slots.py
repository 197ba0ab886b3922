"""The concurrency slots and their fair, bounded queue.

A call that finds every concurrency slot taken waits in a queue for as long as
its caller allows (Caller.queue_wait: part of its deadline, capped by the
server's --max-queue-wait); slots go round-robin across identities and in
arrival order within one, so one caller with many threads cannot starve
another. Refusals say when a retry makes sense (errors.*.retry_after, which the
transport passes on as retry pushback).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable

from paraminit_server import errors

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
