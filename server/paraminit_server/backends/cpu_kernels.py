"""Numba kernels of the CPU backend: one fused, parallel pass per value kind, casts included.

`fill` writes `out[k]` for the local elements `l_begin + k` of a parameter's
region. Work is split into fixed-size pieces of the local index, which the
threads take from a shared counter; each piece walks its runs (Runs in plan.py)
with contiguous inner loops, and every element depends only on (key, global
index): bytes never depend on threads, scheduling or chunking.

Speed comes from letting LLVM vectorize every inner loop (AVX2 on the target
machines), so the loops are kept free of branches and of anything that
blocks vectorization:
- indices are unsigned, so numba emits no negative-index wraparound per store;
- the first SplitMix64 multiply works on 32-bit halves: inside a segment where
  `x >> 30` is constant, `x ^ (x >> 30)` has a constant high word, so its
  product needs two 32x32 multiplies instead of three (AVX2 has no 64-bit
  multiply);
- the low 32 bits of a draw become a binary64 by the exponent-bias trick
  (OR into 2^52, subtract 2^52), which is exact and needs no packing;
- float16/bfloat16 bits come from a branch-free integer rounding (normal
  range), a floating-point add of a magic constant (subnormal range, where the
  hardware's round-to-nearest-even is the one rounding) and selects.
No fastmath anywhere: every binary64 operation rounds on its own (no FMA
contraction), and `log`/`cos` are the C library's, as Python's math module uses.

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
_MUL1_LO = np.uint64(0x1CE4E5B9)
_MUL1_HI = np.uint64(0xBF58476D)
_MUL2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)
_LOW30 = np.uint64((1 << 30) - 1)
_SPAN30 = np.uint64(1 << 30)
_U1 = np.uint64(1)
_U2 = np.uint64(2)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_EXP52 = np.uint64(0x4330000000000000)  # bits of 2^52: OR a u32 into its mantissa to get 2^52 + u32
_TWO52 = 2.0**52
_TWO_NEG_32 = 2.0**-32
_TWO_PI = 2.0 * math.pi
_U1_FLOOR = 1e-6
_SIGN16 = np.int64(0x8000)
PIECE = 1 << 16  # elements per parallel task; tensors up to this size run on the calling thread
_WORKERS = 256  # at least the number of threads

# Helpers are small and not marked inline: LLVM inlines them after linking, before it vectorizes (numba-level
# inlining only multiplied compile time).
_jit = nb.njit(cache=True, nogil=True)
_parallel = nb.njit(cache=True, parallel=True, nogil=True)


@_jit
def mix(x: Any) -> Any:
    """SplitMix64 finalizer on a uint64 (the plain form, for the rare elements off the fast path)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


def _f64_bits(typingctx: Any, x: Any) -> Any:
    """Reinterpret a binary64 as its bit pattern, as int64 (a plain LLVM bitcast)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


def _bits_f64(typingctx: Any, x: Any) -> Any:
    """Reinterpret a 64-bit pattern as a binary64 (a plain LLVM bitcast)."""
    if x not in (types.int64, types.uint64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(x), codegen


f64_bits: Any = intrinsic(_f64_bits)
bits_f64: Any = intrinsic(_bits_f64)


@_jit
def low_draw(x: Any) -> Any:
    """Low 32 bits of mix(x - GOLDEN) as an exact binary64 integer in [0, 2^32)."""
    return bits_f64((mix(x - _GOLDEN) & _LOW32) | _EXP52) - _TWO52


@_jit
def seg_consts(x0: Any) -> Any:
    """Constants of a segment of words x = key + GOLDEN + i that share `x >> 30` (see draw_seg)."""
    c = x0 >> _S30
    a_hi = (x0 ^ c) >> _S32
    return c & _LOW32, ((a_hi * _MUL1_LO) & _LOW32) << _S32


@_jit
def draw_seg(xl: Any, c: Any, c1: Any) -> Any:
    """low_draw(x) for x = high | xl in a segment with constants seg_consts(x).

    a = x ^ (x >> 30) = x ^ C; its high word is constant, so a * MUL1 needs
    a_lo * MUL1_lo (64-bit) and the low word of a_lo * MUL1_hi only; the
    high-word product is folded into c1.
    """
    a = (xl ^ c) & _LOW32
    z = a * _MUL1_LO + ((a * _MUL1_HI) << _S32) + c1
    z = (z ^ (z >> _S27)) * _MUL2
    return bits_f64(((z ^ (z >> _S31)) & _LOW32) | _EXP52) - _TWO52


@_jit
def seg_room(x0: Any) -> Any:
    """How many words from x0 on stay in x0's 2^30-word segment (where `x >> 30` is constant)."""
    return np.int64(_SPAN30 - (x0 & _LOW30))


