"""Plans as columns: checked, valued and resolved a column at a time instead of a parameter at a time.

A plan of 100,000s of small parameters (a mixture of experts) costs microseconds per parameter when every
step reads the message and builds objects per parameter. `of` scans the plan's wire bytes once (plans/scanner.py)
and, for the plain parameters (a whole tensor of a distribution or a constant: nearly all of them), computes
their sizes, form checks (the initializer table's `forms`) and kernel values as arrays. The check's one sweep
(validation.check) takes these columns; everything else about a plan (regions, patches, data, any parameter that
fails a check) goes through the per-parameter code, which keeps one statement of every rule and every message.

Every plan is columns, whatever its size: a plan too small to be worth a scan has no plain rows (every row is
special, read one by one), so the sweep, layouts, fills and backends read one representation.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from paraminit import dtypes, inits
from paraminit.shapes import MAX_RANK
from paraminit.v1 import plan_pb2
from paraminit_server.plans import plan as _plan
from paraminit_server.plans import scanner
from paraminit_server.plans.plan import Formula, ResolvedParam, kernel_columns

SCAN_MIN = 16  # from this many parameters a plan is read as columns: reading them (~0.4 ms) beats resolving each row (~25 us)
_SMALL = float(1 << 59)  # element counts below this cannot overflow 2^63 bytes at 8 bytes per element
_KIND_BY_NUMBER = {plan_pb2.Init.DESCRIPTOR.fields_by_name[k.field].number: k for k in inits.KINDS.values()}
_ITEMSIZE = np.zeros(max(d.enum for d in dtypes.SUPPORTED) + 1, dtype=np.int64)
_MAX_FINITE = np.full(_ITEMSIZE.shape[0], np.inf)  # the 8-bit range rule's limit per dtype (none for the rest)
for _d in dtypes.SUPPORTED:
    _ITEMSIZE[_d.enum] = _d.itemsize
    _MAX_FINITE[_d.enum] = np.inf if _d.max_finite is None else _d.max_finite


@dataclass(frozen=True)
class Columns:
    """A plan's columns; `plain` rows are valued here, the rest (every row of a plan not scanned) are read from
    the message."""

    scan: scanner.Scan | None  # None: too small to scan, no plain rows
    names: list[str]
    name_bytes: npt.NDArray[np.int64]  # each name's UTF-8 length
    init: npt.NDArray[np.int64]  # the Init oneof's field number (-1 where not scanned)
    shapes: list[tuple[int, ...]]
    plain: npt.NDArray[np.bool_]
    dtype: npt.NDArray[np.int64]  # enum, an omitted dtype as float32
    numel: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.int64]
    kernel: npt.NDArray[np.int64]  # plan.Formula of plain rows
    p0: npt.NDArray[np.float64]
    p1: npt.NDArray[np.float64]
    key: npt.NDArray[np.uint64]
    lo: npt.NDArray[np.float64]
    hi: npt.NDArray[np.float64]
    seed: npt.NDArray[np.uint64]

    def __len__(self) -> int:
        return len(self.names)


def of(plan: plan_pb2.Plan) -> Columns:
    """The plan's columns: scanned from SCAN_MIN parameters on; a smaller plan's rows are all special."""
    if len(plan.params) < SCAN_MIN:
        return _unscanned(plan)
    s = scanner.scan(plan)
    n = len(s)
    rank = np.diff(s.dims_at)
    dtype = np.where(s.dtype == 0, plan_pb2.DTYPE_FLOAT32, s.dtype)
    known = (dtype >= 0) & (dtype < _ITEMSIZE.shape[0])
    itemsize = np.where(known, _ITEMSIZE[np.where(known, dtype, 0)], 0)
    numel, small = _numel(s, rank)
    plain = s.regular & (itemsize > 0) & (rank <= MAX_RANK) & small
    kernel = np.full(n, -1, dtype=np.int64)
    p0, p1, lo, hi = (np.zeros(n) for _ in range(4))
    key, seed = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    for number in np.unique(s.kind[plain]).tolist():
        kind = _KIND_BY_NUMBER.get(number)
        if kind is None or kind.forms is None:
            continue
        rows = np.flatnonzero(plain & (s.kind == number))
        message = type(getattr(plan_pb2.Init(), kind.field))
        forms = kind.forms(functools.partial(_field, s, message, rows), rows.shape[0])  # all the table says of them
        good = forms.ok & s.declared[rows]
        if forms.bound is not None:  # 8-bit rows out of range: checked one by one
            with np.errstate(invalid="ignore"):
                good &= forms.bound <= _MAX_FINITE[dtype[rows]]
        at = rows[good]
        code, a, b, k, low, high, sd = kernel_columns(forms.kernel, good)
        kernel[at], p0[at], p1[at], key[at], lo[at], hi[at], seed[at] = code, a, b, k, low, high, sd
    plain &= kernel >= 0
    name_bytes = s.name_at[:, 1] - s.name_at[:, 0]
    return Columns(s, s.names(), name_bytes, s.kind, s.shapes(), plain, dtype, numel, numel * itemsize, kernel, p0, p1, key, lo, hi, seed)


def _unscanned(plan: plan_pb2.Plan) -> Columns:
    """A small plan's columns: no plain row, so the sweep reads every row from the message (its name, for the
    name rules, and the rest); the other columns are only placeholders the special rows replace."""
    n = len(plan.params)
    names = [p.name for p in plan.params]
    zero, zero_i, zero_u = np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64)
    none = np.full(n, -1, dtype=np.int64)
    size = np.fromiter((len(name.encode()) for name in names), dtype=np.int64, count=n)
    plain = np.zeros(n, dtype=bool)
    return Columns(None, names, size, none, [()] * n, plain, zero_i, zero_i, zero_i, none, zero, zero, zero_u, zero, zero, zero_u)


def _field(s: scanner.Scan, message: Any, rows: npt.NDArray[np.int64], name: str) -> npt.NDArray[Any]:
    return s.field(message, name)[rows]


def _numel(s: scanner.Scan, rank: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Element counts, and whether each is below _SMALL (larger ones are left to the per-parameter checks)."""
    n = rank.shape[0]
    numel = np.ones(n, dtype=np.int64)
    small = np.ones(n, dtype=bool)
    for r in np.unique(rank).tolist():
        if r == 0:
            continue
        rows = np.flatnonzero(rank == r)
        mat = s.dims[s.dims_at[rows][:, None] + np.arange(r)]
        # zero dimensions count as 1 here: an empty tensor's other dimensions must still be small to stay plain
        ok = np.where(mat == 0, 1, mat).astype(np.float64).prod(axis=1) < _SMALL
        numel[rows] = np.where(ok, np.where(ok[:, None], mat, 0).astype(np.int64).prod(axis=1), 0)
        small[rows] = ok
    return numel, small


