"""Regions of a tensor and the contiguous runs they cover: the one place both ends compute them.

A region is a box, (start, stop) per dimension, of a tensor of a given shape; a
parameter without one is the whole tensor. Kernels walk a region as runs of the
tensor's row-major order: the trailing dimensions the box covers fully merge
into each run, so a whole tensor is one run and a row shard one run per row.
Patches (a box over a region) and checkpoint reads (a region of a file's tensor)
ask for the same runs, expanded into one start index per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension

_NO_DIMS = np.zeros(0, dtype=np.int64)  # shared by every run set without outer dimensions (never written)
_ZERO = np.zeros(1, dtype=np.int64)


def _i64(values: list[int]) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64) if values else _NO_DIMS


def whole(shape: Sequence[int]) -> Box:
    """The box of the whole tensor."""
    return tuple((0, int(d)) for d in shape)


def box_of(p: Any) -> Box:
    """A plan parameter's region (`paraminit.v1.Param`): its `region` ranges, or the whole tensor without one."""
    return tuple((int(r.start), int(r.stop)) for r in p.region) or whole(p.shape)


@dataclass(frozen=True)
class Runs:
    """A region as contiguous runs of the full tensor's row-major order, in the form kernels walk.

    The global flat index of run r is `base + sum((digit_d(r) + outer_start[d]) * outer_stride[d])` over the
    outer dimensions (those before the first dimension of a run), digit_d(r) being r's row-major digits over
    `outer_ext`; each run holds `run_len` elements.
    """

    outer_start: npt.NDArray[np.int64]
    outer_ext: npt.NDArray[np.int64]
    outer_stride: npt.NDArray[np.int64]
    base: int
    run_len: int

    @classmethod
    def single(cls, n: int, base: int = 0) -> Runs:
        """One run of n elements from `base`."""
        return cls(_NO_DIMS, _NO_DIMS, _NO_DIMS, base, n)

    def global_index(self, l: int) -> int:
        """Global flat index of local element l (what the kernels compute per element)."""
        r, off = divmod(l, self.run_len)
        g = self.base + off
        for d in range(len(self.outer_ext) - 1, -1, -1):
            r, digit = divmod(r, int(self.outer_ext[d]))
            g += (digit + int(self.outer_start[d])) * int(self.outer_stride[d])
        return g

    def global_indices(self, l_begin: int, n: int) -> npt.NDArray[np.int64]:
        """Global flat indices of local elements [l_begin, l_begin + n), vectorized."""
        r, g = np.divmod(np.arange(l_begin, l_begin + n, dtype=np.int64), self.run_len)
        g += self.base
        for d in range(len(self.outer_ext) - 1, -1, -1):
            r, digit = np.divmod(r, int(self.outer_ext[d]))
            g += (digit + int(self.outer_start[d])) * int(self.outer_stride[d])
        return g

    def shifted(self, by: int) -> Runs:
        """The same runs with every global index `by` lower (for a slice of the values that starts there)."""
        return replace(self, base=self.base - by)

    def starts(self) -> npt.NDArray[np.int64]:
        """The global flat index of every run's first element, ascending (one entry per run)."""
        starts = _ZERO + self.base
        for d in range(len(self.outer_ext) - 1, -1, -1):
            lo = int(self.outer_start[d])
            offs = np.arange(lo, lo + int(self.outer_ext[d]), dtype=np.int64) * self.outer_stride[d]
            starts = (offs[:, None] + starts[None, :]).reshape(-1)
        return starts


def first_run_dim(shape: Sequence[int], box: Box) -> int:
    """The first dimension of a run of `box`: every later one the box covers fully (0 for a scalar)."""
    k = len(shape) - 1
    while k > 0 and box[k][0] == 0 and box[k][1] == shape[k]:
        k -= 1
    return max(k, 0)


