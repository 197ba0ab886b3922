"""Backends fill parameter buffers; the NumPy one is embedded, CuPy is imported only when chosen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from paraminit_server.errors import BackendUnavailable
from paraminit_server.plan import ResolvedParam


@dataclass(frozen=True)
class DeviceDescription:
    kind: str  # "cpu" | "cuda"
    name: str
    uuid: str = ""
    ordinal: int = -1
    memory_total: int = 0
    memory_free: int = 0


class Backend(Protocol):
    """What the service needs from a backend."""

    name: str

    def warm_up(self) -> None:
        """Compile kernels; health reports SERVING only after this returns."""

    def empty(self, nbytes: int) -> Any:
        """A 1-D uint8 buffer of nbytes in the backend's memory."""

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        """Write local elements [l_begin, l_begin + len(out)) of p into out (p.dtype.storage, 1-D)."""

    def to_host(self, buf: Any) -> Any:
        """A host numpy view or copy of a backend buffer."""

    def device(self) -> DeviceDescription:
        """What the backend runs on, for GetInfo and metrics."""


def create(name: str = "auto", device: int = 0, threads: int | None = None) -> Backend:
    """Create a backend by name: "numpy", "cupy" or "auto" (CuPy when it imports and a GPU is present)."""
    if name in ("cupy", "auto"):
        try:
            from paraminit_server.backends.cupy_backend import CupyBackend

            gpu: Backend = CupyBackend(device)
            return gpu
        except BackendUnavailable:
            if name == "cupy":
                raise
    if name in ("numpy", "auto"):
        from paraminit_server.backends.numpy_backend import NumpyBackend

        return NumpyBackend(threads)
    raise BackendUnavailable(f"unknown backend {name!r}: expected auto, numpy or cupy")
