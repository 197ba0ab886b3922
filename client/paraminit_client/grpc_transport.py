"""The gRPC transport: a paraminit server (or several, scaleout) over a channel, and the channel itself (retry
policy, TLS, bearer token)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paraminit import dtypes, packed_table, times, wire
from paraminit.header_checksum import header_crc32c
from paraminit.hostmem import receive_buffer, tune_malloc_for_streams
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit.v1 import plan_pb2
from paraminit.violations import INVALID, LIMIT, ValidationReport, Violation
from paraminit_client import scaleout
from paraminit_client.arrays import arrays_from_buffer, numpy_dtype
from paraminit_client.delivery import Delivery
from paraminit_client.errors import InvalidArgument, ParaminitError
from paraminit_client.transports import CLOSE_WAIT, Arrays, CallGate, Chunk, TensorTable, copy_into, land


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Turn every gRPC failure into the client's error."""
    try:
        yield
    except grpc.RpcError as err:
        raise ParaminitError.from_rpc(err) from None


def first_response(call: Any) -> Any:
    """The first message of a server-streaming call (None if it ends without one); raises the call's error.

    With retries enabled, gRPC Python (seen with 1.85) can leave the response iterator waiting forever when the
    call fails while an attempt is being retried and the server goes away (a draining worker): the call has its
    status (`call.code()` returns) but the pending read never completes, deadline or not. Retries happen only
    before the first response, so that one is awaited on a helper thread while the call's end is watched; the
    rest of the stream is read as usual. A helper stuck on such a call stays parked (a daemon thread)."""
    box: list[Any] = []
    arrived = threading.Event()

    def read() -> None:
        try:
            box.append(next(call, None))
        except BaseException as exc:  # handed to the caller below
            box.append(exc)
        arrived.set()

    threading.Thread(target=read, daemon=True, name="paraminit-first-response").start()
    while not arrived.wait(0.05):
        if call.done() and call.code() != grpc.StatusCode.OK:
            raise call  # the call is its own RpcError: code, details and trailers
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _verified_chunks(call: Any, total: int, check_crc: bool = True) -> Iterator[Chunk]:
    """Chunks in order with length checks (and CRC32C unless the consumer checks it: `land`); cancels the
    call if the consumer stops early."""
    expected = 0
    try:
        with rpc_errors():
            for c in call:
                if not isinstance(c, wire.Chunk):
                    c = wire.Chunk(c.chunk.offset, memoryview(c.chunk.data), c.chunk.crc32c)
                if c.offset != expected or expected + len(c.data) > total:
                    raise ParaminitError(
                        grpc.StatusCode.DATA_LOSS, f"out-of-order or oversized chunk at offset {c.offset} (expected {expected})"
                    )
                if check_crc and crc32c.crc32c(c.data) != c.crc32c:
                    raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"CRC32C mismatch in chunk at offset {c.offset}")
                expected += len(c.data)
                yield c
        if expected != total:
            raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"stream ended after {expected} of {total} bytes")
    finally:
        call.cancel()


# gRPC's own retries (gRFC A6), for every InitService method: a call refused before any response (a busy or
# draining server: RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again after an exponential backoff with jitter, or
# after the server's grpc-retry-pushback-ms (a negative pushback, sent for limits no retry can fix, stops it);
# the call's deadline bounds every attempt together. Any gRPC client can use this JSON as its service config.
RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 5,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
}
SERVICE_CONFIG: dict[str, Any] = {"methodConfig": [{"name": [{"service": "paraminit.v1.InitService"}], "retryPolicy": RETRY_POLICY}]}
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
]


@dataclass(frozen=True)
class Connection:
    """How a Client reaches a server: its arguments in one value, so the transport is built from what the
    Client was given and nothing is restated on the way.

    timeout: each gRPC call's deadline in seconds (None: none). credentials: channel credentials; override
    `tls_ca`/`tls_cert`/`tls_key`. split_bytes: the size above which a parameter is cut into row regions when
    a plan is split across targets. token: bearer token (None: $PARAMINIT_TOKEN). tls_ca: the CA bundle that
    verifies the server; tls_cert/tls_key: a client certificate (mutual TLS).
    """

    timeout: float | None = None
    credentials: grpc.ChannelCredentials | None = None
    split_bytes: int = 64 << 20
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


