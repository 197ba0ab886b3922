"""Plain reference implementation of docs/SAMPLER.md, for tests and cross-backend checks.

Deliberately written differently from the kernels: unit draws on NumPy uint64
arrays, normal element by element with log and cos correctly rounded by mpmath
(section 2.1; no libm, no tables), and half casts through Python's round()
(ties to even) on an exactly scaled binary64. Slow; use it on small tensors only.
"""

from __future__ import annotations

import math
from typing import Any

import mpmath
import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit_server.plans import sampler
from paraminit_server.plans.plan import Formula, ResolvedParam

# fmt: (fraction bits, smallest normal exponent, largest exponent, sign bit, overflow pattern, NaN pattern)
_NARROW_FORMATS = {
    dtypes.FMT_FLOAT16: (10, -14, 15, 0x8000, 0x7C00, 0x7E00),
    dtypes.FMT_BFLOAT16: (7, -126, 127, 0x8000, 0x7F80, 0x7FC0),
    dtypes.FMT_F8E5M2: (2, -14, 15, 0x80, 0x7C, 0x7E),
    dtypes.FMT_F8E4M3: (3, -6, 8, 0x80, 0x7F, 0x7F),
}  # e4m3fn: no infinity, 0x7F is NaN


def units(key: int, g: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """unit draws for global indices g of a stream key, vectorized on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + g + np.uint64(sampler.GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(sampler.MUL1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(sampler.MUL2)
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64(0xFFFFFFFF)).astype(np.float64) / 2.0**32


def global_indices(p: Any) -> npt.NDArray[np.int64]:
    """Global flat index of every local element of p's region (a window fake may carry its own)."""
    own = getattr(p, "global_indices", None)
    if callable(own):
        return np.asarray(own(), dtype=np.int64)
    grids = np.meshgrid(*[np.arange(a, b, dtype=np.int64) for a, b in p.region], indexing="ij")
    if not grids:
        return np.zeros(1, dtype=np.int64)
    return np.ravel_multi_index([g.ravel() for g in grids], p.shape).astype(np.int64)


def _nearest(v: Any) -> float:
    """The binary64 nearest an mpmath value, ties to even; refuses values too close to a tie to be sure."""
    c = float(v)
    other = math.nextafter(c, math.inf if v > c else -math.inf)
    mid = (mpmath.mpf(c) + mpmath.mpf(other)) / 2
    if abs(v - mid) <= abs(v) * mpmath.mpf(2) ** -(mpmath.mp.prec - 10):
        raise ArithmeticError(f"{v} is too close to a rounding boundary at {mpmath.mp.prec} bits")
    return c


def cr_log(x: float) -> float:
    """log(x) correctly rounded to binary64 (mpmath at 160 bits, then one rounding)."""
    with mpmath.workprec(160):
        return _nearest(mpmath.log(mpmath.mpf(x)))


def cr_cos(x: float) -> float:
    """cos(x) correctly rounded to binary64."""
    with mpmath.workprec(160):
        return _nearest(mpmath.cos(mpmath.mpf(x)))


def normal_z(u1: float, u2: float) -> float:
    """The spec's z from two unit draws: clamp, correctly rounded log and cos, every other step one rounding."""
    u1 = sampler.NORMAL_U1_FLOOR if u1 <= sampler.NORMAL_U1_FLOOR else u1
    return math.sqrt(-2.0 * cr_log(u1)) * cr_cos(sampler.TWO_PI * u2)


def values_f64(p: ResolvedParam, g: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float64]:
    """binary64 values of the parameter's region (or of global indices g), in local row-major order."""
    if g is None:
        g = global_indices(p)
    if p.formula == Formula.CONST:
        return np.full(g.shape, p.p0, dtype=np.float64)
    if p.formula == Formula.AFFINE:
        return p.p0 + units(p.key, g.astype(np.uint64)) * p.p1
    if p.formula == Formula.FLAT:
        assert p.values is not None
        return np.asarray(p.values[g], dtype=np.float64)  # payloads keep their own dtype
    if p.formula == Formula.TRUNCNORM:
        return np.asarray([truncated_normal(p, int(i)) for i in g.tolist()], dtype=np.float64)
    u1 = units(p.key, 2 * g.astype(np.uint64))
    u2 = units(p.key, 2 * g.astype(np.uint64) + np.uint64(1))
    z = [normal_z(a, b) for a, b in zip(u1.tolist(), u2.tolist(), strict=True)]
    return p.p0 + p.p1 * np.asarray(z, dtype=np.float64)


def truncated_normal(p: ResolvedParam, i: int) -> float:
    """Section 2.2 for element i, candidate by candidate from sampler.unit (scalar Python)."""
    v = p.p0
    for j in range(sampler.TRUNC_CANDIDATES):
        s = sampler.candidate_seed(p.seed, j)
        v = p.p0 + p.p1 * normal_z(sampler.unit(s, 2 * i), sampler.unit(s, 2 * i + 1))
        if p.lo <= v <= p.hi:
            return v
    return min(max(v, p.lo), p.hi)


def round_half_bits(v: float, fmt: int) -> int:
    """Bits of v rounded once, to nearest even, in a narrow format (float16, bfloat16, the 8-bit floats), by
    exact scaling and Python's round(); the spec's arithmetic written plainly, apart from the kernels'."""
    mant, emin, emax, sign_bit, overflow, nan = _NARROW_FORMATS[fmt]
    bias = -emin + 1
    sign = sign_bit if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return sign | nan
    a = abs(v)
    if a == 0.0:
        return sign
    e = max(math.frexp(a)[1] - 1, emin) if math.isfinite(a) else emax + 1
    if e > emax:
        return sign | overflow
    n = round(math.ldexp(a, mant - e))  # exact scaling; round() ties to even
    if n == 1 << (mant + 1):
        n >>= 1
        e += 1
    if e > emax:
        return sign | overflow
    if n < 1 << mant:
        return sign | n
    bits = ((e + bias) << mant) | (n - (1 << mant))
    return sign | min(bits, overflow)


def cast(values: npt.NDArray[np.float64], dt: dtypes.DTypeInfo) -> npt.NDArray[np.generic]:
    """binary64 values cast to a dtype's storage (float16/bfloat16 as uint16 bits, 8-bit floats as uint8 bits)."""
    if dt.fmt == dtypes.FMT_NATIVE:
        return values.astype(dt.storage)
    return np.asarray([round_half_bits(v, dt.fmt) for v in values.tolist()], dtype=dt.storage)


def materialize(p: ResolvedParam) -> npt.NDArray[np.generic]:
    """The parameter's region in storage dtype, shaped like the region."""
    return cast(values_f64(p), p.dtype).reshape(p.out_shape)


def canonical(plan: Any) -> bytes:
    """plan.proto's canonical bytes as the contract states them, through the message: a copy with unknown fields
    dropped and every unspecified Param.dtype set to float32, serialized deterministically."""
    from paraminit.v1 import plan_pb2

    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    out.DiscardUnknownFields()
    for p in out.params:  # SafetensorsRef.dtype keeps 0: there it means "any", not float32
        if p.dtype == plan_pb2.DTYPE_UNSPECIFIED:
            p.dtype = plan_pb2.DTYPE_FLOAT32
    return out.SerializeToString(deterministic=True)
