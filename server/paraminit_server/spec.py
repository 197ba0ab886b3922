"""Scalar definitions from docs/SAMPLER.md shared by validation, resolution and tests.

Everything here is plain Python on exact integers and binary64 floats: it is
the readable statement of the algorithm that the vectorized kernels must match.
"""

from __future__ import annotations

import math

from paraminit.shapes import fan_in_out, numel, shape_str

__all__ = ["candidate_seed", "fan_in_out", "kaiming_bound", "key", "mix", "numel", "shape_str", "trunc_bounds_ok",
           "unit", "xavier_bound"]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
TWO_NEG_32 = 2.0**-32
NORMAL_U1_FLOOR = 1e-6
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


def unit(seed: int, i: int) -> float:
    """The i-th uniform draw of a seed, in [0, 1 - 2^-32]."""
    return (mix((key(seed) + i) & MASK64) & 0xFFFFFFFF) * TWO_NEG_32


def xavier_bound(fan_in: int, fan_out: int) -> float:
    """sqrt(6 / (fanIn + fanOut)) with fans converted to binary64 first; 0 for zero fans."""
    denom = float(fan_in) + float(fan_out)
    return 0.0 if denom == 0.0 else math.sqrt(6.0 / denom)


def kaiming_bound(fan_in: int) -> float:
    """sqrt(6 / fanIn) (He-uniform for ReLU); 0 for a zero fan."""
    return 0.0 if fan_in == 0 else math.sqrt(6.0 / float(fan_in))


def candidate_seed(seed: int, j: int) -> int:
    """Seed of candidate j of a truncatedNormal: (seed + j * GOLDEN) mod 2^64 (section 2.2)."""
    return (seed + j * GOLDEN) & MASK64


def trunc_bounds_ok(mean: float, std: float, lo: float, hi: float) -> bool:
    """Section 2.2's interval rule: lo <= mean - 0.5 * std and hi >= mean + 0.5 * std (binary64 roundings)."""
    half = 0.5 * std
    return lo <= mean - half and hi >= mean + half
