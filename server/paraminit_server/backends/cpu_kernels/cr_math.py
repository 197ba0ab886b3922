"""Correctly rounded log and cos on the sampler's domain (docs/SAMPLER.md section 2.1).

The inputs are log(max(k * 2^-32, 1e-6)) and cos((2.0 * pi) * (k * 2^-32)) for a 32-bit draw k. Each
function has two vectorizable, branch-free evaluations on the same table-driven reduction (tables: cr_tables):
- `*_dd`: the result as an unevaluated sum hi + lo with a relative error far below 2^-74, and a flag that
  says whether hi is provably the correctly rounded value (Ziv's test: |lo| + bound below half an ulp of
  hi, hi not a power of two). Undecided inputs (about 1e-6 of them) look their draw k up in a short
  table of the inputs whose hi is not the correctly rounded value (cr_tables' FIX tables, found by running
  every one of the 2^32 inputs through this code and deciding the flagged ones with mpmath;
  bench/verify_cr.py re-checks all 2^32 inputs against an independent oracle).
- `*_plain`: a plain binary64 value within LOG_PLAIN_ULPS / COS_PLAIN_ULPS ulps of the correctly rounded
  value (checked on all 2^32 inputs by bench/verify_cr.py); float32 outputs (and the 16-bit and 8-bit ones
  that f32_math's binary32 pass leaves undecided) propagate that interval through the spec's monotone
  operations and fall back to the exact path only when the interval straddles a rounding boundary of the
  output format.
Fused multiply-adds (llvm.fma.f64) are used inside these functions only; the spec's own operations stay
separate roundings. paraminit_kernels.cuh has the same code with __fma_rn, so CPU and GPU agree bit for bit.

Importing this module builds the tables (cr_tables.tables(): decimal arithmetic, tens of milliseconds): numba
freezes them into the kernels as constants when they compile.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from paraminit_server.backends.cpu_kernels.counter_rng import TWO_NEG_32
from paraminit_server.backends.cpu_kernels.cr_tables import (
    COS_BOUND,
    COS_FIX,
    COS_PLAIN_ULPS,
    LOG_BOUND,
    LOG_FIX,
    LOG_OFF,
    LOG_PLAIN_ULPS,
    U1_FLOOR,
    tables,
)
from paraminit_server.backends.cpu_kernels.jit import bits_f64, f64_bits, inline, jit

__all__ = [
    "COS_PLAIN_ULPS",
    "LOG_FLOOR",
    "LOG_PLAIN_ULPS",
    "cos_dd",
    "cos_input",
    "cos_plain",
    "cr_cos",
    "cr_log",
    "fma",
    "log_dd",
    "log_input",
    "log_plain",
    "sqrt",
]

_TWO_PI = 2.0 * math.pi


def _fma_impl(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c with one rounding (llvm.fma.f64: the FMA instruction, or a correct libm call without one)."""
    if not all(isinstance(v, types.Float) for v in (a, b, c)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d = ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))
        return builder.call(fn, [context.cast(builder, v, t, types.float64) for v, t in zip(args, signature.args, strict=True)])

    return types.float64(types.float64, types.float64, types.float64), codegen


fma: Any = intrinsic(_fma_impl)


def _sqrt_impl(typingctx: Any, a: Any) -> Any:
    """Correctly rounded square root as llvm.sqrt.f64 (vsqrtpd when vectorized; math.sqrt calls libm)."""
    if not isinstance(a, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d = ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.sqrt", [d], ir.FunctionType(d, [d]))
        return builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.float64)])

    return types.float64(types.float64), codegen


sqrt: Any = intrinsic(_sqrt_impl)

TABLES = tables()
_LOG_R = TABLES["log_r"]
_LOG_TH = TABLES["log_th"]
_LOG_TL = TABLES["log_tl"]
_LN2H = TABLES["ln2h"]
_LN2L = TABLES["ln2l"]
_COS_CH = TABLES["cos_ch"]
_COS_CL = TABLES["cos_cl"]
_COS_SH = TABLES["cos_sh"]
_COS_SL = TABLES["cos_sl"]
_P1 = TABLES["p1"]
_P2 = TABLES["p2"]
_P3 = TABLES["p3"]
_INV_STEP = TABLES["inv_step"]
_LN2 = _LN2H + _LN2L
_THIRD_H, _THIRD_L = TABLES["third"]
_SIXTH_H, _SIXTH_L = TABLES["sixth"]
LOG_FLOOR = TABLES["log_floor"]  # log(1e-6), correctly rounded
_ROUND_MAGIC = 6755399441055744.0  # 1.5 * 2^52: (x + M) - M rounds x to an integer, ties to even
_LOG_IMASK = np.int64(0xFF)
_HIGH12 = np.int64(-(1 << 52))  # 0xFFF0000000000000
_I_OFF = np.int64(LOG_OFF)
_I44 = np.int64(44)
_I52 = np.int64(52)
_MANT = np.int64((1 << 52) - 1)
_ABS = np.int64((1 << 63) - 1)