class ParamTable(Sequence[ResolvedParam]):
    """A resolved plan (or part of one) whose plain parameters are columns: indexing builds their ResolvedParam on
    demand, while the hot paths (stream layout, tensor tables, the CPU backend's batched fill) read the columns.
    Row i is the plan's parameter plan_index[i]; `special` holds the ResolvedParam of every row that is not plain.
    Every row has its name, shape, dtype, numel, nbytes and itemsize in the columns; the kernel columns (kernel,
    p0, p1, key, lo, hi, seed, init) are meaningful on plain rows only."""

    def __init__(self, cols: Columns, special: dict[int, ResolvedParam]) -> None:
        self.special = special
        self.plan_index = np.arange(len(cols), dtype=np.int64)
        self.plain = cols.plain
        self.names = cols.names
        self.shapes = cols.shapes  # delivered (region) shapes
        self.dtype = cols.dtype
        self.init = cols.init  # Init oneof field number
        self.kernel, self.p0, self.p1, self.key = cols.kernel, cols.p0, cols.p1, cols.key
        self.lo, self.hi, self.seed = cols.lo, cols.hi, cols.seed
        self.numel, self.nbytes = cols.numel, cols.nbytes
        if special:  # the table's columns describe every row: the special rows' from their ResolvedParam
            self.names, self.shapes = list(self.names), list(self.shapes)
            self.dtype, self.numel, self.nbytes = self.dtype.copy(), self.numel.copy(), self.nbytes.copy()
            for i, rp in special.items():
                self.names[i], self.shapes[i], self.dtype[i] = rp.name, rp.out_shape, rp.dtype.enum
                self.numel[i], self.nbytes[i] = rp.numel, rp.nbytes
        self.itemsize = _ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, params: Sequence[ResolvedParam]) -> ParamTable:
        """A table of parameters resolved one by one, every row special: a plan without columns, the warm-up's
        parameters, one output of an in-process fill.

        Args:
            params: resolved parameters, in the order the table's rows take.

        Returns:
            Their table.
        """
        n = len(params)
        out = object.__new__(cls)
        out.special = dict(enumerate(params))
        out.plan_index = np.fromiter((p.index for p in params), dtype=np.int64, count=n)
        out.plain = np.zeros(n, dtype=bool)
        out.names, out.shapes = [p.name for p in params], [p.out_shape for p in params]
        out.dtype = np.fromiter((p.dtype.enum for p in params), dtype=np.int64, count=n)
        out.numel = np.fromiter((p.numel for p in params), dtype=np.int64, count=n)
        out.nbytes = np.fromiter((p.nbytes for p in params), dtype=np.int64, count=n)
        out.itemsize = _ITEMSIZE[out.dtype]
        zero, zero_u = np.zeros(n), np.zeros(n, dtype=np.uint64)  # read only on plain rows: none here
        out.init = out.kernel = np.full(n, -1, dtype=np.int64)
        out.p0 = out.p1 = out.lo = out.hi = zero
        out.key = out.seed = zero_u
        return out

    def take(self, rows: npt.NDArray[np.int64]) -> ParamTable:
        """The table of these rows only (ascending), e.g. the parameters inside one slab of a stream."""
        out = object.__new__(ParamTable)
        listed = rows.tolist()
        out.special = {j: self.special[i] for j, i in enumerate(listed) if i in self.special} if self.special else {}
        out.names, out.shapes = [self.names[i] for i in listed], [self.shapes[i] for i in listed]
        for column in (
            "plan_index",
            "plain",
            "dtype",
            "init",
            "kernel",
            "p0",
            "p1",
            "key",
            "lo",
            "hi",
            "seed",
            "numel",
            "nbytes",
            "itemsize",
        ):
            setattr(out, column, getattr(self, column)[rows])
        return out

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> ResolvedParam: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ResolvedParam]: ...

    def __getitem__(self, i: int | slice) -> ResolvedParam | Sequence[ResolvedParam]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        rp = self.special.get(i)
        if rp is not None:
            return rp
        dt = dtypes.by_enum(int(self.dtype[i]))
        assert dt is not None, "plain rows have a known dtype"
        kind = _KIND_BY_NUMBER[int(self.init[i])]
        return ResolvedParam.whole(
            int(self.plan_index[i]),
            self.names[i],
            self.shapes[i],
            dt,
            kind.field,
            Formula(int(self.kernel[i])),
            float(self.p0[i]),
            float(self.p1[i]),
            int(self.key[i]),
            float(self.lo[i]),
            float(self.hi[i]),
            int(self.seed[i]),
        )

    def __iter__(self) -> Iterator[ResolvedParam]:
        for i in range(len(self)):
            yield self[i]

    def kinds(self) -> set[tuple[int, Formula]]:
        """The (dtype enum, kernel kind) pairs the table's fills use, read from the columns (plan.kinds_of)."""
        plain = self.plain & (self.numel > 0)
        codes: list[int] = (
            np.flatnonzero(np.bincount(self.dtype[plain] * len(Formula) + self.kernel[plain])).tolist() if plain.any() else []
        )
        return {(c // len(Formula), Formula(c % len(Formula))) for c in codes} | _plan.kinds_of(list(self.special.values()))
