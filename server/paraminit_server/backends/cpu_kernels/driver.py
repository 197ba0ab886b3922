"""The fill driver: `fill` writes a parameter region's local elements, piece by piece, on one or all threads.

`fill` writes `out[k]` for the local elements `l_begin + k` of a parameter's region. Work is split into
fixed-size pieces of the local index, which the threads take from a shared counter; each piece walks its runs
(Runs in plan.py) with contiguous inner loops and hands each run to its kind's fill (distributions), and every
element depends only on (key, global index): bytes never depend on threads, scheduling or chunking.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from paraminit_server.backends.cpu_kernels.counter_rng import GOLDEN, TWO_NEG_32, U2
from paraminit_server.backends.cpu_kernels.distributions import fill_affine, fill_const, fill_flat, fill_normal, fill_truncnorm
from paraminit_server.backends.cpu_kernels.half_rounding import BF16, F16
from paraminit_server.backends.cpu_kernels.jit import jit, parallel

PIECE = 1 << 16  # elements per parallel task; tensors up to this size run on the calling thread
_WORKERS = 256  # at least the number of threads


@jit
def run_global(r: int, outer_start: Any, outer_ext: Any, outer_stride: Any, base: int) -> int:
    """Global flat index of the first element of run r (Runs in plan.py)."""
    g = base
    for d in range(outer_ext.shape[0] - 1, -1, -1):
        ext = outer_ext[d]
        q = r // ext
        g += (r - q * ext + outer_start[d]) * outer_stride[d]
        r = q
    return g


@jit
def fill_run(dst: Any, g: int, kind: int, s: Any, p0: float, p1: float, sc: float, p1b: float,
             lo: float, hi: float, seed: Any, values: Any, h: Any) -> None:
    """dst = elements g, g+1, ... of the full tensor (Kind codes as in plan.py); s = key + GOLDEN."""
    if kind == 4:
        fill_truncnorm(dst, s + U2 * np.uint64(g), np.uint64(g), p0, p1, lo, hi, seed, h)
    elif kind == 1:
        fill_affine(dst, s + np.uint64(g), p0, sc, p1b, h)
    elif kind == 2:
        fill_normal(dst, s + U2 * np.uint64(g), p0, p1, h)
    elif kind == 3:
        fill_flat(dst, values, g, h)
    else:
        fill_const(dst, p0, h)


def run_any(out: Any, dst: Any, g: int, kind: int, s: Any, p0: float, p1: float, sc: float, p1b: float,
            lo: float, hi: float, seed: Any, values: Any, fmt: int) -> None:
    """fill_run with the half format's constants fixed at compile time (float arrays ignore them)."""
    raise NotImplementedError("called only inside kernels")


@overload(run_any)
def _run_any_overload(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
                      lo: Any, hi: Any, seed: Any, values: Any, fmt: Any) -> Any:
    if out.dtype == types.uint16:
        def half(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
                 lo: Any, hi: Any, seed: Any, values: Any, fmt: Any) -> Any:
            if fmt == 1:
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, F16)
            else:
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, BF16)
        return half

    def native(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
               lo: Any, hi: Any, seed: Any, values: Any, fmt: Any) -> Any:
        fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, BF16)
    return native


@jit
def fill_piece(out: Any, l: int, lend: int, l_begin: int, kind: int, key: Any, p0: float, p1: float, sc: float,
               p1b: float, lo: float, hi: float, seed: Any, values: Any, fmt: int, outer_start: Any, outer_ext: Any,
               outer_stride: Any, base: int, run_len: int) -> None:
    """Local elements [l, lend) of the region, run by run (compiled once, called by both entry points)."""
    s = key + GOLDEN
    while l < lend:
        r = l // run_len
        off = l - r * run_len
        g = run_global(r, outer_start, outer_ext, outer_stride, base) + off
        m = min(lend - l, run_len - off)
        dst = out[l - l_begin:l - l_begin + m]
        run_any(out, dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, fmt)
        l += m


