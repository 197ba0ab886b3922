"""Numba kernels of the CPU backend: one fused, parallel pass per value kind, casts included.

Each kernel fills `out[k]` for the local elements `l_begin + k` of a parameter's
region. Work is split into fixed-size pieces of the local index, each piece
walks its runs (Runs in plan.py) with a contiguous inner loop, and every element
depends only on (key, global index): bytes never depend on threads or chunking.

Compiled lazily on first call (no work at import) and cached on disk.
"""

from __future__ import annotations

import math
from typing import Any

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_TWO_NEG_32 = 2.0**-32
_TWO_PI = 2.0 * math.pi
_U1_FLOOR = 1e-6
PIECE = 1 << 16  # elements per parallel task

_jit = nb.njit(cache=True, inline="always", nogil=True)
_kernel = nb.njit(cache=True, parallel=True, nogil=True)


@_jit  # type: ignore[misc]
def mix(x: Any) -> Any:
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


@_jit  # type: ignore[misc]
def unit(key: Any, i: Any) -> float:
    # u32 -> binary64 through int32 (exact, and vectorizes on AVX2 where u64 -> f64 does not)
    low = np.uint32(mix(key + np.uint64(i)))
    return float(np.int32(low ^ np.uint32(0x80000000))) * _TWO_NEG_32 + 0.5


@_jit  # type: ignore[misc]
def normal_z(key: Any, g: Any) -> float:
    u1 = unit(key, 2 * g)
    u2 = unit(key, 2 * g + 1)
    if u1 <= _U1_FLOOR:
        u1 = _U1_FLOOR
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(_TWO_PI * u2)


@intrinsic  # type: ignore[misc]
def f64_bits(typingctx: Any, x: Any) -> Any:
    """Reinterpret a binary64 as its 64-bit pattern (a plain LLVM bitcast)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(64))

    return types.uint64(types.float64), codegen


@_jit  # type: ignore[misc]
def half_bits(v: float, mant: int, emin: int, inf_bits: int) -> int:
    """Round binary64 to nearest-even in a 16-bit float format, directly from the binary64 bits.

    `mant` fraction bits, smallest normal exponent `emin`; one rounding, carries
    into the exponent field (and to infinity) fall out of the integer addition.
    """
    b = f64_bits(v)
    sign = np.int64((b >> np.uint64(48)) & np.uint64(0x8000))
    big_e = np.int64((b >> np.uint64(52)) & np.uint64(0x7FF))
    frac = np.int64(b & np.uint64(0xFFFFFFFFFFFFF))
    if big_e == 0x7FF:
        return sign | inf_bits | ((1 << (mant - 1)) if frac != 0 else 0)
    e = big_e - 1023
    if e < emin - mant - 1:
        return sign
    sig = frac | (1 << 52)
    shift = 52 - mant
    lead = e - emin  # biased exponent minus one, for normal results
    if e < emin:
        shift += emin - e
        lead = 0
    rounded = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (rounded & 1) == 1):
        rounded += 1
    out = (lead << mant) + rounded
    if out > inf_bits:
        out = inf_bits
    return sign | out


def store(out: Any, k: int, v: float, fmt: int) -> None:
    """Write one value: native float arrays take the binary64 value (one RNE cast), uint16 arrays half bits."""
    raise NotImplementedError("called only inside kernels")


@overload(store, jit_options={"cache": True})  # type: ignore[misc]
def _store_overload(out: Any, k: Any, v: Any, fmt: Any) -> Any:
    if out.dtype == types.uint16:
        def store_half(out: Any, k: Any, v: Any, fmt: Any) -> Any:
            out[k] = half_bits(v, 10, -14, 0x7C00) if fmt == 1 else half_bits(v, 7, -126, 0x7F80)
        return store_half

    def store_native(out: Any, k: Any, v: Any, fmt: Any) -> Any:
        out[k] = v
    return store_native


@_jit  # type: ignore[misc]
def run_global(r: int, outer_start: Any, outer_ext: Any, outer_stride: Any, base: int) -> int:
    g = base
    for d in range(outer_ext.shape[0] - 1, -1, -1):
        ext = outer_ext[d]
        q = r // ext
        g += (r - q * ext + outer_start[d]) * outer_stride[d]
        r = q
    return g


@_kernel  # type: ignore[misc]
def fill(out: Any, l_begin: int, kind: int, key: Any, p0: float, p1: float, values: Any, fmt: int,
         outer_start: Any, outer_ext: Any, outer_stride: Any, base: int, run_len: int) -> None:
    """Fill out[k] with the value of local element l_begin + k of a region (Kind codes as in plan.py)."""
    n = out.shape[0]
    for t in nb.prange((n + PIECE - 1) // PIECE):
        l = l_begin + t * PIECE
        lend = min(l + PIECE, l_begin + n)
        while l < lend:
            r = l // run_len
            off = l - r * run_len
            g = run_global(r, outer_start, outer_ext, outer_stride, base) + off
            m = min(lend - l, run_len - off)
            o = l - l_begin
            if kind == 1:
                for k in range(m):
                    store(out, o + k, p0 + unit(key, g + k) * p1, fmt)
            elif kind == 2:
                for k in range(m):
                    store(out, o + k, p0 + p1 * normal_z(key, g + k), fmt)
            elif kind == 3:
                for k in range(m):
                    store(out, o + k, values[g + k], fmt)
            else:
                for k in range(m):
                    store(out, o + k, p0, fmt)
            l += m