def runs(shape: Sequence[int], box: Box, first_dim: int = 0) -> Runs:
    """The runs of `box` in the row-major order of a tensor of `shape` (a box of rank len(shape), not empty).

    Args:
        shape: the tensor's shape.
        box: (start, stop) per dimension, within the shape.
        first_dim: runs start at this dimension or a later one (shorter runs than the box allows, so that two
            boxes of the same extents walk alike).

    Returns:
        The runs; a scalar (rank 0) is one run of one element.
    """
    rank = len(shape)
    if rank == 0:
        return Runs.single(1)
    strides = [1] * rank
    for d in range(rank - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    k = max(first_run_dim(shape, box), first_dim)  # the first dimension of a run: every later one is covered fully
    lo_k, hi_k = box[k]
    if k == 0:
        return Runs(_NO_DIMS, _NO_DIMS, _NO_DIMS, lo_k * strides[0], (hi_k - lo_k) * strides[0])
    return Runs(
        _i64([box[d][0] for d in range(k)]),
        _i64([box[d][1] - box[d][0] for d in range(k)]),
        _i64(strides[:k]),
        lo_k * strides[k],
        (hi_k - lo_k) * strides[k],
    )


@dataclass(frozen=True)
class Region:
    """A box of a tensor: what one parameter (or one shard of it) materializes."""

    shape: tuple[int, ...]
    box: Box

    @classmethod
    def of(cls, shape: Sequence[int], box: Sequence[tuple[int, int]] | None = None) -> Region:
        """The region `box` of a tensor of `shape`; no box (or an empty one) is the whole tensor."""
        dims = tuple(int(d) for d in shape)
        return cls(dims, tuple((int(a), int(b)) for a, b in box) if box else whole(dims))

    @classmethod
    def of_param(cls, p: Any) -> Region:
        """A plan parameter's region (`paraminit.v1.Param`), defaulting to the whole tensor."""
        dims = tuple(int(d) for d in p.shape)
        return cls(dims, tuple((int(r.start), int(r.stop)) for r in p.region) or whole(dims))

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The extents: the shape of what the region materializes."""
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n

    @property
    def is_full(self) -> bool:
        return self.box == whole(self.shape)

    @property
    def fits(self) -> bool:
        """Whether the box has the shape's rank and lies within it (what runs() needs)."""
        return len(self.box) == len(self.shape) and all(0 <= a <= b <= d for (a, b), d in zip(self.box, self.shape, strict=True))

    def runs(self) -> Runs:
        """The region's runs in the full tensor's row-major order."""
        return runs(self.shape, self.box)

    def run_starts(self) -> tuple[npt.NDArray[np.int64], int]:
        """(global start index of every run, ascending; the common run length)."""
        r = self.runs()
        return r.starts(), r.run_len

    def local(self, box: Sequence[tuple[int, int]]) -> Region | None:
        """`box` (in the tensor's coordinates) intersected with this region, as a region of the region itself
        (coordinates relative to its start, shape its extents); None when they do not meet."""
        out = []
        for (ra, rb), (ba, bb) in zip(self.box, box, strict=True):
            lo, hi = max(ra, ba), min(rb, bb)
            if hi <= lo:
                return None
            out.append((lo - ra, hi - ra))
        return Region(self.out_shape, tuple(out))

    def local_runs(self, box: Sequence[tuple[int, int]]) -> tuple[npt.NDArray[np.int64], int]:
        """Runs of box ∩ region in the region's own row-major order: (local start of each run, run length);
        (no starts, 0) when they do not meet."""
        part = self.local(box)
        if part is None:
            return _NO_DIMS, 0
        return part.run_starts()

    def box_runs(self, box: Sequence[tuple[int, int]]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """Runs of box ∩ region contiguous both in the region's row-major order and in the box's own (a patch
        whose box is a tensor part): (local start of each run, its index within the box, run length); (no starts,
        no starts, 0) when they do not meet."""
        part = self.local(box)
        if part is None:
            return _NO_DIMS, _NO_DIMS, 0
        ext = tuple(b - a for a, b in box)
        in_box = tuple((lo + ra - ba, hi + ra - ba) for (lo, hi), (ra, _), (ba, _) in zip(part.box, self.box, box, strict=True))
        k = max(first_run_dim(part.shape, part.box), first_run_dim(ext, in_box))
        local, own = runs(part.shape, part.box, k), runs(ext, in_box, k)
        return local.starts(), own.starts(), local.run_len
