"""Zero-copy exports: the server owns one buffer per materialization and lends it under a lease.

SHM (CPU backend): a POSIX shared-memory segment, mode 0600, with a 128-bit
random name, filled in place by the kernels. CUDA_IPC (GPU backend): one plain
cudaMalloc allocation (an IPC handle covers a whole allocation), exported with
cudaIpcGetMemHandle. Both only to peers on this host.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from paraminit.v1 import init_service_pb2 as pb
from paraminit_server import engine, errors, layout
from paraminit_server.auth import ANONYMOUS, TokenAuth, identity
from paraminit_server.backends import Backend
from paraminit_server.config import ServerConfig
from paraminit_server.leases import LeaseRecord, LeaseTable
from paraminit_server.plan import ResolvedParam

SHM_DIR = "/dev/shm"
SHM_PREFIX = "paraminit-"
GPU_ALIGN = 256


def is_local_peer(peer: str) -> bool:
    """True for loopback TCP and Unix-socket peers (context.peer() strings)."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


class ShmSegment:
    """A POSIX shared-memory segment created exclusively with mode 0600 and unlinked on close."""

    def __init__(self, size: int) -> None:
        self.name = SHM_PREFIX + secrets.token_hex(16)
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, max(size, 1))
            os.posix_fallocate(fd, 0, max(size, 1))  # tmpfs space now: ENOSPC here, not SIGBUS mid-fill
            self._map = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=size)

    def rename(self) -> None:
        """A fresh unguessable name for the same pages (pooling); the old name stops resolving."""
        name = SHM_PREFIX + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        os.rename(self.path, path)
        self.name, self.path = name, path

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):  # a view is still alive somewhere; the mapping goes when it does
            self._map.close()


