"""The deterministic orthogonal initializer (docs/SAMPLER.md 2.3): a Gaussian matrix of the counter-based normal,
a Householder QR in binary64 with one fixed operation order, the sign correction, the gain.

Every sum runs in increasing index order on one thread and nothing is fused (numba compiles without fast-math, so
LLVM neither contracts a multiply and an add nor reorders a reduction): the bytes depend on (shape, gain, seed)
alone, never on threads, chunking, regions, ranks or backend. Every backend takes these values as data (the CUDA
path uploads them like a payload), so the matrix is always computed here, on the host. A region is cut from the
whole matrix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit_server.backends.cpu_kernels.jit import jit


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
            d = 0.0
            for i in range(k, m):
                d += vs[k, i] * at[j, i]
            f = b * d
            for i in range(k, m):
                at[j, i] -= f * vs[k, i]
    q = np.zeros((n, m))
    for j in range(n):
        q[j, j] = 1.0
    for k in range(n - 1, -1, -1):
        b = beta[k]
        for j in range(k, n):
            d = 0.0
            for i in range(k, m):
                d += vs[k, i] * q[j, i]
            f = b * d
            for i in range(k, m):
                q[j, i] -= f * vs[k, i]
    for j in range(n):
        for i in range(m):
            q[j, i] *= sign[j]
    return q


def values(rows: int, cols: int, gain: float, seed: int) -> npt.NDArray[np.float64]:
    """The whole parameter's binary64 values, row-major over its rows x cols matrix view (inits.Orthogonal).

    Args:
        rows: the parameter's first dimension.
        cols: the product of the others.
        gain: the scale (finite).
        seed: the Gaussian matrix's seed.

    Returns:
        A float64 array of rows * cols values.
    """
    from paraminit_server.backends.cpu_kernels.driver import KERNELS
    from paraminit_server.plans import spec
    from paraminit_server.plans.plan import Kind

    n = rows * cols
    g = np.empty(n, dtype=np.float64)
    if n == 0:
        return g
    none = np.zeros(0, dtype=np.int64)
    KERNELS[Kind.NORMAL].fill(g, 0, n, 0, np.uint64(spec.key(seed)), 0.0, 1.0, 0.0, 0.0, np.uint64(0),
                              np.zeros(0, dtype=np.float64), 0, none, none, none, 0, n)
    grid = g.reshape(rows, cols)
    # rows < cols: A = G^T, so at = G and the result is Q^T = q; else A = G, at = G^T and the result is Q = q^T
    q = _q_rows(np.ascontiguousarray(grid)) if rows < cols else _q_rows(np.ascontiguousarray(grid.T)).T
    flat: npt.NDArray[np.float64] = np.ascontiguousarray(q).reshape(-1) * gain
    return flat
