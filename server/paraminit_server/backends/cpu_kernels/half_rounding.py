"""Rounding binary64 values once into float16, bfloat16 and 8-bit float bits, and the per-element store of every
fill.

float16/bfloat16 bits come through binary32 rounded to odd (`sticky32`), so the hardware conversions give the
one rounding (docs/SAMPLER.md section 3); `store_fast` is the vectorizable common path, and the rare elements it
flags (NaN, bfloat16 subnormals) are stored again with `store`. 8-bit floats (section 4.1) are rounded in integer
arithmetic on the binary64 bits (`narrow_bits`), branch-free, subnormals included.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from paraminit_server.backends.cpu_kernels.counter_rng import U1
from paraminit_server.backends.cpu_kernels.jit import AVX512BF16, F16C, bits_f64, f64_bits, jit

_SIGN16 = np.int64(0x8000)


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


F16 = _half_consts(10, -14, 15)
BF16 = _half_consts(7, -126, 127)
F8E5M2 = _half_consts(2, -14, 15)
# float8_e4m3fn has no infinity: the pattern past 448 (S.1111.111) is its NaN, and so is the clamp's result. A valid
# plan never reaches it (its values stay within 448, validation's range rule), so no saturation rule matters.
_E4M3 = _half_consts(3, -6, 8)
F8E4M3 = (_E4M3[0], _E4M3[1], 0x7F, 0x7F, _E4M3[4], 480.0, _E4M3[6], _E4M3[7])


def f32_bits_as(word: types.Integer) -> Any:
    """The intrinsic that reinterprets a binary32 as its bit pattern, typed `word` (a 32-bit integer type): one
    plain LLVM bitcast, whichever signedness the caller's arithmetic wants (uint32 here, int32 in f32_math)."""

    def bits(typingctx: Any, x: Any) -> Any:
        if x != types.float32:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))

        return word(types.float32), codegen

    bits.__qualname__ = bits.__name__ = f"f32_bits_{word}"
    return intrinsic(bits)


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


f32_bits: Any = f32_bits_as(types.uint32)
f16_of_f32_bits: Any = intrinsic(_f16_of_f32_bits)
bf16_of_f32_bits: Any = intrinsic(_bf16_of_f32_bits)
_LOW29 = np.int64((1 << 29) - 1)
_LOW16 = np.int64(0xFFFF)
_I16 = np.int64(16)
_I29 = np.int64(29)
_I48 = np.int64(48)
_BF16_ROUND = np.int64(0x7FFF)
F32_MIN_NORMAL = 2.0**-126


@jit
def narrow_magnitude_bits(v: float, h: Any) -> Any:
    """The bits of |v| rounded once, to nearest even, into a narrow format (h: its _half_consts), without the sign.

    Normal range: round at bit `shift` of the binary64 bits with the exponent rebiased in the same addition;
    carries run into the exponent, and |v| is first clamped to the smallest value that rounds to infinity (or, for
    float8_e4m3fn, to its NaN). Subnormal range: |v| + magic has the target's subnormal spacing as its ulp, so the
    hardware's one rounding is the spec's, and a value below half the smallest subnormal becomes zero. NaN becomes
    the quiet NaN. Branch-free.
    """
    shift, adj, _, nan_bits, min_normal, ovf, magic, magic_bits = h
    av = abs(v)
    a = np.uint64(f64_bits(min(av, ovf)))
    rn = np.int64((a + np.uint64(adj) + ((a >> np.uint64(shift)) & U1)) >> np.uint64(shift))
    rs = f64_bits(av + magic) - np.int64(magic_bits)
    r = rn
    if av < min_normal:
        r = rs
    if av != av:
        r = np.int64(nan_bits)
    return r


@jit
def half_bits_int(v: float, h: Any) -> Any:
    """half_bits in integer arithmetic on the binary64 bits (hosts without F16C): narrow_magnitude_bits with the
    sign in bit 15."""
    return np.uint16(narrow_magnitude_bits(v, h) | ((f64_bits(v) >> 48) & _SIGN16))


_SIGN8 = np.int64(0x80)
_I56 = np.int64(56)


@jit
def narrow_bits(v: float, h: Any) -> Any:
    """Round binary64 once, to nearest even, into 8-bit float bits (h: F8E4M3 or F8E5M2): narrow_magnitude_bits
    with the sign in bit 7 (a zero keeps its sign)."""
    return np.uint8(narrow_magnitude_bits(v, h) | ((f64_bits(v) >> _I56) & _SIGN8))


@jit
def sticky32(v: float) -> Any:
    """v rounded to odd at 24 significant bits, as binary32 (exact in binary32's normal range)."""
    bv = f64_bits(v)
    sticky = bv & _LOW29
    return np.float32(bits_f64((bv ^ sticky) | (np.int64(sticky != 0) << _I29)))


@jit
def half_bits(v: float, h: Any) -> Any:
    """Round binary64 once, to nearest even, into float16/bfloat16 bits (h: F16 or BF16); branch-free.

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
    """Write one binary64 value: one RNE cast into float arrays, half bits (half_bits) into uint16 arrays, 8-bit
    float bits (narrow_bits) into uint8 arrays."""
    raise NotImplementedError("called only inside kernels")


@overload(store)
def _store_overload(out: Any, k: Any, v: Any, h: Any) -> Any:
    if out.dtype == types.uint8:

        def store_byte(out: Any, k: Any, v: Any, h: Any) -> Any:
            out[k] = narrow_bits(v, h)

        return store_byte
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


# Left to LLVM's inliner, as the helpers are: inlined by numba, the 16- and 8-bit normal loops compiled in a process
# ran about 5x slower than the same kernels that process had saved, loaded from the cache in the next.
@overload(store_fast)
def _store_fast_overload(out: Any, k: Any, v: Any, h: Any) -> Any:
    if out.dtype == types.uint8:

        def store_byte(out: Any, k: Any, v: Any, h: Any) -> Any:
            out[k] = narrow_bits(v, h)  # branch-free and exact everywhere: nothing to redo
            return np.int64(0)

        return store_byte
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
            return np.int64(not (av >= F32_MIN_NORMAL)) & np.int64(av != 0.0)

        return store_half

    def store_native(out: Any, k: Any, v: Any, h: Any) -> Any:
        out[k] = v
        return np.int64(0)

    return store_native
