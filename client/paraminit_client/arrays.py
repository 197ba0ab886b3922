"""Numpy views of delivered bytes: one tensor table, one buffer, no copies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import numpy as np

from paraminit import dtypes
from paraminit_client.errors import ParaminitError


def numpy_dtype(dtype_enum: int) -> np.dtype[Any]:
    """The numpy dtype a plan dtype reads as (bfloat16 from ml_dtypes)."""
    dt = dtypes.by_enum(dtype_enum)
    if dt is None:
        raise ParaminitError(grpc.StatusCode.INTERNAL, f"server sent unknown dtype enum {dtype_enum}")
    return dt.numpy


def arrays_from_buffer(tensors: Iterable[Any], buf: Any) -> dict[str, np.ndarray[Any, Any]]:
    """Views of each tensor (name, dtype, shape, offset, nbytes) inside one buffer (numpy or any buffer)."""
    host = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    out: dict[str, np.ndarray[Any, Any]] = {}
    kinds: dict[int, np.dtype[Any]] = {}  # one lookup per dtype, not per tensor
    for t in tensors:
        dt = kinds.get(t.dtype)
        if dt is None:
            dt = kinds[t.dtype] = numpy_dtype(t.dtype)
        out[t.name] = host[t.offset:t.offset + t.nbytes].view(dt).reshape(tuple(t.shape))
    return out
