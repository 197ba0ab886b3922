"""Whole-plan validation: every violation at once, before anything is allocated.

TorchLean stops at its first error; we keep its messages word for word
(docs/SAMPLER.md section 6) and report all of them, each with the parameter index,
its name and the field, so a user fixes a plan in one round trip.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from paraminit import dtypes, inits, regions
from paraminit.shapes import MAX_ELEMENTS, MAX_RANK, numel_at_most
from paraminit.sizes import format_size
from paraminit.v1 import plan_pb2
from paraminit.violations import INVALID, LIMIT, MAX_ANSWER_VIOLATIONS, NAME_ECHO, Violation, camel_path, clip
from paraminit_server import errors
from paraminit_server.plans import columns, sampler, scanner
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Readings, ResolvedParam, resolve_param

if TYPE_CHECKING:
    from paraminit_server.plans.snapshot import RequestSnapshot

__all__ = ["INVALID", "LIMIT", "Checked", "Limits", "Report", "Violation", "check"]
MAX_BYTES = (1 << 63) - 1
# names a safetensors header keeps for itself: a tensor so named would overwrite the file's metadata entry
RESERVED_NAMES = frozenset({"__metadata__"})
_EMPTY_SPAN = (1 << 60) - 1  # the other dimensions of an empty tensor: as an 8-byte tensor they fit 2^63 bytes
MAX_NAME_BYTES = 1024  # a name is echoed in headers and errors: a 100 MB name would double into a 200 MB header
ECHO = 64  # characters of a user string repeated in a message


# A parameter name's rules, stated once for one parameter (its facts as plain values: text, size in UTF-8 bytes,
# free = not reserved) and for a large plan's columns (arrays of them): a name reports the first rule it breaks.
# A repeated name is found in plan order, one row at a time.
NAME_RULES: tuple[inits.Rule, ...] = (
    inits.Rule(lambda n: n.size > 0, lambda n: "parameter name must not be empty"),
    inits.Rule(lambda n: n.size <= MAX_NAME_BYTES, lambda n: f"parameter name is {n.size} bytes long; the limit is {MAX_NAME_BYTES}"),
    inits.Rule(
        lambda n: n.free, lambda n: f"parameter name {n.text!r} is reserved (a safetensors header keeps it for the file's metadata)"
    ),
)


def _fits(size: Any, limit: int | None) -> Any:
    """Whether a parameter's bytes (an int, or an array of them) are within the per-parameter limit."""
    return True if limit is None else size <= limit


@dataclass(frozen=True)
class Limits:
    """Byte limits a plan must fit; None means unlimited."""

    max_param_bytes: int | None = None
    max_plan_bytes: int | None = None


@dataclass(frozen=True)
class Report:
    """What validation found: violations and per-parameter materialized bytes (0 when unknown).

    At most MAX_ANSWER_VIOLATIONS violations of parameters are kept (a few plan-wide ones after them); the rest
    are counted in `omitted`, and `categories` holds the category of every violation found, kept or not."""

    violations: tuple[Violation, ...]
    param_bytes: tuple[int, ...]
    omitted: int = 0
    categories: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return not self.violations and not self.omitted

    @property
    def total_bytes(self) -> int:
        return sum(self.param_bytes)

    @property
    def only_limits(self) -> bool:
        return self.categories == {LIMIT}

    @property
    def valid(self) -> bool:
        """No violation but limits."""
        return INVALID not in self.categories

    @property
    def fits_limits(self) -> bool:
        return LIMIT not in self.categories


class Found:
    """Violations as they are found, up to MAX_ANSWER_VIOLATIONS (the first, in plan order: what an answer
    lists); beyond it each is only counted, with its category. A plan of a hundred thousand mistakes then costs a
    counter, not a hundred thousand messages (about 1.2 KB each with a long name: 117 MiB held for one call)."""

    def __init__(self) -> None:
        self.kept: list[Violation] = []
        self.omitted = 0
        self.categories: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.kept) >= MAX_ANSWER_VIOLATIONS

    def tally(self, category: str) -> None:
        """One more violation not kept."""
        self.categories.add(category)
        self.omitted += 1

    def add(self, v: Violation, plan_wide: bool = False) -> None:
        """Keep v, or count it once full (a plan-wide violation is always kept: there are at most a few)."""
        if self.full and not plan_wide:
            self.tally(v.category)
            return
        self.categories.add(v.category)
        self.kept.append(v)