def _half_consts(mant: int, emin: int, emax: int) -> tuple[int, int, int, int, float, float, float, int]:
    """Constants of half_bits for a 16-bit format with `mant` fraction bits and exponents [emin, emax]."""
    shift = 52 - mant
    bias = 1 - emin
    adj = ((1 << (shift - 1)) - 1 - ((1023 - bias) << 52)) % (1 << 64)
    inf_bits = (2 * bias + 1) << mant
    ovf = math.ldexp(2.0 - 2.0 ** -(mant + 1), emax)  # max finite + half an ulp: the first value that rounds to inf
    magic = math.ldexp(1.0, emin - mant + 52)
    magic_bits = (1023 + emin - mant + 52) << 52
    return shift, adj, inf_bits, inf_bits | (1 << (mant - 1)), math.ldexp(1.0, emin), ovf, magic, magic_bits


_F16 = _half_consts(10, -14, 15)
_BF16 = _half_consts(7, -126, 127)


@_jit
def half_bits(v: float, h: Any) -> Any:
    """Round binary64 once, to nearest even, into float16/bfloat16 bits (h: _F16 or _BF16); branch-free.

    Normal range: round at bit `shift` of the binary64 bits with the exponent
    rebiased in the same addition; carries run into the exponent, and |v| is
    first clamped to the smallest value that rounds to infinity. Subnormal
    range: |v| + magic has the target's subnormal spacing as its ulp, so the
    hardware's one rounding is the spec's. NaN keeps its sign and becomes the
    quiet NaN.
    """
    shift, adj, _, nan_bits, min_normal, ovf, magic, magic_bits = h
    av = abs(v)
    a = np.uint64(f64_bits(min(av, ovf)))
    rn = np.int64((a + np.uint64(adj) + ((a >> np.uint64(shift)) & _U1)) >> np.uint64(shift))
    rs = f64_bits(av + magic) - np.int64(magic_bits)
    r = rn
    if av < min_normal:
        r = rs
    if av != av:
        r = np.int64(nan_bits)
    return np.uint16(r | ((f64_bits(v) >> 48) & _SIGN16))


def store(out: Any, k: Any, v: float, h: Any) -> None:
    """Write one binary64 value: one RNE cast into float arrays, half bits (half_bits) into uint16 arrays."""
    raise NotImplementedError("called only inside kernels")


@overload(store)
def _store_overload(out: Any, k: Any, v: Any, h: Any) -> Any:
    if out.dtype == types.uint16:
        def store_half(out: Any, k: Any, v: Any, h: Any) -> Any:
            out[k] = half_bits(v, h)
        return store_half

    def store_native(out: Any, k: Any, v: Any, h: Any) -> Any:
        out[k] = v
    return store_native


@_jit
def fill_affine(dst: Any, x0: Any, p0: float, sc: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + unit(g + k) * p1 with x0 = key + GOLDEN + g; `sc * p1` is p1 * 2^-32 split exactly."""
    m = dst.shape[0]
    k = 0
    while k < m:
        x = x0 + np.uint64(k)
        cnt = min(m - k, seg_room(x))
        c, c1 = seg_consts(x)
        xl = x & _LOW32
        sub = dst[k:k + cnt]
        if sc == 1.0:
            for j in range(cnt):
                store(sub, np.uint64(j), p0 + draw_seg(xl + np.uint64(j), c, c1) * p1, h)
        else:
            for j in range(cnt):
                store(sub, np.uint64(j), p0 + (draw_seg(xl + np.uint64(j), c, c1) * sc) * p1, h)
        k += cnt


@_jit
def normal_z(d1: float, d2: float) -> float:
    """Box-Muller cosine branch from two draws given as integers d = unit * 2^32 (scaling exact)."""
    u1 = d1 * _TWO_NEG_32
    u2 = d2 * _TWO_NEG_32
    if u1 <= _U1_FLOOR:
        u1 = _U1_FLOOR
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(_TWO_PI * u2)


@_jit
def fill_normal(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + p1 * z(g + k) with x0 = key + GOLDEN + 2g (draws 2(g+k) and 2(g+k)+1)."""
    m = dst.shape[0]
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), p0 + p1 * normal_z(low_draw(x), low_draw(x + _U1)), h)
            k += 1
            continue
        c, c1 = seg_consts(x)
        xl = x & _LOW32
        sub = dst[k:k + cnt]
        for j in range(cnt):
            w = xl + _U2 * np.uint64(j)
            store(sub, np.uint64(j), p0 + p1 * normal_z(draw_seg(w, c, c1), draw_seg(w + _U1, c, c1)), h)
        k += cnt


