"""The paraminit client: validate plans, materialize them into arrays or safetensors files.

Without a target the client runs the server's data plane in this process (CPU
backend): the same validation, errors and bytes as a server, with no sockets,
no chunk encoding and arrays filled in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

from paraminit import dtypes, overlap, times, wire
from paraminit.header_checksum import header_crc32c
from paraminit.hostmem import host_buffer, prefault, tune_malloc_for_streams
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit.v1 import plan_pb2
from paraminit_client import filesink, scaleout
from paraminit_client._embedded import start_embedded
from paraminit_client.arrays import arrays_from_buffer, numpy_dtype
from paraminit_client.errors import ParaminitError, Violation
from paraminit_client.exports import Lease

# gRPC's own retries (gRFC A6), for every InitService method: a call refused before any response (a busy or
# draining server: RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again after an exponential backoff with jitter, or
# after the server's grpc-retry-pushback-ms (a negative pushback, sent for limits no retry can fix, stops it);
# the call's deadline bounds every attempt together. Any gRPC client can use this JSON as its service config.
RETRY_POLICY: dict[str, Any] = {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "5s",
                                "backoffMultiplier": 2, "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}
SERVICE_CONFIG: dict[str, Any] = {"methodConfig": [{"name": [{"service": "paraminit.v1.InitService"}],
                                                    "retryPolicy": RETRY_POLICY}]}
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 256 << 20),
                   ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(SERVICE_CONFIG))]


@dataclass(frozen=True)
class ValidationReport:
    valid: bool
    fits_limits: bool
    violations: tuple[pb.Violation, ...]
    param_bytes: tuple[int, ...]
    total_bytes: int
    plan_digest: str

    @property
    def ok(self) -> bool:
        return self.valid and self.fits_limits

    def lines(self) -> list[str]:
        return [f"{v.field} ({v.name!r}): {v.message}" if v.index >= 0 else f"{v.field}: {v.message}"
                for v in self.violations]


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


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Turn every gRPC failure into the one client exception type."""
    try:
        yield
    except grpc.RpcError as err:
        raise ParaminitError.from_rpc(err) from None