@dataclass(frozen=True)
class Checked:
    """What one sweep over a plan found: its report, its digest and, when resolution was asked for and the plan is
    valid, the table the kernels fill from."""

    report: Report
    digest: str
    params: ParamTable | None = None


def check(plan: plan_pb2.Plan, limits: Limits | None = None, sources: RequestSnapshot | None = None, *, resolve: bool = True) -> Checked:
    """Check a whole plan in one sweep that reads every row once: its violations, its digest and, with `resolve`,
    the resolved table, together. Validation alone is the same call without resolution.

    Plain rows are checked and valued as columns (plans.columns); every other row is read once by the
    initializer table (inits.read): checked, named in the digest (the content it references) and resolved from
    that reading. Rows whose resolution reads data or builds run arrays (checkpoints, computed values, patches)
    are resolved after the sweep, only when nothing was found: a plan that fails allocates nothing.

    Args:
        plan: the plan.
        limits: byte limits (none by default).
        sources: the request's snapshot (snapshot.RequestSnapshot): flat_ref and safetensors initializers are checked
            against what the server holds and their content enters the digest; without it only their form is
            checked.
        resolve: also resolve the plan when it is valid.

    Returns:
        The report (every violation, each parameter's materialized bytes), the digest and the table (None when
        not resolved or not valid).
    """
    limits = limits or Limits()
    cols = columns.of(plan)
    sweep = _Sweep(limits, sources, resolve)
    out = sweep.out
    sizes = _rows(plan, cols, sweep)
    total = sum(sizes)
    if limits.max_plan_bytes is not None and total > limits.max_plan_bytes:
        out.add(
            Violation(
                -1,
                "",
                "params",
                f"plan needs {total} bytes ({format_size(total)}), over the "
                f"per-plan limit of {limits.max_plan_bytes} ({format_size(limits.max_plan_bytes)}; "
                "--max-plan-bytes, PARAMINIT_MAX_PLAN_BYTES)",
                LIMIT,
            ),
            plan_wide=True,
        )
    if sweep.work > inits.ORTHOGONAL_MAX_WORK:
        out.add(
            Violation(
                -1,
                "",
                "params",
                f"the plan's orthogonal matrices need {sweep.work} steps of factorization (rows * cols * min(rows, cols), "
                f"summed), over the per-plan limit of 4096^3 ({inits.ORTHOGONAL_MAX_WORK})",
                LIMIT,
            ),
            plan_wide=True,
        )
    report = Report(tuple(out.kept), tuple(sizes), out.omitted, frozenset(out.categories))
    h = hashlib.sha256(scanner.canonical(plan, cols.scan))
    if sweep.contents:
        h.update("\n".join(["", *sweep.contents]).encode())
    if not (sweep.resolving and report.ok):
        return Checked(report, h.hexdigest())
    for i, p, readings in sweep.later:
        sweep.special[i] = resolve_param(i, p, sources, readings)
    return Checked(report, h.hexdigest(), columns.ParamTable(cols, sweep.special))


class _Sweep:
    """What one sweep has found so far, row by row in plan order (so a repeated name is reported where it repeats)."""

    def __init__(self, limits: Limits, sources: RequestSnapshot | None, resolve: bool) -> None:
        self.limits, self.sources = limits, sources
        self.out = Found()
        self.first_seen: dict[str, int] = {}
        self.resolving = resolve
        self.special: dict[int, ResolvedParam] = {}
        self.later: list[tuple[int, plan_pb2.Param, Readings]] = []  # resolved once the whole plan is known valid
        self.contents: list[str] = []  # what references name, for the digest
        self.work = 0  # orthogonal factorization steps, summed


