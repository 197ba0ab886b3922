"""What the data plane answers, as plain values: the one set of result types both doors speak.

The data plane returns these; the gRPC edge encodes them to the contract's messages (paraminit.messages), and the
in-process door hands them to the client's local transport as they are, so neither side of that door sees a
server module's private, a protobuf message or a gRPC status. Nothing here imports protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, SupportsIndex, overload

from paraminit.violations import Violation

STREAM, SHM, CUDA_IPC = "stream", "shm", "cuda_ipc"  # the deliveries, by the names the data plane uses


class TensorSpan(NamedTuple):
    """One tensor of a delivered buffer: the fields of the contract's TensorInfo, as a plain tuple."""

    name: str
    dtype: int  # paraminit.v1.DType enum value
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SpanTable(Sequence[TensorSpan]):
    """A delivered buffer's tensor table, as columns: `columns()` gives them to a reader that wants them whole
    (the client's arrays_from_buffer, a packed stream header); iterating gives TensorSpans, made only then. It
    equals any sequence of the same TensorSpans."""

    def __init__(self, names: list[str], dtypes: list[int], shapes: list[tuple[int, ...]], offsets: list[int], nbytes: list[int]) -> None:
        self._columns = (names, dtypes, shapes, offsets, nbytes)

    def columns(self) -> tuple[list[str], list[int], list[tuple[int, ...]], list[int], list[int]]:
        """Names, dtype enums, shapes, offsets and byte counts, in plan order."""
        return self._columns

    def __len__(self) -> int:
        return len(self._columns[0])

    def __iter__(self) -> Iterator[TensorSpan]:
        return map(TensorSpan, *self._columns)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable columns, like a list

    @overload
    def __getitem__(self, i: SupportsIndex) -> TensorSpan: ...

    @overload
    def __getitem__(self, i: slice) -> list[TensorSpan]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> TensorSpan | list[TensorSpan]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        names, dtypes_, shapes, offsets, nbytes = self._columns
        return TensorSpan(names[i], dtypes_[i], shapes[i], offsets[i], nbytes[i])


@dataclass(frozen=True)
class StreamHeader:
    """The first item of a stream: the plan's digest, the safetensors prefix and where each tensor lies."""

    plan_digest: str
    safetensors_prefix: bytes
    data_bytes: int
    tensors: Sequence[TensorSpan]


@dataclass(frozen=True)
class Lease:
    """A live lease: its id, expiry (seconds since the Unix epoch), size and delivery ("shm" or "cuda_ipc")."""

    lease_id: str
    expires_at: float
    nbytes: int
    delivery: str


@dataclass(frozen=True)
class LeaseStatus:
    """A lease as ListLeases shows it: with its creation time (epoch seconds), owner and plan digest."""

    lease: Lease
    created: float
    owner: str
    plan_digest: str


@dataclass(frozen=True)
class DeviceInfo:
    """The device a server fills on."""

    kind: str  # "cpu" | "cuda"
    name: str
    uuid: str = ""
    ordinal: int = -1
    memory_total: int = 0
    memory_free: int = 0


@dataclass(frozen=True)
class ExportInfo:
    """An exported buffer: its lease, where each tensor lies, and how a peer on this host maps it (a shared
    memory segment's name, or a CUDA IPC handle on a device)."""

    plan_digest: str
    lease: Lease
    tensors: Sequence[TensorSpan]
    size: int
    shm_name: str = ""
    ipc_handle: bytes = b""
    device: DeviceInfo | None = None


@dataclass(frozen=True)
class ServerLimits:
    """The limits a server states (GetInfo's Limits), so that a caller can size its plans before sending them."""

    max_plan_bytes: int
    max_param_bytes: int
    max_concurrent_requests: int
    max_chunk_bytes: int
    max_leased_bytes: int
    max_leases_per_client: int


@dataclass(frozen=True)
class ServerInfo:
    """What GetInfo answers: version, backend, device, limits, dtypes (enums) and deliveries (names)."""

    version: str
    backend: str
    device: DeviceInfo
    limits: ServerLimits
    dtypes: tuple[int, ...]
    deliveries: tuple[str, ...]


@dataclass(frozen=True)
class Failure:
    """A failed call as a client reports it: a canonical status name (google.rpc.Code), a message and, for
    plans, every violation."""

    code: str
    message: str
    violations: tuple[Violation, ...] = ()
