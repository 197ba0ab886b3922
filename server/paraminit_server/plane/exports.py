"""Zero-copy exports: the backend's buffer for one materialization, lent under a lease.

The CPU backend lends POSIX shared-memory segments, the GPU backend whole
cudaMalloc allocations by CUDA IPC; this module only sees `ExportBuffer`s. Both
go to peers on this host only. A buffer is filled completely before its handle
leaves, and freed exactly once: on Release, expiry or shutdown.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paraminit import results
from paraminit_server import errors
from paraminit_server.backends import HOST, Backend, ExportBuffer, ExportHandle
from paraminit_server.ledger import Claim
from paraminit_server.plane import engine, layout
from paraminit_server.plane.budget import MemoryBudget
from paraminit_server.plane.caller import REMOTE, UNIX_SHARED, Caller
from paraminit_server.plane.leases import LeaseRecord, LeaseTable
from paraminit_server.plans.columns import ParamTable

GPU_ALIGN = 256
QUARANTINE_CHECK = 2.0  # seconds between looks at whether an expired segment is still mapped elsewhere


@dataclass(frozen=True)
class Export:
    """A lent buffer: the lease, where each tensor lies, and how a peer maps it."""

    lease: LeaseRecord
    layout: layout.Layout
    handle: ExportHandle

    def info(self) -> results.ExportInfo:
        """The export as the data plane answers it: the lease, the tensor table and the peer's handle."""
        h = self.handle
        return results.ExportInfo(
            self.lease.plan_digest, self.lease.lease(), self.layout.spans(), h.size, h.shm_name, h.ipc_handle, h.device
        )


@dataclass(frozen=True)
class _Charges:
    """What a quarantined segment holds: its bytes in the memory budget and a slot among its owner's leases."""

    reservation: Claim
    slot: Claim

    @property
    def nbytes(self) -> int:
        return self.reservation.nbytes

    def release(self) -> None:
        self.reservation.release()
        self.slot.release()


class BufferPool:
    """Explicitly released buffers kept for the same identity's next export of the same size.

    Allocating and mapping tmpfs pages costs about 0.8 s per GiB on a host whose shared memory has
    no huge pages, several times the fill itself; a trainer that exports again (restarts, sweeps)
    pays it once. A buffer only ever goes back to the identity that released it, under a new handle,
    and pooled bytes stay reserved against the memory budget until they are reused or freed.
    """

    def __init__(self, max_bytes: int, budget: MemoryBudget) -> None:
        self.max_bytes = max_bytes
        self.budget = budget
        self._held: list[tuple[str, ExportBuffer, Claim]] = []  # oldest first
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(buf.size for _, buf, _ in self._held)

    def take(self, owner: str, size: int) -> ExportBuffer | None:
        with self._lock:
            match = next((i for i, (who, buf, _) in enumerate(self._held) if who == owner and buf.size == size), None)
            if match is None:
                return None
            _, buf, reservation = self._held.pop(match)
        reservation.release()
        return buf

    def give(self, owner: str, buf: ExportBuffer) -> None:
        """Keep the buffer if it can be recycled and fits the pool and the budget; free it otherwise."""
        if self.max_bytes <= 0 or buf.size > self.max_bytes or not buf.recycle():
            buf.close()
            return
        try:
            reservation = self.budget.reserve(buf.size, 0.0, "pooled buffer")
        except errors.ResourceExhausted:
            buf.close()
            return
        with self._lock:
            self._held.append((owner, buf, reservation))
            evicted = []
            while sum(b.size for _, b, _ in self._held) > self.max_bytes:
                evicted.append(self._held.pop(0))
        for _, old, res in evicted:
            old.close()
            res.release()

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for _, buf, reservation in held:
            buf.close()
            reservation.release()