class GrpcTransport:
    """A paraminit server over gRPC; with `workers`, materialize splits plans across them (scaleout)."""

    releases_at_exit = True  # the server keeps a lease to its TTL unless told

    def __init__(
        self, target: str, channel: grpc.Channel, timeout: float | None, split_bytes: int, workers: Sequence[GrpcTransport] = ()
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.split_bytes = split_bytes
        self.workers = list(workers)
        self._channel = channel
        self._gate = CallGate(f"client of {target}")
        # leases made through this channel that still owe the server a Release (not released, or released while a
        # CUDA_IPC view lives on): a closed client keeps the channel open for it (at the latest at exit), or they
        # would be held until their TTL
        self._leases: weakref.WeakSet[Any] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _close_channel, self._gate, channel)
        self.stub = pb_grpc.InitServiceStub(channel)
        # Uploads with the chunk codec: each message is encoded once, without a protobuf copy of the data.
        self._upload = channel.stream_unary(
            "/paraminit.v1.InitService/UploadPayload", request_serializer=bytes, response_deserializer=pb.PayloadRef.FromString
        )
        # Materialize with the chunk codec: payloads arrive as views, not as copies inside messages.
        self._materialize = channel.unary_stream(
            "/paraminit.v1.InitService/Materialize",
            request_serializer=pb.MaterializeRequest.SerializeToString,
            response_deserializer=wire.decode_response,
        )

    def call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """One unary (or client-streaming) call of the raw stub, its failure as a ParaminitError."""
        self._gate.check()
        with rpc_errors():
            return method(request, timeout=self.timeout if timeout is None else timeout)

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport:
        r = self.call(self.stub.Validate, pb.ValidateRequest(plan=plan))
        violations = tuple(Violation(v.index, v.name, v.field, v.message, LIMIT if v.limit else INVALID) for v in r.violations)
        return ValidationReport(
            r.valid, r.fits_limits, violations, tuple(r.param_bytes), r.total_bytes, r.plan_digest, r.omitted_violations
        )

    def info(self) -> pb.GetInfoResponse:
        return self.call(self.stub.GetInfo, pb.GetInfoRequest())  # type: ignore[no-any-return]

    def health(self, service: str) -> str:
        r = self.call(health_pb2_grpc.HealthStub(self._channel).Check, health_pb2.HealthCheckRequest(service=service), self.timeout or 5.0)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    def stream(self, plan: plan_pb2.Plan, chunk_bytes: int, check_crc: bool) -> tuple[pb.StreamHeader, Iterator[Chunk]]:
        header, _table, chunks = self._open_stream(plan, chunk_bytes, check_crc, packed=False)
        return header, chunks

    def _open_stream(
        self, plan: plan_pb2.Plan, chunk_bytes: int, check_crc: bool, packed: bool = True
    ) -> tuple[pb.StreamHeader, TensorTable, Iterator[Chunk]]:
        """The header, its tensor table (TensorInfo messages, or a packed_table.Table when `packed` was asked
        for and the server packs) and the checked chunks. The header's checksum is verified here, before anyone
        writes a byte. A `packed` stream is for arrays: it comes without the safetensors prefix."""
        self._gate.check()
        # arrays need the table, not a file's JSON header: a packed stream leaves the prefix out
        call = self._materialize(
            pb.MaterializeRequest(
                plan=plan, delivery=pb.DELIVERY_STREAM, chunk_bytes=chunk_bytes, packed_table=packed, omit_safetensors_prefix=packed
            ),
            timeout=self.timeout,
        )
        with rpc_errors():
            first = first_response(call)
        if not isinstance(first, pb.MaterializeResponse) or first.WhichOneof("msg") != "header":
            call.cancel()
            raise ParaminitError(grpc.StatusCode.INTERNAL, "server did not start the stream with a header")
        header = first.header
        is_packed = header.HasField("packed_tensors")
        groups = [header.packed_tensors]
        prefix = [header.safetensors_prefix]
        for k in range(header.header_parts):  # a large table and prefix come in parts (init_service.proto)
            with rpc_errors():
                part = next(call, None)
            if not isinstance(part, pb.MaterializeResponse) or part.WhichOneof("msg") != "header_part":
                call.cancel()
                raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"stream header part {k + 1} of {header.header_parts} is missing")
            if is_packed:
                groups.append(part.header_part.packed_tensors)
            else:
                header.tensors.extend(part.header_part.tensors)
            prefix.append(part.header_part.safetensors_prefix)
        header.safetensors_prefix = b"".join(prefix)
        table: TensorTable = header.tensors
        if is_packed:
            joined = packed_table.join(groups)
            header.ClearField("packed_tensors")
            ok = packed_table.checksum(header.safetensors_prefix, header.plan_digest, header.data_bytes, joined) == header.header_crc32c
        else:
            ok = header_crc32c(header) == header.header_crc32c
        if not ok:
            call.cancel()
            raise ParaminitError(
                grpc.StatusCode.DATA_LOSS, "stream header checksum mismatch: the prefix, tensor table or digest was corrupted in transit"
            )
        if is_packed:
            try:
                table = packed_table.Table(joined)
            except ValueError as exc:
                call.cancel()
                raise ParaminitError(grpc.StatusCode.DATA_LOSS, str(exc)) from None
        return header, table, _verified_chunks(call, header.data_bytes, check_crc)

    def materialize(self, plan: plan_pb2.Plan, chunk_bytes: int, progress: Callable[[int], None] | None) -> Arrays:
        if self.workers or self.target.startswith("dns:"):
            return self._materialize_split(plan, chunk_bytes, _locked(progress))
        return self._materialize_one(plan, chunk_bytes, progress)

    def _materialize_one(self, plan: plan_pb2.Plan, chunk_bytes: int = 0, progress: Callable[[int], None] | None = None) -> Arrays:
        header, table, chunks = self._open_stream(plan, chunk_bytes, check_crc=False)
        buf = receive_buffer(header.data_bytes)

        def put(c: Chunk) -> None:
            buf[c.offset : c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)

        land(chunks, put, progress)
        return arrays_from_buffer(table, buf)

    def _materialize_split(self, plan: plan_pb2.Plan, chunk_bytes: int, progress: Callable[[int], None] | None) -> Arrays:
        report = self.validate(plan)
        if not report.ok:
            code = grpc.StatusCode.INVALID_ARGUMENT if not report.valid else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise ParaminitError(code, "invalid plan:\n" + "\n".join(report.lines()), report.violations)
        workers = self.workers or [self]
        n_parts = len(workers) if self.workers else 4
        parts = scaleout.split_plan(plan, report.param_bytes, n_parts, self.split_bytes)
        out, views = scaleout.assemble(plan, report.param_bytes, [numpy_dtype(p.dtype) for p in plan.params])
        scaleout.run_parts(parts, workers, lambda w, part: w._land(part.plan, views(part), chunk_bytes, progress))
        return out

    def materialize_into(self, plan: plan_pb2.Plan, outputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
        self._land(plan, outputs, 0, None)

    def _land(
        self, plan: plan_pb2.Plan, outputs: Mapping[str, np.ndarray[Any, Any]], chunk_bytes: int, progress: Callable[[int], None] | None
    ) -> None:
        """One stream of `plan` written into `outputs` (each checked against the stream's table first)."""
        _header, table, chunks = self._open_stream(plan, chunk_bytes, check_crc=False)
        copy_into(table, chunks, outputs, progress)

    def export(self, plan: plan_pb2.Plan, delivery: str, ttl_seconds: float) -> pb.ExportInfo:
        kinds: dict[str, pb.Delivery.ValueType] = {Delivery.SHM: pb.DELIVERY_SHM, Delivery.CUDA_IPC: pb.DELIVERY_CUDA_IPC}
        self._gate.check()
        request = pb.MaterializeRequest(plan=plan, delivery=kinds[delivery], lease_ttl=times.duration(ttl_seconds))
        with rpc_errors():
            call = self.stub.Materialize(request, timeout=self.timeout)
            first = first_response(call)
            responses = [] if first is None else [first, *call]
        if len(responses) != 1 or responses[0].WhichOneof("msg") != "export":
            raise ParaminitError(grpc.StatusCode.INTERNAL, "server did not answer the export with one ExportInfo")
        return responses[0].export  # type: ignore[no-any-return]

    def upload(self, raw: memoryview, dtype: int, count: int, chunk_bytes: int) -> str:
        def encoded() -> Iterator[bytes]:  # PayloadChunk messages encoded once, with one copy of the data
            yield wire.encode_payload_chunk(raw[:chunk_bytes], dtype, count)
            for off in range(chunk_bytes, len(raw), chunk_bytes):
                yield wire.encode_payload_chunk(raw[off : off + chunk_bytes])

        return str(self.call(self._upload, encoded()).payload_id)

    def leases(self) -> list[pb.LeaseStatus]:
        return list(self.call(self.stub.ListLeases, pb.ListLeasesRequest()).leases)

    def adopt(self, lease: Any) -> None:
        """Keep the channel open for `lease`'s Release even after close() (until it is released)."""
        self._leases.add(lease)

    def _lease_call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """A call about a lease this client made: through the gate while the client is open; after close() straight
        on the channel, which stays open while any of its leases owes the server a Release."""
        if not self._gate.closed or self._gate.forked():
            return self.call(method, request, timeout)
        with rpc_errors():
            return method(request, timeout=self.timeout if timeout is None else timeout)

    def release(self, lease_id: str, timeout: float | None = None) -> bool:
        released = bool(self._lease_call(self.stub.Release, pb.ReleaseRequest(lease_id=lease_id), timeout).released)
        if self._gate.closed and not self._gate.forked():
            self._leases = weakref.WeakSet(x for x in self._leases if getattr(x, "lease_id", None) != lease_id and _owes_release(x))
            if not self._leases:  # the last lease of a closed client is settled: now the channel goes
                self._channel.close()
        return released

    def renew(self, lease_id: str, ttl_seconds: float) -> float:
        """Renew (also after close(), while a lease still owes its Release: one released while a CUDA_IPC view lives on
        keeps renewing until the view goes; once nothing is owed the channel is gone and the gate says so)."""
        request = pb.RenewRequest(lease_id=lease_id, ttl=times.duration(ttl_seconds))
        call = self._lease_call if any(_owes_release(x) for x in self._leases) else self.call
        return times.epoch(call(self.stub.Renew, request).lease.expires_at)

    def apply(self, lease_id: str, plan: plan_pb2.Plan) -> str:
        return str(self.call(self.stub.Apply, pb.ApplyRequest(lease_id=lease_id, plan=plan)).plan_digest)

    def close(self) -> None:
        """Close the channel (and the workers'), once, in the process that opened it; while leases made through
        it are live, new calls are refused but the channel stays open for their Release."""
        for w in self.workers:
            w.close()
        live = [x for x in self._leases if _owes_release(x)]
        if live and not self._gate.forked():
            self._gate.close(CLOSE_WAIT)
            self._finalizer.detach()
            return
        self._finalizer()


def _owes_release(lease: Any) -> bool:
    """Whether a lease of this client is still to be released on the server (exports.Lease.owes_release)."""
    return bool(getattr(lease, "owes_release", False))


def _locked(progress: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """`progress` called by one thread at a time (a split plan's streams land concurrently)."""
    if progress is None:
        return None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


def _close_channel(gate: CallGate, channel: grpc.Channel) -> None:
    if gate.close(0.0):
        channel.close()


def payload_bytes(values: Any) -> tuple[memoryview, int, int]:
    """A payload's bytes, dtype enum and value count.

    Raises:
        InvalidArgument: a dtype payloads cannot have.
    """
    arr = np.ascontiguousarray(values)
    dt = dtypes.by_numpy(arr.dtype)
    if dt is None:
        raise InvalidArgument(f"payload dtype must be one of {', '.join(dtypes.NAMES)}, not {arr.dtype}")
    return memoryview(arr.reshape(-1).view(np.uint8)), int(dt.enum), int(arr.size)  # type: ignore[arg-type]


def connect(target: str, c: Connection, workers: Sequence[GrpcTransport] = ()) -> GrpcTransport:
    """A GrpcTransport to `target` over a new channel: the retry policy, TLS and the bearer token as `c` says."""
    tune_malloc_for_streams()  # megabyte messages reuse heap memory (paraminit.hostmem); before the channel exists
    options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
    if target.startswith("dns:"):
        # client-side balancing over every address behind the name (a headless Service)
        options.append(("grpc.lb_policy_name", "round_robin"))
    credentials = c.credentials
    if credentials is None and (c.tls_ca or c.tls_cert):
        credentials = tls_credentials(c.tls_ca or "", c.tls_cert or "", c.tls_key or "")
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    token = os.environ.get("PARAMINIT_TOKEN") if c.token is None else c.token
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return GrpcTransport(target, channel, c.timeout, c.split_bytes, workers)


def tls_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS verifying the server against `ca` (system roots when empty), with an optional client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = tuple(metadata)
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (works on plaintext loopback channels too)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return _CallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)