@inline
def two_sum(a: float, b: float) -> Any:
    """s + e = a + b exactly, s = fl(a + b) (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@inline
def log_input(k: float) -> float:
    """The log input of a draw k (an integer-valued binary64): max(k * 2^-32, 1e-6)."""
    u1 = k * TWO_NEG_32
    return U1_FLOOR if u1 <= U1_FLOOR else u1


@inline
def cos_input(k: float) -> float:
    """The cos input of a draw k: (2.0 * pi) * (k * 2^-32)."""
    return _TWO_PI * (k * TWO_NEG_32)


@inline
def log_reduce(x: float) -> Any:
    """x = 2^e * m, m in [0.6875, 1.375); t = m * r_i - 1 (exact: m has <= 32 significant bits, r_i 20)."""
    ix = f64_bits(x)
    tmp = ix - _I_OFF
    i = np.uint64((tmp >> _I44) & _LOG_IMASK)
    e = np.float64(tmp >> _I52)
    m = bits_f64(ix - (tmp & _HIGH12))
    t = m * _LOG_R[i] - 1.0
    return e, t, _LOG_TH[i], _LOG_TL[i]


@inline
def log_plain(x: float) -> Any:
    """log(x) within LOG_PLAIN_ULPS ulps, for x = k * 2^-32 > 1e-6 (any other x: log_input's floor).

    Only for the interval test of float32/16-bit outputs: two table reads, a degree-4 polynomial.
    """
    xs = x if x > U1_FLOOR else 0.5
    ix = f64_bits(xs)
    tmp = ix - _I_OFF
    i = np.uint64((tmp >> _I44) & _LOG_IMASK)
    e = np.float64(tmp >> _I52)
    t = fma(bits_f64(ix - (tmp & _HIGH12)), _LOG_R[i], -1.0)
    q = fma(fma(fma(fma(-1.0 / 6, t, 0.2), t, -0.25), t, 1.0 / 3), t, -0.5)
    r = fma(e, _LN2, _LOG_TH[i]) + fma(t * t, q, t)
    return r if x > U1_FLOOR else LOG_FLOOR


@inline
def log_dd(x: float) -> Any:
    """log(x) as hi + lo (relative error < LOG_BOUND) and whether hi is its correct rounding."""
    xs = x if x > U1_FLOOR else 0.5
    e, t, th, tl = log_reduce(xs)
    t2h = t * t
    t2l = fma(t, t, -t2h)
    a3h = t * _THIRD_H
    a3l = fma(t, _THIRD_H, -a3h) + t * _THIRD_L
    qr = fma(fma(fma(fma(fma(fma(-0.1, t, 1.0 / 9), t, -0.125), t, 1.0 / 7), t, -1.0 / 6), t, 0.2), t, -0.25)
    wh = a3h - 0.5
    wl = (a3h - (wh + 0.5)) + (a3l + t2h * qr)
    ph = t2h * wh
    pl = fma(t2h, wh, -ph) + (t2h * wl + t2l * wh)
    s = t + ph
    e1 = ph - (s - t)
    a, ea = two_sum(e * _LN2H, th)
    b, eb = two_sum(a, s)
    lo = ((ea + eb) + (tl + e * _LN2L)) + (e1 + pl)
    hi = b + lo
    lo = lo - (hi - b)
    ok = decided(hi, lo, LOG_BOUND)
    return (hi if x > U1_FLOOR else LOG_FLOOR), lo, ok | (x <= U1_FLOOR)


@inline
def decided(hi: float, lo: float, bound: float) -> Any:
    """Whether hi = RN(hi + lo + err) for every |err| <= bound * |hi| (hi = RN(hi + lo) already).

    Half the gap to the nearer neighbour of hi: half an ulp, a quarter when hi is a power of two (the gap
    below it is half as wide).
    """
    bh = f64_bits(hi) & _ABS
    a = bits_f64(bh)
    half_gap = (0.5 if (bh & _MANT) != 0 else 0.25) * (bits_f64(bh + 1) - a)
    return abs(lo) + bound * a < half_gap


@inline
def cos_reduce(t: float) -> Any:
    """t = j * pi/128 + (rh + rl), |r| <= pi/256 (+ a rounding), with a three-part pi/128."""
    jf = (t * _INV_STEP + _ROUND_MAGIC) - _ROUND_MAGIC
    j = np.uint64(np.int64(jf))
    r1 = t - jf * _P1  # exact: jf * P1 fits 53 bits, and t is within a factor 2 of it (Sterbenz)
    rh, e = two_sum(r1, -(jf * _P2))
    rl = e - jf * _P3
    return j, rh, rl


@inline
def cos_plain(t: float) -> Any:
    """cos(t) within COS_PLAIN_ULPS ulps, for t in [0, 2 pi); two table reads, short polynomials."""
    jf = (t * _INV_STEP + _ROUND_MAGIC) - _ROUND_MAGIC
    j = np.uint64(np.int64(jf))
    r = fma(-jf, _P2, t - jf * _P1) - jf * _P3
    ch = _COS_CH[j]
    sh = _COS_SH[j]
    r2 = r * r
    cm = r2 * fma(r2, fma(r2, -1.0 / 720, 1.0 / 24), -0.5)
    sm = (r * r2) * fma(r2, 1.0 / 120, -1.0 / 6)
    return ch + fma(-sh, r, fma(ch, cm, -(sh * sm)))


@inline
def cos_dd(t: float) -> Any:
    """cos(t) as hi + lo (relative error < COS_BOUND) and whether hi is its correct rounding."""
    j, rh, rl = cos_reduce(t)
    ch = _COS_CH[j]
    cl = _COS_CL[j]
    sh = _COS_SH[j]
    sl = _COS_SL[j]
    r2h = rh * rh
    r2l = fma(rh, rh, -r2h) + 2.0 * rh * rl
    # cos r - 1 = cmh + cml
    pc = fma(r2h, fma(r2h, fma(r2h, 1.0 / 3628800, -1.0 / 40320), 1.0 / 720), -1.0 / 24)
    cmh = -0.5 * r2h
    cml = fma(-r2h * r2h, pc, -0.5 * r2l)
    # sin r - r = r^3 * (-1/6 + r^2 * ps) = smh + sml
    ps = fma(r2h, fma(r2h, fma(r2h, -1.0 / 39916800, 1.0 / 362880), -1.0 / 5040), 1.0 / 120)
    v = r2h * ps
    uh = _SIXTH_H + v
    ul = (v - (uh - _SIXTH_H)) + _SIXTH_L
    r3h = rh * r2h
    r3l = fma(rh, r2h, -r3h) + (rh * r2l + rl * r2h)
    smh = r3h * uh
    sml = fma(r3h, uh, -smh) + (r3h * ul + r3l * uh)
    # cos t = C + C * (cos r - 1) - S * r - S * (sin r - r)
    x1h = sh * rh
    x1l = fma(sh, rh, -x1h) + (sh * rl + sl * rh)
    x2h = ch * cmh
    x2l = fma(ch, cmh, -x2h) + (ch * cml + cl * cmh)
    x3h = sh * smh
    x3l = fma(sh, smh, -x3h) + (sh * sml + sl * smh)
    s1, e1 = two_sum(ch, -x1h)
    s2, e2 = two_sum(s1, x2h)
    s3, e3 = two_sum(s2, -x3h)
    lo = ((e1 + e2) + (e3 + cl)) + ((x2l - x1l) - x3l)
    hi = s3 + lo
    lo = lo - (hi - s3)
    return hi, lo, decided(hi, lo, COS_BOUND)


# Flagged inputs whose hi is not the correctly rounded value: draw k -> bit delta. Generated by


def _fix_arrays(fix: dict[int, int]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    keys = sorted(fix)
    return np.array([*keys, 2.0**33], dtype=np.float64), np.array([*(fix[k] for k in keys), 0], dtype=np.int64)


_LOG_FIX_K, _LOG_FIX_D = _fix_arrays(LOG_FIX)
_COS_FIX_K, _COS_FIX_D = _fix_arrays(COS_FIX)


@jit
def _fixed(hi: float, k: float, keys: Any, deltas: Any) -> Any:
    """hi, or its correction when k is in a FIX table of cr_tables (keys sorted, with a sentinel above every draw)."""
    i = np.searchsorted(keys, k)
    if keys[i] == k:
        return bits_f64(f64_bits(hi) + deltas[i])
    return hi


@jit
def cr_log(k: float) -> Any:
    """Correctly rounded log(max(k * 2^-32, 1e-6)) for a draw k (integer-valued binary64)."""
    hi, _, ok = log_dd(log_input(k))
    if ok:
        return hi
    return _fixed(hi, k, _LOG_FIX_K, _LOG_FIX_D)


@jit
def cr_cos(k: float) -> Any:
    """Correctly rounded cos((2.0 * pi) * (k * 2^-32)) for a draw k."""
    hi, _, ok = cos_dd(cos_input(k))
    if ok:
        return hi
    return _fixed(hi, k, _COS_FIX_K, _COS_FIX_D)
