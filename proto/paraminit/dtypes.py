"""Parameter dtypes: the one table of enum, names, storage and byte size that server and client share.

float16 and bfloat16 are stored by backends as their uint16 bit patterns, and the 8-bit floats as uint8 ones, so
that every backend writes the exact bits the spec rounds to (docs/SAMPLER.md sections 4 and 4.1), without relying
on any library's float64 -> narrow conversion (PyTorch's rounds twice through float32). Clients view those bits
as numpy's float16 or ml_dtypes' bfloat16 / float8 types (`numpy`). ml_dtypes is imported when an array of one
of its types is first made (it takes about a second to import, which every command would otherwise pay).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit.v1 import plan_pb2

FMT_NATIVE = 0
FMT_FLOAT16 = 1
FMT_BFLOAT16 = 2
FMT_F8E4M3 = 3
FMT_F8E5M2 = 4


@dataclass(frozen=True)
class DTypeInfo:
    """How one plan dtype is stored and named."""

    enum: int
    name: str  # numpy/torch style name, e.g. "bfloat16"
    safetensors: str  # safetensors header name, e.g. "BF16"
    itemsize: int
    storage: np.dtype[Any]  # what backends write into (half formats: uint16 bit patterns)
    numpy_name: str  # what users read: a numpy dtype name, or "ml_dtypes.bfloat16"
    fmt: int  # kernel store format: FMT_NATIVE, FMT_FLOAT16, FMT_BFLOAT16, FMT_F8E4M3 or FMT_F8E5M2
    aliases: tuple[str, ...] = ()
    # the largest finite value of an 8-bit float, which a plan's values must not round beyond (SAMPLER.md 4.1);
    # None for the wider formats, where overflow gives infinity as IEEE rounding does
    max_finite: float | None = None
    mant_bits: int = 0  # fraction bits (float32: 23; float8_e4m3fn: 3)
    min_exp: int = 0  # exponent of the smallest normal value (float32: -126; float8_e4m3fn: -6)

    @property
    def unit_roundoff(self) -> float:
        """The relative error bound of one rounding into the format (half an ulp at 1)."""
        return 2.0 ** -(self.mant_bits + 1)

    @property
    def subnormal_spacing(self) -> float:
        """The spacing of its subnormal values (the absolute error bound of a rounding near zero is half of it)."""
        return 2.0 ** (self.min_exp - self.mant_bits)

    @property
    def via_ml_dtypes(self) -> bool:
        """Whether numpy knows this dtype only through ml_dtypes (bfloat16, the 8-bit floats): libraries that do
        not (cupy, torch.from_numpy) see its bit patterns (`storage`) instead."""
        return self.numpy_name.startswith(_ML_DTYPES)

    @property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype users read (ml_dtypes.bfloat16 for bfloat16, imported on first use)."""
        return _numpy_dtype(self.numpy_name)


_ML_DTYPES = "ml_dtypes."


@functools.cache
def _numpy_dtype(name: str) -> np.dtype[Any]:
    if name.startswith(_ML_DTYPES):
        import ml_dtypes

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name.removeprefix(_ML_DTYPES)))
        return found
    return np.dtype(name)


FLOAT32 = DTypeInfo(
    plan_pb2.DTYPE_FLOAT32, "float32", "F32", 4, np.dtype(np.float32), "float32", FMT_NATIVE, ("f32", "fp32", "float"), None, 23, -126
)
FLOAT64 = DTypeInfo(
    plan_pb2.DTYPE_FLOAT64, "float64", "F64", 8, np.dtype(np.float64), "float64", FMT_NATIVE, ("f64", "fp64", "double"), None, 52, -1022
)
FLOAT16 = DTypeInfo(
    plan_pb2.DTYPE_FLOAT16, "float16", "F16", 2, np.dtype(np.uint16), "float16", FMT_FLOAT16, ("f16", "fp16", "half"), None, 10, -14
)
BFLOAT16 = DTypeInfo(
    plan_pb2.DTYPE_BFLOAT16, "bfloat16", "BF16", 2, np.dtype(np.uint16), "ml_dtypes.bfloat16", FMT_BFLOAT16, ("bf16",), None, 7, -126
)