class Client:
    """Talks to one paraminit server, or an embedded one when no target is given."""

    def __init__(self, target: str | Sequence[str] | None = None, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, split_bytes: int = 64 << 20,
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, safetensors_dirs: Sequence[str] | None = None) -> None:
        """`token`: bearer token (default: $PARAMINIT_TOKEN). `tls_ca`/`tls_cert`/`tls_key`: TLS, and a client
        certificate for mutual TLS; `credentials` overrides them. `safetensors_dirs` (in process only): the
        directories whose safetensors files plans may name; default: every file this process can read (a
        server's own --safetensors-dirs decides for a server)."""
        if safetensors_dirs is not None and target is not None:
            raise ValueError("safetensors_dirs applies in process only; a server's --safetensors-dirs decides "
                             "which files its plans may read")
        self._local: Any = None  # paraminit_server.embedded.InProcess when no target is given
        self._finalizer: Any = None  # weakref.finalize closing the in-process data plane
        self._workers: list[Client] = []
        self._renewing: weakref.WeakSet[Lease] = weakref.WeakSet()
        self.split_bytes = split_bytes
        options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
        if isinstance(target, (list, tuple)):
            targets = list(target)
            if not targets:
                raise ValueError("an empty list of targets")
            if len(targets) > 1:
                self._workers = [Client(t, timeout=timeout, credentials=credentials, token=token, tls_ca=tls_ca,
                                        tls_cert=tls_cert, tls_key=tls_key) for t in targets]
            target = targets[0]
        if isinstance(target, str) and target.startswith("dns:"):
            # client-side balancing over every address behind the name (a headless Service)
            options.append(("grpc.lb_policy_name", "round_robin"))
        self.timeout = timeout
        if target is None:
            dirs = "/" if safetensors_dirs is None else ":".join(os.fspath(d) for d in safetensors_dirs)
            self._local = start_embedded(safetensors_dirs=dirs)
            # a client that is never closed still frees its leases and segments when collected or at exit
            self._finalizer = weakref.finalize(self, self._local.close)
            self.target = "in-process"
            self.stub: Any = self._local
            return
        assert isinstance(target, str)
        self.target = target
        tune_malloc_for_streams()  # megabyte messages reuse heap memory (paraminit.hostmem)
        if credentials is None and (tls_ca or tls_cert):
            credentials = tls_credentials(tls_ca or "", tls_cert or "", tls_key or "")
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        token = os.environ.get("PARAMINIT_TOKEN") if token is None else token
        if token:
            self._channel = grpc.intercept_channel(self._channel, _BearerToken(token))
        self.stub = pb_grpc.InitServiceStub(self._channel)
        # Uploads with the chunk codec: each message is encoded once, without a protobuf copy of the data.
        self._upload = self._channel.stream_unary("/paraminit.v1.InitService/UploadPayload",
                                                  request_serializer=bytes, response_deserializer=pb.PayloadRef.FromString)
        # Materialize with the chunk codec: payloads arrive as views, not as copies inside messages.
        self._materialize = self._channel.unary_stream(
            "/paraminit.v1.InitService/Materialize",
            request_serializer=pb.MaterializeRequest.SerializeToString, response_deserializer=wire.decode_response)

    @property
    def in_process(self) -> bool:
        """True when this client runs the data plane itself (no target given)."""
        return self._local is not None

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        for w in self._workers:
            w.close()
        for lease in list(self._renewing):
            lease.stop_renewing()
        if self._finalizer is not None:
            self._finalizer()  # frees every lease of this in-process data plane, once
        else:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport:
        with rpc_errors():
            r = self.stub.Validate(pb.ValidateRequest(plan=plan), timeout=self.timeout)
        return ValidationReport(r.valid, r.fits_limits, tuple(r.violations), tuple(r.param_bytes), r.total_bytes,
                                r.plan_digest)

    def info(self) -> pb.GetInfoResponse:
        with rpc_errors():
            return self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout)  # type: ignore[no-any-return]

    def health(self, service: str = "") -> str:
        """The health service's status name (SERVING, NOT_SERVING, ...)."""
        if self.in_process:
            return "SERVING"  # kernels were compiled when the client started
        with rpc_errors():
            r = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=self.timeout or 5.0)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server reports SERVING (kernels compiled)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except ParaminitError:
                pass
            if time.monotonic() > deadline:
                raise ParaminitError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.target} not SERVING after {timeout} s")
            time.sleep(0.05)

    def stream(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0,
               check_crc: bool = True) -> tuple[pb.StreamHeader, Iterator[wire.Chunk]]:
        """Start a STREAM materialization: the header, then verified chunks in order.

        `check_crc=False` leaves each chunk's CRC32C to the consumer (see `land`), which may check it
        on another thread; order and length are checked here either way."""
        if self.in_process:
            return self._local_stream(plan)
        call = self._materialize(pb.MaterializeRequest(plan=plan, delivery=pb.DELIVERY_STREAM,
                                                           chunk_bytes=chunk_bytes), timeout=self.timeout)
        with rpc_errors():
            first = first_response(call)
        if not isinstance(first, pb.MaterializeResponse) or first.WhichOneof("msg") != "header":
            call.cancel()
            raise ParaminitError(grpc.StatusCode.INTERNAL, "server did not start the stream with a header")
        header = first.header
        for k in range(header.header_parts):  # a large table and prefix come in parts (init_service.proto)
            with rpc_errors():
                part = next(call, None)
            if not isinstance(part, pb.MaterializeResponse) or part.WhichOneof("msg") != "header_part":
                call.cancel()
                raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"stream header part {k + 1} of "
                                     f"{header.header_parts} is missing")
            header.tensors.extend(part.header_part.tensors)
            header.safetensors_prefix += part.header_part.safetensors_prefix
        if header_crc32c(header) != header.header_crc32c:  # before anyone writes a byte of it
            call.cancel()
            raise ParaminitError(grpc.StatusCode.DATA_LOSS, "stream header checksum mismatch: the prefix, tensor "
                                 "table or digest was corrupted in transit")
        return header, _verified_chunks(call, header.data_bytes, check_crc)

    def _local_stream(self, plan: plan_pb2.Plan) -> tuple[pb.StreamHeader, Iterator[wire.Chunk]]:
        """In process: slabs straight from the data plane, as chunks with the same CRC32C a server sends."""
        items = self._local.stream(plan)
        with rpc_errors():
            header = next(items)

        def chunks() -> Iterator[wire.Chunk]:
            with rpc_errors():
                for offset, slab in items:
                    data = memoryview(slab).cast("B")
                    yield wire.Chunk(offset, data, crc32c.crc32c(data))

        return header, chunks()

    def _call(self, method: Any, request: Any) -> Any:
        with rpc_errors():
            return method(request, timeout=self.timeout)

    def export(self, plan: plan_pb2.Plan, delivery: str = "shm", *, ttl_seconds: float = 0.0,
               auto_renew: bool | None = None) -> Lease:
        """Zero-copy handoff from a server on this host: "shm" (CPU) or "cuda_ipc" (GPU).

        CUDA_IPC leases renew themselves by default (`auto_renew=None`): an expiry frees device memory
        that kernels of this process may still be using, which no error could report."""
        if auto_renew is None:
            auto_renew = delivery == "cuda_ipc"
        kinds = {"shm": pb.DELIVERY_SHM, "cuda_ipc": pb.DELIVERY_CUDA_IPC}
        if delivery not in kinds:
            raise ValueError(f"delivery must be one of {sorted(kinds)}, got {delivery!r}")
        request = pb.MaterializeRequest(plan=plan, delivery=kinds[delivery], lease_ttl=times.duration(ttl_seconds))
        with rpc_errors():
            call = self.stub.Materialize(request, timeout=self.timeout)
            if self.in_process:  # the in-process stub answers with a list
                responses = list(call)
            else:
                first = first_response(call)
                responses = [] if first is None else [first, *call]
        if len(responses) != 1 or responses[0].WhichOneof("msg") != "export":
            raise ParaminitError(grpc.StatusCode.INTERNAL, "server did not answer the export with one ExportInfo")
        try:
            lease = Lease(self, responses[0].export, auto_renew=auto_renew)
            if auto_renew:
                self._renewing.add(lease)
            return lease
        except BaseException:
            with contextlib.suppress(ParaminitError):
                self._call(self.stub.Release, pb.ReleaseRequest(lease_id=responses[0].export.lease.lease_id))
            raise

    def upload_payload(self, values: Any, *, chunk_bytes: int = 1 << 20) -> str:
        """Upload a flat payload of any size (float32/float64/float16/bfloat16 array); plans name the returned id
        with {"flatRef": {"payloadId": id}}. Payloads belong to this client's identity and expire."""
        arr = np.ascontiguousarray(values)
        dt = dtypes.by_numpy(arr.dtype)
        if dt is None:
            raise ValueError(f"payload dtype must be one of {', '.join(dtypes.NAMES)}, not {arr.dtype}")
        kind: Any = dt.enum
        raw = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]

        if self.in_process:
            def messages() -> Iterator[pb.PayloadChunk]:
                yield pb.PayloadChunk(dtype=kind, count=arr.size, data=bytes(raw[:chunk_bytes]))
                for off in range(chunk_bytes, len(raw), chunk_bytes):
                    yield pb.PayloadChunk(data=bytes(raw[off:off + chunk_bytes]))

            return str(self._call(self.stub.UploadPayload, messages()).payload_id)

        def encoded() -> Iterator[bytes]:  # PayloadChunk messages encoded once, with one copy of the data
            yield wire.encode_payload_chunk(raw[:chunk_bytes], kind, arr.size)
            for off in range(chunk_bytes, len(raw), chunk_bytes):
                yield wire.encode_payload_chunk(raw[off:off + chunk_bytes])

        return str(self._call(self._upload, encoded()).payload_id)

    def leases(self) -> list[pb.LeaseStatus]:
        """The live leases this caller's identity holds on the server (`paraminit leases` prints them)."""
        return list(self._call(self.stub.ListLeases, pb.ListLeasesRequest()).leases)

    def release(self, lease_id: str) -> bool:
        """Free a lease by id (one this process no longer holds as a Lease object, e.g. after a crash).

        Args:
            lease_id: the id `leases()` lists.

        Returns:
            False when it was already released.

        Raises:
            ParaminitError: NOT_FOUND for an unknown or foreign lease.
        """
        return bool(self._call(self.stub.Release, pb.ReleaseRequest(lease_id=lease_id)).released)

    def renew(self, lease_id: str, ttl_seconds: float = 0.0) -> float:
        """Extend a lease by id; `ttl_seconds` 0 is the server's default. Returns the new expiry (epoch seconds).

        Raises:
            ParaminitError: NOT_FOUND for an unknown or foreign lease.
        """
        resp = self._call(self.stub.Renew, pb.RenewRequest(lease_id=lease_id, ttl=times.duration(ttl_seconds)))
        return times.epoch(resp.lease.expires_at)

    def materialize(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0,
                    progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray[Any, Any]]:
        """All parameters as numpy arrays that share one preallocated buffer (no per-chunk copies).

        With several targets (or a dns:/// target) the plan is split across workers and reassembled.
        """
        if self.in_process:
            with rpc_errors():
                tensors, _digest, buf = self._local.fill(plan)
            if progress is not None:
                progress(int(buf.nbytes))
            return arrays_from_buffer(tensors, buf)
        if self._workers or self.target.startswith("dns:"):
            return self._materialize_split(plan)
        return self._materialize_one(plan, chunk_bytes=chunk_bytes, progress=progress)

    def materialize_into(self, plan: plan_pb2.Plan, outputs: dict[str, np.ndarray[Any, Any]]) -> None:
        """Fill arrays the caller owns (e.g. a module's tensors as numpy views), one per parameter name.

        In process the kernels write straight into them; from a server the stream is copied into them
        as it arrives, one chunk at a time."""
        if self.in_process:
            with rpc_errors():
                self._local.fill(plan, outputs)
            return
        header, chunks = self.stream(plan, check_crc=False)
        spans = sorted(((t.offset, t.offset + t.nbytes, outputs[t.name].reshape(-1).view(np.uint8))
                        for t in header.tensors if t.name in outputs), key=lambda s: s[0])

        def put(c: wire.Chunk) -> None:
            lo, hi = c.offset, c.offset + len(c.data)
            data = np.frombuffer(c.data, dtype=np.uint8)
            for start, stop, out in spans:
                if start < hi and stop > lo:
                    a, b = max(start, lo), min(stop, hi)
                    out[a - start:b - start] = data[a - lo:b - lo]

        land(chunks, put)

    def _materialize_one(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0,
                         progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray[Any, Any]]:
        header, chunks = self.stream(plan, chunk_bytes=chunk_bytes, check_crc=False)
        buf = host_buffer(header.data_bytes)  # huge pages: first-touch faults cost more than the copy itself
        prefault(buf)  # and a helper thread takes the faults ahead of the copies

        def put(c: wire.Chunk) -> None:
            buf[c.offset:c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)

        land(chunks, put, progress)
        return arrays_from_buffer(header.tensors, buf)

    def _materialize_split(self, plan: plan_pb2.Plan) -> dict[str, np.ndarray[Any, Any]]:
        report = self.validate(plan)
        if not report.ok:
            code = grpc.StatusCode.INVALID_ARGUMENT if not report.valid else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise ParaminitError(code, "invalid plan:\n" + "\n".join(report.lines()),
                                 tuple(Violation(v.field, line) for v, line in zip(report.violations, report.lines(),
                                                                                   strict=True)))
        workers = self._workers or [self]
        n_parts = len(workers) if self._workers else 4
        parts = scaleout.split_plan(plan, report.param_bytes, n_parts, self.split_bytes)
        out, put = scaleout.assemble(plan, [numpy_dtype(p.dtype) for p in plan.params])
        scaleout.run_parts(parts, workers, lambda w, sub: w._materialize_one(sub), put)
        return out

    def materialize_to_file(self, plan: plan_pb2.Plan, path: str | os.PathLike[str], *,
                            progress: bool | Callable[[int, int], None] = False,
                            chunk_bytes: int = 0, durable: bool = True) -> pb.StreamHeader:
        """Write a safetensors file atomically: a temporary file renamed into place only when complete.

        The file is sized up front (a full disk fails before any transfer) and each chunk is written as
        it arrives (paraminit_client.filesink). `durable` (the default) writes the data with direct I/O
        where the file system allows and flushes it and the directory entry to disk before returning,
        so the file survives a crash once this returns; without it the page cache decides (faster where
        the disk is slower than the network). `progress`: True for a bar on stderr, or a callable given
        (bytes written, total bytes): once with 0 when the header arrives, then after each chunk."""
        dest = Path(path)
        header, chunks = self.stream(plan, chunk_bytes=chunk_bytes, check_crc=False)
        bar = _progress_bar(header.data_bytes, dest.name) if progress is True else None
        update: Callable[[int], None] | None = bar.update if bar is not None else None
        if callable(progress):
            update = _cumulative(progress, header.data_bytes)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent or ".")
        base = len(header.safetensors_prefix)
        try:
            try:
                if base + header.data_bytes:
                    try:
                        os.posix_fallocate(fd, 0, base + header.data_bytes)
                    except OSError as exc:  # a full disk: say which file, and how much it needed
                        raise OSError(exc.errno, f"{exc.strerror} (the file needs {base + header.data_bytes} "
                                                 "bytes)", str(dest)) from None
                sink = filesink.open_sink(fd, tmp, header.safetensors_prefix, header.data_bytes, durable)
                try:
                    land(chunks, sink.put, update)
                    sink.finish()
                finally:
                    sink.close()
                if durable:
                    os.fsync(fd)
                os.fchmod(fd, 0o644 & ~_umask())
            finally:
                os.close(fd)
            os.replace(tmp, dest)
            if durable:
                _fsync_dir(dest.parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            if bar is not None:
                bar.close()
        return header


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    dfd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def tls_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS verifying the server against `ca` (system roots when empty), with an optional client certificate."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes() if ca else None,
                                        private_key=Path(key).read_bytes() if key else None,
                                        certificate_chain=Path(cert).read_bytes() if cert else None)


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
                   grpc.StreamUnaryClientInterceptor):  # type: ignore[misc]
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _cumulative(report: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """A per-chunk byte counter that calls `report(bytes so far, total)`; reports (0, total) at once."""
    done = 0

    def update(n: int) -> None:
        nonlocal done
        done += n
        report(done, total)

    report(0, total)
    return update


def _progress_bar(total: int, name: str) -> Any:
    # "iB" with unit_divisor 1024 reads KiB, MiB, GiB: the units of every size paraminit prints
    return tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=name, leave=True)  # the finished bar stays on screen


