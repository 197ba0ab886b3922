"""Numba kernels of the CPU backend: one fused, parallel pass per value kind, casts included.

`fill` writes `out[k]` for the local elements `l_begin + k` of a parameter's
region. Work is split into fixed-size pieces of the local index, which the
threads take from a shared counter; each piece walks its runs (Runs in plan.py)
with contiguous inner loops, and every element depends only on (key, global
index): bytes never depend on threads, scheduling or chunking.

Speed comes from letting LLVM vectorize every inner loop (AVX2 or AVX-512 on
the host), so the loops are kept free of branches and of anything that blocks
vectorization; rare elements are redone block by block after a vector pass:
- indices are unsigned, so numba emits no negative-index wraparound per store;
- SplitMix64 runs as is where the host has a 64-bit vector multiply
  (AVX-512DQ); elsewhere its first multiply works on 32-bit halves: inside a
  segment where `x >> 30` is constant, `x ^ (x >> 30)` has a constant high
  word, so its product needs two 32x32 multiplies instead of three;
- the low 32 bits of a draw become a binary64 by the exponent-bias trick
  (OR into 2^52, subtract 2^52), which is exact and needs no packing;
- float16/bfloat16 bits come through binary32 rounded to odd (half_bits), so
  the hardware conversions give the one rounding;
- normal: log and cos are correctly rounded (docs/SAMPLER.md section 2.1) by
  the "Correctly rounded log and cos" section below. float64 outputs take the
  double-double evaluation; float32 and 16-bit outputs a cheaper evaluation
  whose error interval is carried through the spec's monotone operations, and
  only elements whose interval straddles a rounding boundary of the output
  format (about one in a million) are redone exactly.
No fastmath anywhere: every binary64 operation of the spec rounds on its own
(no FMA contraction); fused multiply-adds appear only inside log and cos.

Compiled lazily on first call and cached on disk; import builds the log/cos tables
(decimal arithmetic, tens of milliseconds).
"""

from __future__ import annotations

import decimal
import math
import struct
import warnings
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.core.errors import NumbaIRAssumptionWarning
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
# The log/cos helpers are too large for LLVM's inliner, and a call in the loop stops vectorization: they are
# inlined by numba.
_inline = nb.njit(cache=True, nogil=True, inline="always")
# numba's inliner reports phi variables of inlined helpers as out of scope; harmless for this code.
warnings.filterwarnings("ignore", message="variable '.*' is not in scope", category=NumbaIRAssumptionWarning)


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




def _host_feature(name: str) -> bool:
    """Whether the host CPU (which the kernels are compiled for) has an LLVM feature, e.g. f16c."""
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get(name, False))
    except Exception:  # pragma: no cover - feature query unavailable: take the integer paths
        return False


def _wide_multiply() -> bool:
    """Whether the host has a 64-bit vector multiply (AVX-512DQ vpmullq); the kernels compile for the host."""
    return _host_feature("avx512dq")


WIDE_MULTIPLY = _wide_multiply()
# LLVM's tuning for Intel server cores (skylake-avx512 .. emeraldrapids) prefers 256-bit vectors, which halves
# the width of the normal kernels' double-double pipeline on hosts with AVX-512 (AMD's tuning already uses 512).
# The normal kernels ask for 512-bit vectors per function (wide_vectors below), only where AVX-512 exists; the
# other kernels keep LLVM's choice. The decision is a function of the host features, which key numba's cache.
WIDE_VECTORS = _host_feature("avx512f") and _host_feature("avx512dq")
_WIDE_ATTRS = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


