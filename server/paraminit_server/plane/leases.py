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

from paraminit import results
from paraminit_server import errors
from paraminit_server.ledger import Claim, Ledger

log = logging.getLogger("paraminit.server")
RELEASED_MEMORY = 65536  # remembered released ids, so a second Release is not NOT_FOUND


Slot = Claim  # a lease slot and its bytes, held from the admission check until the lease ends


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
    claim: Claim | None = None  # the slot and bytes this lease holds in the table's ledger
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lease(self) -> results.Lease:
        """The lease as the data plane answers it."""
        return results.Lease(self.lease_id, self.expires_at, self.nbytes, self.delivery)

    def status(self) -> results.LeaseStatus:
        """The lease as ListLeases shows it."""
        return results.LeaseStatus(self.lease(), self.created, self.owner, self.plan_digest)


class LeaseTable:
    def __init__(
        self,
        max_bytes: int,
        max_per_owner: int,
        default_ttl: float,
        max_ttl: float,
        reap_interval: float = 0.5,
        max_bytes_per_owner: int | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_per_owner = max_per_owner
        # one owner's share of the leasable bytes, so one identity's leases cannot take them all
        self.max_bytes_per_owner = max_bytes if max_bytes_per_owner is None else max_bytes_per_owner
        self.default_ttl = default_ttl
        self.max_ttl = max_ttl
        self._leases: dict[str, LeaseRecord] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> owner
        # every slot, reserved or leased, is a claim: per-owner counts and leased bytes come from one place
        self.ledger = Ledger("leases")
        self._lock = self.ledger.lock  # the records change in the same step as the claims
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval,), name="paraminit-reaper", daemon=True)
        self._reaper.start()

    def ttl(self, requested: float) -> float:
        if requested < 0 or requested != requested:
            raise errors.InvalidRequest(f"lease ttl must be a non-negative number of seconds, got {requested}")
        return min(requested or self.default_ttl, self.max_ttl)

    def reserve(self, owner: str, nbytes: int) -> Claim:
        """Take a lease slot and its bytes now, before anything is allocated: concurrent exports cannot
        all pass the check and overshoot. The claim becomes the lease's (add) or is released.

        Raises:
            ResourceExhausted: the owner holds its limit of leases, or the bytes would pass the table's limit."""

        def refusal(ledger: Ledger, n: int, holder: str) -> errors.ResourceExhausted | None:
            held = ledger.claims(holder)
            if held >= self.max_per_owner:
                return errors.ResourceExhausted(
                    f"client holds {held} leases (expired ones whose memory it still maps count), the limit is "
                    f"{self.max_per_owner}; release some first"
                )
            own = ledger.held_bytes(holder)
            if own + n > self.max_bytes_per_owner:
                return errors.ResourceExhausted(
                    f"export needs {n} bytes; this client's leases hold {own} of its "
                    f"share of {self.max_bytes_per_owner} leasable bytes; release some "
                    "first",
                    reason="identity_share",
                )
            used = ledger.total
            if used + n > self.max_bytes:
                return errors.ResourceExhausted(
                    f"export needs {n} bytes but only {self.max_bytes - used} of the {self.max_bytes} leasable bytes are free"
                )
            return None

        return self.ledger.claim(nbytes, owner, refusal)

    def add(
        self, slot: Claim, delivery: str, ttl: float, plan_digest: str, release_fn: Callable[[bool], None], payload: Any = None
    ) -> LeaseRecord:
        """Turn a reserved slot into a lease; `release_fn(explicit)` frees it exactly once.

        Raises:
            RuntimeError: the slot was already used or released."""
        now = time.time()
        rec = LeaseRecord(secrets.token_hex(16), slot.holder, delivery, slot.nbytes, now, now + ttl, plan_digest, release_fn, payload, slot)

        def record() -> None:
            self._leases[rec.lease_id] = rec

        if not slot.commit(record):
            raise RuntimeError("lease slot used twice")
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

    def leased_bytes(self) -> int:
        """Bytes of live leases and of slots reserved for exports in progress."""
        return self.ledger.total

    def reap(self) -> int:
        now = time.time()
        with self._lock:
            expired = [r for r in self._leases.values() if r.expires_at <= now]
            for r in expired:
                del self._leases[r.lease_id]
                self._remember(r.lease_id, r.owner)
        for r in expired:
            if r.lock.acquire(blocking=False):  # not in use: freed here and now
                r.lock.release()
                self._free(r, "expired")
            else:  # an Apply is filling it: freed once that ends, without holding up the other expiries
                threading.Thread(target=self._free, args=(r, "expired"), name="paraminit-expire", daemon=True).start()
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
            if rec.claim is not None:
                rec.claim.release()
        log.info("lease %s %s bytes=%d", rec.lease_id[:8], why, rec.nbytes)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:
                log.exception("lease reaper failed")
