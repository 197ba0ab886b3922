"""Numpy views of delivered bytes: one tensor table, one buffer, no copies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import numpy as np

from paraminit import dtypes, packed_table
from paraminit_client.errors import ParaminitError


def numpy_dtype(dtype_enum: int) -> np.dtype[Any]:
    """The numpy dtype a plan dtype reads as (bfloat16 from ml_dtypes)."""
    dt = dtypes.by_enum(dtype_enum)
    if dt is None:
        raise ParaminitError(grpc.StatusCode.INTERNAL, f"server sent unknown dtype enum {dtype_enum}")
    return dt.numpy


Columns = tuple[list[str], list[int], list[tuple[int, ...]], list[int], list[int]]


def table_columns(tensors: Iterable[Any] | packed_table.Table) -> Columns:
    """A tensor table's names, dtype enums, shapes, offsets and byte counts, in table order: its own `columns()`
    where it has them (a packed stream table, the in-process data plane's), else read from each row (TensorInfo
    messages, or anything with those attributes)."""
    if isinstance(tensors, packed_table.Table):
        return tensors.columns()
    columns = getattr(tensors, "columns", None)
    if columns is not None:
        return columns()  # type: ignore[no-any-return]
    listed = list(tensors)
    return (
        [t.name for t in listed],
        [t.dtype for t in listed],
        [tuple(t.shape) for t in listed],
        [t.offset for t in listed],
        [t.nbytes for t in listed],
    )


def arrays_from_buffer(tensors: Iterable[Any] | packed_table.Table, buf: Any) -> dict[str, np.ndarray[Any, Any]]:
    """Views of each tensor (name, dtype, shape, offset, nbytes) inside one buffer (numpy or any buffer).

    Consecutive tensors of one dtype and shape lying back to back (most of a plan of many small parameters) are
    viewed as one array and split along its first axis: one view each, without a slice, a cast and a reshape
    each. A packed stream table gives its runs; a table with `columns()` (the in-process data plane's) is read
    as its columns.
    """
    host = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if isinstance(tensors, packed_table.Table):
        names, found = tensors.names, tensors.runs()
    else:
        names, enums, shapes, offsets, sizes = table_columns(tensors)
        found = packed_table.runs(enums, shapes, offsets, sizes)
    out: dict[str, np.ndarray[Any, Any]] = {}
    kinds: dict[int, np.dtype[Any]] = {}  # one lookup per dtype, not per tensor
    for i, j, enum, shape, start, size in found:
        dt = kinds.get(enum)
        if dt is None:
            dt = kinds[enum] = numpy_dtype(enum)
        whole = host[start : start + (j - i) * size].view(dt)
        if j == i + 1:
            out[names[i]] = whole.reshape(shape)
        elif shape:
            out.update(zip(names[i:j], whole.reshape((j - i, *shape)), strict=True))
        else:  # scalars: 0-d views (iterating a 1-D array would give numpy scalars, copies)
            out.update((name, whole[k : k + 1].reshape(())) for k, name in enumerate(names[i:j]))
    return out
