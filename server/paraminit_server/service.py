"""InitService over gRPC: protobuf in, data-plane calls, protobuf out.

Everything else (validation, admission, memory, slabs, encoding, leases) is the
data plane's (materializer.py); errors map to status codes in status.boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from paraminit import peers
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit_server import errors
from paraminit_server.auth import TokenAuth, identity
from paraminit_server.backends import CUDA_IPC, SHM, ExportHandle
from paraminit_server.caller import Caller
from paraminit_server.exports import Export
from paraminit_server.layout import Layout
from paraminit_server.leases import LeaseRecord
from paraminit_server.materializer import Materializer, PayloadPiece, StreamStart
from paraminit_server.metrics import Metrics
from paraminit_server.status import MalformedRequest, boundary

log = logging.getLogger("paraminit.server")
DELIVERIES: dict[str, int] = {"stream": pb.DELIVERY_STREAM, SHM: pb.DELIVERY_SHM, CUDA_IPC: pb.DELIVERY_CUDA_IPC}
DELIVERY_NAMES = {v: k for k, v in DELIVERIES.items()}
NO_DEADLINE = 1e9  # grpc reports about 9.2e18 s remaining for calls without a deadline


class InitServicer(pb_grpc.InitServiceServicer):
    def __init__(self, plane: Materializer, tokens: TokenAuth | None = None, metrics: Metrics | None = None) -> None:
        self.plane = plane
        self.tokens = tokens
        self.metrics = metrics

    def methods(self) -> dict[str, Callable[..., Any]]:
        """The RPC implementations by method name, for the server's handler table."""
        return {"Materialize": self.Materialize, "Validate": self.Validate, "GetInfo": self.GetInfo,
                "UploadPayload": self.UploadPayload, "Release": self.Release, "Renew": self.Renew,
                "ListLeases": self.ListLeases, "Apply": self.Apply}

    # -- what status.boundary needs --------------------------------------------------------

    def draining(self) -> bool:
        return self.plane.admission.draining.is_set()

    def count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(method, code.name).inc()

    # -- conversions -----------------------------------------------------------------------

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """The data plane's view of a call: identity, locality, how long it may wait for memory."""
        remaining: float | None = context.time_remaining()
        wait = 0.0  # no deadline: refuse at once rather than hold the call for --admission-wait
        if remaining is not None and remaining < NO_DEADLINE:
            wait = max(0.0, min(self.plane.config.admission_wait, remaining / 2))
        return Caller(identity(context, self.tokens), peers.is_local_peer(context.peer()), wait, context.is_active)

    # -- RPCs ------------------------------------------------------------------------------

    @boundary
    def Materialize(self, request: pb.MaterializeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        started = time.perf_counter()
        delivery = request.delivery or pb.DELIVERY_STREAM
        if delivery not in DELIVERY_NAMES:
            raise errors.InvalidRequest(f"unknown delivery enum value {delivery}")
        caller = self.caller(context)
        lay: Layout | None = None
        digest = ""
        outcome = "error"
        try:
            if delivery == pb.DELIVERY_STREAM:
                for item in self.plane.stream(request.plan, caller, request.chunk_bytes):
                    if isinstance(item, StreamStart):
                        lay, digest = item.layout, item.digest
                        yield pb.MaterializeResponse(header=_header(item))
                    else:
                        yield item  # a pre-encoded MaterializeResponse (paraminit.wire)
            else:
                export = self.plane.export(request.plan, DELIVERY_NAMES[delivery], caller, request.lease_ttl_seconds)
                lay, digest = export.layout, export.lease.plan_digest
                yield pb.MaterializeResponse(export=_export_info(export))
            outcome = "ok" if context.is_active() else "cancelled"
        finally:
            self._record(delivery, lay, digest, outcome, time.perf_counter() - started)

    def _record(self, delivery: int, lay: Layout | None, digest: str, outcome: str, seconds: float) -> None:
        params = [pl.param for pl in lay.placements] if lay is not None else []
        nbytes = sum(p.nbytes for p in params)
        name = pb.Delivery.Name(delivery)  # type: ignore[arg-type]
        if self.metrics is not None:
            self.metrics.latency.labels(name).observe(seconds)
            if outcome == "ok":
                for p in params:
                    self.metrics.bytes.labels(self.plane.backend.name, p.dtype.name, p.initializer).inc(p.nbytes)
        log.info("materialize digest=%s params=%d bytes=%d delivery=%s seconds=%.3f outcome=%s",
                 digest[:16], len(params), nbytes, name, seconds, outcome,
                 extra={"method": "Materialize", "plan_digest": digest, "bytes": nbytes,
                        "seconds": round(seconds, 6), "outcome": outcome})

    @boundary
    def Validate(self, request: pb.ValidateRequest, context: grpc.ServicerContext) -> pb.ValidateResponse:
        report, digest = self.plane.validate(request.plan, self.caller(context))
        resp = pb.ValidateResponse(valid=not any(not v.is_limit for v in report.violations),
                                   param_bytes=report.param_bytes, total_bytes=report.total_bytes,
                                   fits_limits=not any(v.is_limit for v in report.violations), plan_digest=digest)
        for v in report.violations:
            resp.violations.add(index=v.index, name=v.name, field=v.field, message=v.message, limit=v.is_limit)
        return resp

    @boundary
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        info = self.plane.info()
        dev, c = info.device, info.config
        return pb.GetInfoResponse(
            version=info.version, backend=info.backend,
            device=pb.DeviceInfo(kind=dev.kind, name=dev.name, uuid=dev.uuid, ordinal=dev.ordinal,
                                 memory_total=dev.memory_total, memory_free=dev.memory_free),
            limits=pb.Limits(max_plan_bytes=c.max_plan_bytes, max_param_bytes=c.max_param_bytes,
                             max_concurrent_requests=c.max_concurrent, max_chunk_bytes=c.max_chunk_bytes,
                             max_leased_bytes=c.max_leased_bytes, max_leases_per_client=c.max_leases_per_client),
            dtypes=[d.enum for d in info.dtypes],  # type: ignore[misc]
            deliveries=[DELIVERIES[d] for d in info.deliveries])  # type: ignore[misc]

    @boundary
    def UploadPayload(self, request: Iterator[pb.PayloadChunk], context: grpc.ServicerContext) -> pb.PayloadRef:
        def pieces() -> Iterator[PayloadPiece]:
            for chunk in request:
                if isinstance(chunk, MalformedRequest):
                    raise errors.InvalidRequest(chunk.reason)
                yield PayloadPiece(chunk.dtype, chunk.count, chunk.data)

        pid, payload = self.plane.upload(pieces(), self.caller(context))
        return pb.PayloadRef(payload_id=pid, count=payload.values.size, expires_at=payload.expires_at)

    @boundary
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.plane.release(request.lease_id, self.caller(context)))

    @boundary
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:
        return pb.RenewResponse(lease=_lease(self.plane.renew(request.lease_id, self.caller(context),
                                                              request.ttl_seconds)))

    @boundary
    def ListLeases(self, request: pb.ListLeasesRequest, context: grpc.ServicerContext) -> pb.ListLeasesResponse:
        now = time.time()
        resp = pb.ListLeasesResponse()
        for rec in self.plane.list_leases(self.caller(context)):
            resp.leases.add(lease=_lease(rec), age_seconds=now - rec.created, owner=rec.owner,
                            plan_digest=rec.plan_digest)
        return resp

    @boundary
    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyResponse:
        return pb.ApplyResponse(plan_digest=self.plane.apply(request.lease_id, request.plan, self.caller(context)))


