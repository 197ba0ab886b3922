"""Binary32 log and cos of the normal's 32-bit draws, with proven error bounds, for 16-bit and 8-bit outputs.

A 16-bit or 8-bit output needs about 11 significant bits of `mean + std * z`, so binary32 arithmetic, which
vectorizes twice as wide as binary64 (16 lanes in AVX-512, 8 in AVX2), can decide almost every element: the
error of `log32` and `cos32` against the correctly rounded binary64 log and cos (cr_math.cr_log / cr_cos) is
measured on every one of the 2^32 draws by `bench/verify_f32.py`, and the bounds below are those maxima with a
margin. `normal32` carries them through `sqrt(-2 log) * cos` and `mean + std * z` into an interval [lo, hi] of
binary32 values that holds the spec's binary64 value; an element whose ends round to the same output word is
decided (rounding is monotone), the rest go to the binary64 path (distributions.normal_fast).

Both functions take the draw k as uint32 and use only 32-bit integer and binary32 operations, no tables and no
branches, so a loop over them vectorizes at full width without gathers. The inputs are exact integers:
- log: x = k * 2^-32 is split as kh + kl (16 significant bits each, exact in binary32) and reduced by its binary32
  rounding's exponent to m in [sqrt(1/2), sqrt(2)); log m = log1p(m - 1) by one polynomial (no division), with
  m - 1 formed with one rounding, so the relative error stays small near x = 1.
- cos: cos(2 pi k / 2^32) reduces exactly in integers to a quadrant q and r in [-2^29, 2^29): the result is
  +-cos or +-sin of 2 pi r / 2^32 (|angle| <= pi/4), by short polynomials. It differs from cos of the binary64
  input t = (2.0 * pi) * u2 by at most about 2^-50 absolutely, which is a large relative error only near the
  zeros of cos: results below COS32_TINY in magnitude are left undecided (about 6e-7 of the draws).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from paraminit_server.backends.cpu_kernels.half_rounding import bf16_of_f32_bits, f16_of_f32_bits, f32_bits_as
from paraminit_server.backends.cpu_kernels.jit import AVX512BF16, F16C, inline, jit

__all__ = [
    "COS32_REL",
    "COS32_TINY",
    "LOG32_REL",
    "V32_P",
    "V32_V",
    "Z32_REL",
    "bits_f32",
    "cos32",
    "f32_bits",
    "fma32",
    "log32",
    "sqrt32",
]


def _fma32_impl(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c in binary32 with one rounding (llvm.fma.f32)."""
    if not all(v == types.float32 for v in (a, b, c)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


def _sqrt32_impl(typingctx: Any, a: Any) -> Any:
    """Correctly rounded binary32 square root (llvm.sqrt.f32: vsqrtps when vectorized)."""
    if a != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.sqrt", [f], ir.FunctionType(f, [f]))
        return builder.call(fn, args)

    return types.float32(types.float32), codegen


def _bits_f32_impl(typingctx: Any, b: Any) -> Any:
    """Reinterpret the low 32 bits of an integer as a binary32 (numba widens 32-bit arithmetic to 64 bits; LLVM
    narrows it again, since only these bits are used)."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(b), codegen


fma32: Any = intrinsic(_fma32_impl)
sqrt32: Any = intrinsic(_sqrt32_impl)
f32_bits: Any = f32_bits_as(types.int32)  # signed: the pattern's arithmetic here is on int32
bits_f32: Any = intrinsic(_bits_f32_impl)

_F = np.float32
_I = np.int32
_U = np.uint32

# |cr_log(k) - log32(k)| <= LOG32_REL * |log32(k)| for every draw k, and the same for cos where |cos32(k)| >= COS32_TINY.
# bench/verify_f32.py measured the maxima on all 2^32 draws (docs/PERFORMANCE.md): log 1.358e-7 (2^-22.81), cos
# 1.928e-7 (2^-22.31, 2606 draws below COS32_TINY); the bounds are those with a margin of at least 1.25x (the script
# fails below it). Rerun it after any change to log32 or cos32.
LOG32_REL = 1.75e-7
COS32_REL = 2.5e-7
COS32_TINY = 2.0**-20


def _z_rel(log_rel: float, cos_rel: float) -> float:
    """Relative bound of the spec's z = RN(RN(sqrt(-2 L)) * C) around z32 = RN32(RN32(sqrt(-2 l32)) * c32), for
    |L - l32| <= log_rel |l32| and |C - c32| <= cos_rel |c32| (binary64 roundings 2^-53, binary32 2^-24), rounded
    up to a binary32 with a margin."""
    u64, u32 = Fraction(1, 2**53), Fraction(1, 2**24)
    el, ec = Fraction(log_rel), Fraction(cos_rel)
    # sqrt(1 + a) <= 1 + a/2 and >= 1 - |a|/2 - a^2/2 for |a| <= 1
    up = (1 + el / 2) * (1 + ec) * (1 + u64) ** 2 / (1 - u32) ** 2 - 1
    down = 1 - (1 - el / 2 - el * el / 2) * (1 - ec) * (1 - u64) ** 2 / (1 + u32) ** 2
    return float(max(up, down) * (1 + Fraction(1, 2**10)))


Z32_REL = _z_rel(LOG32_REL, COS32_REL)

# log: m = k * 2^-e in [sqrt(1/2), sqrt(2)) with e from the binary32 rounding of k; ln 2 in two parts, the first
# with 16 bits so that (e - 32) * LN2H is exact for |e - 32| < 2^8.
_OFF = _I(0x3F3504F3)  # bits of the binary32 nearest sqrt(1/2)
_LN2H = float(np.float32(round(math.log(2) * 2**16) / 2**16))
_LN2H32 = _F(_LN2H)
_LN2L32 = _F(math.log(2) - _LN2H)
_K_FLOOR = _U(4294)  # k * 2^-32 <= 1e-6 exactly when k <= 4294: the spec's floor
_LOG_FLOOR32 = _F(math.log(1e-6))
# log1p(t) = t + t^2 Q(t) on t in [sqrt(1/2) - 1, sqrt(2) - 1]: Q of degree 8, binary32 coefficients of a least-squares
# fit iterated towards minimax (Lawson) for the relative error of log1p; fit error 2^-27.9, far below the roundings.
_Q = tuple(
    _F(c)
    for c in (
        -0.49999988079071045,
        0.33333325386047363,
        -0.25001585483551025,
        0.20001985132694244,
        -0.16609056293964386,
        0.14181633293628693,
        -0.13242985308170319,
        0.1290552169084549,
        -0.0762307196855545,
    )
)
_Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6, _Q7, _Q8 = _Q
_ONE = _F(1.0)
_TWO16 = _F(65536.0)
_MASK16 = _U(0xFFFF)
_S16 = _U(16)
_S23 = _I(23)
_BIAS = _I(127)
_E32 = _I(32)


@inline
def log32(k: Any) -> Any:
    """Binary32 log(max(k * 2^-32, 1e-6)) for a draw k (uint32), within LOG32_REL of the correctly rounded value."""
    kh = _F(_I(k >> _S16)) * _TWO16  # exact: 16 significant bits each
    kl = _F(_I(k & _MASK16))
    tmp = _I(f32_bits(kh + kl) - _OFF)  # kh + kl rounds k once; any such e gives m near [sqrt(1/2), sqrt(2))
    e = tmp >> _S23
    scale = bits_f32((_BIAS - e) << _S23)  # 2^-e
    mh = kh * scale
    ml = kl * scale
    t = (mh - _ONE) + ml  # mh - 1 is exact (Sterbenz): t is m - 1 rounded once
    q = fma32(fma32(fma32(fma32(_Q8, t, _Q7), t, _Q6), t, _Q5), t, _Q4)
    q = fma32(fma32(fma32(fma32(q, t, _Q3), t, _Q2), t, _Q1), t, _Q0)
    p = fma32(t * t, q, t)
    ef = _F(_I(e - _E32))
    r = fma32(ef, _LN2H32, fma32(ef, _LN2L32, p))
    return _LOG_FLOOR32 if k <= _K_FLOOR else r


# cos: angle = 2 pi r / 2^32 with r in [-2^29, 2^29); cephes' binary32 minimax coefficients on [-pi/4, pi/4]
_STEP = _F(2.0 * math.pi * 2.0**-32)
_HALF_Q = _U(1 << 29)
_LOW30 = _U((1 << 30) - 1)
_S30 = _U(30)
_S1, _S2, _S3 = _F(-1.6666654611e-1), _F(8.3321608736e-3), _F(-1.9515295891e-4)
_C1, _C2, _C3 = _F(4.166664568298827e-2), _F(-1.388731625493765e-3), _F(2.443315711809948e-5)
_HALF = _F(0.5)
_SIGN = _U(1 << 31)
_U1 = _U(1)
_I1 = _I(1)
_BF16_HALF = _U(0x7FFF)


@inline
def cos32(k: Any) -> Any:
    """Binary32 cos((2.0 * pi) * (k * 2^-32)) for a draw k (uint32), within COS32_REL of the correctly rounded value
    where its magnitude is at least COS32_TINY."""
    w = _U(k + _HALF_Q)  # quadrant q = round(4 k / 2^32) mod 4, in the top two bits
    q = w >> _S30
    a = _F(_I(_I(w & _LOW30) - _I(_HALF_Q))) * _STEP
    y = a * a
    sn = fma32(a * y, fma32(fma32(_S3, y, _S2), y, _S1), a)
    cs = fma32(y * y, fma32(fma32(_C3, y, _C2), y, _C1), fma32(-_HALF, y, _ONE))
    v = sn if (q & _U1) != _U(0) else cs  # q = 1: -sin, 2: -cos, 3: sin
    neg = ((q + _U1) << _S30) & _SIGN  # bit 1 of q + 1, moved to the sign
    return bits_f32(_U(f32_bits(v)) ^ neg)


# mean + std * z in binary32: P0 = RN32(p0), P1 = RN32(p1), m = RN32(P1 * z32), v = RN32(P0 + m). The spec's
# v_spec = RN64(p0 + RN64(p1 * z)) lies within A |P0| + B |m| + U |v| of v (binary32 roundings 2^-24 relative to
# their results, binary64 ones 2^-53, z within Z32_REL of z32), and, as |m| <= (1 + 2^-24) |v| + |P0|, within
# E = V32_V |v| + V32_P |P0|; lo = RN32(v - E) and hi = RN32(v + E) hold it when E also covers their own rounding
# (another 2^-24 |v|, and a relative 2^-18 for the binary32 roundings of E itself).
# Valid while the binary32 values m, v, E are normal or exact: |p0| = 0 or in [2^-100, 2^100], |p1| = 0 or in
# [2^-48, 2^60] (|z32| >= 2^-36 where cos32 is decided, so |m| >= 2^-84). Where v is tiny through cancellation,
# p0 != 0, E >= V32_P |P0| >= 2^-124, v is exact (a sum of two binary32 values that underflows), and the absolute
# 2^-150 of a subnormal lo or hi lies far inside E's margin: no tiny value needs a test (word32 is exact on binary32
# subnormals, except the bfloat16 conversion instruction, which flushes them: normal32_body tests its zero word).
_U32, _U64 = Fraction(1, 2**24), Fraction(1, 2**53)
_GROW = 1 + Fraction(1, 2**18)
_BETA = (1 + _U32) ** 2 * (1 + Fraction(Z32_REL)) - 1  # |RN64(p1 z) - m| <= (BETA + 2^-52) |m| with p1 = P1(1 + e)
_A = _U32 + 2 * _U64  # |p0 - P0| and p0's share of the binary64 roundings
_B = _BETA + 4 * _U64
V32_V = float(((_B * (1 + _U32)) + 2 * _U32) * _GROW)
V32_P = float((_A + _B) * _GROW)
_V32 = np.nextafter(_F(V32_V), _F(1.0))  # rounded up
_COS_TINY32 = _F(COS32_TINY)
_M2 = _F(-2.0)


@jit
def normal32_params(p0: float, p1: float) -> Any:
    """(whether normal32 holds for mean p0 and std p1, P0, P1, V32_P * |P0| rounded up): once per run."""
    a0, a1 = abs(p0), abs(p1)
    ok = ((a0 == 0.0) | ((a0 >= 2.0**-100) & (a0 <= 2.0**100))) & ((a1 == 0.0) | ((a1 >= 2.0**-48) & (a1 <= 2.0**60)))
    big0 = _F(p0)
    # in binary64 (exact to 2^-52), then rounded to binary32 upwards by a relative 2^-20 step
    return ok, big0, _F(p1), _F(V32_P * abs(np.float64(big0)) * (1.0 + 2.0**-20))


@inline
def normal32(k1: Any, k2: Any, big0: Any, big1: Any, e0: Any) -> Any:
    """(lo, hi, undecided): binary32 bounds of the spec's mean + std * z for draws k1, k2 (uint32), with
    (P0, P1, V32_P |P0|) from normal32_params; undecided where cos32 is near a zero."""
    c = cos32(k2)
    v = big0 + big1 * (sqrt32(_M2 * log32(k1)) * c)
    e = fma32(_V32, abs(v), e0)
    return v - e, v + e, abs(c) < _COS_TINY32


@inline
def ceil32(x: float) -> Any:
    """The least binary32 >= x (x a binary64, not NaN): comparisons with it decide `>= x` for binary32 values."""
    c = _F(x)
    b = f32_bits(c)
    up = bits_f32(b + np.int64(1) - np.int64(2) * np.int64(b < 0))  # one step towards +inf (c != +inf, c != 0 -> ...)
    return c if np.float64(c) >= x else (bits_f32(np.int64(1)) if c == _F(0.0) else up)


def word32_consts(h: tuple[Any, ...]) -> tuple[Any, ...]:
    """The constants of word32 for a narrow format given by its half_rounding constants h (F16, BF16, F8E4M3,
    F8E5M2): the rounding of half_rounding.narrow_magnitude_bits on binary32 bits instead of binary64 ones."""
    mant = 52 - int(h[0])
    emin = math.frexp(float(h[4]))[1] - 1
    bias = 1 - emin
    width = 1 + (bias + 1).bit_length() + mant
    shift = 23 - mant
    return (
        _I(shift),
        _I((1 << (shift - 1)) - 1 - ((127 - bias) << 23)),
        _F(h[4]),
        _F(h[5]),
        _F(math.ldexp(1.0, emin - mant + 23)),
        _I((127 + emin - mant + 23) << 23),
        _U(32 - width),
        _I(1 << (width - 1)),
    )


@jit
def word32(x: Any, w: Any) -> Any:
    """The output word (float16, bfloat16 or 8-bit float bits, as int32) of a binary32 x, rounded once to nearest
    even; w: word32_consts of the format. Exact for every binary32 x but with the bfloat16 conversion instruction
    (AVX512BF16), which flushes binary32 subnormals to zero (normal32_body tests for a zero word there).
    Branch-free once inlined with w a constant; 32-bit integers throughout (numba widens each operation to 64 bits,
    the casts let LLVM narrow them back, so the loop keeps its full vector width)."""
    shift, adj, min_normal, ovf, magic, magic_bits, sign_shift, sign_bit = w
    if shift == 13 and F16C:
        return _I(f16_of_f32_bits(_U(f32_bits(x))))
    if shift == 16 and AVX512BF16:
        return _I(bf16_of_f32_bits(_U(f32_bits(x))))
    if shift == 16:  # bfloat16 has binary32's exponents: carries reach infinity, subnormals round alike, sign kept
        b = _U(f32_bits(x))
        return _I(_U(_U(b + _BF16_HALF) + _U((b >> _S16) & _U1)) >> _S16)
    av = abs(x)
    a = f32_bits(min(av, ovf))
    rn = _I(_I(_I(a + adj) + _I((a >> shift) & _I1)) >> shift)
    rs = _I(f32_bits(av + magic) - magic_bits)
    r = rs if av < min_normal else rn
    return _I(r | _I(_I(_U(f32_bits(x)) >> sign_shift) & sign_bit))