def _rows(plan: plan_pb2.Plan, cols: columns.Columns, sweep: _Sweep) -> list[int]:
    """Every row's checks: a row its columns vouch for (plain, with a good name and size) only records its name;
    every other row, and a repeated name, takes the full checks of _row. Returns each row's bytes."""
    params = plan.params
    names = cols.names
    free = np.ones(len(names), dtype=bool)
    for reserved in RESERVED_NAMES.intersection(names):
        free[[i for i, n in enumerate(names) if n == reserved]] = False
    vouched = cols.plain & _fits(cols.nbytes, sweep.limits.max_param_bytes)
    facts = SimpleNamespace(text=names, size=cols.name_bytes, free=free)  # the names' facts as columns
    for rule in NAME_RULES:
        vouched &= rule.holds(facts)
    sizes: list[int] = cols.nbytes.tolist()
    if bool(vouched.all()) and len(set(names)) == len(names):  # nothing to check one by one
        return sizes
    first_seen = sweep.first_seen
    for i, ok in enumerate(vouched.tolist()):
        name = names[i]
        if ok and name not in first_seen:
            first_seen[name] = i
        else:
            sizes[i] = _row(i, params[i], sweep)
    return sizes


def _row(i: int, p: plan_pb2.Param, sweep: _Sweep) -> int:
    """Every check of one parameter, read once: its violations go to the sweep's findings, the content its
    references name to the digest, and, while nothing was found, its resolution. Returns its materialized bytes."""
    out, limits = sweep.out, sweep.limits

    def bad(field: str, message: str, category: str = INVALID) -> None:
        if out.full:  # counted only: no message is kept beyond what an answer lists
            out.tally(category)
        else:
            out.add(Violation(i, _shown_name(p.name), f"params[{i}].{camel_path(field)}", message, category))

    facts = SimpleNamespace(text=p.name, size=len(p.name.encode()), free=p.name not in RESERVED_NAMES)
    broken = next((rule for rule in NAME_RULES if not rule.holds(facts)), None)
    if broken is not None:
        bad("name", broken.message(facts))
    elif p.name in sweep.first_seen:
        bad("name", f"duplicate parameter name {_echo(p.name)} (first at params[{sweep.first_seen[p.name]}])")
    else:
        sweep.first_seen[p.name] = i
    shape = [int(d) for d in p.shape]
    numel, problems = _size_problems(shape, "the full tensor")
    for message in problems:
        bad("shape", message)
    sane = not problems
    if numel == 0 and numel_at_most([d for d in shape if d], _EMPTY_SPAN) > _EMPTY_SPAN:
        sane = False  # empty, but no array library can hold the shape (nor its fans)
        bad(
            "shape",
            f"the dimensions of {_shape_echo(shape)} other than 0 multiply to 2^60 or more; an empty "
            "tensor's shape must still fit in 2^63 bytes as if it were not empty",
        )
    dt = dtypes.by_enum(p.dtype)
    if dt is None:
        bad("dtype", f"unknown dtype enum value {p.dtype}")
    region_numel = (_check_region(shape, p, bad) if p.region else numel) if sane else None
    read = _check_init(shape, p, dt, bad, sweep.sources if sane else None)
    patched = _check_patches(shape, p, dt, bad) if p.patches and sane else []
    sweep.work += read.work
    readings: Readings = (read, *patched)
    if sweep.sources is not None:
        _name_contents(i, p, readings, sweep)
    size = 0
    if dt is not None and region_numel is not None:
        size = region_numel * dt.itemsize
        if size > MAX_BYTES:
            bad("shape", f"size overflows: {region_numel} elements of {dt.name} exceed 2^63 bytes")
            size = 0
        elif limits.max_param_bytes is not None and not _fits(size, limits.max_param_bytes):
            bad(
                "shape",
                f"parameter needs {size} bytes ({format_size(size)}), over the per-parameter limit "
                f"of {limits.max_param_bytes} ({format_size(limits.max_param_bytes)}; "
                "--max-param-bytes, PARAMINIT_MAX_PARAM_BYTES)",
                LIMIT,
            )
    if sweep.resolving:
        _resolve(i, p, readings, sweep)
    return size