def _header(start: StreamStart) -> pb.StreamHeader:
    lay = start.layout
    header = pb.StreamHeader(plan_digest=start.digest, safetensors_prefix=lay.prefix, data_bytes=lay.data_bytes)
    _tensors(header.tensors, lay)
    return header


def _tensors(out: Any, lay: Layout) -> None:
    for pl in lay.placements:
        p = pl.param
        out.add(name=p.name, dtype=p.dtype.enum, shape=p.out_shape, offset=pl.offset, nbytes=p.nbytes)


def _lease(rec: LeaseRecord) -> pb.Lease:
    return pb.Lease(lease_id=rec.lease_id, expires_at=rec.expires_at, nbytes=rec.nbytes,
                    delivery=DELIVERIES[rec.delivery])  # type: ignore[arg-type]


def _export_info(export: Export) -> pb.ExportInfo:
    info = pb.ExportInfo(plan_digest=export.lease.plan_digest)
    info.lease.CopyFrom(_lease(export.lease))
    _tensors(info.tensors, export.layout)
    _handle(info, export.handle)
    return info


def _handle(info: pb.ExportInfo, h: ExportHandle) -> None:
    if h.delivery == SHM:
        info.shm.SetInParent()  # present even for an empty plan
        info.shm.segment_name = h.shm_name
        info.shm.size = h.size
        return
    info.cuda_ipc.SetInParent()
    info.cuda_ipc.ipc_handle = h.ipc_handle
    info.cuda_ipc.size = h.size
    if h.device is not None:
        info.cuda_ipc.device = h.device.ordinal
        info.cuda_ipc.device_uuid = h.device.uuid
