"""InitService over gRPC: protobuf in, data-plane calls, protobuf out.

Everything else (validation, admission, memory, slabs, leases) is the data
plane's (materializer.py); chunk messages are encoded here from the slabs it
lends, and its errors map to status codes in status.boundary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from paraminit import dtypes, messages, packed_table, peers, times, wire
from paraminit.header_checksum import checksum
from paraminit.messages import DELIVERY_NAMES
from paraminit.results import STREAM
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit.violations import listed
from paraminit_server import errors
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.materializer import Materializer, PayloadPiece, StreamStart
from paraminit_server.rpc.auth import Endpoint, TokenAuth, identity
from paraminit_server.rpc.metrics import Metrics
from paraminit_server.rpc.stalls import StallWatch
from paraminit_server.rpc.status import MalformedRequest, boundary

log = logging.getLogger("paraminit.server")
NO_DEADLINE = 1e9  # grpc reports about 9.2e18 s remaining for calls without a deadline


class InitServiceHandlers:
    """protobuf request -> data plane -> protobuf response, for the gRPC servicer and the in-process stub alike."""

    def __init__(self, plane: Materializer) -> None:
        self.plane = plane

    def stream(self, request: pb.MaterializeRequest, caller: Caller) -> Iterator[pb.MaterializeResponse | bytes]:
        """The header messages, then the data section as encoded chunk messages (bytes, paraminit.wire).

        Chunks are encoded here, on the transport's thread, as gRPC asks for them: each slab is borrowed
        from the data plane (lend=True) and copied into its messages before the next one is asked for."""
        chunk = self.plane.chunk_size(request.chunk_bytes)
        for item in self.plane.stream(request.plan, caller, request.chunk_bytes, lend=True):
            if isinstance(item, StreamStart):
                yield from header_messages(*_header(item, request.packed_table, request.omit_safetensors_prefix))
                continue
            start, slab = item
            for off in range(0, int(slab.shape[0]), chunk):
                yield wire.encode_chunk(start + off, slab[off : off + chunk])

    def export(self, request: pb.MaterializeRequest, caller: Caller) -> pb.MaterializeResponse:
        delivery = DELIVERY_NAMES.get(request.delivery)
        if delivery is None or delivery == STREAM:
            raise errors.InvalidRequest(f"unknown delivery enum value {request.delivery}")
        bound = export_info_bound(request.plan)
        if bound > MAX_ANSWER_BYTES:  # refused before anything is exported or leased
            raise errors.ResourceExhausted(
                f"the export's answer (one ExportInfo with {len(request.plan.params)} tensors) could take up to "
                f"{bound} bytes, over the {MAX_ANSWER_BYTES} a client receives by default; use STREAM (its table "
                "comes in parts) or export the plan in several calls"
            )
        export = self.plane.export(request.plan, delivery, caller, times.seconds(request.lease_ttl))
        return pb.MaterializeResponse(export=messages.export_info_message(export))

    def validate(self, request: pb.ValidateRequest, caller: Caller) -> pb.ValidateResponse:
        report, digest = self.plane.validate(request.plan, caller)
        resp = pb.ValidateResponse(
            valid=report.valid,
            param_bytes=report.param_bytes,
            total_bytes=report.total_bytes,
            fits_limits=report.fits_limits,
            plan_digest=digest,
        )
        shown, beyond = listed(report.violations)  # an answer's size does not grow with the plan
        resp.omitted_violations = beyond + report.omitted
        for v in shown:
            resp.violations.add(index=v.index, name=v.name, field=v.field, message=v.message, limit=v.is_limit)
        return resp

    def info(self, request: pb.GetInfoRequest, caller: Caller) -> pb.GetInfoResponse:
        return messages.server_info_message(self.plane.info())

    def upload(self, request: Iterable[pb.PayloadChunk | wire.Piece | MalformedRequest], caller: Caller) -> pb.PayloadRef:
        def pieces() -> Iterator[PayloadPiece]:
            for chunk in request:
                if isinstance(chunk, MalformedRequest):
                    raise errors.InvalidRequest(chunk.reason)
                yield PayloadPiece(chunk.dtype, chunk.count, chunk.data)

        pid, payload = self.plane.upload(pieces(), caller)
        return pb.PayloadRef(payload_id=pid, count=payload.values.size, expires_at=times.timestamp(payload.expires_at))

    def release(self, request: pb.ReleaseRequest, caller: Caller) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.plane.release(request.lease_id, caller))

    def renew(self, request: pb.RenewRequest, caller: Caller) -> pb.RenewResponse:
        return pb.RenewResponse(lease=messages.lease_message(self.plane.renew(request.lease_id, caller, times.seconds(request.ttl))))

    def list_leases(self, request: pb.ListLeasesRequest, caller: Caller) -> pb.ListLeasesResponse:
        now = time.time()
        return pb.ListLeasesResponse(leases=[messages.lease_status_message(s, now) for s in self.plane.list_leases(caller)])

    def apply(self, request: pb.ApplyRequest, caller: Caller) -> pb.ApplyResponse:
        return pb.ApplyResponse(plan_digest=self.plane.apply(request.lease_id, request.plan, caller))


class InitServicer(pb_grpc.InitServiceServicer):
    def __init__(
        self, plane: Materializer, tokens: TokenAuth | None = None, metrics: Metrics | None = None, stalls: StallWatch | None = None
    ) -> None:
        self.plane = plane
        self.handlers = InitServiceHandlers(plane)
        self.tokens = tokens
        self.metrics = metrics
        self.stalls = stalls or StallWatch(plane.config.max_stall)
        self.endpoint = Endpoint()  # where callers' connections end; set once the server has bound

    def methods(self) -> dict[str, Callable[..., Any]]:
        """The RPC implementations by method name, for the server's handler table."""
        return {
            "Materialize": self.Materialize,
            "Validate": self.Validate,
            "GetInfo": self.GetInfo,
            "UploadPayload": self.UploadPayload,
            "Release": self.Release,
            "Renew": self.Renew,
            "ListLeases": self.ListLeases,
            "Apply": self.Apply,
        }

    # -- what status.boundary needs --------------------------------------------------------

    def draining(self) -> bool:
        return self.plane.admission.draining.is_set()

    def count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(method, code.name).inc()

    def refused(self, method: str, reason: str) -> None:
        """A call turned away for load (RESOURCE_EXHAUSTED or UNAVAILABLE), by why: busy, queue_full,
        queue_timeout, identity_share, memory, draining, limit."""
        if self.metrics is not None:
            self.metrics.refusals.labels(method, reason).inc()

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """The data plane's view of a call: identity, locality, how long it may wait for memory."""
        remaining: float | None = context.time_remaining()
        config = self.plane.config
        wait = 0.0  # no deadline: refuse at once rather than hold the call for --admission-wait
        queue_wait = config.queue_wait_no_deadline  # 0 by default: refuse at once when busy
        if remaining is not None and remaining < NO_DEADLINE:
            wait = max(0.0, min(config.admission_wait, remaining / 2))
            # half the deadline in line at most: the other half is for the work once a slot is free
            queue_wait = max(0.0, min(config.max_queue_wait, remaining / 2))
        ident, uid = identity(context, self.tokens, self.endpoint)
        return Caller(ident, peers.is_local_peer(context.peer()), wait, context.is_active, queue_wait, uid)

    # -- RPCs ------------------------------------------------------------------------------

    @boundary
    def Materialize(self, request: pb.MaterializeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        started = time.perf_counter()
        delivery = request.delivery or pb.DELIVERY_STREAM
        caller = self.caller(context)
        header: pb.StreamHeader | None = None
        parts: list[pb.HeaderPart] = []  # a large plan's tensor table continues in header parts
        outcome = "error"
        try:
            if delivery == pb.DELIVERY_STREAM:
                with self.stalls.watch("stream", context.cancel) as watched:
                    try:
                        for message in self.handlers.stream(request, caller):
                            if isinstance(message, pb.MaterializeResponse):
                                if header is None:
                                    header = message.header
                                elif message.HasField("header_part"):
                                    parts.append(message.header_part)
                            watched.waiting()  # until gRPC has sent it and asks for the next: the client's pace
                            yield message
                            watched.progress()
                    finally:  # a cancelled stream ends at its yield: the log still says why
                        outcome = "stalled" if watched.stalled else outcome
            else:
                response = self.handlers.export(request, caller)
                header = pb.StreamHeader(plan_digest=response.export.plan_digest, tensors=response.export.tensors)
                if not context.is_active():  # the caller left while the export was made: nobody will know its id
                    with contextlib.suppress(errors.ParaminitServerError):
                        self.plane.release(response.export.lease.lease_id, caller)
                    raise errors.Cancelled("client cancelled or deadline passed during the export")
                # (once sent, a caller that hangs up at once may still hold the answer: the lease stays)
                yield response
            if outcome != "stalled":
                outcome = "ok" if context.is_active() else "cancelled"
        finally:
            self._record(request, delivery, header, parts, outcome, time.perf_counter() - started)

    def _record(
        self,
        request: pb.MaterializeRequest,
        delivery: int,
        header: pb.StreamHeader | None,
        parts: list[pb.HeaderPart],
        outcome: str,
        seconds: float,
    ) -> None:
        enums, sizes = _table_columns(header, parts)
        digest = header.plan_digest if header is not None else ""
        nbytes = int(sizes.sum())
        name = pb.Delivery.Name(delivery) if delivery in DELIVERY_NAMES else str(delivery)  # type: ignore[arg-type]
        if self.metrics is not None:
            self.metrics.latency.labels(name).observe(seconds)
            if outcome == "ok" and enums.size:
                # bytes summed per (dtype, initializer) with array operations: one counter update per label
                fields = [p.init.WhichOneof("kind") or "" for p in request.plan.params][: enums.size]
                names, inverse = np.unique(np.asarray(fields, dtype=object).astype(str), return_inverse=True)
                labels = enums[: len(fields)].astype(np.int64) * len(names) + inverse.reshape(-1)
                totals = np.bincount(labels, weights=sizes[: len(fields)].astype(np.float64))
                for label in np.flatnonzero(totals).tolist():
                    dt = dtypes.by_enum(label // len(names))
                    self.metrics.bytes.labels(self.plane.backend.name, dt.name if dt else "?", str(names[label % len(names)])).inc(
                        int(totals[label])
                    )
        log.info(
            "materialize digest=%s params=%d bytes=%d delivery=%s seconds=%.3f outcome=%s",
            digest[:16],
            enums.size,
            nbytes,
            name,
            seconds,
            outcome,
            extra={"method": "Materialize", "plan_digest": digest, "bytes": nbytes, "seconds": round(seconds, 6), "outcome": outcome},
        )

    @boundary
    def Validate(self, request: pb.ValidateRequest, context: grpc.ServicerContext) -> pb.ValidateResponse:
        return self.handlers.validate(request, self.caller(context))

    @boundary
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        return self.handlers.info(request, self.caller(context))

    @boundary
    def UploadPayload(self, request: Iterator[pb.PayloadChunk], context: grpc.ServicerContext) -> pb.PayloadRef:
        with self.stalls.watch("payload upload", context.cancel) as watched:
            try:
                return self.handlers.upload(self.stalls.iterate(iter(request), watched), self.caller(context))
            except Exception:
                if watched.stalled:  # what the cancelled request stream raised: say why instead
                    raise errors.Cancelled(f"the upload made no progress for {self.stalls.limit:.0f} s (--max-stall)") from None
                raise

    @boundary
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return self.handlers.release(request, self.caller(context))

    @boundary
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:
        return self.handlers.renew(request, self.caller(context))

    @boundary
    def ListLeases(self, request: pb.ListLeasesRequest, context: grpc.ServicerContext) -> pb.ListLeasesResponse:
        return self.handlers.list_leases(request, self.caller(context))

    @boundary
    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyResponse:
        return self.handlers.apply(request, self.caller(context))


def _header(
    start: StreamStart, packed: bool = False, omit_prefix: bool = False
) -> tuple[pb.StreamHeader, list[packed_table.Packed] | None]:
    """The stream's header and, for a packed table, its columns cut into groups (one per header message);
    `omit_prefix`: no safetensors prefix (it is then never built)."""
    lay = start.layout
    spans = lay.spans()
    prefix = b"" if omit_prefix else lay.prefix
    if packed:
        table = packed_table.pack(*spans.columns())
        crc = packed_table.checksum(prefix, start.digest, lay.data_bytes, table)
        header = pb.StreamHeader(plan_digest=start.digest, safetensors_prefix=prefix, data_bytes=lay.data_bytes, header_crc32c=crc)
        return header, packed_table.split(table, HEADER_PART_BYTES // 2)  # with a prefix slice: under 2 MiB
    # clients check the checksum before writing anything; it is computed from the plain table, not the messages
    crc = checksum(prefix, start.digest, lay.data_bytes, spans)
    return pb.StreamHeader(
        plan_digest=start.digest,
        safetensors_prefix=prefix,
        data_bytes=lay.data_bytes,
        tensors=messages.tensor_infos(spans),
        header_crc32c=crc,
    ), None


HEADER_PART_BYTES = 1 << 20  # tensor table and prefix bytes per message: each message stays under 2 MiB


def header_messages(
    header: pb.StreamHeader, packed: list[packed_table.Packed] | None = None, part_bytes: int = HEADER_PART_BYTES
) -> list[pb.MaterializeResponse]:
    """`header` as the stream's first messages: a StreamHeader, then `header_parts` HeaderParts, so that no
    message comes near a client's default 4 MiB receive limit however many tensors the plan has. Message k
    holds the k-th group of tensors (at most `part_bytes` of them serialized; `packed`: the groups of a packed
    table) and the k-th `part_bytes` slice of the prefix; the checksum is that of the whole header
    (init_service.proto, StreamHeader)."""
    groups: list[Any] = [[]]
    if packed is not None:
        groups = list(packed)
    else:
        size = 0
        for t in header.tensors:
            n = t.ByteSize() + 5  # tag and length
            if size + n > part_bytes and groups[-1]:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += n
    prefix = header.safetensors_prefix
    slices = [prefix[i : i + part_bytes] for i in range(0, len(prefix), part_bytes)] or [b""]
    count = max(len(groups), len(slices))
    empty: Any = packed_table.Packed(0, b"", b"", b"", b"", b"", b"", b"") if packed is not None else []
    groups += [empty] * (count - len(groups))
    slices += [b""] * (count - len(slices))

    def table(g: Any) -> dict[str, Any]:
        return {"packed_tensors": pb.PackedTensors(**g.fields())} if packed is not None else {"tensors": g}

    if count == 1 and packed is None:
        return [pb.MaterializeResponse(header=header)]
    first = pb.StreamHeader(
        plan_digest=header.plan_digest,
        safetensors_prefix=slices[0],
        data_bytes=header.data_bytes,
        header_crc32c=header.header_crc32c,
        header_parts=count - 1,
        **table(groups[0]),
    )
    return [pb.MaterializeResponse(header=first)] + [
        pb.MaterializeResponse(header_part=pb.HeaderPart(safetensors_prefix=b, **table(g)))
        for g, b in zip(groups[1:], slices[1:], strict=True)
    ]


def _table_columns(header: pb.StreamHeader | None, parts: list[pb.HeaderPart]) -> tuple[Any, Any]:
    """(dtype enums, byte counts) of every tensor of a sent header, packed or not, as arrays."""
    if header is None:
        return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint64)
    if header.HasField("packed_tensors"):
        table = packed_table.join([header.packed_tensors, *(p.packed_tensors for p in parts)])
        return np.frombuffer(table.dtypes, dtype=np.uint8), np.frombuffer(table.nbytes, dtype="<u8")
    infos = [*header.tensors, *(t for p in parts for t in p.tensors)]
    return (
        np.fromiter((t.dtype for t in infos), dtype=np.int64, count=len(infos)),
        np.fromiter((t.nbytes for t in infos), dtype=np.uint64, count=len(infos)),
    )


MAX_ANSWER_BYTES = (4 << 20) - (16 << 10)  # one message a stock client receives (4 MiB), framing left aside


def export_info_bound(plan: Any) -> int:
    """An upper bound of the serialized ExportInfo of a plan's export: per tensor its name, 11 bytes per dim
    (a varint and its share of the packed length), and the other fields with their tags; plus the lease and
    buffer messages."""
    return 512 + sum(len(p.name.encode()) + 11 * len(p.shape) + 48 for p in plan.params)
