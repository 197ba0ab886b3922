"""The fill driver: per value kind, `fill` writes a span of a parameter region's local elements, or many small
whole tensors in one call (a batch).

`fill` writes `out[k - l_begin]` for the local elements k in [l, lend) of a parameter's region: it walks the
span's runs (Runs in plan.py) with contiguous inner loops and hands each run to its kind's fill (distributions).
Every element depends only on (key, global index), so bytes never depend on threads, scheduling or chunking: the
backend splits large outputs into spans that its threads take from a shared counter (backends/cpu.py).

Each kind has kernels of its own (`KERNELS[kind]`), so a process compiles only the kinds its plans use: the
normal's correctly rounded log and cos, the largest code here, are compiled only by a plan that draws normals,
and a plan of normals and constants never compiles the truncated normal, the uniform family or the payload copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import types
from numba.extending import overload

from paraminit.dtypes import FMT_F8E4M3, FMT_FLOAT16
from paraminit_server.backends.cpu_kernels.counter_rng import GOLDEN, TWO_NEG_32, U2
from paraminit_server.backends.cpu_kernels.distributions import fill_affine, fill_const, fill_flat, fill_normal, fill_truncnorm
from paraminit_server.backends.cpu_kernels.half_rounding import BF16, F8E4M3, F8E5M2, F16
from paraminit_server.backends.cpu_kernels.jit import bits_f64, jit, kernel_of
from paraminit_server.plans.plan import Formula

PIECE = 1 << 16  # outputs up to this many elements are filled on the calling thread; larger ones in spans of PIECEs
# A batch row of `fill` (uint64; p0, p1, lo and hi as their binary64 bits), and the empty batch of a span's call.
BATCH_COLUMNS = ("start", "count", "key", "p0", "p1", "lo", "hi", "seed")
NO_BATCH = np.zeros((0, len(BATCH_COLUMNS)), dtype=np.uint64)


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


# One run of each kind: dst = elements g, g+1, ... of the full tensor; s = key + GOLDEN. All take the same
# arguments, so one driver (below) serves them all.
@jit
def run_const(
    dst: Any, g: int, s: Any, p0: float, p1: float, sc: float, p1b: float, lo: float, hi: float, seed: Any, values: Any, h: Any
) -> None:
    """A constant run."""
    fill_const(dst, p0, h)


@jit
def run_affine(
    dst: Any, g: int, s: Any, p0: float, p1: float, sc: float, p1b: float, lo: float, hi: float, seed: Any, values: Any, h: Any
) -> None:
    """A run of the uniform family."""
    fill_affine(dst, s + np.uint64(g), p0, sc, p1b, h)


@jit
def run_normal(
    dst: Any, g: int, s: Any, p0: float, p1: float, sc: float, p1b: float, lo: float, hi: float, seed: Any, values: Any, h: Any
) -> None:
    """A normal run."""
    fill_normal(dst, s + U2 * np.uint64(g), p0, p1, h)


@jit
def run_flat(
    dst: Any, g: int, s: Any, p0: float, p1: float, sc: float, p1b: float, lo: float, hi: float, seed: Any, values: Any, h: Any
) -> None:
    """A run of payload values."""
    fill_flat(dst, values, g, h)


@jit
def run_truncnorm(
    dst: Any, g: int, s: Any, p0: float, p1: float, sc: float, p1b: float, lo: float, hi: float, seed: Any, values: Any, h: Any
) -> None:
    """A truncated-normal run."""
    fill_truncnorm(dst, s + U2 * np.uint64(g), np.uint64(g), p0, p1, lo, hi, seed, h)


@dataclass(frozen=True)
class Kernels:
    """One value kind's kernel (a numba dispatcher, documented in `_kernels`): `fill` of a span of a region, or of
    a batch of small whole tensors. It compiles on its first call only."""

    kind: int
    fill: Any


def _kernels(kind: int, run: Any) -> Kernels:
    """The driver of one kind around its run function.

    A closure per kind rather than one kernel that switches on the kind at run time: numba compiles a kernel with
    everything it may call, so one kernel for all kinds made every process compile every kind.
    """

    def run_any(
        out: Any,
        dst: Any,
        g: int,
        s: Any,
        p0: float,
        p1: float,
        sc: float,
        p1b: float,
        lo: float,
        hi: float,
        seed: Any,
        values: Any,
        fmt: int,
    ) -> None:
        """`run` with the narrow format's constants fixed at compile time (float arrays ignore them); fmt is the
        dtype's `fmt` (paraminit.dtypes)."""
        raise NotImplementedError("called only inside kernels")

    @overload(run_any)
    def _run_any_overload(
        out: Any, dst: Any, g: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any, lo: Any, hi: Any, seed: Any, values: Any, fmt: Any
    ) -> Any:
        if out.dtype == types.uint8:

            def byte(
                out: Any, dst: Any, g: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any, lo: Any, hi: Any, seed: Any, values: Any, fmt: Any
            ) -> Any:
                if fmt == FMT_F8E4M3:
                    run(dst, g, s, p0, p1, sc, p1b, lo, hi, seed, values, F8E4M3)
                else:
                    run(dst, g, s, p0, p1, sc, p1b, lo, hi, seed, values, F8E5M2)

            return byte
        if out.dtype == types.uint16:

            def half(
                out: Any, dst: Any, g: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any, lo: Any, hi: Any, seed: Any, values: Any, fmt: Any
            ) -> Any:
                if fmt == FMT_FLOAT16:
                    run(dst, g, s, p0, p1, sc, p1b, lo, hi, seed, values, F16)
                else:
                    run(dst, g, s, p0, p1, sc, p1b, lo, hi, seed, values, BF16)

            return half

        def native(
            out: Any, dst: Any, g: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any, lo: Any, hi: Any, seed: Any, values: Any, fmt: Any
        ) -> Any:
            run(dst, g, s, p0, p1, sc, p1b, lo, hi, seed, values, BF16)

        return native

    @kernel_of(kind)
    def fill(
        out: Any,
        l: Any,
        lend: Any,
        l_begin: Any,
        key: Any,
        p0: float,
        p1: float,
        lo: float,
        hi: float,
        seed: Any,
        values: Any,
        fmt: int,
        outer_start: Any,
        outer_ext: Any,
        outer_stride: Any,
        base: Any,
        run_len: Any,
        batch: Any,
    ) -> None:
        """Local elements [l, lend) of a region into out[l - l_begin:lend - l_begin], run by run; or, when `batch`
        has rows, whole tensors instead (the scalar arguments from l to run_len are then ignored).

        The backend calls it from several threads at once on disjoint spans of one output (it releases the GIL);
        a parallel kernel of numba's instead would cost a second, larger compile per kind and a threading layer.

        lo, hi and seed are the truncated normal's bounds and raw seed (ignored by the other kinds).

        batch: uint64 rows (BATCH_COLUMNS) of whole tensors of this kind, for plans of many small tensors: row j
        fills out[start:start + count] as a whole tensor of count elements with its key, p0, p1, lo, hi (binary64
        bits) and seed. One call instead of one per tensor, and one kernel: a second entry point of its own
        compiled everything again (numba compiles a kernel with all it calls).
        """
        pieces = batch.shape[0]
        no_dims = outer_ext[:0]
        for j in range(max(pieces, 1)):
            oe, os_, ost, b, rl = outer_ext, outer_start, outer_stride, base, run_len
            a, e, begin, k, q0, q1, qlo, qhi, sd = l, lend, l_begin, key, p0, p1, lo, hi, seed
            if pieces:
                row = batch[j]
                oe, os_, ost, b, rl = no_dims, no_dims, no_dims, 0, np.int64(row[1])
                a, e, begin = 0, np.int64(row[1]), -np.int64(row[0])
                k, q0, q1, qlo, qhi, sd = row[2], bits_f64(row[3]), bits_f64(row[4]), bits_f64(row[5]), bits_f64(row[6]), row[7]
            # p1 * 2^-32 is exact unless it falls into the subnormal range; then scale the draw instead.
            p1s = q1 * TWO_NEG_32
            sc, p1b = (1.0, p1s) if p1s * 2.0**32 == q1 else (TWO_NEG_32, q1)
            s = k + GOLDEN
            while a < e:
                r = a // rl
                off = a - r * rl
                g = run_global(r, os_, oe, ost, b) + off
                m = min(e - a, rl - off)
                dst = out[a - begin : a - begin + m]
                run_any(out, dst, g, s, q0, q1, sc, p1b, qlo, qhi, sd, values, fmt)
                a += m

    return Kernels(kind, fill)


KERNELS: dict[int, Kernels] = {
    kind: _kernels(kind, run)
    for kind, run in (
        (Formula.CONST, run_const),
        (Formula.AFFINE, run_affine),
        (Formula.NORMAL, run_normal),
        (Formula.FLAT, run_flat),
        (Formula.TRUNCNORM, run_truncnorm),
    )
}