class SegmentPool:
    """Released segments kept for the same identity's next export of the same size.

    Allocating and mapping tmpfs pages costs about 0.8 s per GiB on a host whose shared memory has
    no huge pages, several times the fill itself; a trainer that exports again (restarts, sweeps)
    pays it once. A segment only ever goes back to the identity that held it, under a new random
    name, and pooled bytes stay reserved against the memory budget until they are reused or freed.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: list[tuple[str, ShmSegment, Any]] = []  # (owner, segment, budget reservation), oldest first
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(seg.size for _, seg, _ in self._held)

    def take(self, owner: str, size: int) -> ShmSegment | None:
        with self._lock:
            match = next((i for i, (who, seg, _) in enumerate(self._held) if who == owner and seg.size == size), None)
            if match is None:
                return None
            _, seg, reservation = self._held.pop(match)
        if reservation is not None:
            reservation.release()
        return seg

    def give(self, owner: str, seg: ShmSegment, budget: Any) -> None:
        """Keep the segment if it fits the pool and the budget; free it otherwise."""
        reservation = None
        try:
            if seg.size > self.max_bytes:
                raise errors.ResourceExhausted("larger than the pool")
            seg.rename()  # the released name stops resolving at once
            reservation = budget.reserve(seg.size, 0.0, "pooled segment") if budget is not None else None
        except (errors.ResourceExhausted, OSError):
            seg.close()
            return
        with self._lock:
            self._held.append((owner, seg, reservation))
            evicted = []
            while sum(s.size for _, s, _ in self._held) > self.max_bytes:
                evicted.append(self._held.pop(0))
        for _, old, res in evicted:
            old.close()
            if res is not None:
                res.release()

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for _, seg, reservation in held:
            seg.close()
            if reservation is not None:
                reservation.release()


class Exports:
    def __init__(self, config: ServerConfig, backend: Backend, tokens: TokenAuth | None = None) -> None:
        self.tokens = tokens
        self.config = config
        self.backend = backend
        self.budget: Any = None  # the servicer's MemoryBudget
        self.memory_wait: Any = lambda context: 0.0
        self.leases = LeaseTable(config.max_leased_bytes, config.max_leases_per_client, config.lease_ttl,
                                 config.max_lease_ttl)
        self.pool = SegmentPool(config.shm_pool_bytes)

    def owner(self, context: grpc.ServicerContext) -> str:
        """Leases belong to the caller's identity; another identity gets NOT_FOUND for them."""
        return identity(context, self.tokens)

    def deliveries(self) -> list[int]:
        return [pb.DELIVERY_CUDA_IPC] if self.backend.name == "cupy" else [pb.DELIVERY_SHM]

    def _check(self, delivery: int, context: grpc.ServicerContext) -> None:
        name = pb.Delivery.Name(delivery)  # type: ignore[arg-type]
        if not is_local_peer(context.peer()):
            raise errors.FailedPrecondition(f"{name} hands out memory on this host only; peer {context.peer()} is "
                                            "remote: use STREAM delivery")
        if delivery not in self.deliveries():
            offered = [pb.Delivery.Name(d) for d in self.deliveries()]  # type: ignore[arg-type]
            raise errors.FailedPrecondition(f"{name} is not available on the {self.backend.name} backend; this "
                                            f"server offers {offered}")

    def export(self, params: list[ResolvedParam], digest: str, request: pb.MaterializeRequest,
               context: grpc.ServicerContext) -> pb.ExportInfo:
        delivery = request.delivery
        self._check(delivery, context)
        owner = self.owner(context)
        ttl = self.leases.ttl(request.lease_ttl_seconds)
        lay = layout.export_layout(params, GPU_ALIGN if delivery == pb.DELIVERY_CUDA_IPC else layout.EXPORT_ALIGN)
        self.leases.reserve(owner, lay.data_bytes)
        pooled = self.pool.take(owner, lay.data_bytes) if delivery == pb.DELIVERY_SHM else None
        try:
            reservation = self._reserve(lay.data_bytes, context)
        except BaseException:
            if pooled is not None:
                pooled.close()
            raise
        info = pb.ExportInfo(plan_digest=digest)

        def stop() -> bool:
            return not context.is_active()

        try:
            if delivery == pb.DELIVERY_SHM:
                buf, free = self._shm(lay, info, stop, owner, pooled)
            else:
                buf, free = self._cuda(lay, info, stop)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise

        def release() -> None:
            free()
            if reservation is not None:
                reservation.release()

        if stop():  # client gone while we filled: free now, lend nothing
            release()
            raise errors.Cancelled("client cancelled during export")
        rec = self.leases.add(owner, delivery, lay.data_bytes, ttl, digest, release, (lay, buf))
        _describe(info, lay, rec)
        return info

    def _reserve(self, nbytes: int, context: grpc.ServicerContext) -> Any:
        if self.budget is None:
            return None
        try:
            return self.budget.reserve(nbytes, self.memory_wait(context), "export")
        except errors.ResourceExhausted:
            if not self.pool.nbytes:
                raise
            self.pool.close()  # pooled segments yield to live requests
            return self.budget.reserve(nbytes, self.memory_wait(context), "export")

    def _shm(self, lay: layout.Layout, info: pb.ExportInfo, stop: Callable[[], bool], owner: str,
             pooled: ShmSegment | None) -> tuple[Any, Any]:
        if pooled is not None:
            seg = pooled
        else:
            try:
                seg = ShmSegment(lay.data_bytes)
            except OSError as exc:
                raise errors.ResourceExhausted(f"cannot create a {lay.data_bytes}-byte shared-memory segment: {exc}") from None
        try:
            engine.fill_all(self.backend, lay, seg.array, stop)
        except BaseException:
            seg.close()
            raise
        info.shm.segment_name = seg.name
        info.shm.size = lay.data_bytes
        return seg.array, lambda: self.pool.give(owner, seg, self.budget)

    def _cuda(self, lay: layout.Layout, info: pb.ExportInfo, stop: Callable[[], bool]) -> tuple[Any, Any]:
        try:
            buf = self.backend.empty(lay.data_bytes)
        except MemoryError as exc:
            raise errors.ResourceExhausted(f"cannot allocate {lay.data_bytes} bytes on the device: {exc}") from None
        engine.fill_all(self.backend, lay, buf, stop)
        handle = self.backend.ipc_handle(buf)  # type: ignore[attr-defined]
        dev = self.backend.device()
        info.cuda_ipc.ipc_handle = bytes(handle)
        info.cuda_ipc.device = dev.ordinal
        info.cuda_ipc.device_uuid = dev.uuid
        info.cuda_ipc.size = lay.data_bytes
        holder = [buf]
        return buf, holder.clear

    # -- lease RPCs ----------------------------------------------------------------------

    def release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.leases.release(request.lease_id, self.owner(context)))

    def renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:
        rec = self.leases.renew(request.lease_id, self.owner(context), request.ttl_seconds)
        return pb.RenewResponse(lease=_lease(rec))

    def list_leases(self, request: pb.ListLeasesRequest, context: grpc.ServicerContext) -> pb.ListLeasesResponse:
        import time

        owner = self.owner(context)
        now = time.time()
        resp = pb.ListLeasesResponse()
        for rec in self.leases.list(None if owner == ANONYMOUS else owner):
            resp.leases.add(lease=_lease(rec), age_seconds=now - rec.created, owner=rec.owner,
                            plan_digest=rec.plan_digest)
        return resp

    def apply(self, request: pb.ApplyRequest, params: list[ResolvedParam], digest: str,
              context: grpc.ServicerContext) -> pb.ApplyResponse:
        rec = self.leases.get(request.lease_id, self.owner(context))
        with rec.lock:
            if rec.payload is None:
                raise errors.NotFound(f"no lease {request.lease_id!r}")
            lay, buf = rec.payload
            _check_same_parameters(lay, params)
            new = layout.Layout(tuple(layout.Placement(p, pl.offset) for p, pl in zip(params, lay.placements,
                                                                                      strict=True)), lay.data_bytes)
            engine.fill_all(self.backend, new, buf)
            rec.plan_digest = digest
        return pb.ApplyResponse(plan_digest=digest)

    def close(self) -> None:
        self.leases.close()
        self.pool.close()


def _check_same_parameters(lay: layout.Layout, params: list[ResolvedParam]) -> None:
    """Apply keeps the buffer: names, shapes, regions, dtypes and order must match the lease exactly."""
    old = [pl.param for pl in lay.placements]
    problems: list[str] = []
    if len(old) != len(params):
        problems.append(f"the lease has {len(old)} parameters, the plan {len(params)}")
    for a, b in zip(old, params, strict=False):
        if (a.name, a.shape, a.region, a.dtype.enum) != (b.name, b.shape, b.region, b.dtype.enum):
            problems.append(f"params[{b.index}] {b.name!r} {b.dtype.name}{list(b.out_shape)} does not match the "
                            f"leased {a.name!r} {a.dtype.name}{list(a.out_shape)}")
    if problems:
        raise errors.InvalidRequest("plan does not match the lease's parameter list: " + "; ".join(problems))


def _lease(rec: LeaseRecord) -> pb.Lease:
    return pb.Lease(lease_id=rec.lease_id, expires_at=rec.expires_at, nbytes=rec.nbytes,
                    delivery=rec.delivery)  # type: ignore[arg-type]


def _describe(info: pb.ExportInfo, lay: layout.Layout, rec: LeaseRecord) -> None:
    info.lease.CopyFrom(_lease(rec))
    for pl in lay.placements:
        p = pl.param
        info.tensors.add(name=p.name, dtype=p.dtype.enum, shape=p.out_shape, offset=pl.offset, nbytes=p.nbytes)
