"""Parameter dtypes: storage, byte size and interchange names in one table.

float16 and bfloat16 are stored as their uint16 bit patterns so that every
backend writes the exact bits the spec rounds to (SAMPLER.md section 4),
without relying on any library's float64 -> half conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraminit.v1 import plan_pb2


@dataclass(frozen=True)
class DTypeInfo:
    """How one plan dtype is stored and named."""

    enum: int
    name: str  # numpy/torch style name, e.g. "bfloat16"
    safetensors: str  # safetensors header name, e.g. "BF16"
    itemsize: int
    storage: np.dtype[np.generic]  # what backends write into
    fmt: int  # kernel store format: 0 native float, 1 float16 bits, 2 bfloat16 bits


FMT_NATIVE = 0
FMT_FLOAT16 = 1
FMT_BFLOAT16 = 2

FLOAT32 = DTypeInfo(plan_pb2.DTYPE_FLOAT32, "float32", "F32", 4, np.dtype(np.float32), FMT_NATIVE)
FLOAT64 = DTypeInfo(plan_pb2.DTYPE_FLOAT64, "float64", "F64", 8, np.dtype(np.float64), FMT_NATIVE)
FLOAT16 = DTypeInfo(plan_pb2.DTYPE_FLOAT16, "float16", "F16", 2, np.dtype(np.uint16), FMT_FLOAT16)
BFLOAT16 = DTypeInfo(plan_pb2.DTYPE_BFLOAT16, "bfloat16", "BF16", 2, np.dtype(np.uint16), FMT_BFLOAT16)

_BY_ENUM: dict[int, DTypeInfo] = {
    plan_pb2.DTYPE_UNSPECIFIED: FLOAT32,
    plan_pb2.DTYPE_FLOAT32: FLOAT32,
    plan_pb2.DTYPE_FLOAT64: FLOAT64,
    plan_pb2.DTYPE_FLOAT16: FLOAT16,
    plan_pb2.DTYPE_BFLOAT16: BFLOAT16,
}
_BY_NAME: dict[str, DTypeInfo] = {d.name: d for d in (FLOAT32, FLOAT64, FLOAT16, BFLOAT16)}

SUPPORTED: tuple[DTypeInfo, ...] = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16)


def by_enum(value: int) -> DTypeInfo | None:
    """The dtype for a proto enum value, or None for values this server does not know."""
    return _BY_ENUM.get(value)


def by_name(name: str) -> DTypeInfo:
    """The dtype for a numpy-style name ("float32", "bfloat16", ...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_BY_NAME)}") from None
