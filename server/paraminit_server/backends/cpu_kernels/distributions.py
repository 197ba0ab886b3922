"""The value kinds' fills over one run of consecutive global elements: affine (uniform family), normal, truncated
normal, flat payload, constant. One fused, vectorized pass per kind, casts included.

Speed comes from letting LLVM vectorize every inner loop (AVX2 or AVX-512 on the host), so the loops are kept free
of branches and of anything that blocks vectorization; rare elements are redone block by block after a vector pass.
Indices are unsigned, so numba emits no negative-index wraparound per store. normal: float64 outputs take the
double-double evaluation of cr_math; float32 outputs a cheaper binary64 evaluation whose error interval is
carried through the spec's monotone operations, and only elements whose interval straddles a rounding boundary of
the output format (about one in a million) are redone exactly. 16-bit and 8-bit outputs first take a binary32
evaluation (f32_math: twice the vector width) with proven bounds; the elements it leaves undecided (0.2% for
float16, fewer for the narrower formats) take the binary64 one, and the exact path where that cannot decide.
The truncated normal's candidate 0 goes the same way.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import types
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import overload

from paraminit_server.backends.cpu_kernels.counter_rng import (
    GOLDEN,
    LOW32,
    U1,
    U2,
    draw_bits,
    draw_seg,
    low_draw,
    mix,
    seg_consts,
    seg_room,
)
from paraminit_server.backends.cpu_kernels.cr_math import (
    cos_dd,
    cos_input,
    cos_plain,
    cr_cos,
    cr_log,
    log_dd,
    log_input,
    log_plain,
    sqrt,
)
from paraminit_server.backends.cpu_kernels.cr_tables import Z_PLAIN_STEPS
from paraminit_server.backends.cpu_kernels.f32_math import ceil32, normal32, normal32_params, word32, word32_consts
from paraminit_server.backends.cpu_kernels.half_rounding import (
    BF16,
    F8E4M3,
    F8E5M2,
    F16,
    F32_MIN_NORMAL,
    sticky32,
    store,
    store_fast,
)
from paraminit_server.backends.cpu_kernels.jit import AVX512BF16, bits_f64, f64_bits, inline, jit, wide_vectors

_ABLOCK = 2048  # elements per fast pass of fill_affine; a block with a rare element is stored again exactly
trailing_zeros: Any = _trailing_zeros  # llvm.cttz: the index of the lowest set bit
_U64_0 = np.uint64(0)
_U64_1 = np.uint64(1)
_MAG16 = np.int64(0x7FFF)
_TWO8 = np.uint8(2)


@inline
def affine_body(dst: Any, x0: Any, p0: float, sc: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + unit(g + k) * p1 with x0 = key + GOLDEN + g; `sc * p1` is p1 * 2^-32 split exactly.

    Inlined by numba into fill_affine_f16 / fill_affine_bf16 with h a global constant, so the format's
    branches fold at compile time (passed as an argument, h is a runtime tuple and the vector loop carries
    both formats' code and a test per iteration).
    """
    m = dst.shape[0]
    # No NaN, and no nonzero |value| below 2^-126 (where bfloat16 rounds on another path), can occur when p0 and
    # p1 are finite and |p0| >= 2^-73 (values near -p0 are then multiples of 2^-126) or p0 = 0 and
    # |p1| >= 2^-90: then store_fast never flags, and its flag is not even computed (the loop drops it).
    plain = (sc == 1.0) & math.isfinite(p0) & math.isfinite(p1) & ((abs(p0) >= 2.0**-73) | ((p0 == 0.0) & (abs(p1) >= 2.0**-122)))
    k = 0
    while k < m:
        x = x0 + np.uint64(k)
        cnt = min(m - k, seg_room(x))
        c, c1, hi = seg_consts(x)
        if plain:
            xl = x & LOW32
            sub = dst[k : k + cnt]
            for j in range(cnt):
                store_fast(sub, np.uint64(j), p0 + draw_seg(xl + np.uint64(j), c, c1, hi) * p1, h)
            k += cnt
            continue
        for b0 in range(0, cnt, _ABLOCK):
            nb_ = min(cnt - b0, _ABLOCK)
            xl = (x & LOW32) + np.uint64(b0)
            sub = dst[k + b0 : k + b0 + nb_]
            rare = 0
            if sc == 1.0:
                for j in range(nb_):
                    rare += store_fast(sub, np.uint64(j), p0 + draw_seg(xl + np.uint64(j), c, c1, hi) * p1, h)
            else:
                for j in range(nb_):
                    rare += store_fast(sub, np.uint64(j), p0 + (draw_seg(xl + np.uint64(j), c, c1, hi) * sc) * p1, h)
            if rare and sc == 1.0:
                for j in range(nb_):
                    store(sub, np.uint64(j), p0 + draw_seg(xl + np.uint64(j), c, c1, hi) * p1, h)
            elif rare:
                for j in range(nb_):
                    store(sub, np.uint64(j), p0 + (draw_seg(xl + np.uint64(j), c, c1, hi) * sc) * p1, h)
        k += cnt


