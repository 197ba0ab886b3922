"""The data plane: validate, stream, export, lease and upload, with no transport in sight.

The gRPC servicer converts protobuf to these calls, encodes what they return
and maps errors to status codes; the embedded client calls them in process.
Admission, memory reservations and slab sizing live here, so every door
behaves the same; messages and checksums are the transports'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit import dtypes, overlap, results
from paraminit.hostmem import host_buffer, receive_buffer
from paraminit.shapes import output_problem
from paraminit.v1 import plan_pb2
from paraminit_server import __version__, errors
from paraminit_server.backends import HOST, Backend
from paraminit_server.backends.cpu_kernels import sparse_zero_keys, standard_normal
from paraminit_server.config import ServerConfig
from paraminit_server.host_limits import host_memory
from paraminit_server.ledger import Claim
from paraminit_server.plane import engine, layout
from paraminit_server.plane.admission import Admission
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.exports import Exports
from paraminit_server.plane.leases import LeaseTable
from paraminit_server.plans import columns, validation
from paraminit_server.plans.payloads import Follower, Payload, ValueSources
from paraminit_server.plans.snapshot import RequestSnapshot

PREFETCH = 2  # slabs generated ahead of the one being sent
# What checking a plan costs in host memory, charged to the budget before the work: per parameter (its
# protobuf wrappers, validation, resolution, digest and layout entries: about 2.7 KB measured for small
# parameters, streamed) and per byte of the plan as received (gRPC's buffers, the bytes, their parsed
# message: 229 MiB measured for a 33 MB plan).
PLAN_PARAM_BYTES = 3072
PLAN_WIRE_FACTOR = 8


def plan_memory(p: plan_pb2.Plan, wire_bytes: int | None = None) -> int:
    """The host memory a plan's parse, validation and resolution are charged (an estimate, on the high side);
    `wire_bytes`: the plan's serialized size when the caller has it (ByteSize walks the whole message)."""
    size = p.ByteSize() if wire_bytes is None else wire_bytes
    return PLAN_PARAM_BYTES * len(p.params) + PLAN_WIRE_FACTOR * size


