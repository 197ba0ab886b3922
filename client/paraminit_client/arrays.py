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
    """Views of each tensor (name, dtype, shape, offset, nbytes) inside one buffer (numpy or any buffer).

    Consecutive tensors of one dtype and shape lying back to back (most of a plan of many small parameters) are
    viewed as one array and split along its first axis: one view each, without a slice, a cast and a reshape
    each. A table with `columns()` (the in-process data plane's) is read as its columns.
    """
    host = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    columns = getattr(tensors, "columns", None)
    if columns is not None:
        names, enums, shapes, offsets, sizes = columns()
    else:
        listed = list(tensors)
        names, enums = [t.name for t in listed], [t.dtype for t in listed]
        shapes = [tuple(t.shape) for t in listed]
        offsets, sizes = [t.offset for t in listed], [t.nbytes for t in listed]
    out: dict[str, np.ndarray[Any, Any]] = {}
    kinds: dict[int, np.dtype[Any]] = {}  # one lookup per dtype, not per tensor
    n, i = len(names), 0
    while i < n:
        enum, shape, start, size = enums[i], shapes[i], offsets[i], sizes[i]
        j, end = i + 1, start + size
        while j < n and offsets[j] == end and sizes[j] == size and enums[j] == enum and shapes[j] == shape:
            j, end = j + 1, end + size
        dt = kinds.get(enum)
        if dt is None:
            dt = kinds[enum] = numpy_dtype(enum)
        if j == i + 1:
            out[names[i]] = host[start:end].view(dt).reshape(shape)
        else:
            out.update(zip(names[i:j], host[start:end].view(dt).reshape((j - i, *shape)), strict=True))
        i = j
    return out
