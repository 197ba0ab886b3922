"""Scalar definitions from docs/SAMPLER.md shared by validation, resolution and tests.

Everything here is plain Python on exact integers and binary64 floats: it is
the readable statement of the algorithm that the vectorized kernels must match.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from paraminit.inits import NORMAL_U1_FLOOR, kaiming_bound, trunc_bounds_ok, xavier_bound
from paraminit.shapes import fan_in_out, numel, shape_str

__all__ = [
    "NORMAL_U1_FLOOR",
    "candidate_seed",
    "fan_in_out",
    "kaiming_bound",
    "key",
    "keys",
    "mix",
    "numel",
    "shape_str",
    "trunc_bounds_ok",
    "unit",
    "xavier_bound",
]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
TWO_NEG_32 = 2.0**-32
TWO_PI = 2.0 * math.pi
TRUNC_CANDIDATES = 64  # truncatedNormal: candidates tried before the last one is clamped


def mix(x: int) -> int:
    """SplitMix64 finalizer on a 64-bit word."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def key(seed: int) -> int:
    """Per-seed stream key: mix(seed mod 2^64)."""
    return mix(seed & MASK64)


def keys(seeds: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """`key` of every seed of an array (numpy's uint64 arithmetic wraps modulo 2^64, as MASK64 does above)."""
    z = seeds.astype(np.uint64) + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MUL2)
    return z ^ (z >> np.uint64(31))


def unit(seed: int, i: int) -> float:
    """The i-th uniform draw of a seed, in [0, 1 - 2^-32]."""
    return (mix((key(seed) + i) & MASK64) & 0xFFFFFFFF) * TWO_NEG_32


def candidate_seed(seed: int, j: int) -> int:
    """Seed of candidate j of a truncatedNormal: (seed + j * GOLDEN) mod 2^64 (section 2.2)."""
    return (seed + j * GOLDEN) & MASK64