def _wide_vectors(typingctx: Any) -> Any:
    """Mark the function being compiled to vectorize 512 bits wide (a no-op without AVX-512)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if WIDE_VECTORS:
            for attr in _WIDE_ATTRS:
                # llvmlite's attribute set accepts only enum attributes by name; string attributes are written
                # into the IR text as they are.
                set.add(builder.function.attributes, attr)
        return context.get_dummy_value()

    return types.none(), codegen


wide_vectors: Any = intrinsic(_wide_vectors)
F16C = _host_feature("f16c")  # binary32 -> float16 conversion (vcvtps2ph)
AVX512BF16 = _host_feature("avx512bf16")  # binary32 -> bfloat16 (vcvtneps2bf16; flushes binary32 subnormals)


@_jit
def seg_consts(x0: Any) -> Any:
    """Constants of a segment of words x = key + GOLDEN + i that share `x >> 30` (see draw_seg)."""
    c = x0 >> _S30
    a_hi = (x0 ^ c) >> _S32
    return c & _LOW32, ((a_hi * _MUL1_LO) & _LOW32) << _S32, x0 & ~_LOW32


@_jit
def draw_seg(xl: Any, c: Any, c1: Any, hi: Any) -> Any:
    """low_draw(x) for x = hi | xl in a segment with constants seg_consts(x).

    With a 64-bit vector multiply (AVX-512DQ) the plain SplitMix64 is cheapest. Without one (AVX2):
    a = x ^ (x >> 30) = x ^ C; its high word is constant, so a * MUL1 needs a_lo * MUL1_lo (64-bit) and the
    low word of a_lo * MUL1_hi only; the high-word product is folded into c1.
    """
    if WIDE_MULTIPLY:
        return low_draw(hi | xl)
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


def _f32_bits(typingctx: Any, x: Any) -> Any:
    """Reinterpret a binary32 as uint32 (a plain LLVM bitcast)."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _f16_of_f32_bits(typingctx: Any, b: Any) -> Any:
    """float16 bits of the binary32 with bits b, rounded to nearest even (fptrunc: vcvtps2ph with F16C)."""
    if b != types.uint32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f = builder.bitcast(args[0], ir.FloatType())
        return builder.bitcast(builder.fptrunc(f, ir.HalfType()), ir.IntType(16))

    return types.uint16(types.uint32), codegen


class _BFloat(ir.Type):  # type: ignore[misc]
    """LLVM's bfloat type (llvmlite.ir has none)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _bf16_of_f32_bits(typingctx: Any, b: Any) -> Any:
    """bfloat16 bits of a normal binary32, rounded to nearest even (vcvtneps2bf16; AVX512BF16 hosts only)."""
    if b != types.uint32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f = builder.bitcast(args[0], ir.FloatType())
        return builder.bitcast(builder.fptrunc(f, _BFloat()), ir.IntType(16))

    return types.uint16(types.uint32), codegen


f32_bits: Any = intrinsic(_f32_bits)
f16_of_f32_bits: Any = intrinsic(_f16_of_f32_bits)
bf16_of_f32_bits: Any = intrinsic(_bf16_of_f32_bits)
_LOW29 = np.int64((1 << 29) - 1)
_LOW16 = np.int64(0xFFFF)
_I16 = np.int64(16)
_I29 = np.int64(29)
_I48 = np.int64(48)
_BF16_ROUND = np.int64(0x7FFF)
_F32_MIN_NORMAL = 2.0**-126


@_jit
def half_bits_int(v: float, h: Any) -> Any:
    """half_bits in integer arithmetic on the binary64 bits (hosts without F16C).

    Normal range: round at bit `shift` of the binary64 bits with the exponent rebiased in the same addition;
    carries run into the exponent, and |v| is first clamped to the smallest value that rounds to infinity.
    Subnormal range: |v| + magic has the target's subnormal spacing as its ulp, so the hardware's one
    rounding is the spec's. NaN keeps its sign and becomes the quiet NaN.
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


@_jit
def sticky32(v: float) -> Any:
    """v rounded to odd at 24 significant bits, as binary32 (exact in binary32's normal range)."""
    bv = f64_bits(v)
    sticky = bv & _LOW29
    return np.float32(bits_f64((bv ^ sticky) | (np.int64(sticky != 0) << _I29)))


