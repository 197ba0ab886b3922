"""Which backend a server or an embedded data plane runs on, by name: the one module that imports them all, so
the backends' package (their protocol) imports none of them."""

from __future__ import annotations

from paraminit_server.backends import Backend
from paraminit_server.errors import BackendUnavailable

BACKENDS = ("auto", "cpu", "cupy")
ALIASES = {"numpy": "cpu"}


def create(name: str = "auto", device: int = 0, threads: int | None = None) -> Backend:
    """Create a backend by name: "cpu" (alias "numpy"), "cupy", or "auto" (CuPy when it imports and a GPU is present)."""
    name = ALIASES.get(name, name)
    if name in ("cupy", "auto"):
        try:
            from paraminit_server.backends.cupy_backend import CupyBackend  # CuPy only when chosen

            gpu: Backend = CupyBackend(device)
            return gpu
        except BackendUnavailable:
            if name == "cupy":
                raise
    if name in ("cpu", "auto"):
        from paraminit_server.backends.cpu import CpuBackend  # numba only when chosen

        return CpuBackend(threads)
    raise BackendUnavailable(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)} (or numpy for cpu)")