def _resolve(i: int, p: plan_pb2.Param, readings: Readings, sweep: _Sweep) -> None:
    """Resolve a checked row while the plan is clean: a distribution at once (its kernel arguments were read with
    it), data and patches after the sweep; the first violation drops what was resolved."""
    if sweep.out.kept or sweep.out.omitted:
        sweep.resolving = False
        sweep.special, sweep.later = {}, []
    elif p.patches or readings[0] is None or readings[0].kernel is None:
        sweep.later.append((i, p, readings))
    else:
        sweep.special[i] = resolve_param(i, p, sweep.sources, readings)


def _name_contents(i: int, p: plan_pb2.Param, readings: Readings, sweep: _Sweep) -> None:
    """The content each of the row's references uses (a payload's hash, a checkpoint region's), for the digest: the
    same digest then always names the same bytes, also after a checkpoint is rewritten in place. Only data read
    without a problem names content (a reference that could not be read is the plan's violation)."""
    assert sweep.sources is not None
    for reading in readings:
        if reading is not None and reading.form is not None and reading.kind is not None and reading.kind.data:
            used = reading.form.accept(_Content(sweep.sources, p))
            if used is not None:
                sweep.contents.append(f"{i}:{used}")


@dataclass(frozen=True)
class _Content:
    """The content a form references, as the digest names it (inits.FormReader): a payload's or a checkpoint
    region's hash, or None where the plan itself says what the values are."""

    sources: RequestSnapshot
    param: plan_pb2.Param  # its region is the part of a checkpoint tensor the content covers

    def distribution(self, form: inits.Distribution) -> str | None:
        return None

    def inline(self, form: inits.Inline) -> str | None:
        return None

    def orthogonal(self, form: inits.Orthogonal) -> str | None:
        return None

    def computed(self, form: inits.Computed) -> str | None:
        return None

    def payload(self, form: inits.PayloadRef) -> str | None:
        payload = self.sources.payload(form.payload_id)
        return f"payload:{payload.sha256 if payload is not None else '-'}"

    def checkpoint(self, form: inits.Checkpoint) -> str | None:
        try:
            used = self.sources.content_hash(form.path, form.tensor, regions.box_of(self.param))
        except errors.InvalidRequest:  # the check reports why; the digest marks it unreadable
            used = "-"
        return f"safetensors:{used}"


def _check_region(shape: list[int], p: plan_pb2.Param, bad: _Bad) -> int | None:
    """Validate the region; returns the materialized element count, or None if unknown."""
    if not p.region:
        return sampler.numel(shape)
    if len(p.region) != len(shape):
        bad("region", f"region has {len(p.region)} ranges but the shape {sampler.shape_str(shape)} has rank {len(shape)}")
        return None
    ok = True
    n = 1
    for d, (r, dim) in enumerate(zip(p.region, shape, strict=True)):
        if r.start > r.stop:
            bad(f"region[{d}]", f"range start {r.start} exceeds stop {r.stop}")
            ok = False
        elif r.start == r.stop:
            bad(f"region[{d}]", f"range [{r.start}, {r.stop}) is empty")
            ok = False
        elif r.stop > dim:
            bad(f"region[{d}]", f"range [{r.start}, {r.stop}) is out of bounds for dimension {d} of size {dim}")
            ok = False
        n *= r.stop - r.start
    return n if ok else None


MAX_PATCHES = 4096
BOX_RANGES_SHOWN = 2  # bad ranges of one patch box reported one by one; the last says how many more


