"""The counter-based generator: SplitMix64 of (key + GOLDEN + index) and its low 32 bits as a binary64 draw.

Every value is a function of (key, global element index) only (docs/SAMPLER.md section 1), so bytes never depend
on threads, scheduling or chunking. The fill loops draw through `draw_seg`, which LLVM vectorizes:
- SplitMix64 runs as is where the host has a 64-bit vector multiply (AVX-512DQ); elsewhere its first multiply
  works on 32-bit halves: inside a segment where `x >> 30` is constant, `x ^ (x >> 30)` has a constant high
  word, so its product needs two 32x32 multiplies instead of three;
- the low 32 bits of a draw become a binary64 by the exponent-bias trick (OR into 2^52, subtract 2^52), which
  is exact and needs no packing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paraminit_server.backends.cpu_kernels.jit import WIDE_MULTIPLY, bits_f64, jit

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL1_LO = np.uint64(0x1CE4E5B9)
_MUL1_HI = np.uint64(0xBF58476D)
_MUL2 = np.uint64(0x94D049BB133111EB)
LOW32 = np.uint64(0xFFFFFFFF)
_LOW30 = np.uint64((1 << 30) - 1)
_SPAN30 = np.uint64(1 << 30)
U1 = np.uint64(1)
U2 = np.uint64(2)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_EXP52 = np.uint64(0x4330000000000000)  # bits of 2^52: OR a u32 into its mantissa to get 2^52 + u32
_TWO52 = 2.0**52
TWO_NEG_32 = 2.0**-32  # a draw k (an integer in [0, 2^32)) times this is the spec's unit value


@jit
def mix(x: Any) -> Any:
    """SplitMix64 finalizer on a uint64 (the plain form, for the rare elements off the fast path)."""
    z = x + GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


@jit
def low_draw(x: Any) -> Any:
    """Low 32 bits of mix(x - GOLDEN) as an exact binary64 integer in [0, 2^32)."""
    return bits_f64((mix(x - GOLDEN) & LOW32) | _EXP52) - _TWO52


@jit
def seg_consts(x0: Any) -> Any:
    """Constants of a segment of words x = key + GOLDEN + i that share `x >> 30` (see draw_seg)."""
    c = x0 >> _S30
    a_hi = (x0 ^ c) >> _S32
    return c & LOW32, ((a_hi * _MUL1_LO) & LOW32) << _S32, x0 & ~LOW32


@jit
def draw_bits(xl: Any, c: Any, c1: Any, hi: Any) -> Any:
    """The draw of x = hi | xl (the low 32 bits of mix(x - GOLDEN), as uint64) in a segment with constants
    seg_consts(x).

    With a 64-bit vector multiply (AVX-512DQ) the plain SplitMix64 is cheapest. Without one (AVX2):
    a = x ^ (x >> 30) = x ^ C; its high word is constant, so a * MUL1 needs a_lo * MUL1_lo (64-bit) and the
    low word of a_lo * MUL1_hi only; the high-word product is folded into c1.
    """
    if WIDE_MULTIPLY:
        return mix((hi | xl) - GOLDEN) & LOW32
    a = (xl ^ c) & LOW32
    z = a * _MUL1_LO + ((a * _MUL1_HI) << _S32) + c1
    z = (z ^ (z >> _S27)) * _MUL2
    return (z ^ (z >> _S31)) & LOW32


@jit
def draw_seg(xl: Any, c: Any, c1: Any, hi: Any) -> Any:
    """low_draw(x) for x = hi | xl in a segment with constants seg_consts(x): draw_bits as an exact binary64."""
    return bits_f64(draw_bits(xl, c, c1, hi) | _EXP52) - _TWO52


@jit
def seg_room(x0: Any) -> Any:
    """How many words from x0 on stay in x0's 2^30-word segment (where `x >> 30` is constant)."""
    return np.int64(_SPAN30 - (x0 & _LOW30))
