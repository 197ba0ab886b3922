"""Numba kernels of the CPU backend: one fused, parallel pass per value kind, casts included.

Modules, by concern (each imports only those above it):
- jit: how kernels compile (decorators, the package-wide cache key, host features, bit casts);
- counter_rng: SplitMix64 of (key + GOLDEN + index) and the 32-bit draws, vectorizable;
- half_rounding: binary64 rounded once into float16/bfloat16 bits, and the per-element store;
- cr_tables: the correctly rounded log/cos tables and constants (pure Python; `make kernel-tables` copies them
  into the CUDA header);
- cr_math: the correctly rounded log and cos (docs/SAMPLER.md section 2.1);
- f32_math: binary32 log, cos and mean + std * z with proven error bounds, which decide most 16-bit and 8-bit
  outputs of normal at twice the vector width;
- distributions: the fill of one run per value kind (affine, normal, truncated normal, flat, constant);
- driver: per value kind, `fill`, which maps a region's local elements (or a batch of small whole tensors) to runs
  (KERNELS).

Compiled lazily on first call and cached on disk (numba's cache, keyed on every module here). Importing this package
costs nothing; `KERNELS`, `PIECE` and `NO_BATCH` load the kernels' modules on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paraminit_server.backends.cpu_kernels.driver import KERNELS, NO_BATCH, PIECE

__all__ = ["KERNELS", "NO_BATCH", "PIECE", "sparse_zero_keys", "standard_normal"]


def standard_normal(n: int, seed: int) -> Any:
    """The first n values of normal(0, 1, seed) in binary64 (docs/SAMPLER.md section 2), on the calling thread: the
    Gaussian matrix of an orthogonal parameter and a sparse one's draws, the same on every backend.

    Args:
        n: how many values (flat indices 0 .. n-1).
        seed: the normal's seed.

    Returns:
        A float64 array of n values.
    """
    from paraminit_server.plans.plan import Formula

    return _draws(Formula.NORMAL, n, seed)


def sparse_zero_keys(n: int, seed: int) -> Any:
    """The keys choosing a sparse parameter's zeros (docs/SAMPLER.md 2.6): the first n unit draws of its seed's stream
    SPARSE_ZERO_STREAM, in binary64, on the calling thread.

    Args:
        n: how many keys (flat indices 0 .. n-1).
        seed: the sparse parameter's seed.

    Returns:
        A float64 array of n values in [0, 1).
    """
    from paraminit import inits
    from paraminit_server.plans import sampler
    from paraminit_server.plans.plan import Formula

    return _draws(Formula.AFFINE, n, sampler.candidate_seed(seed, inits.SPARSE_ZERO_STREAM))  # 0 + unit * 1: the unit draw


def _draws(kind: Any, n: int, seed: int) -> Any:
    """n values of a kernel kind with p0 = 0 and p1 = 1 (normal: z; affine: the unit draw) under a seed."""
    import numpy as np

    from paraminit_server.backends.cpu_kernels.driver import KERNELS, NO_BATCH
    from paraminit_server.plans import sampler

    out = np.empty(n, dtype=np.float64)
    if n:
        none = np.zeros(0, dtype=np.int64)
        KERNELS[kind].fill(
            out,
            0,
            n,
            0,
            np.uint64(sampler.key(seed)),
            0.0,
            1.0,
            0.0,
            0.0,
            np.uint64(0),
            np.zeros(0, dtype=np.float64),
            0,
            none,
            none,
            none,
            0,
            n,
            NO_BATCH,
        )
    return out


def __getattr__(name: str) -> Any:
    """The driver's `KERNELS`, `PIECE` and `NO_BATCH`, imported on first access (numba, the tables) rather than with
    the package."""
    if name in ("KERNELS", "NO_BATCH", "PIECE"):
        from paraminit_server.backends.cpu_kernels import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
