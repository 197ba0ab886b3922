"""Shapes, fans and sizes: the arithmetic both ends of the contract must agree on (regions: paraminit.regions)."""

from __future__ import annotations

from collections.abc import Sequence

from paraminit import regions
from paraminit.v1 import plan_pb2


def numel(shape: Sequence[int]) -> int:
    """Element count; a scalar (empty shape) has one element."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def fan_in_out(shape: Sequence[int]) -> tuple[int, int]:
    """Fans of a Linear/Conv weight [out, in, k1, ..., kd] (docs/SAMPLER.md section 3); (0, 0) below rank 2."""
    if len(shape) < 2:
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
