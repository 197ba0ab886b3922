"""Leases on exported buffers: who holds what, until when; expired and abandoned ones are freed.

A lease owns a release callback; the table guarantees it runs exactly once,
whether through Release, expiry, or shutdown, so no segment or device
allocation outlives its lease.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paraminit_server import errors

log = logging.getLogger("paraminit.server")
RELEASED_MEMORY = 65536  # remembered released ids, so a second Release is not NOT_FOUND


class Slot:
    """A lease slot and its bytes, held from the admission check until the lease exists or the export fails."""

    def __init__(self, table: LeaseTable, owner: str, nbytes: int) -> None:
        self.table = table
        self.owner = owner
        self.nbytes = nbytes
        self.done = False

    def cancel(self) -> None:
        """Give the slot back (idempotent; a slot that became a lease is not affected)."""
        with self.table._lock:
            if not self.done:
                self.done = True
                self.table._unreserve_locked(self)


@dataclass
class LeaseRecord:
    lease_id: str
    owner: str
    delivery: str  # backends.SHM or backends.CUDA_IPC
    nbytes: int
    created: float
    expires_at: float
    plan_digest: str
    release_fn: Callable[[bool], None]  # called once with True for an explicit Release, False otherwise
    payload: Any = None  # what Apply needs: layout and buffer
    lock: threading.Lock = field(default_factory=threading.Lock)


class LeaseTable:
    def __init__(self, max_bytes: int, max_per_owner: int, default_ttl: float, max_ttl: float,
                 reap_interval: float = 0.5) -> None:
        self.max_bytes = max_bytes
        self.max_per_owner = max_per_owner
        self.default_ttl = default_ttl
        self.max_ttl = max_ttl
        self._leases: dict[str, LeaseRecord] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> owner
        self._pending_count: dict[str, int] = {}  # slots reserved but not yet leases, per owner
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval,), name="paraminit-reaper",
                                        daemon=True)
        self._reaper.start()

    def ttl(self, requested: float) -> float:
        if requested < 0 or requested != requested:
            raise errors.InvalidRequest(f"lease ttl must be a non-negative number of seconds, got {requested}")
        return min(requested or self.default_ttl, self.max_ttl)

    def reserve(self, owner: str, nbytes: int) -> Slot:
        """Take a lease slot and its bytes now, before anything is allocated: concurrent exports cannot
        all pass the check and overshoot. The slot becomes the lease (add) or is given back (cancel)."""
        with self._lock:
            held = sum(1 for r in self._leases.values() if r.owner == owner) + self._pending_count.get(owner, 0)
            if held >= self.max_per_owner:
                raise errors.ResourceExhausted(f"client holds {held} leases, the limit is {self.max_per_owner}; "
                                               "release some first")
            used = self.leased_bytes_locked()
            if used + nbytes > self.max_bytes:
                raise errors.ResourceExhausted(f"export needs {nbytes} bytes but only {self.max_bytes - used} of the "
                                               f"{self.max_bytes} leasable bytes are free")
            self._pending_count[owner] = self._pending_count.get(owner, 0) + 1
            self._pending_bytes += nbytes
        return Slot(self, owner, nbytes)

    def _unreserve_locked(self, slot: Slot) -> None:
        self._pending_count[slot.owner] -= 1
        if not self._pending_count[slot.owner]:
            del self._pending_count[slot.owner]
        self._pending_bytes -= slot.nbytes

    def add(self, slot: Slot, delivery: str, ttl: float, plan_digest: str,
            release_fn: Callable[[bool], None], payload: Any = None) -> LeaseRecord:
        """Turn a reserved slot into a lease; `release_fn(explicit)` frees it exactly once."""
        now = time.time()
        rec = LeaseRecord(secrets.token_hex(16), slot.owner, delivery, slot.nbytes, now, now + ttl, plan_digest,
                          release_fn, payload)
        with self._lock:
            if slot.done:
                raise RuntimeError("lease slot used twice")
            slot.done = True
            self._unreserve_locked(slot)
            self._leases[rec.lease_id] = rec
        return rec

    def get(self, lease_id: str, owner: str) -> LeaseRecord:
        with self._lock:
            rec = self._leases.get(lease_id)
        if rec is None or rec.owner != owner:
            raise errors.NotFound(f"no lease {lease_id!r}")
        return rec

    def release(self, lease_id: str, owner: str) -> bool:
        """True when this call freed it, False when it was already released; NOT_FOUND otherwise."""
        with self._lock:
            rec = self._leases.get(lease_id)
            if rec is None or rec.owner != owner:
                if self._released.get(lease_id) == owner:
                    return False
                raise errors.NotFound(f"no lease {lease_id!r}")
            del self._leases[lease_id]
            self._remember(lease_id, owner)
        self._free(rec, "released", explicit=True)
        return True

    def renew(self, lease_id: str, owner: str, ttl: float) -> LeaseRecord:
        rec = self.get(lease_id, owner)
        rec.expires_at = time.time() + self.ttl(ttl)
        return rec

    def list(self, owner: str | None = None) -> list[LeaseRecord]:
        with self._lock:
            return [r for r in self._leases.values() if owner is None or r.owner == owner]

    def leased_bytes_locked(self) -> int:
        return sum(r.nbytes for r in self._leases.values()) + self._pending_bytes

    def leased_bytes(self) -> int:
        with self._lock:
            return self.leased_bytes_locked()

    def reap(self) -> int:
        now = time.time()
        with self._lock:
            expired = [r for r in self._leases.values() if r.expires_at <= now]
            for r in expired:
                del self._leases[r.lease_id]
                self._remember(r.lease_id, r.owner)
        for r in expired:
            self._free(r, "expired")
        return len(expired)

    def close(self) -> None:
        """Free every lease (shutdown)."""
        self._stop.set()
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for r in leases:
            self._free(r, "shutdown")

    def _remember(self, lease_id: str, owner: str) -> None:
        self._released[lease_id] = owner
        while len(self._released) > RELEASED_MEMORY:
            self._released.popitem(last=False)

    def _free(self, rec: LeaseRecord, why: str, explicit: bool = False) -> None:
        with rec.lock:
            try:
                rec.release_fn(explicit)
            except Exception:
                log.exception("freeing lease %s (%s) failed", rec.lease_id[:8], why)
            rec.payload = None
        log.info("lease %s %s bytes=%d", rec.lease_id[:8], why, rec.nbytes)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:
                log.exception("lease reaper failed")