def land(chunks: Iterator[wire.Chunk], put: Callable[[wire.Chunk], None],
         progress: Callable[[int], None] | None = None, depth: int = 8) -> None:
    """Check each chunk's CRC32C and `put` it behind the thread that receives (paraminit.overlap: on a
    helper thread where cores allow, at most `depth` chunks in flight). A mismatch is DATA_LOSS and stops
    the stream."""

    def check_and_put(c: wire.Chunk) -> int:
        if crc32c.crc32c(c.data) != c.crc32c:
            raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"CRC32C mismatch in chunk at offset {c.offset}")
        put(c)
        return len(c.data)

    for n in overlap.behind(chunks, check_and_put, depth):
        if progress is not None:
            progress(n)


def _verified_chunks(call: Any, total: int, check_crc: bool = True) -> Iterator[wire.Chunk]:
    """Chunks in order with length checks (and CRC32C unless the consumer checks it: `land`); cancels the
    call if the consumer stops early."""
    expected = 0
    try:
        with rpc_errors():
            for c in call:
                if not isinstance(c, wire.Chunk):
                    c = wire.Chunk(c.chunk.offset, memoryview(c.chunk.data), c.chunk.crc32c)
                if c.offset != expected or expected + len(c.data) > total:
                    raise ParaminitError(grpc.StatusCode.DATA_LOSS,
                                         f"out-of-order or oversized chunk at offset {c.offset} (expected {expected})")
                if check_crc and crc32c.crc32c(c.data) != c.crc32c:
                    raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"CRC32C mismatch in chunk at offset {c.offset}")
                expected += len(c.data)
                yield c
        if expected != total:
            raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"stream ended after {expected} of {total} bytes")
    finally:
        call.cancel()
