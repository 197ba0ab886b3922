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
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

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
def _q_rows(at: Any) -> Any:
    """Q of A = QR for the m x n matrix A (m >= n) given as at = A^T (n x m, A's columns as rows), returned the same
    way (n x m: Q's columns as rows), column k multiplied by the sign of R's k-th diagonal entry.

    The Householder vector of step k is kept in vs[k, k:]; `at` is overwritten by the factorization.
    """
    n, m = at.shape
    vs = np.zeros((n, m))
    beta = np.zeros(n)
    sign = np.ones(n)
    for k in range(n):
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
    q = np.zeros((n, m))
    for j in range(n):
        q[j, j] = 1.0
    for k in range(n - 1, -1, -1):
        b = beta[k]
        for j in range(k, n):
            _reflect(vs[k, k:], b, q[j, k:])
    for j in range(n):
        for i in range(m):
            q[j, i] *= sign[j]
    return q


def values(rows: int, cols: int, gain: float, gaussian: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The whole parameter's binary64 values, row-major over its rows x cols matrix view (inits.Orthogonal).

    Args:
        rows: the parameter's first dimension.
        cols: the product of the others.
        gain: the scale (finite).
        gaussian: the rows * cols normal(0, 1, seed) values G, row-major.

    Returns:
        A float64 array of rows * cols values.
    """
    n = rows * cols
    if n == 0:
        return np.empty(0, dtype=np.float64)
    grid = gaussian.reshape(rows, cols)
    # rows < cols: A = G^T, so at = G and the result is Q^T = q; else A = G, at = G^T and the result is Q = q^T
    q = _q_rows(np.array(grid)) if rows < cols else _q_rows(np.ascontiguousarray(grid.T)).T
    flat: npt.NDArray[np.float64] = np.ascontiguousarray(q).reshape(-1) * gain
    return flat
