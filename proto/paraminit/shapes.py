"""Shapes, fans and sizes: the arithmetic both ends of the contract must agree on (regions: paraminit.regions)."""

from __future__ import annotations

from collections.abc import Sequence

from paraminit import regions
from paraminit.v1 import plan_pb2

MAX_ELEMENTS = (1 << 63) - 1  # flat indices are signed 64-bit in every kernel


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