@jit
def fill_affine_f16(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for float16 outputs."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, F16)


@jit
def fill_affine_bf16(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for bfloat16 outputs (and float outputs, which ignore the format)."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, BF16)


@jit
def fill_affine_f8e4m3(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for float8_e4m3fn outputs."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, F8E4M3)


@jit
def fill_affine_f8e5m2(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for float8_e5m2 outputs."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, F8E5M2)


def fill_affine(dst: Any, x0: Any, p0: float, sc: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + unit(g + k) * p1 (affine_body), the format's kernel chosen by the output's dtype when the
    kernel compiles, and between the two formats of one width once per call (by the rounding position h[0]).

    Chosen at compile time because numba compiles every branch: a runtime choice among all four made each
    dtype's kernel compile four copies of the affine loop (a float output ignores the format)."""
    raise NotImplementedError("called only inside kernels")


def _either(rounding: int, first: Any, second: Any) -> Any:
    """An affine fill that calls `first` for the format whose rounding position h[0] is `rounding`, else `second`."""

    def pick(dst: Any, x0: Any, p0: Any, sc: Any, p1: Any, h: Any) -> None:
        if h[0] == rounding:
            first(dst, x0, p0, sc, p1)
        else:
            second(dst, x0, p0, sc, p1)

    return pick


def _by_format(out: Any, choose: Any, f16: Any, bf16: Any, f8e4m3: Any, f8e5m2: Any) -> Any:
    """The implementation of a per-format kernel family for an output array's type: `choose(rounding, first,
    second)` between the two formats of its width (uint16, uint8); float outputs ignore the format: one kernel."""
    if out.dtype == types.uint16:
        return choose(F16[0], f16, bf16)
    if out.dtype == types.uint8:
        return choose(F8E4M3[0], f8e4m3, f8e5m2)
    return choose(BF16[0], bf16, bf16)


@overload(fill_affine, inline="always")
def _fill_affine_overload(dst: Any, x0: Any, p0: Any, sc: Any, p1: Any, h: Any) -> Any:
    return _by_format(dst, _either, fill_affine_f16, fill_affine_bf16, fill_affine_f8e4m3, fill_affine_f8e5m2)


@jit
def normal_exact(d1: float, d2: float, p0: float, p1: float) -> Any:
    """mean + std * z of the spec, from two draws (the exact path, scalar)."""
    return p0 + p1 * (math.sqrt(-2.0 * cr_log(d1)) * cr_cos(d2))


_Z_ULPS = np.int64(Z_PLAIN_STEPS)


@inline
def normal_bounds(d1: float, d2: float, p0: float, p1: float) -> Any:
    """An interval [va, vb] that holds mean + std * z of the spec, from the plain log and cos.

    The correctly rounded log and cos lie within a few ulps of the plain values, so the spec's z lies within
    _Z_ULPS steps of the plain z, and `mean + std * z` is monotone in z: its values at the ends bound it.
    """
    z = sqrt(-2.0 * log_plain(log_input(d1))) * cos_plain(cos_input(d2))
    zb = f64_bits(z)
    z0 = bits_f64(zb - _Z_ULPS)
    z1 = bits_f64(zb + _Z_ULPS)
    va = p0 + p1 * z0
    vb = p0 + p1 * z1
    return min(va, vb), max(va, vb)


def normal_fast(out: Any, d1: float, d2: float, p0: float, p1: float, h: Any) -> Any:
    """(value to store, undecided) for one normal element in out's dtype; vectorizable, branch-free."""
    raise NotImplementedError("called only inside kernels")


@overload(normal_fast, inline="always")
def _normal_fast_overload(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, h: Any) -> Any:
    if out.dtype == types.float64:

        def f64(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, h: Any) -> Any:
            lh, _, lok = log_dd(log_input(d1))
            ch, _, cok = cos_dd(cos_input(d2))
            return p0 + p1 * (sqrt(-2.0 * lh) * ch), np.int64(~(lok & cok)) & 1

        return f64
    if out.dtype == types.float32:

        def f32(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, h: Any) -> Any:
            va, vb = normal_bounds(d1, d2, p0, p1)
            return va, np.int64(np.float32(va) != np.float32(vb))

        return f32

    def half(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, h: Any) -> Any:
        # half_bits(v) is a function of sticky32(v): equal sticky values give equal bits (below 2^-126, where
        # bfloat16 takes another path, the element is simply redone)
        va, vb = normal_bounds(d1, d2, p0, p1)
        return va, np.int64((sticky32(va) != sticky32(vb)) | (abs(va) < F32_MIN_NORMAL))

    return half


_NBLOCK = 512  # elements per fast pass; a block with an undecided element is redone element by element


@jit
def draws_into(k1: Any, k2: Any, xl: Any, c: Any, c1: Any, hi: Any) -> None:
    """The two draws of each element of a block (words xl + 2j and xl + 2j + 1 of a segment) as uint32: the 64-bit
    pass of the narrow outputs' normal, apart from the binary32 pass, so that each loop vectorizes at its own width."""
    wide_vectors()
    for j in range(k1.shape[0]):
        w = xl + U2 * np.uint64(j)
        k1[j] = np.uint32(draw_bits(w, c, c1, hi))
        k2[j] = np.uint32(draw_bits(w + U1, c, c1, hi))


@inline
def normal32_body(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, flags: Any, w: Any) -> None:
    """Normal elements of a block of a narrow output from their draws, in binary32 (f32_math.normal32): the word
    where both ends of the interval round to it, and a flag (1) where they do not.
    w: the format's word32_consts, a constant once inlined into its kernel (normal32_f16, ...)."""
    flush = w[0] == 16 and AVX512BF16  # the conversion instruction makes binary32 subnormals zero: zero is undecided
    for j in range(out.shape[0]):
        lo, hi, u = normal32(k1[j], k2[j], big0, big1, e0)
        wl = word32(lo, w)
        out[j] = wl
        flags[j] = (wl != word32(hi, w)) | u | (flush & ((wl & _MAG16) == 0))


def _normal32_for(h: Any, fmt: str) -> Any:
    """normal32_body for one narrow format as a kernel of its own (named per format, as _first_for)."""
    w = word32_consts(h)

    def normal32_fmt(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, flags: Any) -> None:
        wide_vectors()
        normal32_body(out, k1, k2, big0, big1, e0, flags, w)

    normal32_fmt.__qualname__ = normal32_fmt.__name__ = f"normal32_{fmt}"
    return jit(normal32_fmt)


normal32_f16 = _normal32_for(F16, "f16")
normal32_bf16 = _normal32_for(BF16, "bf16")
normal32_f8e4m3 = _normal32_for(F8E4M3, "f8e4m3")
normal32_f8e5m2 = _normal32_for(F8E5M2, "f8e5m2")


def _pass_of(rounding: int, first: Any, second: Any) -> Any:
    """A normal32 pass that calls `first` for the format whose rounding position h[0] is `rounding`, else `second`."""

    def pick(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, flags: Any, h: Any) -> None:
        if h[0] == rounding:
            first(out, k1, k2, big0, big1, e0, flags)
        else:
            second(out, k1, k2, big0, big1, e0, flags)

    return pick


def normal32_pass(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, flags: Any, h: Any) -> None:
    """normal32_body in the kernel of out's format (chosen as trunc_first chooses)."""
    raise NotImplementedError("called only inside kernels")


@overload(normal32_pass, inline="always")
def _normal32_pass_overload(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, flags: Any, h: Any) -> Any:
    return _by_format(out, _pass_of, normal32_f16, normal32_bf16, normal32_f8e4m3, normal32_f8e5m2)


_PENDING = 256  # undecided elements of the binary32 pass gathered for one vector pass on the binary64 path


@jit
def normal_plain_pass(out: Any, d1s: Any, d2s: Any, n: int, p0: float, p1: float, vals: Any, undecided: Any, h: Any) -> None:
    """normal_fast of n elements from their draws (binary64), in one vector pass: vals[:n], undecided[:n]."""
    wide_vectors()
    for t in range(n):
        vals[t], undecided[t] = normal_fast(out, d1s[t], d2s[t], p0, p1, h)


@jit
def settle(dst: Any, at: Any, d1s: Any, d2s: Any, n: int, p0: float, p1: float, vals: Any, undecided: Any, h: Any) -> None:
    """Elements at[:n] of dst from their draws: the binary64 path (normal_plain_pass), exact where it cannot decide."""
    normal_plain_pass(dst, d1s, d2s, n, p0, p1, vals, undecided, h)
    for t in range(n):
        v = normal_exact(d1s[t], d2s[t], p0, p1) if undecided[t] else vals[t]
        store(dst, at[t], v, h)


@jit
def fill_normal32(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> None:
    """fill_normal for a narrow output (float16, bfloat16, 8-bit floats) whose mean and std suit normal32.

    Per block: the draws (draws_into) and the binary32 pass (normal32_pass). The elements it leaves undecided (about
    0.3% for float16, 0.05% for bfloat16, fewer for 8-bit floats) are gathered across blocks and settled _PENDING at
    a time by `settle`, so the binary64 path runs vectorized there too."""
    m = dst.shape[0]
    _, big0, big1, e0 = normal32_params(p0, p1)
    k1 = np.empty(_NBLOCK, dtype=np.uint32)
    k2 = np.empty(_NBLOCK, dtype=np.uint32)
    flags = np.zeros(_NBLOCK, dtype=np.uint8)
    words = flags.view(np.uint64)  # eight flags at a time: most are zero
    at = np.empty(_PENDING, dtype=np.uint64)
    d1s = np.empty(_PENDING, dtype=np.float64)
    d2s = np.empty(_PENDING, dtype=np.float64)
    vals = np.empty(_PENDING, dtype=np.float64)
    undecided = np.empty(_PENDING, dtype=np.int64)
    n = 0
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), normal_exact(low_draw(x), low_draw(x + U1), p0, p1), h)
            k += 1
            continue
        c, c1, hi = seg_consts(x)
        for b0 in range(0, cnt, _NBLOCK):
            nb_ = min(cnt - b0, _NBLOCK)
            sub = dst[k + b0 : k + b0 + nb_]
            if nb_ < _NBLOCK:
                flags[:] = 0  # a short block writes flags[:nb_] only
            draws_into(k1[:nb_], k2[:nb_], (x & LOW32) + U2 * np.uint64(b0), c, c1, hi)
            normal32_pass(sub, k1, k2, big0, big1, e0, flags, h)
            for half in range(_NBLOCK // 512):  # bit q of `mask`: word q of this 512-element half holds a flag
                mask = _U64_0
                for q in range(64):
                    mask |= np.uint64(words[64 * half + q] != 0) << np.uint64(q)
                while mask:
                    q = 64 * half + trailing_zeros(mask)
                    mask &= mask - _U64_1
                    fw = words[q]
                    while fw:
                        j = 8 * q + (trailing_zeros(fw) >> 3)
                        fw &= fw - _U64_1
                        at[n] = k + b0 + j
                        d1s[n] = np.float64(k1[j])
                        d2s[n] = np.float64(k2[j])
                        n += 1
                        if n == _PENDING:
                            settle(dst, at, d1s, d2s, n, p0, p1, vals, undecided, h)
                            n = 0
        k += cnt
    settle(dst, at, d1s, d2s, n, p0, p1, vals, undecided, h)


def narrow_normal(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> Any:
    """fill_normal32 where dst is a narrow output and (p0, p1) suit normal32, returning whether it did (float
    outputs: always False, decided when the caller compiles)."""
    raise NotImplementedError("called only inside kernels")


@overload(narrow_normal, inline="always")
def _narrow_normal_overload(dst: Any, x0: Any, p0: Any, p1: Any, h: Any) -> Any:
    if dst.dtype not in (types.uint16, types.uint8):

        def never(dst: Any, x0: Any, p0: Any, p1: Any, h: Any) -> Any:
            return False

        return never

    def narrow(dst: Any, x0: Any, p0: Any, p1: Any, h: Any) -> Any:
        if not normal32_params(p0, p1)[0]:
            return False
        fill_normal32(dst, x0, p0, p1, h)
        return True

    return narrow


@jit
def fill_normal(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + p1 * z(g + k) with x0 = key + GOLDEN + 2g (draws 2(g+k) and 2(g+k)+1)."""
    wide_vectors()
    if narrow_normal(dst, x0, p0, p1, h):
        return
    m = dst.shape[0]
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), normal_exact(low_draw(x), low_draw(x + U1), p0, p1), h)
            k += 1
            continue
        c, c1, hi = seg_consts(x)
        for b0 in range(0, cnt, _NBLOCK):
            nb_ = min(cnt - b0, _NBLOCK)
            xl = (x & LOW32) + U2 * np.uint64(b0)
            sub = dst[k + b0 : k + b0 + nb_]
            bad = 0
            for j in range(nb_):
                w = xl + U2 * np.uint64(j)
                v, u = normal_fast(sub, draw_seg(w, c, c1, hi), draw_seg(w + U1, c, c1, hi), p0, p1, h)
                bad += u | store_fast(sub, np.uint64(j), v, h)
            if bad:  # redo the block: undecided elements on the exact path, the rest through the full store
                for j in range(nb_):
                    w = xl + U2 * np.uint64(j)
                    d1 = draw_seg(w, c, c1, hi)
                    d2 = draw_seg(w + U1, c, c1, hi)
                    v, u = normal_fast(sub, d1, d2, p0, p1, h)
                    store(sub, np.uint64(j), normal_exact(d1, d2, p0, p1) if u else v, h)
        k += cnt


def trunc_try(out: Any, d1: float, d2: float, p0: float, p1: float, lo: float, hi: float, h: Any) -> Any:
    """(value, state) for one candidate of a truncated-normal element from its draws, on the fast path: state 0
    accepts the value (inside [lo, hi], its rounding into `out`'s format decided), 1 rejects the candidate (its
    exact value is certainly outside), 2 leaves it undecided (the exact path settles it). Vectorizable, branch-free.
    """
    raise NotImplementedError("called only inside kernels")


_TWO = np.int64(2)


@overload(trunc_try, inline="always")
def _trunc_try_overload(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
    if out.dtype == types.float64:

        def f64(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
            lh, _, lok = log_dd(log_input(d1))
            ch, _, cok = cos_dd(cos_input(d2))
            v = p0 + p1 * (sqrt(-2.0 * lh) * ch)  # the exact value when both are decided
            return v, _TWO - np.int64(lok & cok) * (np.int64(1) + np.int64((lo <= v) & (v <= hi)))

        return f64
    if out.dtype == types.float32:

        def f32(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
            va, vb = normal_bounds(d1, d2, p0, p1)  # the exact value lies in [va, vb]
            accept = (lo <= va) & (vb <= hi) & (np.float32(va) == np.float32(vb))
            return va, _TWO - _TWO * np.int64(accept) - np.int64((vb < lo) | (hi < va))

        return f32

    def half(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
        va, vb = normal_bounds(d1, d2, p0, p1)
        accept = (lo <= va) & (vb <= hi) & (sticky32(va) == sticky32(vb)) & (abs(va) >= F32_MIN_NORMAL)
        return va, _TWO - _TWO * np.int64(accept) - np.int64((vb < lo) | (hi < va))

    return half


_CANDIDATES = 64  # sampler.TRUNC_CANDIDATES


@jit
def trunc_settle(out: Any, g: Any, p0: float, p1: float, lo: float, hi: float, keys: Any, first: int, h: Any) -> Any:
    """Section 2.2 for global element g (scalar): the first candidate whose exact value lies in [lo, hi], each
    candidate settled on the fast path where it can be and on the exact path where it cannot (keys[j]: candidate
    j's key, mix(seed + j * GOLDEN)); past the last candidate, whose exact value the clamp needs, the clamp.
    Candidates before `first` are known to be rejected."""
    last = keys.shape[0] - 1
    for j in range(first, last):
        x = keys[j] + GOLDEN + U2 * g
        d1, d2 = low_draw(x), low_draw(x + U1)
        v, state = trunc_try(out, d1, d2, p0, p1, lo, hi, h)
        if state == 0:
            return v
        if state == 2:
            v = normal_exact(d1, d2, p0, p1)
            if lo <= v and v <= hi:
                return v
    x = keys[last] + GOLDEN + U2 * g
    v = normal_exact(low_draw(x), low_draw(x + U1), p0, p1)
    c = lo if lo > v else v  # Python's min(max(v, lo), hi), as the spec writes it
    return hi if hi < c else c


@inline
def trunc_first_body(out: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: float, p1: float, lo: float, hi: float, flags: Any, h: Any) -> Any:
    """Candidate 0 of a block of `out` in one vector pass, stored where it is accepted, and a flag per element (1:
    rejected; 2 or 3: undecided, or a value only store() writes); returns how many are flagged.

    Inlined by numba into one kernel per narrow format (trunc_first_f16, ...) with h a global constant, so the
    format's branches fold when it compiles: passed at run time, h left both 16-bit formats' stores and a test of
    h[0] in the vector loop (uint16 outputs ran about 8% slower)."""
    bad = 0
    for j in range(out.shape[0]):
        w = xl + U2 * np.uint64(j)
        v, state = trunc_try(out, draw_seg(w, c, c1, hi32), draw_seg(w + U1, c, c1, hi32), p0, p1, lo, hi, h)
        rare = store_fast(out, np.uint64(j), v, h)  # a value store() must write (an accepted one never is)
        flags[j] = state | (rare << 1)
        bad += state | rare
    return bad


def _first_for(h: Any, fmt: str) -> Any:
    """trunc_first_body for one narrow format (h: its constants), as a kernel of its own, so that the body's helpers
    stay inlined and its loop vectorized whatever else fill_truncnorm holds. Named per format: numba keys a closure's
    cache on its name (jit.KernelCache)."""

    def first(out: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: float, p1: float, lo: float, hi: float, flags: Any) -> Any:
        wide_vectors()
        return trunc_first_body(out, xl, c, c1, hi32, p0, p1, lo, hi, flags, h)

    first.__qualname__ = first.__name__ = f"trunc_first_{fmt}"
    return jit(first)


trunc_first_f16 = _first_for(F16, "f16")
trunc_first_bf16 = _first_for(BF16, "bf16")  # also float outputs, which ignore the format
trunc_first_f8e4m3 = _first_for(F8E4M3, "f8e4m3")
trunc_first_f8e5m2 = _first_for(F8E5M2, "f8e5m2")


def trunc_first(out: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: float, p1: float, lo: float, hi: float, flags: Any, h: Any) -> Any:
    """trunc_first_body in the kernel of out's format: chosen by the output's dtype when the caller compiles, and
    between the two formats of one width once per call (by the rounding position h[0]), as fill_affine chooses."""
    raise NotImplementedError("called only inside kernels")


def _first_of(rounding: int, first: Any, second: Any) -> Any:
    """A trunc_first that calls `first` for the format whose rounding position h[0] is `rounding`, else `second`."""

    def pick(out: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: Any, p1: Any, lo: Any, hi: Any, flags: Any, h: Any) -> Any:
        if h[0] == rounding:
            return first(out, xl, c, c1, hi32, p0, p1, lo, hi, flags)
        return second(out, xl, c, c1, hi32, p0, p1, lo, hi, flags)

    return pick


@overload(trunc_first, inline="always")
def _trunc_first_overload(out: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: Any, p1: Any, lo: Any, hi: Any, flags: Any, h: Any) -> Any:
    return _by_format(out, _first_of, trunc_first_f16, trunc_first_bf16, trunc_first_f8e4m3, trunc_first_f8e5m2)


@inline
def trunc32_body(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, lo_up: Any, hi_down: Any, flags: Any, w: Any) -> None:
    """Candidate 0 of a block of a narrow output in binary32 (f32_math.normal32), as trunc_first_body does it in
    binary64: flags[j] 0 where the word is stored (the interval inside [lo, hi], both ends the same word), 1 where the
    candidate is certainly outside, 2 where neither is certain. lo_up, hi_down: lo and hi rounded to binary32
    inwards (ceil32), so comparisons of binary32 values with them are comparisons with lo and hi."""
    flush = w[0] == 16 and AVX512BF16  # as in normal32_body
    for j in range(out.shape[0]):
        a, b, u = normal32(k1[j], k2[j], big0, big1, e0)
        wl = word32(a, w)
        out[j] = wl
        exact = (not flush) | ((wl & _MAG16) != 0)  # a zero word of the flushing conversion may be wrong
        accept = (lo_up <= a) & (b <= hi_down) & (wl == word32(b, w)) & exact
        reject = (b < lo_up) | (hi_down < a)
        flags[j] = _TWO8 if u else _TWO8 - _TWO8 * np.uint8(accept) - np.uint8(reject)


def _trunc32_for(h: Any, fmt: str) -> Any:
    """trunc32_body for one narrow format as a kernel of its own (named per format, as _first_for)."""
    w = word32_consts(h)

    def trunc32_fmt(out: Any, k1: Any, k2: Any, big0: Any, big1: Any, e0: Any, lo_up: Any, hi_down: Any, flags: Any) -> None:
        wide_vectors()
        trunc32_body(out, k1, k2, big0, big1, e0, lo_up, hi_down, flags, w)

    trunc32_fmt.__qualname__ = trunc32_fmt.__name__ = f"trunc32_{fmt}"
    return jit(trunc32_fmt)


trunc32_f16 = _trunc32_for(F16, "f16")
trunc32_bf16 = _trunc32_for(BF16, "bf16")
trunc32_f8e4m3 = _trunc32_for(F8E4M3, "f8e4m3")
trunc32_f8e5m2 = _trunc32_for(F8E5M2, "f8e5m2")


def _trunc32_of(rounding: int, first: Any, second: Any) -> Any:
    """A trunc32 pass that calls `first` for the format whose rounding position h[0] is `rounding`, else `second`."""

    def pick(out: Any, k1: Any, k2: Any, f32: Any, flags: Any, h: Any) -> None:
        _, big0, big1, e0, lo_up, hi_down = f32
        if h[0] == rounding:
            first(out, k1, k2, big0, big1, e0, lo_up, hi_down, flags)
        else:
            second(out, k1, k2, big0, big1, e0, lo_up, hi_down, flags)

    return pick


def trunc32_pass(out: Any, k1: Any, k2: Any, f32: Any, flags: Any, h: Any) -> None:
    """trunc32_body in the kernel of out's format (chosen as trunc_first chooses); f32: trunc_params."""
    raise NotImplementedError("called only inside kernels")


@overload(trunc32_pass, inline="always")
def _trunc32_pass_overload(out: Any, k1: Any, k2: Any, f32: Any, flags: Any, h: Any) -> Any:
    return _by_format(out, _trunc32_of, trunc32_f16, trunc32_bf16, trunc32_f8e4m3, trunc32_f8e5m2)


@jit
def trunc_params(p0: float, p1: float, lo: float, hi: float) -> Any:
    """(whether the binary32 pass holds, P0, P1, V32_P |P0|, ceil32(lo), floor32(hi)): once per run."""
    ok, big0, big1, e0 = normal32_params(p0, p1)
    return ok, big0, big1, e0, ceil32(lo), -ceil32(-hi)


def trunc_block(
    out: Any,
    k1: Any,
    k2: Any,
    xl: Any,
    c: Any,
    c1: Any,
    hi32: Any,
    p0: float,
    p1: float,
    lo: float,
    hi: float,
    f32: Any,
    flags: Any,
    h: Any,
) -> Any:
    """Candidate 0 of a block: trunc32_pass where out is a narrow output and f32 (trunc_params) holds, else
    trunc_first; flags as trunc_first sets them; returns how many are nonzero. Chosen by out's dtype when the caller
    compiles (float outputs take trunc_first only)."""
    raise NotImplementedError("called only inside kernels")


@overload(trunc_block, inline="always")
def _trunc_block_overload(
    out: Any, k1: Any, k2: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: Any, p1: Any, lo: Any, hi: Any, f32: Any, flags: Any, h: Any
) -> Any:
    if out.dtype not in (types.uint16, types.uint8):

        def wide(
            out: Any,
            k1: Any,
            k2: Any,
            xl: Any,
            c: Any,
            c1: Any,
            hi32: Any,
            p0: Any,
            p1: Any,
            lo: Any,
            hi: Any,
            f32: Any,
            flags: Any,
            h: Any,
        ) -> Any:
            return trunc_first(out, xl, c, c1, hi32, p0, p1, lo, hi, flags, h)

        return wide

    def narrow(
        out: Any, k1: Any, k2: Any, xl: Any, c: Any, c1: Any, hi32: Any, p0: Any, p1: Any, lo: Any, hi: Any, f32: Any, flags: Any, h: Any
    ) -> Any:
        if not f32[0]:
            return trunc_first(out, xl, c, c1, hi32, p0, p1, lo, hi, flags, h)
        nb_ = out.shape[0]
        draws_into(k1[:nb_], k2[:nb_], xl, c, c1, hi32)
        trunc32_pass(out, k1, k2, f32, flags, h)
        bad = 0
        for j in range(nb_):
            bad += flags[j] != 0
        return bad

    return narrow


@jit
def trunc_candidates(out: Any, x: Any, at: Any, n: int, p0: float, p1: float, lo: float, hi: float, vals: Any, states: Any, h: Any) -> None:
    """One candidate of elements at[:n] on the fast path, in one vector pass (x: the candidate's key + GOLDEN +
    2 times the block's first element): vals[:n] and states[:n] as trunc_try gives them. A function of its own, so
    the caller's main loop keeps its helpers inlined and vectorized."""
    wide_vectors()
    for t in range(n):
        w = x + U2 * at[t]
        vals[t], states[t] = trunc_try(out, low_draw(w), low_draw(w + U1), p0, p1, lo, hi, h)


@jit
def fill_truncnorm(dst: Any, x0: Any, g0: Any, p0: float, p1: float, lo: float, hi: float, seed: Any, h: Any) -> None:
    """dst[k] = truncated normal of element g0 + k; x0 = key(seed) + GOLDEN + 2 g0 (candidate 0's draws).

    One vectorized pass (trunc_block: in binary32 for narrow outputs, trunc_first otherwise) computes candidate 0
    as fill_normal does and flags the elements it cannot settle in a byte per element. Those whose candidate 0 is
    rejected take candidate 1 in a second vector pass (trunc_candidates); what is left goes through trunc_settle,
    exact only where the fast path cannot decide. An element inside the bounds costs what a normal costs.
    """
    wide_vectors()
    m = dst.shape[0]
    flags = np.empty(_NBLOCK, dtype=np.uint8)
    k1 = np.empty(_NBLOCK, dtype=np.uint32)  # the draws of a block (narrow outputs, trunc_block)
    k2 = np.empty(_NBLOCK, dtype=np.uint32)
    f32 = trunc_params(p0, p1, lo, hi)
    again = np.empty(_NBLOCK, dtype=np.uint64)  # elements whose candidate 0 was rejected (their indices in the block)
    vals = np.empty(_NBLOCK, dtype=np.float64)  # and their candidate 1, on the fast path
    states = np.empty(_NBLOCK, dtype=np.int64)
    keys = np.empty(_CANDIDATES, dtype=np.uint64)
    for j in range(_CANDIDATES):
        keys[j] = mix(seed + np.uint64(j) * GOLDEN)
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), trunc_settle(dst, g0 + np.uint64(k), p0, p1, lo, hi, keys, 0, h), h)
            k += 1
            continue
        c, c1, hi32 = seg_consts(x)
        for b0 in range(0, cnt, _NBLOCK):
            nb_ = min(cnt - b0, _NBLOCK)
            xl = (x & LOW32) + U2 * np.uint64(b0)
            sub = dst[k + b0 : k + b0 + nb_]
            if not trunc_block(sub, k1, k2, xl, c, c1, hi32, p0, p1, lo, hi, f32, flags, h):
                continue
            gb = g0 + np.uint64(k + b0)
            n = 0
            for j in range(nb_):  # one pass over the flags
                f = flags[j]
                if f > 1:  # about one in a million: candidate 0 itself needs the exact path
                    store(sub, np.uint64(j), trunc_settle(sub, gb + np.uint64(j), p0, p1, lo, hi, keys, 0, h), h)
                again[n] = j  # the rejected ones' indices, without a branch
                n += f == 1
            trunc_candidates(sub, keys[1] + GOLDEN + U2 * gb, again, n, p0, p1, lo, hi, vals, states, h)
            for t in range(n):
                j = again[t]
                if states[t] == 0:
                    store(sub, j, vals[t], h)
                else:  # rejected: on from candidate 2; undecided: candidate 1 again, exactly
                    store(sub, j, trunc_settle(sub, gb + j, p0, p1, lo, hi, keys, 3 - states[t], h), h)
        k += cnt


@jit
def fill_flat(dst: Any, values: Any, g: int, h: Any) -> None:
    """dst[k] = values[g + k], cast."""
    src = values[g : g + dst.shape[0]]
    for j in range(dst.shape[0]):
        store(dst, np.uint64(j), src[np.uint64(j)], h)


@jit
def fill_const(dst: Any, c: float, h: Any) -> None:
    """The cast of c is loop-invariant: LLVM hoists it and the loop becomes a plain fill."""
    for j in range(dst.shape[0]):
        store(dst, np.uint64(j), c, h)
