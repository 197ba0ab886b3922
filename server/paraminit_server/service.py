"""InitService: a thin servicer over validation, layout, engine and exports.

Each method validates, admits, then delegates; errors are raised as our own
types and mapped to status codes in one place (status.boundary).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import crc32c
import grpc
import numpy as np

from paraminit import wire
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit.v1 import plan_pb2
from paraminit_server import __version__, dtypes, errors, layout, plan, validation
from paraminit_server.admission import Admission
from paraminit_server.auth import identity
from paraminit_server.backends import Backend
from paraminit_server.config import ServerConfig
from paraminit_server.engine import iter_slabs
from paraminit_server.payloads import BoundSources, Sources
from paraminit_server.status import MalformedRequest, boundary

log = logging.getLogger("paraminit.server")


class InitServicer(pb_grpc.InitServiceServicer):
    def __init__(self, config: ServerConfig, backend: Backend, exports: Any = None, tokens: Any = None) -> None:
        self.config = config
        self.tokens = tokens
        self.sources = Sources(config.max_payload_bytes, config.payload_ttl, config.safetensors_dirs.split(":"))
        self.backend = backend
        self.limits = validation.Limits(config.max_param_bytes, config.max_plan_bytes)
        budget = config.memory_budget or backend.device().memory_free // 2
        self.admission = Admission(config.max_concurrent, budget)
        self.exports = exports
        self.metrics: Any = None  # paraminit_server.metrics.Metrics when enabled
        if exports is not None:
            exports.budget = self.admission.memory
            exports.memory_wait = self.memory_wait

    # -- helpers -------------------------------------------------------------------------

    def checked(self, p: plan_pb2.Plan, context: grpc.ServicerContext) -> tuple[list[plan.ResolvedParam], validation.Report]:
        """Validate the whole plan; raise with every violation, or return it resolved."""
        sources = self._sources(context)
        report = validation.validate(p, self.limits, sources)
        if report.only_limits:
            worst = "; ".join(v.message for v in report.violations)
            raise errors.ResourceExhausted(f"plan exceeds server limits: {worst}", report.violations)
        if not report.ok:
            raise errors.InvalidPlan(report.violations)
        return plan.resolve(p, sources), report

    def _sources(self, context: grpc.ServicerContext) -> BoundSources:
        """Payloads and files as this caller may see them."""
        return BoundSources(self.sources, identity(context, self.tokens))

    def memory_wait(self, context: grpc.ServicerContext) -> float:
        """How long a request may wait for memory: only while its deadline leaves time to do the work."""
        remaining: float | None = context.time_remaining()
        if remaining is None:
            return 0.0
        return max(0.0, min(self.config.admission_wait, remaining / 2))

    def _chunk_bytes(self, requested: int) -> int:
        size = requested or self.config.chunk_bytes
        return max(layout.SLAB_QUANTUM, min(size, self.config.max_chunk_bytes))

    # -- RPCs ----------------------------------------------------------------------------

    @boundary
    def Materialize(self, request: pb.MaterializeRequest, context: grpc.ServicerContext) -> Iterator[pb.MaterializeResponse]:
        started = time.perf_counter()
        delivery = request.delivery or pb.DELIVERY_STREAM
        if delivery not in pb.Delivery.values():
            raise errors.InvalidRequest(f"unknown delivery enum value {delivery}")
        params, report = self.checked(request.plan, context)
        digest = plan.digest(request.plan)
        outcome = "error"
        try:
            with self.admission.admit(report.total_bytes):
                if delivery == pb.DELIVERY_STREAM:
                    yield from self._stream(params, digest, request, context)
                else:
                    if self.exports is None:
                        raise errors.FailedPrecondition("this server does not export zero-copy buffers")
                    yield pb.MaterializeResponse(export=self.exports.export(params, digest, request, context))
            outcome = "ok" if context.is_active() else "cancelled"
            if self.metrics is not None and outcome == "ok":
                for p in params:
                    self.metrics.bytes.labels(self.backend.name, p.dtype.name, p.initializer).inc(p.nbytes)
        finally:
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.latency.labels(pb.Delivery.Name(delivery)).observe(seconds)
            log.info("materialize digest=%s params=%d bytes=%d delivery=%s seconds=%.3f outcome=%s",
                     digest[:16], len(params), report.total_bytes, pb.Delivery.Name(delivery), seconds, outcome,
                     extra={"method": "Materialize", "plan_digest": digest, "bytes": report.total_bytes,
                            "seconds": round(seconds, 6), "outcome": outcome})

    def _stream(self, params: list[plan.ResolvedParam], digest: str, request: pb.MaterializeRequest,
                context: grpc.ServicerContext) -> Iterator[pb.MaterializeResponse]:
        lay = layout.stream_layout(params, digest)
        header = pb.StreamHeader(plan_digest=digest, safetensors_prefix=lay.prefix, data_bytes=lay.data_bytes)
        for pl in lay.placements:
            header.tensors.add(name=pl.param.name, dtype=pl.param.dtype.enum, shape=pl.param.out_shape,
                               offset=pl.offset, nbytes=pl.param.nbytes)
        yield pb.MaterializeResponse(header=header)
        chunk = self._chunk_bytes(request.chunk_bytes)
        slab = max(chunk, self.config.slab_bytes // chunk * chunk)
        # the producer holds up to prefetch + 2 slabs and their encoded copies at once
        held = min(lay.data_bytes, slab * 4) * 2
        reservation = self.admission.memory.reserve(held, self.memory_wait(context), "stream")

        def encode(start: int, host: Any) -> list[bytes]:
            mv = memoryview(host).toreadonly()
            pieces = ((off, mv[off:off + chunk]) for off in range(0, len(mv), chunk))
            return [wire.encode_chunk(start + off, piece, crc32c.crc32c(piece)) for off, piece in pieces]

        try:
            for messages in iter_slabs(self.backend, lay, slab, lambda: not context.is_active(), transform=encode):
                yield from messages  # pre-encoded MaterializeResponse bytes (paraminit.wire)
                if not context.is_active():
                    raise errors.Cancelled("client cancelled or deadline passed")
        finally:
            reservation.release()

    @boundary
    def Validate(self, request: pb.ValidateRequest, context: grpc.ServicerContext) -> pb.ValidateResponse:
        report = validation.validate(request.plan, self.limits, self._sources(context))
        resp = pb.ValidateResponse(
            valid=not any(v.category == validation.INVALID for v in report.violations),
            param_bytes=report.param_bytes, total_bytes=report.total_bytes,
            fits_limits=not any(v.category == validation.LIMIT for v in report.violations),
            plan_digest=plan.digest(request.plan))
        for v in report.violations:
            resp.violations.add(index=v.index, name=v.name, field=v.field, message=v.message,
                                limit=v.category == validation.LIMIT)
        return resp

    @boundary
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        dev = self.backend.device()
        c = self.config
        deliveries = [pb.DELIVERY_STREAM]
        if self.exports is not None:
            deliveries += self.exports.deliveries()
        return pb.GetInfoResponse(
            version=__version__, backend=self.backend.name,
            device=pb.DeviceInfo(kind=dev.kind, name=dev.name, uuid=dev.uuid, ordinal=dev.ordinal,
                                 memory_total=dev.memory_total, memory_free=dev.memory_free),
            limits=pb.Limits(max_plan_bytes=c.max_plan_bytes, max_param_bytes=c.max_param_bytes,
                             max_concurrent_requests=c.max_concurrent, max_chunk_bytes=c.max_chunk_bytes,
                             max_leased_bytes=c.max_leased_bytes, max_leases_per_client=c.max_leases_per_client),
            dtypes=[d.enum for d in dtypes.SUPPORTED], deliveries=deliveries)  # type: ignore[misc]

    @boundary
    def UploadPayload(self, request: Iterator[pb.PayloadChunk], context: grpc.ServicerContext) -> pb.PayloadRef:
        buf: Any = None
        dtype = count = received = 0
        for chunk in request:
            if isinstance(chunk, MalformedRequest):
                raise errors.InvalidRequest(chunk.reason)
            if buf is None:
                dtype, count = chunk.dtype, chunk.count
                dt = dtypes.by_enum(dtype)
                if dt is None or dtype == 0:
                    raise errors.InvalidRequest(f"the first payload chunk must name a dtype, got enum value {dtype}")
                if count * 8 > self.sources.max_bytes:
                    raise errors.ResourceExhausted(f"payload of {count} values needs {count * 8} bytes as binary64; "
                                                   f"the payload limit is {self.sources.max_bytes}")
                buf = np.empty(count * dt.itemsize, dtype=np.uint8)
            data = chunk.data  # one copy out of the message; each access would make another
            if received + len(data) > len(buf):
                raise errors.InvalidRequest(f"payload is longer than the declared {count} values")
            buf[received:received + len(data)] = np.frombuffer(data, dtype=np.uint8)
            received += len(data)
        if buf is None:
            raise errors.InvalidRequest("empty payload upload")
        pid, payload = self.sources.store(identity(context, self.tokens), dtype, count, buf[:received])
        return pb.PayloadRef(payload_id=pid, count=count, expires_at=payload.expires_at)

    def _leases(self) -> Any:
        if self.exports is None:
            raise errors.FailedPrecondition("this server does not export zero-copy buffers")
        return self.exports

    @boundary
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return self._leases().release(request, context)  # type: ignore[no-any-return]

    @boundary
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:
        return self._leases().renew(request, context)  # type: ignore[no-any-return]

    @boundary
    def ListLeases(self, request: pb.ListLeasesRequest, context: grpc.ServicerContext) -> pb.ListLeasesResponse:
        return self._leases().list_leases(request, context)  # type: ignore[no-any-return]

    @boundary
    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyResponse:
        params, _ = self.checked(request.plan, context)
        return self._leases().apply(request, params, plan.digest(request.plan), context)  # type: ignore[no-any-return]