FLOAT8_E4M3FN = DTypeInfo(
    plan_pb2.DTYPE_FLOAT8_E4M3FN,
    "float8_e4m3fn",
    "F8_E4M3",
    1,
    np.dtype(np.uint8),
    "ml_dtypes.float8_e4m3fn",
    FMT_F8E4M3,
    ("f8e4m3", "fp8_e4m3", "float8_e4m3", "e4m3"),
    448.0,
    3,
    -6,
)
FLOAT8_E5M2 = DTypeInfo(
    plan_pb2.DTYPE_FLOAT8_E5M2,
    "float8_e5m2",
    "F8_E5M2",
    1,
    np.dtype(np.uint8),
    "ml_dtypes.float8_e5m2",
    FMT_F8E5M2,
    ("f8e5m2", "fp8_e5m2", "e5m2"),
    57344.0,
    2,
    -14,
)

SUPPORTED: tuple[DTypeInfo, ...] = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)
EIGHT_BIT: tuple[DTypeInfo, ...] = (FLOAT8_E4M3FN, FLOAT8_E5M2)
NAMES: tuple[str, ...] = tuple(d.name for d in SUPPORTED)

# DTYPE_UNSPECIFIED (0) means float32 wherever a dtype is read: proto3 omits zero, so a plan that
# names no dtype asks for the default.
_BY_ENUM: dict[int, DTypeInfo] = {plan_pb2.DTYPE_UNSPECIFIED: FLOAT32, **{d.enum: d for d in SUPPORTED}}
_BY_NAME: dict[str, DTypeInfo] = {n: d for d in SUPPORTED for n in (d.name, *d.aliases)}
_BY_SAFETENSORS: dict[str, DTypeInfo] = {d.safetensors: d for d in SUPPORTED}


def by_enum(value: int) -> DTypeInfo | None:
    """The dtype for a proto enum value (0 = float32), or None for values this version does not know."""
    return _BY_ENUM.get(int(value))


def by_name(name: str) -> DTypeInfo:
    """The dtype for a name or alias ("float32", "bf16", "DTYPE_FLOAT16", ...); ValueError lists the valid names."""
    key = name.strip().lower()
    key = key.removeprefix("dtype_")
    found = _BY_NAME.get(key)
    if found is None:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of {', '.join(NAMES)} (aliases: {', '.join(a for d in SUPPORTED for a in d.aliases)})"
        )
    return found


def by_safetensors(code: Any) -> DTypeInfo | None:
    """The dtype for a safetensors header code ("F32", "BF16", ...), or None."""
    return _BY_SAFETENSORS.get(code) if isinstance(code, str) else None


def by_numpy(dtype: Any) -> DTypeInfo | None:
    """The dtype of a numpy array's dtype (bfloat16 and the 8-bit floats from ml_dtypes), or None for others."""
    dt = np.dtype(dtype)
    for d in (BFLOAT16, *EIGHT_BIT):
        if dt.name == d.name:  # an array of it exists, so ml_dtypes is imported already
            return d if dt == d.numpy else None
    return next((d for d in SUPPORTED[:3] if d.numpy == dt), None)


def binary64_table(dt: DTypeInfo) -> npt.NDArray[np.float64]:
    """The binary64 value of each of the 256 bit patterns of an 8-bit float (NaN for its NaN patterns, and
    +-inf for float8_e5m2's): decoding a byte array is a lookup, `table[bytes]`, exact and without ml_dtypes."""
    if dt.max_finite is None:
        raise ValueError(f"{dt.name} is not an 8-bit float")
    return _binary64_table(dt.mant_bits, dt.min_exp, dt.fmt == FMT_F8E4M3)


@functools.cache
def _binary64_table(mant: int, emin: int, fn: bool) -> npt.NDArray[np.float64]:
    bits = np.arange(256)
    exp_bits = 7 - mant
    e = (bits >> mant) & ((1 << exp_bits) - 1)
    f = (bits & ((1 << mant) - 1)).astype(np.float64)
    bias = 1 - emin
    mag = np.where(e == 0, np.ldexp(f, emin - mant), np.ldexp(1.0 + f / (1 << mant), e - bias))
    top = (1 << exp_bits) - 1
    # e4m3fn: only S.1111.111 is special (NaN); IEEE formats: the top exponent holds infinities and NaNs
    special = np.where(f == (1 << mant) - 1, np.nan, mag) if fn else np.where(f == 0, np.inf, np.nan)
    mag = np.where(e == top, special, mag)
    table: npt.NDArray[np.float64] = np.where(bits & 0x80, -mag, mag)
    table.flags.writeable = False
    return table