@_jit
def half_bits(v: float, h: Any) -> Any:
    """Round binary64 once, to nearest even, into float16/bfloat16 bits (h: _F16 or _BF16); branch-free.

    v is first rounded to odd at 24 significant bits (its low 29 fraction bits become one sticky bit), which
    binary32 holds exactly in its normal range; rounding that to nearest even gives the one rounding of v,
    because the 16-bit formats keep at least two bits fewer (round-to-odd never creates a false tie).
    float16 then takes the F16C conversion (values below binary32's normal range are far below float16's
    smallest subnormal and round to zero on either path); bfloat16 an integer rounding of the binary32 bits
    with carries into the exponent and on to infinity, and below 2^-126, where bfloat16 is subnormal and
    binary32 would round again, |v| + magic, whose ulp is bfloat16's subnormal spacing, so the hardware's
    one rounding is the spec's. NaN keeps its sign and becomes the quiet NaN.
    """
    shift, _, _, nan_bits, min_normal, _, magic, magic_bits = h
    bv = f64_bits(v)
    f = sticky32(v)
    if shift == 42 and not F16C:  # float16 (compile-time constants once inlined) without the conversion
        return half_bits_int(v, h)
    if shift == 42:
        r = np.int64(f16_of_f32_bits(f32_bits(f)))
    else:
        b = np.int64(f32_bits(f))
        r = (b + _BF16_ROUND + ((b >> _I16) & 1)) >> _I16
        av = abs(v)
        if av < min_normal:
            r = (f64_bits(av + magic) - np.int64(magic_bits)) | ((bv >> _I48) & _SIGN16)
    if v != v:
        r = np.int64(nan_bits) | ((bv >> _I48) & _SIGN16)
    return np.uint16(r & _LOW16)


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


def store_fast(out: Any, k: Any, v: float, h: Any) -> Any:
    """store() without the rare cases: returns 1 where the element must be stored again with store()."""
    raise NotImplementedError("called only inside kernels")


@overload(store_fast, inline="always")
def _store_fast_overload(out: Any, k: Any, v: Any, h: Any) -> Any:
    if out.dtype == types.uint16:
        def store_half(out: Any, k: Any, v: Any, h: Any) -> Any:
            # half_bits without its NaN and bfloat16-subnormal paths; zero is exact on the common path
            b = f32_bits(sticky32(v))
            if h[0] == 42 and F16C:
                out[k] = f16_of_f32_bits(b)
            elif h[0] == 42:
                out[k] = half_bits_int(v, h)
            elif AVX512BF16:
                out[k] = bf16_of_f32_bits(b)
            else:
                bb = np.int64(b)
                out[k] = np.uint16(((bb + _BF16_ROUND + ((bb >> _I16) & 1)) >> _I16) & _LOW16)
            av = abs(v)
            return np.int64(not (av >= _F32_MIN_NORMAL)) & np.int64(av != 0.0)
        return store_half

    def store_native(out: Any, k: Any, v: Any, h: Any) -> Any:
        out[k] = v
        return np.int64(0)
    return store_native


_ABLOCK = 2048  # elements per fast pass of fill_affine; a block with a rare element is stored again exactly


@_inline
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
    plain = (sc == 1.0) & math.isfinite(p0) & math.isfinite(p1) & (
        (abs(p0) >= 2.0**-73) | ((p0 == 0.0) & (abs(p1) >= 2.0**-122)))
    k = 0
    while k < m:
        x = x0 + np.uint64(k)
        cnt = min(m - k, seg_room(x))
        c, c1, hi = seg_consts(x)
        if plain:
            xl = x & _LOW32
            sub = dst[k:k + cnt]
            for j in range(cnt):
                store_fast(sub, np.uint64(j), p0 + draw_seg(xl + np.uint64(j), c, c1, hi) * p1, h)
            k += cnt
            continue
        for b0 in range(0, cnt, _ABLOCK):
            nb_ = min(cnt - b0, _ABLOCK)
            xl = (x & _LOW32) + np.uint64(b0)
            sub = dst[k + b0:k + b0 + nb_]
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