def _check_patches(shape: list[int], p: plan_pb2.Param, dt: dtypes.DTypeInfo | None, bad: _Bad) -> list[inits.Reading | None]:
    """Each patch: a box inside the full shape, its part if it has one, and a valid, patchable initializer whose
    values fit the parameter's dtype. Returns what it read of each patch's initializer (None: not read)."""
    read: list[inits.Reading | None] = [None] * len(p.patches)
    if len(p.patches) > MAX_PATCHES:
        bad("patches", f"{len(p.patches)} patches exceed the maximum of {MAX_PATCHES} per parameter")
        return read
    for j, q in enumerate(p.patches):

        def sub(field: str, message: str, category: str = INVALID, _j: int = j) -> None:
            bad(f"patches[{_j}].{field}", message, category)

        box_ok = False
        if len(q.box) != len(shape):
            sub("box", f"box has {len(q.box)} ranges but the shape {sampler.shape_str(shape)} has rank {len(shape)}")
        else:
            # at most BOX_RANGES_SHOWN violations per box, the last counting the rest: 4,096 patches of rank 32
            # would otherwise make 131,072 violations of one parameter from a plan of a few hundred kilobytes
            bad_ranges = [(d, r, dim) for d, (r, dim) in enumerate(zip(q.box, shape, strict=True)) if r.start >= r.stop or r.stop > dim]
            shown = bad_ranges[:BOX_RANGES_SHOWN]
            for k, (d, r, dim) in enumerate(shown):
                rest = len(bad_ranges) - len(shown)
                more = f" ({rest} more ranges of this box are bad too)" if rest and k == len(shown) - 1 else ""
                if r.start >= r.stop:
                    sub(f"box[{d}]", f"range [{r.start}, {r.stop}) is empty{more}")
                else:
                    sub(f"box[{d}]", f"range [{r.start}, {r.stop}) is out of bounds for dimension {d} of size {dim}{more}")
            box_ok = not bad_ranges
        seen = shape
        if q.HasField("part"):
            seen = [int(d) for d in q.part.shape]
            if not _check_part(q, seen, box_ok, sub):
                continue
        got = read[j] = inits.read(q.init if q.HasField("init") else None, seen, dt, patch=True)
        for where, message in got.problems:
            sub(where, message)
        if got.range_problem is not None:  # a patch's values are a distribution's: the plan bounds them
            sub(*got.range_problem)
    return read


def _check_part(q: plan_pb2.Patch, part: list[int], box_ok: bool, sub: _Bad) -> bool:
    """A patch's part: a shape of bounded size that holds the box's elements from `start`; whether it is sane
    enough to check the initializer over it."""
    numel, problems = _size_problems(part, "the part")
    for message in problems:
        sub("part.shape", message)
    if problems:
        return False
    if box_ok:
        count = sampler.numel([r.stop - r.start for r in q.box])
        if q.part.start + count > numel:
            sub(
                "part",
                f"the box's {count} elements from index {q.part.start} do not fit in the part "
                f"{sampler.shape_str(part)} of {numel} elements",
            )
    return True


def _size_problems(shape: list[int], noun: str) -> tuple[int, list[str]]:
    """An untrusted shape's element count (capped past MAX_ELEMENTS) and what is wrong with its size: the rank is
    bounded before anything multiplies the dimensions, the product stops at 2^63 (a zero dimension makes it 0)."""
    problems = [f"rank {len(shape)} exceeds the maximum of {MAX_RANK}"] if len(shape) > MAX_RANK else []
    numel = numel_at_most(shape, MAX_ELEMENTS)
    if numel > MAX_ELEMENTS:
        problems.append(f"{noun} {_shape_echo(shape)} has 2^63 elements or more; flat indices must fit in 64 bits")
    return numel, problems


def _shown_name(name: str) -> str:
    """The name violations carry: whole up to the length limit, clipped beyond it as every echo of a name is, so
    the length it states is the name's own (it is echoed to the caller)."""
    return name if len(name.encode()) <= MAX_NAME_BYTES else clip(name, NAME_ECHO)


def _shape_echo(shape: list[int]) -> str:
    """A shape for a message: whole up to MAX_RANK dimensions, else its first ones and its rank."""
    if len(shape) <= MAX_RANK:
        return sampler.shape_str(shape)
    return sampler.shape_str(shape[:8])[:-1] + f", ... ({len(shape)} dimensions)]"


def _echo(text: str) -> str:
    """A user string quoted for a message, cut to ECHO characters."""
    return repr(text) if len(text) <= ECHO else repr(text[:ECHO]) + f"... ({len(text)} characters)"


def _check_init(
    shape: list[int], p: plan_pb2.Param, dt: dtypes.DTypeInfo | None, bad: _Bad, sources: RequestSnapshot | None = None
) -> inits.Reading:
    """The initializer's form (the table's checks), then what it reads against the request's snapshot, then
    whether its values fit an 8-bit dtype. Returns what it read of the initializer."""
    r = inits.read(p.init if p.HasField("init") else None, shape, dt)
    for where, message in r.problems:
        bad(where, message)
    if r.kind is None or r.form is None:
        return r
    if r.kind.data:  # data: what it references, against the snapshot, and the range rule once its values are known
        judged, largest = r.form.accept(_Referenced(shape, dt, bad, sources))
        if dt is not None and judged and largest is not None:
            found = inits.range_problem(dt, r.form, r.kind.field, largest)
            if found is not None:
                bad(*found)
    if r.range_problem is not None:
        bad(*r.range_problem)
    return r


