"""How a Client reaches a data plane, chosen once when it is made (`make_transport`): the `Transport` surface and
what both transports share.

`LocalTransport` (local_transport.py) calls the data plane in this process
(paraminit_server.embedded): kernels fill the caller's arrays, slabs are handed
over as they are, errors are the data plane's own, turned into the client's.
`GrpcTransport` (grpc_transport.py) talks to a server: protobuf on the wire,
each chunk's CRC32C and the header checksum checked before a byte is used, gRPC
statuses turned into the client's errors. The Client and its Leases only ever
see the `Transport` surface.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c
import grpc
import numpy as np

from paraminit import overlap, packed_table
from paraminit.shapes import output_problem
from paraminit.spans import ByteSpans
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit.violations import ValidationReport as ValidationReport  # the client's name for it
from paraminit_client.arrays import numpy_dtype, table_columns
from paraminit_client.errors import ClientClosed, InvalidArgument, ParaminitError

Arrays = dict[str, np.ndarray[Any, Any]]
TensorTable = Iterable[pb.TensorInfo] | packed_table.Table  # a stream's tensor table: messages, or packed columns


class Chunk(Protocol):
    """A piece of a stream's data section: `crc32c` is the sender's checksum of `data`, or None for slabs
    handed over in this process (nothing crossed a wire, so there is nothing to check)."""

    @property
    def offset(self) -> int: ...

    @property
    def data(self) -> memoryview: ...

    @property
    def crc32c(self) -> int | None: ...


@dataclass(frozen=True)
class Slab:
    """A slab of the data section handed over in this process."""

    offset: int
    data: memoryview
    crc32c: None = None


class Transport(Protocol):
    """What a Client and its Leases call; every error is a ParaminitError."""

    target: str
    releases_at_exit: bool  # True when leases must be given back at interpreter exit (a server outlives us)

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport: ...

    def info(self) -> pb.GetInfoResponse: ...

    def health(self, service: str) -> str: ...

    def stream(self, plan: plan_pb2.Plan, chunk_bytes: int, check_crc: bool) -> tuple[pb.StreamHeader, Iterator[Chunk]]: ...

    def materialize(self, plan: plan_pb2.Plan, chunk_bytes: int, progress: Callable[[int], None] | None) -> Arrays: ...

    def materialize_into(self, plan: plan_pb2.Plan, outputs: Mapping[str, np.ndarray[Any, Any]]) -> None: ...

    def export(self, plan: plan_pb2.Plan, delivery: str, ttl_seconds: float) -> pb.ExportInfo: ...

    def upload(self, raw: memoryview, dtype: int, count: int, chunk_bytes: int) -> str: ...

    def leases(self) -> list[pb.LeaseStatus]: ...

    def release(self, lease_id: str, timeout: float | None = None) -> bool: ...

    def renew(self, lease_id: str, ttl_seconds: float) -> float: ...

    def apply(self, lease_id: str, plan: plan_pb2.Plan) -> str: ...

    def close(self) -> None: ...


# -- common to both --------------------------------------------------------------------------------------------------


def land(chunks: Iterator[Chunk], put: Callable[[Chunk], None], progress: Callable[[int], None] | None = None, depth: int = 8) -> None:
    """Check each chunk's CRC32C (where it carries one: it crossed a wire) and `put` it behind the thread that
    receives (paraminit.overlap: on a helper thread where cores allow, at most `depth` chunks in flight).

    Raises:
        ParaminitError: DATA_LOSS on a mismatch, which stops the stream; the stream's own errors.
    """

    def check_and_put(c: Chunk) -> int:
        if c.crc32c is not None and crc32c.crc32c(c.data) != c.crc32c:
            raise ParaminitError(grpc.StatusCode.DATA_LOSS, f"CRC32C mismatch in chunk at offset {c.offset}")
        put(c)
        return len(c.data)

    for n in overlap.behind(chunks, check_and_put, depth):
        if progress is not None:
            progress(n)


def copy_into(
    table: TensorTable, chunks: Iterator[Chunk], outputs: Mapping[str, np.ndarray[Any, Any]], progress: Callable[[int], None] | None = None
) -> None:
    """Copy a stream into the caller's arrays, one chunk at a time (CRC32C checked by `land`), every tensor of the
    table into `outputs[name]`. Every array is checked against its tensor first (paraminit.shapes.output_problem,
    the in-process door's rule): a missing or unfit one closes the stream before a byte is written.

    Raises:
        InvalidArgument: an output array missing, of another shape or item size, read-only or not C-contiguous.
        ParaminitError: as `land`.
    """
    itemsizes: dict[int, int] = {}
    names, enums, shapes, offsets, sizes = table_columns(table)
    views = []
    for name, enum, shape in zip(names, enums, shapes, strict=True):
        if enum not in itemsizes:
            itemsizes[enum] = numpy_dtype(enum).itemsize
        problem = output_problem(outputs, name, shape, itemsizes[enum])
        if problem is not None:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # cancels the call: nothing more is sent
            raise InvalidArgument(problem)
        views.append(outputs[name].reshape(-1).view(np.uint8))
    spans = ByteSpans(offsets, sizes)

    def put(c: Chunk) -> None:
        lo, hi = c.offset, c.offset + len(c.data)
        data = np.frombuffer(c.data, dtype=np.uint8)
        for i in spans.overlapping(lo, hi).tolist():
            start = offsets[i]
            a, b = max(start, lo), min(start + sizes[i], hi)
            views[i][a - start : b - start] = data[a - lo : b - lo]

    land(chunks, put, progress)


class CallGate:
    """Refuses calls once closed, or in a process other than the one that made it (a forked child), and
    lets close() wait for the calls that are running."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.pid = os.getpid()
        self.closed = False
        self._running = 0
        self._idle = threading.Condition()

    def forked(self) -> bool:
        return os.getpid() != self.pid

    def check(self) -> None:
        if self.forked():
            raise ClientClosed(f"this {self.what} belongs to process {self.pid}; a forked child makes its own Client()")
        if self.closed:
            raise ClientClosed(f"this {self.what} is closed")

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self._idle:
            self.check()
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def close(self, wait: float) -> bool:
        """Refuse new calls; True (once) when this process owns what is to be freed, after the running calls
        finished (at most `wait` seconds)."""
        with self._idle:
            if self.closed:
                return False
            self.closed = True
            if self.forked():
                return False
            self._idle.wait_for(lambda: self._running == 0, wait)
            return True


CLOSE_WAIT = 60.0  # longest close() waits for calls still running on other threads
