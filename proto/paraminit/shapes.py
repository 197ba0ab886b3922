"""Shapes, fans and sizes: the arithmetic both ends of the contract must agree on (regions: paraminit.regions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from paraminit import regions
from paraminit.v1 import plan_pb2

MAX_ELEMENTS = (1 << 63) - 1  # flat indices are signed 64-bit in every kernel
MAX_RANK = 32  # dimensions of a parameter, a region or a patch's box


def numel(shape: Sequence[int]) -> int:
    """Element count; a scalar (empty shape) has one element."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def numel_at_most(shape: Sequence[int], cap: int) -> int:
    """numel(shape), or cap + 1 as soon as the product passes cap: the size of an untrusted shape in O(rank) small
    multiplications (a zero dimension anywhere makes it 0), never a big integer."""
    dims = [int(d) for d in shape]
    if 0 in dims:
        return 0
    n = 1
    for d in dims:
        n *= d
        if n > cap:
            return cap + 1
    return n


def fan_in_out(shape: Sequence[int]) -> tuple[int, int]:
    """Fans of a Linear/Conv weight [out, in, k1, ..., kd] (docs/SAMPLER.md section 3); (0, 0) below rank 2, and
    (0, 0) when any dimension is zero (so an empty tensor's fan is never a huge product of its other dimensions)."""
    if len(shape) < 2 or any(int(d) == 0 for d in shape):
        return 0, 0
    receptive = numel(shape[2:])
    return int(shape[1]) * receptive, int(shape[0]) * receptive


def region_of(p: plan_pb2.Param) -> list[tuple[int, int]]:
    """The parameter's region as (start, stop) per dim; no region means the whole tensor (regions.box_of)."""
    return list(regions.box_of(p))


def out_shape(p: plan_pb2.Param) -> tuple[int, ...]:
    """Shape of what is materialized: the region's extents."""
    return tuple(stop - start for start, stop in regions.box_of(p))


def shape_str(shape: Sequence[int]) -> str:
    """A shape printed as a Python-style list, as TorchLean's messages print it."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def output_problem(outputs: Mapping[str, Any], name: str, shape: Sequence[int], itemsize: int) -> str | None:
    """Why `outputs` cannot take parameter `name` in place, or None when `outputs[name]` can: both doors of
    `materialize_into` (in process and over a stream) write straight into the caller's memory, so an array that
    is missing, of another shape or item size, read-only or not C-contiguous (a view whose writes would land in a
    copy) is refused before a byte is written.

    Args:
        outputs: parameter name -> the caller's array (numpy or anything with shape, dtype and flags).
        name: the parameter.
        shape: the shape it materializes (its region's extents).
        itemsize: its dtype's bytes per element.

    Returns:
        The message naming the parameter and what it needs, or None.
    """
    out = outputs.get(name)
    if out is None:
        return f"no output array for parameter {name!r}"
    flags = getattr(out, "flags", None)
    dtype = getattr(out, "dtype", None)
    got_shape = getattr(out, "shape", None)
    if (
        got_shape is None
        or tuple(got_shape) != tuple(int(d) for d in shape)
        or getattr(dtype, "itemsize", None) != itemsize
        or not getattr(flags, "c_contiguous", False)
        or not getattr(flags, "writeable", False)
    ):
        got = f"{list(got_shape)} {dtype}" if got_shape is not None else type(out).__name__
        return (
            f"output for {name!r} must be a writable C-contiguous array of shape {shape_str(shape)} with {itemsize}-byte items, got {got}"
        )
    return None
