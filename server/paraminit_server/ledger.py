"""Bytes held against a limit: one reservation mechanism for memory, leases and payloads.

A `Ledger` counts what its `Claim`s hold. A claim is taken before anything is
allocated (so concurrent requests cannot all pass a check and overshoot), then
either released (the work failed or ended) or committed (it became something
that lives on: a lease, a stored payload) and released when that goes.
`release()` and `commit()` are idempotent and thread-safe, so every error path
may simply release what it holds, and nothing is given back twice.

The memory budget (budget.MemoryBudget), the lease table (leases.LeaseTable)
and the payload store (payloads.ValueSources) each own one ledger; none of them
touches another's lock, and no claim touches its owner's.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["Claim", "Ledger", "Refusal"]

PENDING, COMMITTED, RELEASED = "pending", "committed", "released"


class Claim:
    """`nbytes` held in a ledger for `holder`, until release(); commit() marks them as kept by what they became."""

    __slots__ = ("_ledger", "also", "holder", "nbytes", "state")

    def __init__(self, ledger: Ledger, nbytes: int, holder: str) -> None:
        self._ledger = ledger
        self.nbytes = nbytes
        self.holder = holder
        self.state = PENDING
        self.also: Claim | None = None  # a claim in another ledger (a memory budget) that goes back with this one

    def commit(self, then: Callable[[], None] | None = None) -> bool:
        """Keep the bytes beyond the request that claimed them (they stay counted until release()).

        Args:
            then: runs under the ledger's lock just before the claim commits, so the owner's record of what
                the bytes became appears at the same instant; if it raises, the claim stays pending.

        Returns:
            True when this call committed the claim; False when it was committed or released already
            (`then` is not run).
        """
        with self._ledger.lock:
            if self.state != PENDING:
                return False
            if then is not None:
                then()
            self.state = COMMITTED
            self._ledger._committed(self)
            return True

    def release(self) -> bool:
        """Give the bytes back, whether pending or committed.

        Returns:
            True when this call gave them back; False when they were given back already.
        """
        with self._ledger.lock:
            if self.state == RELEASED:
                return False
            was, self.state = self.state, RELEASED
            self._ledger._released(self, was)
        if self.also is not None:  # outside this ledger's lock: no claim holds two ledgers' locks at once
            self.also.release()
        return True

    @property
    def released(self) -> bool:
        return self.state == RELEASED

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """A claim that was not committed by the end of its block goes back."""
        with self._ledger.lock:
            if self.state == PENDING:
                self.release()

    def __repr__(self) -> str:
        return f"Claim({self.nbytes} bytes, holder={self.holder!r}, {self.state})"


Refusal = Callable[["Ledger", int, str], BaseException | None]


class Ledger:
    """Claims and what they hold: bytes pending, bytes committed, and claims per holder. Thread-safe.

    `lock` is reentrant and may be shared by the owner for its own records (so a commit and the record it
    creates are one step); `changed` is notified whenever bytes go back."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.pending = 0  # bytes of claims not yet committed
        self.committed = 0  # bytes of committed claims not yet released
        self._claims: collections.Counter[str] = collections.Counter()  # live claims per holder
        self._bytes: collections.Counter[str] = collections.Counter()  # bytes of live claims per holder

    @property
    def total(self) -> int:
        """Bytes held by every live claim, pending or committed."""
        with self.lock:
            return self.pending + self.committed

    def claims(self, holder: str) -> int:
        """Live claims (pending or committed) of `holder`."""
        with self.lock:
            return self._claims[holder]

    def held_bytes(self, holder: str) -> int:
        """Bytes of the live claims (pending or committed) of `holder`."""
        with self.lock:
            return self._bytes[holder]

    def claim(self, nbytes: int, holder: str = "", refusal: Refusal = lambda ledger, n, h: None, wait: float = 0.0) -> Claim:
        """Take `nbytes` for `holder` once `refusal(ledger, nbytes, holder)` (run under the lock) returns None.

        Args:
            nbytes: bytes to hold.
            holder: who holds them (per-holder claim counts use it).
            refusal: the owner's limits: None when the claim fits now, else the error to raise.
            wait: seconds to wait for other claims to go back before refusing.

        Returns:
            A pending claim.

        Raises:
            BaseException: what `refusal` returned, once `wait` has passed without the claim fitting.
        """
        if nbytes < 0:
            raise ValueError(f"a claim holds a non-negative number of bytes, not {nbytes}")
        deadline = time.monotonic() + max(0.0, wait)
        with self.changed:
            while (refused := refusal(self, nbytes, holder)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise refused
                self.changed.wait(left)
            self.pending += nbytes
            self._claims[holder] += 1
            self._bytes[holder] += nbytes
            return Claim(self, nbytes, holder)

    def _committed(self, claim: Claim) -> None:
        self.pending -= claim.nbytes
        self.committed += claim.nbytes

    def _released(self, claim: Claim, was: str) -> None:
        if was == PENDING:
            self.pending -= claim.nbytes
        else:
            self.committed -= claim.nbytes
        self._claims[claim.holder] -= 1
        self._bytes[claim.holder] -= claim.nbytes
        if not self._claims[claim.holder]:
            del self._claims[claim.holder]
            del self._bytes[claim.holder]
        self.changed.notify_all()