class Exports:
    def __init__(self, backend: Backend, leases: LeaseTable, budget: MemoryBudget, pool_bytes: int = 0) -> None:
        self.backend = backend
        self.leases = leases
        self.budget = budget
        self.pool = BufferPool(pool_bytes, budget)
        self.align = layout.EXPORT_ALIGN if backend.memory == HOST else GPU_ALIGN
        # expired segments another process still maps, with the budget they keep holding
        self._quarantined: list[tuple[Any, _Charges]] = []
        self._quarantine_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()

    def export(self, params: ParamTable, digest: str, delivery: str, caller: Caller, ttl_seconds: float = 0.0) -> Export:
        """Fill a new buffer with the plan and lend it; every limit is taken before anything is allocated."""
        self.check_caller(delivery, caller)
        ttl = self.leases.ttl(ttl_seconds)
        lay = layout.export_layout(params, self.align)
        slot = self.leases.reserve(caller.identity, lay.data_bytes)
        try:
            buf = self.pool.take(caller.identity, lay.data_bytes)
            reservation = self._reserve(lay.data_bytes, caller)
            try:
                if buf is None:
                    buf = self.backend.export_buffer(lay.data_bytes)
                engine.fill_all(self.backend, lay, buf.array, caller.gone)
                if caller.gone():
                    raise errors.Cancelled("client cancelled during export")
                handle = buf.handle()
            except BaseException:
                if buf is not None:
                    buf.close()
                reservation.release()
                raise
        except BaseException:
            slot.release()
            raise
        owner = caller.identity

        def release(explicit: bool) -> None:
            # An explicit Release says the holder is done, but a view it kept past release() may still map the
            # memory: a buffer another process maps or holds open is never lent again (a pooled one would alias
            # the next export) and its bytes stay charged for as long as that lasts (its pages stay with it). An
            # expired or abandoned buffer is treated so without looking.
            elsewhere = getattr(buf, "mapped_elsewhere", None)
            if explicit and (elsewhere is None or not elsewhere()):
                self.pool.give(owner, buf)
                reservation.release()
            elif elsewhere is not None:
                self._quarantine(buf, reservation, owner)
            else:
                buf.close()
                reservation.release()

        rec = self.leases.add(slot, delivery, ttl, digest, release, (lay, buf))
        return Export(rec, lay, handle)

    def _quarantine(self, buf: Any, reservation: Claim, owner: str) -> None:
        """Keep an expired segment's bytes charged, and counted among its owner's leases (so segments kept mapped
        past expiry cannot pile up beyond --max-leases-per-client), until no other process maps or holds it
        (looked at every QUARANTINE_CHECK seconds), then unlink it and give both back."""
        buf.unmap()
        held = _Charges(reservation, self.leases.ledger.claim(0, owner))  # a lease slot without bytes: always taken
        with self._quarantine_lock:
            self._quarantined.append((buf, held))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="paraminit-quarantine", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        while True:
            self._settle()
            with self._quarantine_lock:
                if not self._quarantined:
                    self._watcher = None
                    return
            if self._closed.wait(QUARANTINE_CHECK):
                return

    def _settle(self, force: bool = False) -> None:
        """Free the quarantined segments nobody maps any more (all of them with `force`, at shutdown)."""
        with self._quarantine_lock:
            items = list(self._quarantined)
        held: set[int] = set()
        if not force and items:  # one pass over /proc for every segment of the round
            check = getattr(type(items[0][0]), "held_elsewhere", None)
            held = check([b for b, _ in items]) if check is not None else {id(b) for b, _ in items if b.mapped_elsewhere()}
        free = [(b, r) for b, r in items if force or id(b) not in held]
        with self._quarantine_lock:
            self._quarantined = [x for x in self._quarantined if x not in free]
        for b, r in free:
            b.close()
            r.release()

    def quarantined_bytes(self) -> int:
        with self._quarantine_lock:
            return sum(r.nbytes for _, r in self._quarantined)

    def check_caller(self, delivery: str, caller: Caller) -> None:
        """Refuse, before any work, an export this caller could not use.

        Raises:
            errors.FailedPrecondition: a remote caller, a delivery this backend lacks, or a segment (mode 0600,
                owned by the server's user) that the caller's user cannot open.
        """
        if not caller.local:
            raise errors.FailedPrecondition(
                f"{delivery.upper()} hands out memory on this host only and this caller is remote: use STREAM delivery"
            )
        if delivery != self.backend.delivery:
            raise errors.FailedPrecondition(
                f"{delivery.upper()} is not available on the {self.backend.name} backend; "
                f"this server offers {self.backend.delivery.upper()}"
            )
        if delivery == "shm" and caller.identity in (REMOTE, UNIX_SHARED):
            raise errors.FailedPrecondition(
                "SHM segments are mode 0600 and only the server's user can open them; the kernel does not show "
                f"which user this caller is ({caller.identity}): use STREAM delivery, or call as the server's user "
                "over a socket only it can connect to (loopback TCP, or the Unix socket at 0600), or with a token"
            )
        if delivery == "shm" and caller.uid is not None and caller.uid not in (0, os.geteuid()):
            raise errors.FailedPrecondition(
                f"SHM segments are mode 0600 and owned by the server's user (uid {os.geteuid()}); this caller is uid "
                f"{caller.uid} and could not open one: use STREAM delivery, or a server run by the same user"
            )

    def _reserve(self, nbytes: int, caller: Caller) -> Claim:
        try:
            return self.budget.reserve(nbytes, caller.wait, "export")
        except errors.ResourceExhausted:
            if not self.pool.nbytes:
                raise
            self.pool.close()  # pooled buffers yield to live requests
            return self.budget.reserve(nbytes, caller.wait, "export")

    def release(self, lease_id: str, caller: Caller) -> bool:
        return self.leases.release(lease_id, caller.identity)

    def renew(self, lease_id: str, caller: Caller, ttl_seconds: float) -> LeaseRecord:
        return self.leases.renew(lease_id, caller.identity, ttl_seconds)

    def list(self, caller: Caller) -> list[LeaseRecord]:
        return self.leases.list(caller.identity)  # no identity sees another's leases

    def apply(self, lease_id: str, params: ParamTable, digest: str, caller: Caller, stop: Callable[[], bool] | None = None) -> str:
        """Re-initialize a live lease in place; the plan must have the lease's parameter list exactly. The fill asks
        `stop` (deadline, cancellation, drain) as it goes, as an export's does.

        Raises:
            Cancelled: `stop` ended the fill; the lease holds partly new values (Apply again)."""
        rec = self.leases.get(lease_id, caller.identity)
        with rec.lock:
            if rec.payload is None:
                raise errors.NotFound(f"no lease {lease_id!r}")
            lay, buf = rec.payload
            _check_same_parameters(lay, params)
            new = layout.Layout(params, lay.offsets, lay.data_bytes)
            ended = errors.Cancelled("the request ended during Apply: the lease holds partly new values (Apply again)")
            try:
                engine.fill_all(self.backend, new, buf.array, stop)
            except errors.Cancelled:
                raise ended from None
            if stop is not None and stop():
                raise ended
            rec.plan_digest = digest
        return digest

    def close(self) -> None:
        self.leases.close()
        self.pool.close()
        self._closed.set()
        # a watcher in the middle of a settle may have taken segments off the list and not yet unlinked them:
        # it stops at its next wait, and only then is everything gone
        with self._quarantine_lock:
            watcher = self._watcher
        if watcher is not None:
            watcher.join()
        self._settle(force=True)  # a server that stops takes its segments with it, mapped or not


def _check_same_parameters(lay: layout.Layout, params: ParamTable) -> None:
    """Apply keeps the buffer: names, shapes, regions, dtypes and order must match the lease exactly."""
    old = [pl.param for pl in lay.placements]
    problems: list[str] = []
    if len(old) != len(params):
        problems.append(f"the lease has {len(old)} parameters, the plan {len(params)}")
    for a, b in zip(old, params, strict=False):
        if (a.name, a.shape, a.region, a.dtype.enum) != (b.name, b.shape, b.region, b.dtype.enum):
            problems.append(
                f"params[{b.index}] {b.name!r} {b.dtype.name}{list(b.out_shape)} does not match the "
                f"leased {a.name!r} {a.dtype.name}{list(a.out_shape)}"
            )
    if problems:
        raise errors.InvalidRequest("plan does not match the lease's parameter list: " + "; ".join(problems))
