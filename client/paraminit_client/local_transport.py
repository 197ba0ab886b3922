"""The in-process transport: the data plane of paraminit_server.embedded, called directly in this process.

The embedded door answers in the data plane's results (paraminit.results) and its failures by status name; this
transport hands the client the contract's messages a server would send for them (paraminit.messages, the gRPC
edge's own encoders) and raises the client's errors, so no server module or gRPC type is seen here."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from paraminit import messages
from paraminit.results import StreamHeader
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit.violations import ValidationReport
from paraminit_client.arrays import arrays_from_buffer
from paraminit_client.errors import ParaminitError
from paraminit_client.transports import CLOSE_WAIT, Arrays, CallGate, Chunk, Slab

if TYPE_CHECKING:  # the embedded door, for the type checker only: the client may be installed alone
    from paraminit_server.embedded import InProcess


class LocalTransport:
    """The data plane in this process, called directly (paraminit_server.embedded.InProcess)."""

    target = "in-process"
    releases_at_exit = False  # closing the data plane (or this process ending) frees every lease

    def __init__(self, embedded: InProcess) -> None:
        self._plane = embedded
        self._gate = CallGate("in-process client")
        # never closed: freed when the last holder (its Client, a Lease) is collected, or at exit; in its own process
        self._finalizer = weakref.finalize(self, _close_local, self._gate, embedded)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """The data plane's errors as the client's (the status name they carry, their violations)."""
        try:
            yield
        except ParaminitError:
            raise
        except Exception as exc:
            f = self._plane.failure(exc)
            raise ParaminitError.named(f.code, f.message, f.violations) from exc

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._gate.call(), self._errors():
            yield

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport:
        with self._call():
            report: ValidationReport = self._plane.validate(plan)
        return report

    def info(self) -> pb.GetInfoResponse:
        with self._call():
            return messages.server_info_message(self._plane.info())

    def health(self, service: str) -> str:
        with self._call():
            _ = self._plane.plane  # the data plane started: SERVING (a failed start raises here)
        return "SERVING"

    def stream(self, plan: plan_pb2.Plan, chunk_bytes: int, check_crc: bool) -> tuple[pb.StreamHeader, Iterator[Chunk]]:
        with self._call():
            items = self._plane.stream(plan, chunk_bytes)
            header = next(items)
        if not isinstance(header, StreamHeader):  # the embedded door always starts with the header
            items.close()
            raise ParaminitError.named("INTERNAL", "the data plane did not start the stream with a header")

        def slabs() -> Iterator[Chunk]:  # not a running call for close(): a consumer may never finish it
            with contextlib.closing(items), self._errors():
                for item in items:
                    if isinstance(item, tuple):
                        offset, slab = item
                        yield Slab(offset, slab.data.cast("B"))

        return messages.stream_header_message(header), slabs()

    def materialize(self, plan: plan_pb2.Plan, chunk_bytes: int, progress: Callable[[int], None] | None) -> Arrays:
        with self._call():
            tensors, _digest, buf = self._plane.fill(plan)
        if progress is not None:
            progress(int(buf.nbytes))
        return arrays_from_buffer(tensors, buf)

    def materialize_into(self, plan: plan_pb2.Plan, outputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
        with self._call():
            self._plane.fill_into(plan, outputs)

    def export(self, plan: plan_pb2.Plan, delivery: str, ttl_seconds: float) -> pb.ExportInfo:
        with self._call():
            return messages.export_info_message(self._plane.export(plan, delivery, ttl_seconds))

    def upload(self, raw: memoryview, dtype: int, count: int, chunk_bytes: int) -> str:
        def pieces() -> Iterator[tuple[int, int, memoryview]]:
            yield dtype, count, raw[:chunk_bytes]
            for off in range(chunk_bytes, len(raw), chunk_bytes):
                yield 0, 0, raw[off : off + chunk_bytes]

        with self._call():
            return str(self._plane.upload(pieces()))

    def leases(self) -> list[pb.LeaseStatus]:
        with self._call():
            statuses = self._plane.leases()
        now = time.time()
        return [messages.lease_status_message(s, now) for s in statuses]

    def release(self, lease_id: str, timeout: float | None = None) -> bool:
        with self._call():
            return bool(self._plane.release(lease_id))

    def renew(self, lease_id: str, ttl_seconds: float) -> float:
        with self._call():
            return float(self._plane.renew(lease_id, ttl_seconds))

    def apply(self, lease_id: str, plan: plan_pb2.Plan) -> str:
        with self._call():
            return str(self._plane.apply(lease_id, plan))

    def close(self) -> None:
        """Free every lease and segment of this data plane, once, in the process that made it (a forked
        child's close, or its exit, frees nothing of its parent's)."""
        self._finalizer()


def _close_local(gate: CallGate, embedded: InProcess) -> None:
    if gate.close(CLOSE_WAIT):
        embedded.close()


def start_local(safetensors_dirs: str = "/") -> LocalTransport:
    """The in-process transport. `safetensors_dirs` (colon-separated): the files its plans may read; by default
    every file this process can read, since the allow-list guards a server from its clients, not a process from
    itself.

    Raises:
        ParaminitError: FAILED_PRECONDITION when the server package (the data plane) is not installed.
    """
    try:
        from paraminit_server import embedded  # optional: the client can be installed alone
    except ImportError as exc:
        raise ParaminitError.named(
            "FAILED_PRECONDITION",
            f"no target given and the embedded server is not installed ({exc}); "
            "pass Client('host:port') or install paraminit with its server",
        ) from None
    return LocalTransport(embedded.InProcess.start("cpu", safetensors_dirs=safetensors_dirs))