@_jit
def fill_affine_f16(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for float16 outputs."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, _F16)


@_jit
def fill_affine_bf16(dst: Any, x0: Any, p0: float, sc: float, p1: float) -> None:
    """affine_body for bfloat16 outputs (and float outputs, which ignore the format)."""
    wide_vectors()
    affine_body(dst, x0, p0, sc, p1, _BF16)


@_jit
def fill_affine(dst: Any, x0: Any, p0: float, sc: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + unit(g + k) * p1 (affine_body), the format's kernel chosen once per call."""
    if h[0] == 42:
        fill_affine_f16(dst, x0, p0, sc, p1)
    else:
        fill_affine_bf16(dst, x0, p0, sc, p1)


# ---------------------------------------------------------------------------
# Correctly rounded log and cos on the sampler's domain (docs/SAMPLER.md section 2.1).
#
# The inputs are log(max(k * 2^-32, 1e-6)) and cos((2.0 * pi) * (k * 2^-32)) for a 32-bit draw k. Each
# function has two vectorizable, branch-free evaluations on the same table-driven reduction:
# - `*_dd`: the result as an unevaluated sum hi + lo with a relative error far below 2^-74, and a flag that
#   says whether hi is provably the correctly rounded value (Ziv's test: |lo| + bound below half an ulp of
#   hi, hi not a power of two). Undecided inputs (about 1e-6 of them) look their draw k up in a short
#   table of the inputs whose hi is not the correctly rounded value (the FIX tables below, found by running
#   every one of the 2^32 inputs through this code and deciding the flagged ones with mpmath;
#   bench/verify_cr.py re-checks all 2^32 inputs against an independent oracle).
# - `*_plain`: a plain binary64 value within LOG_PLAIN_ULPS / COS_PLAIN_ULPS ulps of the correctly rounded
#   value (checked on all 2^32 inputs by bench/verify_cr.py); the float32/16-bit outputs propagate that
#   interval through the spec's monotone operations and fall back to the exact path only when the interval
#   straddles a rounding boundary of the output format.
# Fused multiply-adds (llvm.fma.f64) are used inside these functions only; the spec's own operations stay
# separate roundings. paraminit_kernels.cuh has the same code with __fma_rn, so CPU and GPU agree bit for bit.

def _fma_impl(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c with one rounding (llvm.fma.f64: the FMA instruction, or a correct libm call without one)."""
    if not all(isinstance(v, types.Float) for v in (a, b, c)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d = ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))
        return builder.call(fn, [context.cast(builder, v, t, types.float64)
                                 for v, t in zip(args, signature.args, strict=True)])

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

_D = decimal.Decimal
_PI_DEC = _D("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899863")


def _dd(d: decimal.Decimal) -> tuple[float, float]:
    """Nearest binary64 to d and the nearest binary64 to the rest (Decimal -> float rounds correctly)."""
    hi = float(d)
    return hi, float(d - _D(hi))


def _round_bits(x: decimal.Decimal, bits: int) -> float:
    """x rounded to `bits` significant bits (x > 0), exactly representable."""
    e = math.frexp(float(x))[1]
    return math.ldexp(float((x * _D(2) ** (bits - e)).to_integral_value(decimal.ROUND_HALF_EVEN)), e - bits)


def _sin_dec(x: decimal.Decimal) -> decimal.Decimal:
    """sin(x) by its Taylor series (|x| <= pi/2), in the current decimal context."""
    term, total, n = x, x, 1
    x2 = x * x
    while abs(term) > _D(10) ** -70:
        term = -term * x2 / ((n + 1) * (n + 2))
        total += term
        n += 2
    return total


_LOG_OFF = 0x3FE6000000000000  # reduced argument m in [0.6875, 1.375); interval 159 is [1 - 2^-9, 1)
_LOG_N = 256
_COS_N = 128  # cos table step pi/128


def _tables() -> dict[str, Any]:
    """Reduction tables and constants, from decimal arithmetic at 80 digits (at import, tens of ms)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 80
        r_tab, th_tab, tl_tab = [], [], []
        for i in range(_LOG_N):
            lo = struct.unpack("<d", struct.pack("<q", _LOG_OFF + (i << 44)))[0]
            hi = struct.unpack("<d", struct.pack("<q", _LOG_OFF + ((i + 1) << 44)))[0]
            # 20 bits: m * r - 1 is exact (m has <= 32); r = 1 keeps full relative accuracy just below x = 1
            r = 1.0 if i == 159 else _round_bits(_D(2) / (_D(lo) + _D(hi)), 20)
            th, tl = _dd(-_D(r).ln())
            r_tab.append(r)
            th_tab.append(th)
            tl_tab.append(tl)
        ln2 = _D(2).ln()
        ln2h = _round_bits(ln2, 44)  # E * LN2H exact for |E| < 2^9
        sins = [_sin_dec(_PI_DEC * j / _COS_N) for j in range(_COS_N // 2)] + [_D(1)]
        ch, cl, sh, sl = [], [], [], []
        for j in range(2 * _COS_N + 1):  # cos/sin of j * pi/128 by symmetry from sin on [0, pi/2]
            q, rr = divmod(j, _COS_N // 2)
            a = [sins[rr], sins[_COS_N // 2 - rr]]  # sin(rr h), cos(rr h), h = pi/128
            s, c = [(a[0], a[1]), (a[1], -a[0]), (-a[0], -a[1]), (-a[1], a[0]), (a[0], a[1])][q]
            ch_, cl_ = _dd(c)
            sh_, sl_ = _dd(s)
            ch.append(ch_)
            cl.append(cl_)
            sh.append(sh_)
            sl.append(sl_)
        step = _PI_DEC / _COS_N
        p1 = _round_bits(step, 44)
        p2 = _round_bits(step - _D(p1), 44)
        p3 = float(step - _D(p1) - _D(p2))
        third = _dd(_D(1) / 3)
        sixth = _dd(-_D(1) / 6)
        log_floor = float(_D(_U1_FLOOR).ln())
    return {
        "log_r": np.array(r_tab), "log_th": np.array(th_tab), "log_tl": np.array(tl_tab),
        "ln2h": ln2h, "ln2l": float(ln2 - _D(ln2h)),
        "cos_ch": np.array(ch), "cos_cl": np.array(cl), "cos_sh": np.array(sh), "cos_sl": np.array(sl),
        "p1": p1, "p2": p2, "p3": p3, "inv_step": float(_COS_N / _PI_DEC),
        "third": third, "sixth": sixth, "log_floor": log_floor,
    }


TABLES = _tables()
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
_I_OFF = np.int64(_LOG_OFF)
_I44 = np.int64(44)
_I52 = np.int64(52)
_MANT = np.int64((1 << 52) - 1)
_ABS = np.int64((1 << 63) - 1)
LOG_BOUND = 2.0**-74  # relative error bound of log_dd (measured below 2^-80; see bench/verify_cr.py)
COS_BOUND = 2.0**-74  # relative error bound of cos_dd
LOG_PLAIN_ULPS = 16  # log_plain is within this many ulps of the correctly rounded log
COS_PLAIN_ULPS = 16


@_inline
def two_sum(a: float, b: float) -> Any:
    """s + e = a + b exactly, s = fl(a + b) (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@_inline
def log_input(k: float) -> float:
    """The log input of a draw k (an integer-valued binary64): max(k * 2^-32, 1e-6)."""
    u1 = k * _TWO_NEG_32
    return _U1_FLOOR if u1 <= _U1_FLOOR else u1


@_inline
def cos_input(k: float) -> float:
    """The cos input of a draw k: (2.0 * pi) * (k * 2^-32)."""
    return _TWO_PI * (k * _TWO_NEG_32)


@_inline
def log_reduce(x: float) -> Any:
    """x = 2^e * m, m in [0.6875, 1.375); t = m * r_i - 1 (exact: m has <= 32 significant bits, r_i 20)."""
    ix = f64_bits(x)
    tmp = ix - _I_OFF
    i = np.uint64((tmp >> _I44) & _LOG_IMASK)
    e = np.float64(tmp >> _I52)
    m = bits_f64(ix - (tmp & _HIGH12))
    t = m * _LOG_R[i] - 1.0
    return e, t, _LOG_TH[i], _LOG_TL[i]


@_inline
def log_plain(x: float) -> Any:
    """log(x) within LOG_PLAIN_ULPS ulps, for x = k * 2^-32 > 1e-6 (any other x: log_input's floor).

    Only for the interval test of float32/16-bit outputs: two table reads, a degree-4 polynomial.
    """
    xs = x if x > _U1_FLOOR else 0.5
    ix = f64_bits(xs)
    tmp = ix - _I_OFF
    i = np.uint64((tmp >> _I44) & _LOG_IMASK)
    e = np.float64(tmp >> _I52)
    t = fma(bits_f64(ix - (tmp & _HIGH12)), _LOG_R[i], -1.0)
    q = fma(fma(fma(fma(-1.0 / 6, t, 0.2), t, -0.25), t, 1.0 / 3), t, -0.5)
    r = fma(e, _LN2, _LOG_TH[i]) + fma(t * t, q, t)
    return r if x > _U1_FLOOR else LOG_FLOOR


@_inline
def log_dd(x: float) -> Any:
    """log(x) as hi + lo (relative error < LOG_BOUND) and whether hi is its correct rounding."""
    xs = x if x > _U1_FLOOR else 0.5
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
    return (hi if x > _U1_FLOOR else LOG_FLOOR), lo, ok | (x <= _U1_FLOOR)


@_inline
def decided(hi: float, lo: float, bound: float) -> Any:
    """Whether hi = RN(hi + lo + err) for every |err| <= bound * |hi| (hi = RN(hi + lo) already).

    Half the gap to the nearer neighbour of hi: half an ulp, a quarter when hi is a power of two (the gap
    below it is half as wide).
    """
    bh = f64_bits(hi) & _ABS
    a = bits_f64(bh)
    half_gap = (0.5 if (bh & _MANT) != 0 else 0.25) * (bits_f64(bh + 1) - a)
    return abs(lo) + bound * a < half_gap


@_inline
def cos_reduce(t: float) -> Any:
    """t = j * pi/128 + (rh + rl), |r| <= pi/256 (+ a rounding), with a three-part pi/128."""
    jf = (t * _INV_STEP + _ROUND_MAGIC) - _ROUND_MAGIC
    j = np.uint64(np.int64(jf))
    r1 = t - jf * _P1  # exact: jf * P1 fits 53 bits, and t is within a factor 2 of it (Sterbenz)
    rh, e = two_sum(r1, -(jf * _P2))
    rl = e - jf * _P3
    return j, rh, rl


@_inline
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


@_inline
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
# `bench/verify_cr.py --fix-tables` (3044 log and 3224 cos inputs of 2^32 fail the rounding test; one hi is
# wrong) and checked there on all 2^32 inputs. Regenerate whenever log_dd or cos_dd change.
_LOG_FIX: dict[int, int] = {}
_COS_FIX: dict[int, int] = {
    2826473269: 1,
}


def _fix_arrays(fix: dict[int, int]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    keys = sorted(fix)
    return np.array([*keys, 2.0**33], dtype=np.float64), np.array([*(fix[k] for k in keys), 0], dtype=np.int64)


_LOG_FIX_K, _LOG_FIX_D = _fix_arrays(_LOG_FIX)
_COS_FIX_K, _COS_FIX_D = _fix_arrays(_COS_FIX)


@_jit
def _fixed(hi: float, k: float, keys: Any, deltas: Any) -> Any:
    """hi, or its correction when k is in a FIX table (keys sorted, with a sentinel above every draw)."""
    i = np.searchsorted(keys, k)
    if keys[i] == k:
        return bits_f64(f64_bits(hi) + deltas[i])
    return hi


@_jit
def cr_log(k: float) -> Any:
    """Correctly rounded log(max(k * 2^-32, 1e-6)) for a draw k (integer-valued binary64)."""
    hi, _, ok = log_dd(log_input(k))
    if ok:
        return hi
    return _fixed(hi, k, _LOG_FIX_K, _LOG_FIX_D)


@_jit
def cr_cos(k: float) -> Any:
    """Correctly rounded cos((2.0 * pi) * (k * 2^-32)) for a draw k."""
    hi, _, ok = cos_dd(cos_input(k))
    if ok:
        return hi
    return _fixed(hi, k, _COS_FIX_K, _COS_FIX_D)


@_jit
def normal_exact(d1: float, d2: float, p0: float, p1: float) -> Any:
    """mean + std * z of the spec, from two draws (the exact path, scalar)."""
    return p0 + p1 * (math.sqrt(-2.0 * cr_log(d1)) * cr_cos(d2))


# Distances in units in the last place (steps of the bit pattern), doubled where a binade boundary may halve
# the step: sqrt(-2 L) moves at most 2 * LOG_PLAIN_ULPS + 2 steps when L moves LOG_PLAIN_ULPS, and their
# product at most 4 * (S + C) + 8 steps.
_Z_ULPS = np.int64(4 * ((2 * LOG_PLAIN_ULPS + 2) + COS_PLAIN_ULPS) + 8)


@_inline
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
        return va, np.int64((sticky32(va) != sticky32(vb)) | (abs(va) < _F32_MIN_NORMAL))
    return half


_NBLOCK = 512  # elements per fast pass; a block with an undecided element is redone element by element


@_jit
def fill_normal(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> None:
    """dst[k] = p0 + p1 * z(g + k) with x0 = key + GOLDEN + 2g (draws 2(g+k) and 2(g+k)+1)."""
    wide_vectors()
    m = dst.shape[0]
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), normal_exact(low_draw(x), low_draw(x + _U1), p0, p1), h)
            k += 1
            continue
        c, c1, hi = seg_consts(x)
        for b0 in range(0, cnt, _NBLOCK):
            nb_ = min(cnt - b0, _NBLOCK)
            xl = (x & _LOW32) + _U2 * np.uint64(b0)
            sub = dst[k + b0:k + b0 + nb_]
            bad = 0
            for j in range(nb_):
                w = xl + _U2 * np.uint64(j)
                v, u = normal_fast(sub, draw_seg(w, c, c1, hi), draw_seg(w + _U1, c, c1, hi), p0, p1, h)
                store(sub, np.uint64(j), v, h)
                bad += u
            if bad:
                for j in range(nb_):
                    w = xl + _U2 * np.uint64(j)
                    d1 = draw_seg(w, c, c1, hi)
                    d2 = draw_seg(w + _U1, c, c1, hi)
                    _, u = normal_fast(sub, d1, d2, p0, p1, h)
                    if u:
                        store(sub, np.uint64(j), normal_exact(d1, d2, p0, p1), h)
        k += cnt


def trunc_fast(out: Any, d1: float, d2: float, p0: float, p1: float, lo: float, hi: float, h: Any) -> Any:
    """(candidate 0 to store, flag) for one truncated-normal element; the flag marks an element whose candidate 0
    may lie outside [lo, hi] or whose rounding is undecided. Vectorizable, branch-free."""
    raise NotImplementedError("called only inside kernels")


@overload(trunc_fast, inline="always")
def _trunc_fast_overload(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
    if out.dtype == types.float64:
        def f64(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
            lh, _, lok = log_dd(log_input(d1))
            ch, _, cok = cos_dd(cos_input(d2))
            v = p0 + p1 * (sqrt(-2.0 * lh) * ch)
            return v, np.int64(1) - np.int64(lok & cok & (lo <= v) & (v <= hi))
        return f64
    if out.dtype == types.float32:
        def f32(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
            va, vb = normal_bounds(d1, d2, p0, p1)
            inside = np.int64((lo <= va) & (vb <= hi))
            return va, np.int64(np.float32(va) != np.float32(vb)) | (np.int64(1) - inside)
        return f32

    def half(out: Any, d1: Any, d2: Any, p0: Any, p1: Any, lo: Any, hi: Any, h: Any) -> Any:
        va, vb = normal_bounds(d1, d2, p0, p1)
        inside = np.int64((lo <= va) & (vb <= hi))
        return va, np.int64((sticky32(va) != sticky32(vb)) | (abs(va) < _F32_MIN_NORMAL)) | (np.int64(1) - inside)
    return half


_CANDIDATES = 64  # spec.TRUNC_CANDIDATES


@_jit
def trunc_exact(g: Any, p0: float, p1: float, lo: float, hi: float, seed: Any) -> Any:
    """Section 2.2 for global element g, candidate by candidate on the exact path (scalar)."""
    v = p0
    for j in range(_CANDIDATES):
        x = mix(seed + np.uint64(j) * _GOLDEN) + _GOLDEN + _U2 * g  # key(s_j) + GOLDEN + 2g, as fill_normal's x0
        v = normal_exact(low_draw(x), low_draw(x + _U1), p0, p1)
        if lo <= v and v <= hi:
            return v
    c = lo if lo > v else v  # Python's min(max(v, lo), hi), as the spec writes it
    return hi if hi < c else c


@_jit
def fill_truncnorm(dst: Any, x0: Any, g0: Any, p0: float, p1: float, lo: float, hi: float, seed: Any,
                   h: Any) -> None:
    """dst[k] = truncated normal of element g0 + k; x0 = key(seed) + GOLDEN + 2 g0 (candidate 0's draws).

    One vectorized pass computes candidate 0 as fill_normal does and flags the elements it cannot settle
    (outside the bounds, or rounding undecided) in a byte per element; only those are redone, one by one,
    through every candidate on the exact path, so an element inside the bounds costs what a normal costs.
    """
    wide_vectors()
    m = dst.shape[0]
    flags = np.empty(_NBLOCK, dtype=np.uint8)
    k = 0
    while k < m:
        x = x0 + np.uint64(2 * k)
        cnt = min(m - k, seg_room(x) // 2)  # whole pairs left
        if cnt <= 0:  # this element's pair straddles a segment boundary
            store(dst, np.uint64(k), trunc_exact(g0 + np.uint64(k), p0, p1, lo, hi, seed), h)
            k += 1
            continue
        c, c1, hi32 = seg_consts(x)
        for b0 in range(0, cnt, _NBLOCK):
            nb_ = min(cnt - b0, _NBLOCK)
            xl = (x & _LOW32) + _U2 * np.uint64(b0)
            sub = dst[k + b0:k + b0 + nb_]
            bad = 0
            for j in range(nb_):
                w = xl + _U2 * np.uint64(j)
                v, u = trunc_fast(sub, draw_seg(w, c, c1, hi32), draw_seg(w + _U1, c, c1, hi32), p0, p1, lo, hi, h)
                store(sub, np.uint64(j), v, h)
                flags[j] = u
                bad += u
            if bad:
                gb = g0 + np.uint64(k + b0)
                for j in range(nb_):
                    if flags[j]:
                        store(sub, np.uint64(j), trunc_exact(gb + np.uint64(j), p0, p1, lo, hi, seed), h)
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
             lo: float, hi: float, seed: Any, values: Any, h: Any) -> None:
    """dst = elements g, g+1, ... of the full tensor (Kind codes as in plan.py); s = key + GOLDEN."""
    if kind == 4:
        fill_truncnorm(dst, s + _U2 * np.uint64(g), np.uint64(g), p0, p1, lo, hi, seed, h)
    elif kind == 1:
        fill_affine(dst, s + np.uint64(g), p0, sc, p1b, h)
    elif kind == 2:
        fill_normal(dst, s + _U2 * np.uint64(g), p0, p1, h)
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
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, _F16)
            else:
                fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, _BF16)
        return half

    def native(out: Any, dst: Any, g: Any, kind: Any, s: Any, p0: Any, p1: Any, sc: Any, p1b: Any,
               lo: Any, hi: Any, seed: Any, values: Any, fmt: Any) -> Any:
        fill_run(dst, g, kind, s, p0, p1, sc, p1b, lo, hi, seed, values, _BF16)
    return native


@_jit
def fill_piece(out: Any, l: int, lend: int, l_begin: int, kind: int, key: Any, p0: float, p1: float, sc: float,
               p1b: float, lo: float, hi: float, seed: Any, values: Any, fmt: int, outer_start: Any, outer_ext: Any,
               outer_stride: Any, base: int, run_len: int) -> None:
    """Local elements [l, lend) of the region, run by run (compiled once, called by both entry points)."""
    s = key + _GOLDEN
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


@_parallel
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


@_jit
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
    p1s = p1 * _TWO_NEG_32
    sc, p1b = (1.0, p1s) if p1s * 2.0**32 == p1 else (_TWO_NEG_32, p1)
    if n <= PIECE:
        fill_piece(out, l_begin, l_begin + n, l_begin, kind, key, p0, p1, sc, p1b, lo, hi, seed, values, fmt,
                   outer_start, outer_ext, outer_stride, base, run_len)
    else:
        fill_parallel(out, l_begin, kind, key, p0, p1, sc, p1b, lo, hi, seed, values, fmt,
                      outer_start, outer_ext, outer_stride, base, run_len)