def _fetch_add(typingctx: Any, counter: Any, v: Any) -> Any:
    """Atomically add v to counter[0] (an int64 array) and return the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, args[1], "monotonic")

    return types.int64(counter, types.int64), codegen


fetch_add: Any = intrinsic(_fetch_add)


@parallel
def fill_parallel(out: Any, l_begin: int, kind: int, key: Any, p0: float, p1: float, sc: float, p1b: float,
                  lo: float, hi: float, seed: Any, values: Any, fmt: int, outer_start: Any, outer_ext: Any,
                  outer_stride: Any, base: int, run_len: int) -> None:
    """Workers take the next piece from a shared counter until none are left.

    Not a static split: on a shared machine a thread slowed by other work would hold up the whole call. The
    prange hands the workers out statically; a thread's first worker runs until the pieces are gone, and
    its others find none (asking numba for its thread count here would make the function uncachable).
    """
    n = out.shape[0]
    pieces = (n + PIECE - 1) // PIECE
    counter = np.zeros(1, dtype=np.int64)
    for _ in nb.prange(min(_WORKERS, pieces)):
        t = fetch_add(counter, 1)
        while t < pieces:
            l = l_begin + t * PIECE
            fill_piece(out, l, min(l + PIECE, l_begin + n), l_begin, kind, key, p0, p1, sc, p1b, lo, hi, seed,
                       values, fmt, outer_start, outer_ext, outer_stride, base, run_len)
            t = fetch_add(counter, 1)


@jit
def fill(out: Any, l_begin: int, kind: int, key: Any, p0: float, p1: float, lo: float, hi: float, seed: Any,
         values: Any, fmt: int, outer_start: Any, outer_ext: Any, outer_stride: Any, base: int, run_len: int) -> None:
    """Fill out[k] with the value of local element l_begin + k of a region (Kind codes as in plan.py).

    lo, hi and seed are the truncated normal's bounds and raw seed (ignored by the other kinds).

    Small outputs stay on the calling thread: waking the pool costs more than they do.
    """
    n = out.shape[0]
    if n == 0:
        return
    # p1 * 2^-32 is exact unless it falls into the subnormal range; then scale the draw instead.
    p1s = p1 * TWO_NEG_32
    sc, p1b = (1.0, p1s) if p1s * 2.0**32 == p1 else (TWO_NEG_32, p1)
    if n <= PIECE:
        fill_piece(out, l_begin, l_begin + n, l_begin, kind, key, p0, p1, sc, p1b, lo, hi, seed, values, fmt,
                   outer_start, outer_ext, outer_stride, base, run_len)
    else:
        fill_parallel(out, l_begin, kind, key, p0, p1, sc, p1b, lo, hi, seed, values, fmt,
                      outer_start, outer_ext, outer_stride, base, run_len)



@jit
def fill_batch(out: Any, starts: Any, counts: Any, kinds: Any, keys: Any, p0s: Any, p1s: Any, los: Any, his: Any,
               seeds: Any, fmt: int) -> None:
    """Whole tensors of one dtype in one call: tensor j is out[starts[j]:starts[j] + counts[j]], valued as `fill`
    values a whole tensor of kind kinds[j] (not FLAT) with keys[j], p0s[j], ...

    For plans of many small tensors: one call instead of one per tensor, on the calling thread (each tensor is
    at most PIECE elements, what `fill` keeps on the calling thread too). Every element is computed exactly as
    `fill` computes it.
    """
    no_values = np.zeros(0, dtype=np.float64)
    no_dims = np.zeros(0, dtype=np.int64)
    for j in range(starts.shape[0]):
        n = counts[j]
        if n <= 0:
            continue
        a = starts[j]
        p1 = p1s[j]
        p1s_ = p1 * TWO_NEG_32
        sc, p1b = (1.0, p1s_) if p1s_ * 2.0**32 == p1 else (TWO_NEG_32, p1)
        fill_piece(out[a:a + n], 0, n, 0, kinds[j], keys[j], p0s[j], p1, sc, p1b, los[j], his[j], seeds[j],
                   no_values, fmt, no_dims, no_dims, no_dims, 0, n)
