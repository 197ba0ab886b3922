"""A validated plan resolved into what kernels need: value formula, two binary64 parameters, key, runs.

Every initializer reduces to one of five value formulas, so a backend implements
five value formulas whatever the initializer: constants, affine maps of the unit
draw (uniform, xavier, kaiming, their "for shape" forms), normal, truncated
normal, and flat payloads (inline values, uploaded payloads, checkpoint tensors).
The initializer table (paraminit.inits) maps every initializer to its value form;
this module maps the forms to kernels, and reads payloads and checkpoints through
the request's snapshot (snapshot.RequestSnapshot), the one the check's sweep read.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from paraminit import dtypes, inits, regions
from paraminit.regions import Runs as Runs  # what backends walk; defined with the regions
from paraminit.v1 import plan_pb2
from paraminit_server import errors
from paraminit_server.plans import sampler

if TYPE_CHECKING:
    from paraminit_server.plans.snapshot import RequestSnapshot

# Byte offsets of parameters in a buffer, in plan order: a list, or an array for a large plan's ParamTable
Offsets = Sequence[int] | npt.NDArray[np.int64]


class Formula(enum.IntEnum):
    """The five value formulas a kernel computes, whatever the initializer (inits.Kernel.formula names one)."""

    CONST = 0
    AFFINE = 1  # p0 + unit(i) * p1
    NORMAL = 2  # p0 + p1 * z(i)
    FLAT = 3  # values[i]
    TRUNCNORM = 4  # the first p0 + p1 * z_j(i) in [lo, hi], z_j under candidate_seed(seed, j)


@dataclass(frozen=True)
class ResolvedParam:
    """One parameter ready for a kernel; built only from a plan that validated."""

    index: int
    name: str
    shape: tuple[int, ...]
    region: tuple[tuple[int, int], ...]
    dtype: dtypes.DTypeInfo
    initializer: str
    formula: Formula
    p0: float = 0.0
    p1: float = 0.0
    key: int = 0
    # FLAT values: binary64, or an uploaded payload kept in its own float dtype (exact in binary64; backends
    # convert the slice a window reads)
    values: npt.NDArray[Any] | None = field(default=None, repr=False)
    patches: tuple[Patch, ...] = ()
    compact: bool = False  # values hold only the region (row-major), not the whole tensor: values[local index]
    # TRUNCNORM: the absolute bounds and the raw seed (candidate j's key is key(candidate_seed(seed, j)))
    lo: float = 0.0
    hi: float = 0.0
    seed: int = 0

    # Derived once at construction: the data plane asks for these many times per parameter, and a plan can hold
    # 100,000s of them (replace() derives them again).
    out_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)
    _runs: Runs = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        region = self.region
        out_shape = tuple([stop - start for start, stop in region])
        numel = sampler.numel(out_shape)
        setattr_ = object.__setattr__
        setattr_(self, "out_shape", out_shape)
        setattr_(self, "numel", numel)
        setattr_(self, "nbytes", numel * self.dtype.itemsize)
        if self.compact:  # values are indexed by the local index: one run from 0
            setattr_(self, "_runs", Runs.single(max(1, numel)))
        elif out_shape == self.shape:  # a (valid) region as large as the tensor is the whole tensor: one run
            setattr_(self, "_runs", Runs.single(numel))
        else:
            setattr_(self, "_runs", regions.runs(self.shape, region))

    @classmethod
    def whole(
        cls,
        index: int,
        name: str,
        shape: tuple[int, ...],
        dtype: dtypes.DTypeInfo,
        initializer: str,
        formula: Formula,
        p0: float = 0.0,
        p1: float = 0.0,
        key: int = 0,
        lo: float = 0.0,
        hi: float = 0.0,
        seed: int = 0,
    ) -> ResolvedParam:
        """A whole tensor of a value formula without values or patches: what the constructor builds, without its
        per-field calls (plans of 100,000s of small parameters are mostly these)."""
        region, numel, runs = _whole(shape)
        rp = object.__new__(cls)
        object.__setattr__(
            rp,
            "__dict__",
            {
                "index": index,
                "name": name,
                "shape": shape,
                "region": region,
                "dtype": dtype,
                "initializer": initializer,
                "formula": formula,
                "p0": p0,
                "p1": p1,
                "key": key,
                "values": None,
                "patches": (),
                "compact": False,
                "lo": lo,
                "hi": hi,
                "seed": seed,
                "out_shape": shape,
                "numel": numel,
                "nbytes": numel * dtype.itemsize,
                "_runs": runs,
            },
        )
        return rp

    @property
    def is_full(self) -> bool:
        return self.out_shape == self.shape

    def runs(self) -> Runs:
        return self._runs


@functools.lru_cache(maxsize=4096)
def _whole(shape: tuple[int, ...]) -> tuple[regions.Box, int, Runs]:
    """The region, element count and runs of a whole tensor (immutable, so shared by every parameter of a shape)."""
    numel = sampler.numel(shape)
    return regions.whole(shape), numel, Runs.single(numel)


@dataclass(frozen=True)
class Patch:
    """A box of fixed elements over a parameter's base values, ready for any window of its region.

    `starts` (ascending) and `run_len` are the local runs (of the region's row-major order) the box covers
    there; `values` holds, per run, the index `param` gives its first element. Without a part, `param` is the
    patch's initializer resolved over the parameter's own shape and region, so a backend fills local elements
    [a, b) of it exactly as it fills the base (`values` is `starts`). With a part (Patch.part), `param` is the
    whole part tensor and `values` the runs' indices in it.
    """

    box: tuple[tuple[int, int], ...]
    param: ResolvedParam
    starts: npt.NDArray[np.int64] = field(repr=False)
    run_len: int
    values: npt.NDArray[np.int64] = field(repr=False)

    def runs_in(self, begin: int, end: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The local runs that overlap elements [begin, end): their starts (ascending) and value indices."""
        if not self.run_len or begin >= end:
            return self.starts[:0], self.values[:0]
        first = max(0, int(np.searchsorted(self.starts, begin - self.run_len, side="right")))
        last = int(np.searchsorted(self.starts, end, side="left"))
        return self.starts[first:last], self.values[first:last]


# What validation read of a parameter's initializer and of each of its patches' (inits.read), in that order.
Readings = tuple[inits.Reading | None, ...]


def resolve_unchecked(index: int, p: plan_pb2.Param, sources: RequestSnapshot | None = None) -> ResolvedParam:
    """Resolve one parameter as the plan states it, without the plan's checks (the warm-up, tools, kernel tests, which
    also feed kernels values the checks would refuse): its initializers' forms are taken as stated.

    Args:
        index: its index in the plan.
        p: the parameter (a valid one: nothing here reports what is wrong with it).
        sources: the request's snapshot (payloads, checkpoints), for data.

    Returns:
        The resolved parameter.
    """
    shape = [int(d) for d in p.shape]
    patches = (_stated(q.init, [int(d) for d in (q.part.shape if q.HasField("part") else shape)]) for q in p.patches)
    return resolve_param(index, p, sources, (_stated(p.init, shape), *patches))


def _stated(init: plan_pb2.Init, shape: Sequence[int]) -> inits.Reading:
    """An initializer's reading as the plan states it, unchecked."""
    form = inits.value_form(init, shape)
    return inits.Reading(inits.kind_of(init), [], form, form.own_kernel())


def resolve_param(index: int, p: plan_pb2.Param, sources: RequestSnapshot | None, readings: Readings) -> ResolvedParam:
    """Resolve one parameter from what the check's sweep read of it; the caller guarantees the plan validated (with
    the same sources).

    Args:
        index: its index in the plan.
        p: the parameter.
        sources: the request's snapshot (payloads, checkpoints).
        readings: the readings of its initializers (inits.read: the parameter's, then each patch's).

    Returns:
        The resolved parameter.
    """
    rp = _resolve_base(index, p, sources, readings[0])
    if not p.patches:
        return rp
    patches = []
    area = regions.Region(rp.shape, rp.region)
    boxes = [tuple((int(r.start), int(r.stop)) for r in q.box) for q in p.patches]
    if sources is not None:  # the run arrays, charged before they are built (a small plan can ask for many)
        sources.charge(sum(RUN_BYTES * _runs_at_most(rp.region, box) for box in boxes))
    for j, (q, box) in enumerate(zip(p.patches, boxes, strict=True)):
        if q.HasField("part"):  # the box is part of a tensor of its own: values at indices in that tensor
            starts, values, run_len = area.box_runs(box)
            values = values + int(q.part.start)
            base = plan_pb2.Param(name=p.name, shape=q.part.shape, dtype=p.dtype, init=q.init)
        else:
            starts, run_len = area.local_runs(box)
            values = starts
            base = plan_pb2.Param(name=p.name, shape=p.shape, dtype=p.dtype, init=q.init, region=p.region)
        if run_len:  # a box outside this region changes nothing here
            patches.append(Patch(box, _resolve_base(index, base, sources, readings[1 + j]), starts, run_len, values))
    return replace(rp, patches=tuple(patches))


RUN_BYTES = 16  # a patch's run: its local start and its value index, int64 each


def _runs_at_most(region: regions.Box, box: tuple[tuple[int, int], ...]) -> int:
    """An upper bound on the runs of a patch's box within a region: one per row of its last dimension at most."""
    count = 1
    for (a, b), (lo, hi) in zip(box[:-1], region[:-1], strict=True):
        count *= max(0, min(b, hi) - max(a, lo))
    return count


def _resolve_base(index: int, p: plan_pb2.Param, sources: RequestSnapshot | None, reading: inits.Reading | None) -> ResolvedParam:
    shape = tuple(int(d) for d in p.shape)
    region = regions.box_of(p) if p.region else None  # None: the whole tensor (its region and runs are shared)
    dt = dtypes.by_enum(p.dtype)
    assert reading is not None and dt is not None and reading.kind is not None and reading.form is not None, "a validated plan"
    kind, form = reading.kind, reading.form
    if reading.kernel is not None:  # a distribution: its kernel arguments were read with it
        return _resolve_kernel(index, p.name, shape, region, dt, kind.field, reading.kernel)
    return form.accept(_Resolver(index, p.name, shape, region, dt, kind.field, sources))


@dataclass(slots=True)
class _Resolver:
    """A form resolved for one parameter (inits.FormReader): a distribution's kernel arguments, or data's values
    read from the request's snapshot (a checkpoint region reads and converts only its own values, and the
    budget pays for those only)."""

    index: int
    name: str
    shape: tuple[int, ...]
    region: regions.Box | None  # None: the whole tensor
    dt: dtypes.DTypeInfo
    initializer: str
    sources: RequestSnapshot | None

    @property
    def box(self) -> regions.Box:
        return regions.whole(self.shape) if self.region is None else self.region

    def distribution(self, form: inits.Distribution) -> ResolvedParam:
        return _resolve_kernel(self.index, self.name, self.shape, self.region, self.dt, self.initializer, form.own_kernel())

    def _data(self, values: npt.NDArray[Any], compact: bool = False) -> ResolvedParam:
        return ResolvedParam(
            self.index, self.name, self.shape, self.box, self.dt, self.initializer, Formula.FLAT, values=values, compact=compact
        )

    def inline(self, form: inits.Inline) -> ResolvedParam:
        return self._data(np.asarray(form.values, dtype=np.float64))

    def payload(self, form: inits.PayloadRef) -> ResolvedParam:
        payload = None if self.sources is None else self.sources.payload(form.payload_id)
        if payload is None:  # only when resolved without the validation that reads the same snapshot
            raise errors.NotFound(f"no payload {form.payload_id[:64]!r} (payloads expire)")
        return self._data(payload.values)

    def checkpoint(self, form: inits.Checkpoint) -> ResolvedParam:
        if self.sources is None:  # only when resolved without the validation that reads the same snapshot
            raise errors.InvalidRequest("a checkpoint reference is resolved with the request's sources")
        values, compact = self.sources.tensor_values(form.path, form.tensor, self.box)
        return self._data(values, compact)

    def orthogonal(self, form: inits.Orthogonal) -> ResolvedParam:
        """The whole matrix, computed on the host for every backend."""
        sources = self.sources
        if sources is None or sources.gaussian is None:
            raise errors.InvalidRequest(
                "an orthogonal parameter is resolved with the request's sources (its Gaussian matrix comes from them)"
            )
        from paraminit_server.plans import orthogonal  # numba, compiled on first use (after the cache is set up)

        n = form.rows * form.cols
        sources.charge(orthogonal.HELD_PER_ELEMENT * n)  # what the factorization holds at its peak, before it allocates
        return self._data(orthogonal.values(form.rows, form.cols, form.gain, sources.gaussian(n, form.seed), sources.stop))

    def computed(self, form: inits.Computed) -> ResolvedParam:
        """The whole parameter's values (eye, dirac, sparse), computed on the host for every backend."""
        sources = self.sources
        if sources is None or sources.gaussian is None or sources.zero_keys is None:
            raise errors.InvalidRequest(f"a {form.describe()} parameter is resolved with the request's sources (its draws come from them)")
        if sources.stop is not None and sources.stop():  # each parameter's values are computed whole: look first
            raise errors.Cancelled(f"the request ended before its {form.describe()} values were computed")
        sources.charge(form.held_bytes(self.shape))  # held for the request, binary64
        return self._data(form.values(self.shape, sources.gaussian, sources.zero_keys))


def _resolve_kernel(
    index: int,
    name: str,
    shape: tuple[int, ...],
    region: regions.Box | None,
    dt: dtypes.DTypeInfo,
    initializer: str,
    k: inits.Kernel,
) -> ResolvedParam:
    """A parameter whose values a kernel computes (a distribution or a constant); region None: the whole tensor.
    Its form named the kernel and the arguments (inits.Distribution.kernel), whatever the initializer."""
    formula, p1, key = _FORMULA[k.formula], 0.0 if k.p1 is None else k.p1, 0 if k.seed is None else sampler.key(k.seed)
    if k.lo is not None:
        if region is None:
            return ResolvedParam.whole(index, name, shape, dt, initializer, formula, k.p0, p1, key, k.lo, k.hi, k.seed)
        return ResolvedParam(index, name, shape, region, dt, initializer, formula, k.p0, p1, key, lo=k.lo, hi=k.hi, seed=k.seed)
    if region is None:
        return ResolvedParam.whole(index, name, shape, dt, initializer, formula, k.p0, p1, key)
    return ResolvedParam(index, name, shape, region, dt, initializer, formula, k.p0, p1, key)


_FORMULA = {f.name.lower(): f for f in Formula}  # inits.Kernel.formula -> the Formula


KernelColumns = tuple[
    Any,
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
    npt.NDArray[np.uint64],
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
    npt.NDArray[np.uint64],
]


def kernel_columns(k: inits.Kernel, rows: npt.NDArray[np.bool_]) -> KernelColumns:
    """_resolve_kernel over the `rows` of many parameters of one value form (inits.Forms.kernel): formula, p0, p1, key,
    lo, hi, seed."""
    n = int(np.count_nonzero(rows))
    zero, zero_u = np.zeros(n), np.zeros(n, dtype=np.uint64)
    keys = zero_u if k.seed is None else sampler.keys(k.seed[rows])
    p1 = zero if k.p1 is None else k.p1[rows]
    if k.lo is None:
        return _FORMULA[k.formula], k.p0[rows], p1, keys, zero, zero, zero_u
    return _FORMULA[k.formula], k.p0[rows], p1, keys, k.lo[rows], k.hi[rows], k.seed[rows]


def kinds_of(params: Sequence[ResolvedParam]) -> set[tuple[int, Formula]]:
    """The (dtype enum, formula) pairs filling these parameters takes, their patches' included: which of
    warm_up_params' kernels a fill of them needs."""
    return {(q.dtype.enum, q.formula) for p in params if p.numel for q in (p, *(patch.param for patch in p.patches))}


def warm_up_params() -> list[ResolvedParam]:
    """One small parameter of every formula and dtype: what backends compile before SERVING."""
    params: list[ResolvedParam] = []
    for dt in dtypes.SUPPORTED:
        for init in ("zeros", "uniform", "normal", "truncated_normal", "flat"):
            p = plan_pb2.Param(name=f"{init}_{dt.name}", shape=[2, 3], dtype=dt.enum)  # type: ignore[arg-type]
            getattr(p.init, init).SetInParent()
            if init == "truncated_normal":
                p.init.truncated_normal.std, p.init.truncated_normal.lo, p.init.truncated_normal.hi = 1.0, -2.0, 2.0
            if init == "flat":
                p.init.flat.values.extend([0.0] * 6)
            params.append(resolve_unchecked(len(params), p))
    return params