@_jit
def fill_flat(dst: Any, values: Any, g: int, h: Any) -> None:
    """dst[k] = values[g + k], cast."""
    src = values[g:g + dst.shape[0]]
    for j in range(dst.shape[0]):
        store(dst, np.uint64(j), src[np.uint64(j)], h)


@_jit
def fill_const(dst: Any, c: float, h: Any) -> None:
    """The cast of c is loop-invariant: LLVM hoists it and the loop becomes a plain fill."""
    for j in range(dst.shape[0]):
        store(dst, np.uint64(j), c, h)


@_jit
def run_global(r: int, outer_start: Any, outer_ext: Any, outer_stride: Any, base: int) -> int:
    """Global flat index of the first element of run r (Runs in plan.py)."""
    g = base
    for d in range(outer_ext.shape[0] - 1, -1, -1):
        ext = outer_ext[d]
        q = r // ext
        g += (r - q * ext + outer_start[d]) * outer_stride[d]
        r = q
    return g


@_jit
def fill_run(dst: Any, g: int, kind: int, s: Any, p0: float, p1: float, sc: float, p1b: float,
             values: Any, h: Any) -> None:
    """dst = elements g, g+1, ... of the full tensor (Kind codes as in plan.py); s = key + GOLDEN."""
    if kind == 1:
        fill_affine(dst, s + np.uint64(g), p0, sc, p1b, h)
    elif kind == 2:
        fill_normal(dst, s + _U2 * np.uint64(g), p0, p1, h)
    elif kind == 3:
        fill_flat(dst, values, g, h)
    else:
        fill_const(dst, p0, h)


def run_any(out: Any, dst: Any, g: int, kind: int, s: Any, p0: float, p1: float, sc: float, p1b: float,
            values: Any, fmt: int) -> None:
    """fill_run with the half format's constants fixed at compile time (float arrays ignore them)."""
    raise NotImplementedError("called only inside kernels")


@overload(run_any)
def _run_any_overload(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
                      values: Any, fmt: Any) -> Any:
    if out.dtype == types.uint16:
        def half(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
                 values: Any, fmt: Any) -> Any:
            if fmt == 1:
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, values, _F16)
            else:
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, values, _BF16)
        return half

    def native(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
               values: Any, fmt: Any) -> Any:
        fill_run(dst, g, kind, s, p0, p1, sc, p1b, values, _BF16)
    return native


@_jit
def fill_piece(out: Any, l: int, lend: int, l_begin: int, kind: int, key: Any, p0: float, p1: float, sc: float,
               p1b: float, values: Any, fmt: int, outer_start: Any, outer_ext: Any, outer_stride: Any,
               base: int, run_len: int) -> None:
    """Local elements [l, lend) of the region, run by run (compiled once, called by both entry points)."""
    s = key + _GOLDEN
    while l < lend:
        r = l // run_len
        off = l - r * run_len
        g = run_global(r, outer_start, outer_ext, outer_stride, base) + off
        m = min(lend - l, run_len - off)
        dst = out[l - l_begin:l - l_begin + m]
        run_any(out, dst, g, kind, s, p0, p1, sc, p1b, values, fmt)
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


@_parallel
def fill_parallel(out: Any, l_begin: int, kind: int, key: Any, p0: float, p1: float, sc: float, p1b: float,
                  values: Any, fmt: int, outer_start: Any, outer_ext: Any, outer_stride: Any, base: int,
                  run_len: int) -> None:
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
            fill_piece(out, l, min(l + PIECE, l_begin + n), l_begin, kind, key, p0, p1, sc, p1b, values, fmt,
                       outer_start, outer_ext, outer_stride, base, run_len)
            t = fetch_add(counter, 1)


@_jit
def fill(out: Any, l_begin: int, kind: int, key: Any, p0: float, p1: float, values: Any, fmt: int,
         outer_start: Any, outer_ext: Any, outer_stride: Any, base: int, run_len: int) -> None:
    """Fill out[k] with the value of local element l_begin + k of a region (Kind codes as in plan.py).

    Small outputs stay on the calling thread: waking the pool costs more than they do.
    """
    n = out.shape[0]
    if n == 0:
        return
    # p1 * 2^-32 is exact unless it falls into the subnormal range; then scale the draw instead.
    p1s = p1 * _TWO_NEG_32
    sc, p1b = (1.0, p1s) if p1s * 2.0**32 == p1 else (_TWO_NEG_32, p1)
    if n <= PIECE:
        fill_piece(out, l_begin, l_begin + n, l_begin, kind, key, p0, p1, sc, p1b, values, fmt,
                   outer_start, outer_ext, outer_stride, base, run_len)
    else:
        fill_parallel(out, l_begin, kind, key, p0, p1, sc, p1b, values, fmt,
                      outer_start, outer_ext, outer_stride, base, run_len)