def max_request_bytes(host_budget: int, max_concurrent: int) -> int:
    """The largest request gRPC accepts: as many received at once, with their parsed copies, fit the budget
    (received before any handler runs, so they cannot be charged one by one); 4 MiB to 256 MiB."""
    return max(4 << 20, min(256 << 20, host_budget // (PLAN_WIRE_FACTOR * max(1, max_concurrent))))


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that validated, resolved for the kernels."""

    params: columns.ParamTable
    report: validation.Report
    digest: str
    sources: RequestSnapshot | None = None  # holds the memory of checkpoint values until close()

    def close(self) -> None:
        """Give back the memory reserved for the plan and its checkpoint values."""
        if self.sources is not None:
            self.sources.release()


@dataclass(frozen=True)
class StreamStart:
    """First item of a stream: where each tensor lies in the safetensors data section."""

    layout: layout.Layout
    digest: str

    def header(self) -> results.StreamHeader:
        """The stream's header as the data plane answers it: digest, safetensors prefix, tensor table."""
        return results.StreamHeader(self.digest, self.layout.prefix, self.layout.data_bytes, self.layout.spans())


@dataclass(frozen=True)
class PayloadPiece:
    """One piece of an upload; the first names the dtype (enum, 0 = float32) and the value count."""

    dtype: int
    count: int
    data: bytes | memoryview


class Materializer:
    """One server's data plane over one backend."""

    def __init__(self, config: ServerConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.limits = validation.Limits(config.max_param_bytes, config.max_plan_bytes)
        self.sources = ValueSources(
            config.max_payload_bytes,
            config.payload_ttl,
            config.safetensors_dirs.split(":"),
            lambda n: self.admission.host.reserve(n, 0.0, "payload"),
        )
        host_budget = config.memory_budget or host_memory()[1] // 2
        device_budget = None
        if backend.memory != HOST:
            device_budget = config.device_memory_budget or backend.device().memory_free // 2
        self.admission = Admission(
            config.max_concurrent,
            host_budget,
            device_budget,
            max_queued=config.max_queued,
            slots_per_identity=config.max_concurrent_per_client,
            queued_per_identity=config.max_queued_per_client,
        )
        leasable = min(config.max_leased_bytes, device_budget if device_budget is not None else host_budget)
        self.leases = LeaseTable(
            config.max_leased_bytes,
            config.max_leases_per_client,
            config.lease_ttl,
            config.max_lease_ttl,
            max_bytes_per_owner=config.max_leased_bytes_per_client or max(1, leasable - leasable // 4),
        )
        self.exports = Exports(backend, self.leases, self.admission.backend, config.shm_pool_bytes)

    # -- plans ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _checking(self, caller: Caller, p: plan_pb2.Plan, resolve: bool) -> Iterator[tuple[validation.Checked, RequestSnapshot]]:
        """One sweep over the plan (validation.check) inside a concurrency slot, with the request's view of payloads
        and checkpoints. That view holds the plan's own memory (plan_memory) and any checkpoint values read (host
        memory too, reserved before they are read) until it is released: at the block's end on failure or
        without resolution, else by the CheckedPlan that takes it.

        Checking is work like a materialization (a large plan's checks take a core for a second; a small plan can ask
        for a large orthogonal matrix): it takes a slot, so one identity's checks cannot crowd out the others'
        (fair shares), released before a materialization takes its own."""
        with self.admission.admit(0, caller):
            sources = RequestSnapshot(
                self.sources,
                caller.identity,
                lambda n: self.admission.host.reserve(n, caller.wait, "checkpoint values"),
                standard_normal,
                sparse_zero_keys,
                self._over(caller),
            )
            try:
                size = p.ByteSize()
                held = plan_memory(p, size)
                sources.hold(
                    self.admission.host.reserve(held, caller.wait, f"checking a plan of {len(p.params)} parameters ({size} bytes)")
                )
                yield validation.check(p, self.limits, sources, resolve=resolve), sources
            except BaseException:
                sources.release()
                raise
            if not resolve:
                sources.release()  # the freed heap a large plan's checks leave goes back at the slot's idle trim

    def validate(self, p: plan_pb2.Plan, caller: Caller) -> tuple[validation.Report, str]:
        """Every violation of the plan (limits included) and its digest; raises nothing for a bad plan.

        Raises:
            ResourceExhausted, Unavailable: as admission (no slot within the caller's wait; draining)."""
        with self._checking(caller, p, resolve=False) as (got, _):
            return got.report, got.digest

    def _over(self, caller: Caller) -> Callable[[], bool]:
        """Whether a request's work should stop: its caller went (deadline, cancellation) or the server drains."""
        return lambda: caller.gone() or self.admission.draining.is_set()

    def check(self, p: plan_pb2.Plan, caller: Caller) -> CheckedPlan:
        """Check the whole plan; raise with every violation, or return it resolved, its kernels ready.

        Raises:
            InvalidPlan: with every violation; ResourceExhausted: limits only, or as admission; Cancelled."""
        with self._checking(caller, p, resolve=True) as (got, sources):
            report = got.report
            if report.only_limits:
                worst = "; ".join(v.message for v in report.violations)
                raise errors.ResourceExhausted(f"plan exceeds the limits: {worst}", report.violations)
            if got.params is None:
                raise errors.InvalidPlan(report.violations, report.omitted)
            checked = CheckedPlan(got.params, report, got.digest, sources)
            # kernels a cold cache lacks compile here, before the caller takes a slot or a place in line
            self.backend.prepare(checked.params)
            if caller.gone():
                raise errors.Cancelled("client cancelled or deadline passed")
            return checked

    def chunk_size(self, requested: int) -> int:
        size = requested or self.config.chunk_bytes
        return max(layout.SLAB_QUANTUM, min(size, self.config.max_chunk_bytes)) // layout.SLAB_QUANTUM * layout.SLAB_QUANTUM

    # -- deliveries ----------------------------------------------------------------------

    def stream(
        self, p: plan_pb2.Plan, caller: Caller, chunk_bytes: int = 0, lend: bool = False
    ) -> Generator[StreamStart | tuple[int, engine.HostSlab], None, None]:
        """A StreamStart, then the data section as (offset, host uint8 slab) pairs in order.

        Each slab is a whole number of `chunk_size(chunk_bytes)` chunks (the last may be short). With `lend`
        a slab is the consumer's only until it asks for the next item (engine.iter_slabs): for a consumer
        that copies each slab out, such as a transport encoding messages. Memory is a few slabs whatever
        the plan's size; closing the iterator or the caller going away stops generation at the next slab.

        Raises:
            InvalidPlan, ResourceExhausted: as check(); ResourceExhausted, Unavailable: as admission.
            Cancelled: the caller went away while the stream ran."""
        checked = self.check(p, caller)
        with contextlib.closing(checked):
            yield from self._stream(checked, caller, chunk_bytes, lend)

    def _stream(
        self, checked: CheckedPlan, caller: Caller, chunk_bytes: int, lend: bool
    ) -> Generator[StreamStart | tuple[int, engine.HostSlab], None, None]:
        lay = layout.stream_layout(checked.params, checked.digest)
        chunk = self.chunk_size(chunk_bytes)
        slab = max(chunk, self.config.slab_bytes // chunk * chunk)
        held = min(lay.data_bytes, slab * (PREFETCH + 2))  # slabs in flight (lent or not)
        # the consumer's copies of the slabs in flight (a transport's messages) and, on a device, their host copies
        host = held + (0 if self.backend.memory == HOST else held)
        with (
            self.admission.admit(checked.report.total_bytes, caller),
            self._reserve(held, host, caller, "stream"),
            engine.iter_slabs(self.backend, lay, slab, caller.gone, PREFETCH, lend) as slabs,
        ):
            # the first slabs fill while the consumer builds and sends the header
            yield StreamStart(lay, checked.digest)
            for item in slabs:
                yield item
                if caller.gone():
                    raise errors.Cancelled("client cancelled or deadline passed")

    @contextlib.contextmanager
    def _reserve(self, backend_bytes: int, host_bytes: int, caller: Caller, what: str) -> Iterator[None]:
        """Hold backend and host memory (one budget on the CPU) for the duration of the block."""
        with self.admission.backend.reserve(backend_bytes, caller.wait, what), self.admission.host.reserve(host_bytes, caller.wait, what):
            yield

    def fill_host(
        self, p: plan_pb2.Plan, caller: Caller, outputs: Mapping[str, npt.NDArray[Any]] | None = None
    ) -> tuple[layout.Layout, str, engine.HostSlab | None]:
        """Materialize into host memory of this process, no slabs, no encoding: for in-process callers.

        With `outputs` (parameter name -> C-contiguous array of the region's shape and the dtype's item
        size, e.g. a torch tensor's numpy view) every parameter is written in place and nothing else is
        allocated; without, one buffer in stream (safetensors) layout is returned."""
        if self.backend.memory != HOST:
            raise errors.FailedPrecondition(f"in-process fills need a host backend, not {self.backend.name}")
        checked = self.check(p, caller)
        params = checked.params
        with contextlib.closing(checked), self.admission.admit(checked.report.total_bytes, caller):
            if outputs is None:
                lay = layout.stream_layout(params, checked.digest)
                with self._reserve(0, lay.data_bytes, caller, "materialization"):
                    buf = host_buffer(lay.data_bytes)
                    engine.fill_params(self.backend, params, buf, lay.offsets, caller.gone)
                return lay, checked.digest, buf
            lay = layout.export_layout(params)
            for rp in params:
                problem = output_problem(outputs, rp.name, rp.out_shape, rp.dtype.itemsize)
                if problem is not None:
                    raise errors.InvalidRequest(problem)
            for rp in params:
                flat = outputs[rp.name].reshape(-1).view(np.uint8)
                engine.fill_params(self.backend, columns.ParamTable.of([rp]), flat, [0], caller.gone)
            return lay, checked.digest, None

    def export(self, p: plan_pb2.Plan, delivery: str, caller: Caller, ttl_seconds: float = 0.0) -> results.ExportInfo:
        """Fill a buffer local peers map (SHM or CUDA IPC) and lend it under a lease."""
        self.exports.check_caller(delivery, caller)  # before the plan is even resolved
        checked = self.check(p, caller)
        with contextlib.closing(checked), self.admission.admit(checked.report.total_bytes, caller):
            return self.exports.export(checked.params, checked.digest, delivery, caller, ttl_seconds).info()

    # -- leases --------------------------------------------------------------------------

    def release(self, lease_id: str, caller: Caller) -> bool:
        return self.exports.release(lease_id, caller)

    def renew(self, lease_id: str, caller: Caller, ttl_seconds: float = 0.0) -> results.Lease:
        return self.exports.renew(lease_id, caller, ttl_seconds).lease()

    def list_leases(self, caller: Caller) -> list[results.LeaseStatus]:
        return [rec.status() for rec in self.exports.list(caller)]

    def apply(self, lease_id: str, p: plan_pb2.Plan, caller: Caller) -> str:
        checked = self.check(p, caller)
        with contextlib.closing(checked), self.admission.admit(0, caller):
            return self.exports.apply(lease_id, checked.params, checked.digest, caller, self._over(caller))

    # -- payloads ------------------------------------------------------------------------

    def upload(self, pieces: Iterable[PayloadPiece], caller: Caller) -> tuple[str, Payload]:
        """Receive a payload into one buffer, in its own dtype, hashing it on the way in; the first piece's
        dtype and count size it, and its bytes are taken from the payload limit before anything is kept
        (uploads in flight count against it; the bytes go back on every failure). Shutdown lets uploads in
        flight finish within the drain time."""
        # an upload is work like a materialization: it takes a concurrency slot (so stalled uploads cannot hold
        # every worker thread) and, within it, the payload's bytes
        with self.admission.admit(0, caller), self.sources.uploading():
            receiving = _Upload(self.sources, caller.identity)
            try:
                for _ in overlap.behind(receiving.located(pieces), receiving.land):
                    pass
                return receiving.store(caller.identity)
            except BaseException:
                receiving.cancel()
                raise

    # -- the server ----------------------------------------------------------------------

    def info(self) -> results.ServerInfo:
        """What this server says of itself: version, backend, device, limits, dtypes and deliveries."""
        c = self.config
        limits = results.ServerLimits(
            c.max_plan_bytes, c.max_param_bytes, c.max_concurrent, c.max_chunk_bytes, c.max_leased_bytes, c.max_leases_per_client
        )
        supported = tuple(d.enum for d in dtypes.SUPPORTED)
        return results.ServerInfo(
            __version__, self.backend.name, self.backend.device(), limits, supported, (results.STREAM, self.backend.delivery)
        )

    def close(self) -> None:
        """Free every lease and pooled buffer (shutdown)."""
        self.exports.close()


class _Upload:
    """One payload arriving: sized and reserved by its first piece, then each piece copied (`land`), hashed and
    scanned behind it (Follower)."""

    def __init__(self, sources: ValueSources, owner: str) -> None:
        self.sources = sources
        self.owner = owner
        self.ticket: Claim | None = None
        self.buf: npt.NDArray[np.uint8] | None = None
        self.follower: Follower | None = None
        self.dtype = self.count = self.received = 0

    def located(self, pieces: Iterable[PayloadPiece]) -> Iterator[tuple[int, bytes | memoryview]]:
        """(offset, data) of each piece, checked against the declared size before anything is copied."""
        for piece in pieces:
            if self.buf is None:
                self._start(piece)
            assert self.buf is not None
            data = piece.data
            if self.received + len(data) > len(self.buf):
                raise errors.InvalidRequest(f"payload is longer than the declared {self.count} values")
            yield self.received, data
            self.received += len(data)

    def _start(self, first: PayloadPiece) -> None:
        self.dtype, self.count = first.dtype, first.count
        dt = dtypes.by_enum(first.dtype)
        if dt is None:
            raise errors.InvalidRequest(
                f"unknown payload dtype enum value {first.dtype}; expected one of {', '.join(d.name for d in dtypes.SUPPORTED)}"
            )
        nbytes = first.count * dt.itemsize
        if nbytes > self.sources.max_bytes:
            raise errors.ResourceExhausted(
                f"payload of {first.count} {dt.name} values needs {nbytes} bytes; the payload limit is {self.sources.max_bytes}"
            )
        self.ticket = self.sources.reserve(nbytes, self.owner)
        self.buf = receive_buffer(nbytes)
        self.follower = Follower(self.buf, dt)

    def land(self, item: tuple[int, bytes | memoryview]) -> None:
        at, data = item
        assert self.buf is not None and self.follower is not None
        self.buf[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.follower.landed(at + len(data))

    def store(self, identity: str) -> tuple[str, Payload]:
        if self.buf is None or self.follower is None:
            raise errors.InvalidRequest("empty payload upload")
        sha256, scanned = self.follower.finish()
        whole = self.received == len(self.buf)  # else store() refuses it, naming the sizes
        return self.sources.store(
            identity, self.dtype, self.count, self.buf[: self.received], self.ticket, sha256 if whole else "", scanned if whole else None
        )

    def cancel(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        if self.ticket is not None:
            self.ticket.release()
