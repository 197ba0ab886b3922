"""Parameter dtypes: the one table of enum, names, storage and byte size that server and client share.

float16 and bfloat16 are stored by backends as their uint16 bit patterns so that
every backend writes the exact bits the spec rounds to (docs/SAMPLER.md section 4),
without relying on any library's float64 -> half conversion. Clients view those
bits as ml_dtypes' bfloat16 / numpy's float16 (`numpy`). ml_dtypes is imported when a bfloat16 array is
first made (it takes about a second to import, which every command would otherwise pay).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from paraminit.v1 import plan_pb2

FMT_NATIVE = 0
FMT_FLOAT16 = 1
FMT_BFLOAT16 = 2


@dataclass(frozen=True)
class DTypeInfo:
    """How one plan dtype is stored and named."""

    enum: int
    name: str  # numpy/torch style name, e.g. "bfloat16"
    safetensors: str  # safetensors header name, e.g. "BF16"
    itemsize: int
    storage: np.dtype[Any]  # what backends write into (half formats: uint16 bit patterns)
    numpy_name: str  # what users read: a numpy dtype name, or "ml_dtypes.bfloat16"
    fmt: int  # kernel store format: FMT_NATIVE, FMT_FLOAT16 or FMT_BFLOAT16
    aliases: tuple[str, ...] = ()

    @property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype users read (ml_dtypes.bfloat16 for bfloat16, imported on first use)."""
        return _numpy_dtype(self.numpy_name)


@functools.cache
def _numpy_dtype(name: str) -> np.dtype[Any]:
    if name.startswith("ml_dtypes."):
        import ml_dtypes

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name.removeprefix("ml_dtypes.")))
        return found
    return np.dtype(name)


FLOAT32 = DTypeInfo(plan_pb2.DTYPE_FLOAT32, "float32", "F32", 4, np.dtype(np.float32), "float32",
                    FMT_NATIVE, ("f32", "fp32", "float"))
FLOAT64 = DTypeInfo(plan_pb2.DTYPE_FLOAT64, "float64", "F64", 8, np.dtype(np.float64), "float64",
                    FMT_NATIVE, ("f64", "fp64", "double"))
FLOAT16 = DTypeInfo(plan_pb2.DTYPE_FLOAT16, "float16", "F16", 2, np.dtype(np.uint16), "float16",
                    FMT_FLOAT16, ("f16", "fp16", "half"))
BFLOAT16 = DTypeInfo(plan_pb2.DTYPE_BFLOAT16, "bfloat16", "BF16", 2, np.dtype(np.uint16), "ml_dtypes.bfloat16",
                     FMT_BFLOAT16, ("bf16",))

SUPPORTED: tuple[DTypeInfo, ...] = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16)
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
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(NAMES)} "
                         f"(aliases: {', '.join(a for d in SUPPORTED for a in d.aliases)})")
    return found


def by_safetensors(code: Any) -> DTypeInfo | None:
    """The dtype for a safetensors header code ("F32", "BF16", ...), or None."""
    return _BY_SAFETENSORS.get(code) if isinstance(code, str) else None


def by_numpy(dtype: Any) -> DTypeInfo | None:
    """The dtype of a numpy array's dtype (bfloat16 from ml_dtypes), or None for non-float types."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":  # an array of it exists, so ml_dtypes is imported already
        return BFLOAT16 if dt == BFLOAT16.numpy else None
    return next((d for d in SUPPORTED[:3] if d.numpy == dt), None)