@dataclass(frozen=True)
class _Referenced:
    """What a form references, checked against the request's snapshot (inits.FormReader): whether the 8-bit
    range rule can judge its values, and the largest |value| of referenced data, once read (None: not read,
    or the plan itself bounds the values)."""

    shape: list[int]
    dt: dtypes.DTypeInfo | None
    bad: _Bad
    sources: RequestSnapshot | None

    def distribution(self, form: inits.Distribution) -> tuple[bool, float | None]:
        return True, None

    def inline(self, form: inits.Inline) -> tuple[bool, float | None]:
        return True, None

    def orthogonal(self, form: inits.Orthogonal) -> tuple[bool, float | None]:
        return True, None

    def computed(self, form: inits.Computed) -> tuple[bool, float | None]:
        return True, None

    def payload(self, form: inits.PayloadRef) -> tuple[bool, float | None]:
        largest = None if self.sources is None else _check_payload(self.shape, form, self.bad, self.sources)
        return largest is not None, largest

    def checkpoint(self, form: inits.Checkpoint) -> tuple[bool, float | None]:
        largest = None if self.sources is None else _check_checkpoint(self.shape, form, self.bad, self.sources, self.dt)
        return largest is not None, largest


def _check_payload(shape: list[int], ref: inits.PayloadRef, bad: _Bad, sources: RequestSnapshot) -> float | None:
    """The payload's checks; returns its largest |value| when it is whole and finite (for the range rule)."""
    payload = sources.payload(ref.payload_id)
    if payload is None:
        bad("init.flat_ref.payload_id", f"no payload {_echo(ref.payload_id)} (upload it with UploadPayload; payloads expire)")
        return None
    ok = True
    if payload.values.size != sampler.numel(shape):
        bad("init.flat_ref", inits.length_message(sampler.numel(shape), payload.values.size))
        ok = False
    if payload.nonfinite:
        bad("init.flat_ref", f"flat values must be finite ({payload.nonfinite} not finite, first at index {payload.first_nonfinite})")
        ok = False
    return payload.max_abs if ok else None


def _check_checkpoint(
    shape: list[int], ref: inits.Checkpoint, bad: _Bad, sources: RequestSnapshot, dt: dtypes.DTypeInfo | None
) -> float | None:
    """The checkpoint tensor's checks; for a parameter of an 8-bit dtype whose file holds a wider one, returns
    the tensor's largest |value| (for the range rule; read from the file)."""
    try:
        info = sources.tensor_info(ref.path, ref.tensor)
    except errors.InvalidRequest as exc:
        bad("init.safetensors", str(exc))
        return None
    ok = True
    expected = dtypes.by_enum(ref.dtype) if ref.dtype else None
    if expected is not None and expected.safetensors != info.dtype.safetensors:
        bad("init.safetensors.dtype", f"tensor {_echo(ref.tensor)} is {info.dtype.name} in the file, not {expected.name}")
        ok = False
    if tuple(shape) != info.shape:
        bad(
            "init.safetensors",
            f"tensor {_echo(ref.tensor)} has shape {sampler.shape_str(info.shape)} in the file; the "
            f"parameter's shape is {sampler.shape_str(shape)}",
        )
        ok = False
    if not ok or dt is None or dt.max_finite is None:
        return None
    if info.dtype.max_finite is not None and info.dtype.max_finite <= dt.max_finite:
        return None  # every finite value of the file's format fits
    try:
        return float(sources.largest_magnitude(ref.path, ref.tensor))
    except errors.InvalidRequest as exc:
        bad("init.safetensors", str(exc))
        return None


class _Bad(Protocol):  # the signature of the `bad` closure
    def __call__(self, field: str, message: str, category: str = INVALID) -> None: ...
