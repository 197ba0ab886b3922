"""Numba kernels of the CPU backend: one fused, parallel pass per value kind, casts included.

Modules, by concern (each imports only those above it):
- jit: how kernels compile (decorators, the package-wide cache key, host features, bit casts);
- counter_rng: SplitMix64 of (key + GOLDEN + index) and the 32-bit draws, vectorizable;
- half_rounding: binary64 rounded once into float16/bfloat16 bits, and the per-element store;
- cr_tables: the correctly rounded log/cos tables and constants (pure Python; `make kernel-tables` copies them
  into the CUDA header);
- cr_math: the correctly rounded log and cos (docs/SAMPLER.md section 2.1);
- distributions: the fill of one run per value kind (affine, normal, truncated normal, flat, constant);
- driver: per value kind, `fill`, which maps a region's local elements to runs and spreads pieces over the threads,
  and `fill_batch` (KERNELS).

Compiled lazily on first call and cached on disk (numba's cache, keyed on every module here). Importing this package
costs nothing; `KERNELS` and `PIECE` load the kernels' modules on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paraminit_server.backends.cpu_kernels.driver import KERNELS, PIECE

__all__ = ["KERNELS", "PIECE"]


def __getattr__(name: str) -> Any:
    """The driver's `KERNELS` and `PIECE`, imported on first access (numba, the tables) rather than with the package."""
    if name in __all__:
        from paraminit_server.backends.cpu_kernels import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
