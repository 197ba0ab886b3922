"""Backends fill parameter buffers and own the memory they lend: `cpu` (numba, embedded) and `cupy` (CUDA).

Both implement the whole `Backend` protocol, so nothing above this package asks
which backend it has. The CuPy module is imported only when that backend is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# The zero-copy deliveries and a device's description are the data plane's results (paraminit.results): one home
from paraminit.results import CUDA_IPC as CUDA_IPC
from paraminit.results import SHM as SHM
from paraminit.results import DeviceInfo as DeviceInfo
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Offsets, ResolvedParam

HOST = "host"
DEVICE = "device"


@dataclass(frozen=True)
class ExportHandle:
    """What a peer on this host needs to map an exported buffer."""

    delivery: str  # SHM | CUDA_IPC
    size: int
    shm_name: str = ""
    ipc_handle: bytes = b""
    device: DeviceInfo | None = None


class ExportBuffer(Protocol):
    """One buffer lent to a local peer: a shared-memory segment or a whole device allocation."""

    array: Any  # 1-D uint8 in backend memory, at least `size` bytes
    size: int

    def handle(self) -> ExportHandle:
        """The description a peer maps; valid until close()."""

    def recycle(self) -> bool:
        """Make the buffer unreachable through its old handle so it can be lent again; False if it cannot be."""

    def close(self) -> None:
        """Free the memory (idempotent)."""


class Backend(Protocol):
    """Everything the data plane needs from a backend."""

    name: str
    memory: str  # HOST or DEVICE: which budget its buffers count against
    delivery: str  # the zero-copy delivery it offers: SHM or CUDA_IPC

    def warm_up(self) -> None:
        """Compile kernels; health reports SERVING only after this returns."""

    def prepare(self, params: ParamTable) -> None:
        """Have the kernels these parameters need ready (compiling what is missing, once per process), before
        the call takes a concurrency slot: a slot is then never held while a compile runs."""

    def scratch(self, nbytes: int) -> Any:
        """A 1-D uint8 buffer for stream slabs (pooled on the GPU)."""

    def export_buffer(self, nbytes: int) -> ExportBuffer:
        """A buffer of nbytes that local peers can map (raises errors.ResourceExhausted when it cannot be had)."""

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        """Write local elements [l_begin, l_begin + len(out)) of p into out (p.dtype.storage, 1-D)."""

    def fill_plan(self, params: ParamTable, arena: Any, offsets: Offsets, should_stop: Callable[[], bool] | None = None) -> None:
        """Whole parameters into one 1-D uint8 arena, parameter i at byte offsets[i]; raises errors.Cancelled
        between pieces of work once should_stop() is true."""

    def zero(self, buf: Any, start: int, stop: int) -> None:
        """Zero bytes [start, stop) of a backend buffer (padding that must not leak stale bytes)."""

    def synchronize(self) -> None:
        """Return once every fill issued so far has finished (before memory is handed to another process)."""

    def to_host(self, buf: Any) -> Any:
        """A host numpy view or copy of a backend buffer."""

    def host_staging(self, nbytes: int) -> Any:
        """Host memory a backend buffer of up to nbytes can be copied into without waiting (page-locked on a
        device), reused slab after slab; None where backend buffers are host memory already."""

    def start_to_host(self, buf: Any, out: Any) -> Callable[[], Any]:
        """Queue a copy of buf into `out` (from host_staging, or None for new memory) behind every fill issued
        so far and return at once; calling the result waits for the copy and returns the host array."""

    def device(self) -> DeviceInfo:
        """What the backend runs on, for GetInfo and metrics."""
