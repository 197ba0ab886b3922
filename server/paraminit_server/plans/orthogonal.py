"""The deterministic orthogonal initializer (docs/SAMPLER.md 2.3): a Householder QR in binary64 with one fixed
operation order of the counter-based Gaussian matrix, the sign correction, the gain.

Every sum runs in increasing index order on one thread and nothing is fused (numba compiles without fast-math, so
LLVM neither contracts a multiply and an add nor reorders a reduction): the bytes depend on (shape, gain, seed)
alone, never on threads, chunking, regions, ranks or backend. The Gaussian matrix comes from the request's sources
(`RequestSnapshot.gaussian`: the CPU kernels' normal, whatever the backend), and every backend takes the result as
data (the CUDA path uploads it like a payload), so the matrix is always computed on the host. A region is cut from
the whole matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from paraminit_server import errors

# numba's own on-disk cache keyed on this file: every function the factorization calls lives here
jit = numba.njit(cache=True, nogil=True)


@jit
def _reflect(v: Any, b: float, x: Any) -> None:
    """x -= (b * (v . x)) * v: one Householder reflection of one column (both as contiguous rows), the dot product
    summed in increasing index order (docs/SAMPLER.md 2.3)."""
    d = 0.0
    for i in range(v.shape[0]):
        d += v[i] * x[i]
    f = b * d
    for i in range(v.shape[0]):
        x[i] -= f * v[i]


@jit
def _factor(at: Any, vs: Any, beta: Any, sign: Any, k0: int, k1: int) -> None:
    """Householder steps k0 .. k1-1 of A = QR for the m x n matrix A (m >= n) given as at = A^T (n x m, A's columns
    as rows); step k's vector is kept in vs[k, k:], its factor in beta[k] and R's diagonal sign in sign[k]."""
    n, m = at.shape
    for k in range(k0, k1):
        s = 0.0
        for i in range(k, m):
            s += at[k, i] * at[k, i]
        x0 = at[k, k]
        alpha = -math.sqrt(s) if x0 >= 0.0 else math.sqrt(s)
        for i in range(k, m):
            vs[k, i] = at[k, i]
        vs[k, k] = x0 - alpha
        vv = 0.0
        for i in range(k, m):
            vv += vs[k, i] * vs[k, i]
        b = 0.0 if vv == 0.0 else 2.0 / vv
        beta[k] = b
        sign[k] = -1.0 if alpha < 0.0 else 1.0
        for j in range(k + 1, n):
            _reflect(vs[k, k:], b, at[j, k:])


@jit
def _accumulate(q: Any, vs: Any, beta: Any, k0: int, k1: int) -> None:
    """The reflections of steps k1-1 down to k0 applied to q (Q's columns as rows)."""
    n = q.shape[0]
    for k in range(k1 - 1, k0 - 1, -1):
        b = beta[k]
        for j in range(k, n):
            _reflect(vs[k, k:], b, q[j, k:])


STEP_WORK = 1 << 27  # multiply-adds between two looks at the request's stop (about 0.1 s of one core)


def _q_rows(at: npt.NDArray[np.float64], stop: Callable[[], bool] | None = None) -> npt.NDArray[np.float64]:
    """Q of A = QR for the m x n matrix A (m >= n) given as at = A^T (n x m, A's columns as rows), returned the same
    way (n x m: Q's columns as rows), column k multiplied by the sign of R's k-th diagonal entry; `at` is overwritten
    by the factorization. The steps run in order in blocks of about STEP_WORK, `stop` asked between blocks.

    Raises:
        errors.Cancelled: `stop` said the request is over (deadline, cancellation, drain).
    """
    n, m = at.shape
    vs = np.zeros((n, m))
    beta = np.zeros(n)
    sign = np.ones(n)
    step = max(1, STEP_WORK // max(1, n * m))

    def check() -> None:
        if stop is not None and stop():
            raise errors.Cancelled("the request ended while its orthogonal matrix was being computed")

    for k0 in range(0, n, step):
        check()
        _factor(at, vs, beta, sign, k0, min(n, k0 + step))
    q = np.zeros((n, m))
    for j in range(n):
        q[j, j] = 1.0
    for k1 in range(n, 0, -step):
        check()
        _accumulate(q, vs, beta, max(0, k1 - step), k1)
    q *= sign[:, None]  # one rounding-free multiply by +-1 per element
    return q


HELD_PER_ELEMENT = 48  # bytes values() holds per element at its peak: G, its copy, vs, q, the transposed result


def values(
    rows: int, cols: int, gain: float, gaussian: npt.NDArray[np.float64], stop: Callable[[], bool] | None = None
) -> npt.NDArray[np.float64]:
    """The whole parameter's binary64 values, row-major over its rows x cols matrix view (inits.Orthogonal).

    Args:
        rows: the parameter's first dimension.
        cols: the product of the others.
        gain: the scale (finite).
        gaussian: the rows * cols normal(0, 1, seed) values G, row-major.
        stop: asked about every STEP_WORK multiply-adds; True ends the computation.

    Returns:
        A float64 array of rows * cols values.

    Raises:
        errors.Cancelled: `stop` said the request is over.
    """
    n = rows * cols
    if n == 0:
        return np.empty(0, dtype=np.float64)
    grid = gaussian.reshape(rows, cols)
    # rows < cols: A = G^T, so at = G and the result is Q^T = q; else A = G, at = G^T and the result is Q = q^T
    q = _q_rows(np.array(grid), stop) if rows < cols else _q_rows(np.ascontiguousarray(grid.T), stop).T
    flat: npt.NDArray[np.float64] = np.ascontiguousarray(q).reshape(-1) * gain
    return flat
