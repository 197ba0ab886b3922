"""The initializer table: every kind of `paraminit.v1.Init`, in one place.

Per kind: its oneof field and JSON name, whether it is seeded, whether its values
are data (flat kinds: inline values, uploaded payloads, checkpoint tensors; never
allowed in a patch), the form checks validation reports, and the value form it
defines over a parameter's full shape. Validation, plan resolution, the plan digest,
`paraminit inspect` and the client's policies read this table; adding an initializer
touches the table and the kernels only.

A value form says what element i is: a constant, an affine map of the unit draw
(uniform and every Xavier / Kaiming kind), a normal, a truncated normal, or data (values in the plan, uploaded or
in a checkpoint, or an orthogonal matrix computed whole).
The Xavier and Kaiming bounds (docs/SAMPLER.md section 3) are stated here once, and
a form's `moments` gives the mean, standard deviation and bounds it promises (what
`inspect` checks a file against).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit.shapes import MAX_ELEMENTS, fan_in_out, numel, numel_at_most, shape_str
from paraminit.v1 import plan_pb2

__all__ = [
    "KINDS",
    "Z_MAX",
    "Checkpoint",
    "Computed",
    "Const",
    "Data",
    "Dirac",
    "Distribution",
    "Draws",
    "Eye",
    "FieldColumns",
    "FormReader",
    "Forms",
    "InitKind",
    "Inline",
    "Kernel",
    "Moments",
    "Normal",
    "Orthogonal",
    "PayloadRef",
    "Reading",
    "Rule",
    "Sparse",
    "TruncNormal",
    "Uniform",
    "ValueForm",
    "kaiming_bound",
    "kind_of",
    "label",
    "orthogonal_work",
    "range_problem",
    "read",
    "trunc_bounds_ok",
    "value_form",
    "with_seed",
    "xavier_bound",
]

NORMAL_U1_FLOOR = 1e-6  # the sampler raises u1 to this before log, so |z| <= Z_MAX (docs/SAMPLER.md 2.1)
Z_MAX = math.sqrt(-2.0 * math.log(NORMAL_U1_FLOOR))
_KURTOSIS_NORMAL, _KURTOSIS_UNIFORM = 3.0, 1.8


# -- bounds (docs/SAMPLER.md section 3) ---------------------------------------------------------------------------------


def _finite(*xs: Any) -> Any:
    """Whether every x is finite, for floats and arrays alike (x - x is 0 exactly where x is finite, NaN elsewhere)."""
    out: Any = True
    for x in xs:
        out = out & (x - x == 0)
    return out


def _sqrt6_over(denom: Any) -> Any:
    """sqrt(6 / denom) with 6 / 0 taken as 0 (a zero denominator read as infinite); denom a binary64 float (a float
    back, without numpy's per-call cost) or a float64 array."""
    if isinstance(denom, np.ndarray):
        with np.errstate(divide="ignore"):
            return np.sqrt(6.0 / np.where(denom == 0.0, np.inf, denom))
    return math.sqrt(6.0 / (math.inf if denom == 0.0 else denom))


def _as_f64(x: Any) -> Any:
    """An integer, or an integer array, in binary64 (one rounding)."""
    return x.astype(np.float64) if isinstance(x, np.ndarray) else float(x)


def xavier_bound(fan_in: Any, fan_out: Any) -> Any:
    """sqrt(6 / (fanIn + fanOut)) with fans converted to binary64 first; 0 for zero fans. Of one pair of fans (a
    float) or of arrays of them (an array): one statement for a row and for a large plan's columns."""
    return _sqrt6_over(_as_f64(fan_in) + _as_f64(fan_out))


def kaiming_bound(fan_in: Any) -> Any:
    """sqrt(6 / fanIn) (He-uniform for ReLU); 0 for a zero fan. Of one fan (a float) or an array of them."""
    return _sqrt6_over(_as_f64(fan_in))


def trunc_bounds_ok(mean: Any, std: Any, lo: Any, hi: Any) -> Any:
    """Section 2.2's interval rule: lo <= mean - 0.5 * std and hi >= mean + 0.5 * std (binary64 roundings); of one
    form (a bool) or of arrays (a bool array)."""
    half = 0.5 * std
    return (lo <= mean - half) & (hi >= mean + half)


class Rule(NamedTuple):
    """One form check, stated once for a parameter and for a large plan's columns: `holds` reads the fields as
    attributes (f.lo: floats of one message, which is passed as it is, or arrays of many rows) and is true where
    the check passes; `message` names the problem of one message whose check failed. A form's rules run in order:
    a row reports its first failure."""

    holds: Callable[[Any], Any]
    message: Callable[[Any], str]


def _says(text: str) -> Callable[[Any], str]:
    return lambda _f: text


# -- value forms ----------------------------------------------------------------------------------------------------
# Each form carries its behaviour: the kernel arguments and the range rule's bound (as class methods over its
# fields, floats for one form or arrays for many rows at once, so one rule serves both), its label and moments,
# and, for data, which reader it takes (`accept`). Adding a form is one class here plus its kernel or reader.

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


class Kernel(NamedTuple):
    """What a distribution form gives the fill kernels, of one form (floats) or of many rows (arrays): the value
    formula the kernel computes (the data plane's Formula of that name), p0 and p1 (docs/SAMPLER.md; p1 None:
    zero), the seed (None: no draws) and a truncated normal's bounds (None otherwise)."""

    formula: str
    p0: Any
    p1: Any
    seed: Any = None
    lo: Any = None
    hi: Any = None


class _Form:
    """What every value form answers; a form overrides what it knows."""

    WORDS: ClassVar[str] = "the largest |value|"  # the range rule's words for bound()
    RULES: ClassVar[tuple[Rule, ...]] = ()  # the form checks of a kind whose message holds the form as it is (_direct)

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        """The bound B that the form's |values| stay within, each operation one binary64 rounding (section 4.1):
        of one form (`vars(form)`) or of many rows (`Forms.fields`); None where it is the data's largest |value|."""
        return None

    def largest(self) -> float | None:
        """The largest |value| where the form itself holds its values (inline data), else None."""
        return None

    def own_kernel(self) -> Kernel | None:
        """The kernel's arguments of this one form; None for data, which no kernel computes."""
        return None

    def describe(self) -> str | None:
        """A short label such as "normal(0, 0.02)"; None: the initializer's field name says it."""
        return None

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments | None:
        """The moments the form promises over a parameter's region (what `inspect` checks a file against; inline
        data describes the values of `region` of `shape`, all of them by default); None where it promises nothing
        checkable (references, whose values only the file holds)."""
        return None


_INTERVAL_WORDS = "max(|lo|, |hi|)"


def _interval_bound(f: Mapping[str, Any]) -> Any:
    """The range rule's bound of a form whose values lie in [lo, hi] (uniform, truncated normal)."""
    return np.maximum(np.abs(f["lo"]), np.abs(f["hi"]))


class Distribution(_Form):
    """A form whose elements a kernel computes from the seed and the element's index alone."""

    def accept(self, reader: FormReader[_T]) -> _T:
        """The reader's method for this form."""
        return reader.distribution(self)

    @classmethod
    def kernel(cls, f: Mapping[str, Any]) -> Kernel:
        """The kernel's arguments from the form's fields (floats or arrays)."""
        raise NotImplementedError

    def own_kernel(self) -> Kernel:
        return type(self).kernel(vars(self))


@dataclass(frozen=True)
class Const(Distribution):
    """value everywhere."""

    value: float
    WORDS: ClassVar[str] = "its value"

    @classmethod
    def kernel(cls, f: Mapping[str, Any]) -> Kernel:
        return Kernel("const", f["value"], None)

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return np.abs(f["value"])

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments:
        return Moments(self.value, 0.0, self.value, self.value, 0.0, "point")


@dataclass(frozen=True)
class Uniform(Distribution):
    """lo + unit(seed, i) * (hi - lo)."""

    lo: float
    hi: float
    seed: int
    WORDS: ClassVar[str] = _INTERVAL_WORDS
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(lambda f: _finite(f.lo, f.hi), _says("initialization: uniform bounds must be finite")),
        Rule(lambda f: f.lo <= f.hi, _says("initialization: uniform lower bound must not exceed the upper bound")),
        Rule(lambda f: _finite(f.hi - f.lo), _says("uniform range hi - lo overflows binary64")),
    )

    @classmethod
    def kernel(cls, f: Mapping[str, Any]) -> Kernel:
        return Kernel("affine", f["lo"], f["hi"] - f["lo"], f["seed"])

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return _interval_bound(f)

    def describe(self) -> str:
        return f"uniform({_g(self.lo)}, {_g(self.hi)})"

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments:
        lo, hi = self.lo, self.hi
        return Moments((lo + hi) / 2, (hi - lo) / math.sqrt(12), lo, hi, _KURTOSIS_UNIFORM, "uniform" if hi > lo else "point")


@dataclass(frozen=True)
class Normal(Distribution):
    """mean + std * z(seed, i)."""

    mean: float
    std: float
    seed: int
    WORDS: ClassVar[str] = "|mean| + std * 5.2566"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(lambda f: _finite(f.mean, f.std), _says("initialization: normal mean and standard deviation must be finite")),
        Rule(lambda f: f.std >= 0, _says("initialization: normal standard deviation must be nonnegative")),
    )

    @classmethod
    def kernel(cls, f: Mapping[str, Any]) -> Kernel:
        return Kernel("normal", f["mean"], f["std"], f["seed"])

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return np.abs(f["mean"]) + f["std"] * Z_BOUND

    def describe(self) -> str:
        return f"normal({_g(self.mean)}, {_g(self.std)})"

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments:
        m, s = self.mean, self.std
        return Moments(m, s, m - Z_MAX * s, m + Z_MAX * s, _KURTOSIS_NORMAL, "normal" if s > 0 else "point")


@dataclass(frozen=True)
class TruncNormal(Distribution):
    """The first candidate mean + std * z_j in [lo, hi] (docs/SAMPLER.md 2.2)."""

    mean: float
    std: float
    lo: float
    hi: float
    seed: int
    WORDS: ClassVar[str] = _INTERVAL_WORDS
    # finite, std >= 0, and bounds wide enough that 64 candidates practically never fail (SAMPLER.md 2.2)
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            lambda f: _finite(f.mean, f.std, f.lo, f.hi),
            _says("initialization: truncated normal mean, standard deviation and bounds must be finite"),
        ),
        Rule(lambda f: f.std >= 0, _says("initialization: truncated normal standard deviation must be nonnegative")),
        Rule(
            lambda f: trunc_bounds_ok(f.mean, f.std, f.lo, f.hi),
            lambda f: (
                f"truncated normal bounds [{f.lo!r}, {f.hi!r}] are too tight: they must hold "
                f"[mean - std / 2, mean + std / 2] = [{f.mean - 0.5 * f.std!r}, {f.mean + 0.5 * f.std!r}] "
                "(lo <= mean - 0.5 * std, hi >= mean + 0.5 * std)"
            ),
        ),
    )

    @classmethod
    def kernel(cls, f: Mapping[str, Any]) -> Kernel:
        return Kernel("truncnorm", f["mean"], f["std"], f["seed"], f["lo"], f["hi"])

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return _interval_bound(f)

    def describe(self) -> str:
        return f"truncated_normal({_g(self.mean)}, {_g(self.std)}, {_g(self.lo)}, {_g(self.hi)})"

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments:
        return _truncated(self.mean, self.std, self.lo, self.hi)


class FormReader(Protocol[_T_co]):
    """What a form is read with where its kind of values matters (the data plane's resolution, digest and
    checks): one method per data form and one for the distributions, so a new form is a type error until every
    reader handles it."""

    def distribution(self, form: Distribution) -> _T_co: ...

    def inline(self, form: Inline) -> _T_co: ...

    def payload(self, form: PayloadRef) -> _T_co: ...

    def checkpoint(self, form: Checkpoint) -> _T_co: ...

    def orthogonal(self, form: Orthogonal) -> _T_co: ...

    def computed(self, form: Computed) -> _T_co: ...


class _DataForm(_Form):
    """A form whose values are data: in the plan, uploaded, in a checkpoint, or computed whole."""

    def accept(self, reader: FormReader[_T]) -> _T:
        """The reader's method for this form."""
        raise NotImplementedError


@dataclass(frozen=True)
class Inline(_DataForm):
    """Values in the plan itself, row-major over the full shape."""

    values: Sequence[float]

    def accept(self, reader: FormReader[_T]) -> _T:
        return reader.inline(self)

    def largest(self) -> float:
        vals = np.abs(np.asarray(self.values, dtype=np.float64))
        return float(vals.max()) if vals.size else 0.0

    def describe(self) -> str:
        return f"flat({len(self.values)} values)"

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments | None:
        v = np.asarray(self.values, dtype=np.float64)
        if v.size == 0 or (shape and v.size != numel(shape)):
            return None
        if region:
            v = v.reshape(tuple(shape))[tuple(slice(a, b) for a, b in region)]
        return Moments(float(v.mean()), float(v.std()), float(v.min()), float(v.max()), 0.0, "point" if v.min() == v.max() else "")


@dataclass(frozen=True)
class PayloadRef(_DataForm):
    """Values uploaded with UploadPayload."""

    payload_id: str

    def accept(self, reader: FormReader[_T]) -> _T:
        return reader.payload(self)


@dataclass(frozen=True)
class Checkpoint(_DataForm):
    """A tensor of a safetensors file the server reads; dtype 0 means "do not check"."""

    path: str
    tensor: str
    dtype: int

    def accept(self, reader: FormReader[_T]) -> _T:
        return reader.checkpoint(self)


@dataclass(frozen=True)
class Orthogonal(_DataForm):
    """gain times a (semi-)orthogonal rows x cols matrix (docs/SAMPLER.md 2.3); its values are computed, as data,
    from the whole matrix."""

    gain: float
    seed: int
    rows: int
    cols: int
    WORDS: ClassVar[str] = "|gain|"

    def accept(self, reader: FormReader[_T]) -> _T:
        return reader.orthogonal(self)

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return np.abs(f["gain"])

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments:
        # min(rows, cols) orthonormal vectors: the mean square is 1 / max(rows, cols)
        g, big = abs(self.gain), max(self.rows, self.cols, 1)
        return Moments(0.0, g / math.sqrt(big), -g, g, _KURTOSIS_NORMAL if big > 1 else 1.0, "")


# Counter-based draws a computed form needs, from the data plane's own kernels: (n, seed) -> the first n values of
# normal(0, 1, seed) (`gaussian`), or the sparse form's zero keys, the unit draws of its seed's stream
# SPARSE_ZERO_STREAM (`zero_keys`), binary64.
Draws = Callable[[int, int], npt.NDArray[np.float64]]


class Computed(_DataForm):
    """A form whose values the data plane computes whole from the form and the shape (eye, dirac, sparse:
    docs/SAMPLER.md 2.4-2.6), as data for every backend."""

    def accept(self, reader: FormReader[_T]) -> _T:
        return reader.computed(self)

    def values(self, shape: Sequence[int], gaussian: Draws, zero_keys: Draws) -> npt.NDArray[np.float64]:
        """The whole parameter's binary64 values, row-major."""
        raise NotImplementedError

    def held_bytes(self, shape: Sequence[int]) -> int:
        """The host memory computing the values holds (the values, binary64)."""
        return 8 * numel(shape)


class _Indicator(Computed):
    """A computed form of zeros and ones (eye, dirac)."""

    WORDS: ClassVar[str] = "1"

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return 1.0


@dataclass(frozen=True)
class Eye(_Indicator):
    """The identity matrix: 1 where row == col (docs/SAMPLER.md 2.4)."""

    def describe(self) -> str:
        return "eye"

    def values(self, shape: Sequence[int], gaussian: Draws, zero_keys: Draws) -> npt.NDArray[np.float64]:
        return np.eye(int(shape[0]), int(shape[1]), dtype=np.float64).reshape(-1)

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments | None:
        return None  # 0/1 values placed by index: inspect checks data, not a distribution


@dataclass(frozen=True)
class Dirac(_Indicator):
    """dirac_(groups): each group's first min(out / groups, in) output channels pass their input through at the
    kernel's centre (docs/SAMPLER.md 2.5)."""

    groups: int

    def describe(self) -> str:
        return f"dirac(groups={self.groups})"

    def values(self, shape: Sequence[int], gaussian: Draws, zero_keys: Draws) -> npt.NDArray[np.float64]:
        out = np.zeros(tuple(int(d) for d in shape), dtype=np.float64)
        per_group = int(shape[0]) // self.groups
        centre = tuple(int(k) // 2 for k in shape[2:])
        for g in range(self.groups):
            for d in range(min(per_group, int(shape[1]))):
                out[(g * per_group + d, d, *centre)] = 1.0
        return out.reshape(-1)


SPARSE_ZERO_STREAM = 64  # the zeros' keys: stream 64 of the seed, which no truncated normal draws (it stops at 63)


@dataclass(frozen=True)
class Sparse(Computed):
    """sparse_(sparsity, std), counter-based: ceil(sparsity * rows) zeros per column at the rows with the smallest
    keys, the rest normal(0, std, seed) at their own index (docs/SAMPLER.md 2.6)."""

    sparsity: float
    std: float
    seed: int
    WORDS: ClassVar[str] = "std * 5.2566"

    @classmethod
    def bound(cls, f: Mapping[str, Any]) -> Any:
        return f["std"] * Z_BOUND

    def describe(self) -> str:
        return f"sparse({_g(self.sparsity)}, {_g(self.std)})"

    def held_bytes(self, shape: Sequence[int]) -> int:
        return 32 * numel(shape)  # the normal draws, the keys, their order and the values

    def values(self, shape: Sequence[int], gaussian: Draws, zero_keys: Draws) -> npt.NDArray[np.float64]:
        rows, cols = int(shape[0]), int(shape[1])
        n = rows * cols
        out = 0.0 + self.std * gaussian(n, self.seed)  # Normal(0, std, seed) exactly: mean + std * z
        zeros = math.ceil(self.sparsity * rows)
        if zeros and n:
            keys = zero_keys(n, self.seed).reshape(rows, cols)
            chosen = np.argsort(keys, axis=0, kind="stable")[:zeros]  # ties: the smaller row first
            out.reshape(rows, cols)[chosen, np.arange(cols)] = 0.0
        return out

    def moments(self, shape: Sequence[int] = (), region: Sequence[tuple[int, int]] = ()) -> Moments | None:
        if len(shape) != 2 or not shape[0]:
            return None
        kept = 1.0 - math.ceil(self.sparsity * int(shape[0])) / int(shape[0])
        s = self.std * math.sqrt(kept)
        return Moments(0.0, s, -Z_MAX * self.std, Z_MAX * self.std, _KURTOSIS_NORMAL / kept if kept else 1.0, "")


Data = Inline | PayloadRef | Checkpoint | Orthogonal | Computed
ValueForm = Distribution | Data


@dataclass(frozen=True)
class Forms:
    """The value forms of many parameters of one kind at once: the form's class and one array per field of it
    (what `InitKind.form` gives row by row), the rows whose form checks pass, and, for every row, the range rule's
    bound and the kernel's arguments (meaningless where `ok` is false). Rows that fail are checked one by one,
    which names the problem."""

    form: type[Distribution]
    fields: dict[str, npt.NDArray[Any]]
    ok: npt.NDArray[np.bool_]
    bound: npt.NDArray[np.float64] | None
    kernel: Kernel

    @classmethod
    def of(cls, form: type[Distribution], fields: dict[str, npt.NDArray[Any]], ok: npt.NDArray[np.bool_]) -> Forms:
        """The forms with their bound and kernel, so a caller reads all it needs from the table in one call."""
        with np.errstate(all="ignore"):  # rows that fail their checks (inf, nan) compute garbage, never read
            return cls(form, fields, ok, form.bound(fields), form.kernel(fields))


# A numeric field of the kind's message for every row (float64 for doubles, uint64 for integers), and the row count.
FieldColumns = Callable[[str], npt.NDArray[Any]]

Problem = tuple[str, str]  # (field path under the Param or Patch, message)


# -- the 8-bit range rule (docs/SAMPLER.md section 4.1) --------------------------------------------------------------

Z_BOUND = 5.2566  # bounds |z| (Z_MAX = 5.25652...): the range rule's bound of a normal's values


def range_problem(dt: dtypes.DTypeInfo, form: ValueForm, field: str, largest: float | None = None) -> Problem | None:
    """The range rule's violation for a parameter of an 8-bit dtype, or None when its values fit (or the dtype
    is wider). `largest` is a data form's largest |value| (None: not known here, nothing to say).

    Args:
        dt: the parameter's dtype.
        form: its value form (of the parameter or of a patch).
        field: the Init oneof field that defines it (what the violation names, and its words for xavier/kaiming).
        largest: for data forms, their largest |value|.

    Returns:
        (field path, message), or None.
    """
    if dt.max_finite is None:
        return None
    own = form.largest()
    if own is not None:
        largest = own
    bound = type(form).bound(vars(form))
    words = _Form.WORDS if bound is None else form.WORDS
    if field.startswith(("xavier", "kaiming")):
        words = "its bound L"
    b = largest if bound is None else float(bound)
    if b is None or b <= dt.max_finite:
        return None
    return (
        f"init.{field}",
        f"values could reach {float(f'{b:.12g}')!r} ({words}), beyond {dt.max_finite:g}, the largest finite "
        f"{dt.name} value: an 8-bit parameter's values must stay within it",
    )


# -- the table ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitKind:
    """One initializer kind: how it is named, checked and what its values are."""

    field: str  # the Init oneof field, e.g. "xavier_uniform_for_shape"
    json: str  # its JSON name, e.g. "xavierUniformForShape"
    seeded: bool  # its message has a `seed`
    data: bool  # its values are data (given, referenced or computed whole): no distribution to check, not in a patch
    form: Callable[[Any, Sequence[int]], ValueForm]  # (the kind's message, full shape) -> value form
    checks: Callable[[Any, Sequence[int]], list[Problem]]  # form checks on the message alone
    describe: Callable[[Any, Sequence[int]], str] | None = None  # inspect's label; default: from the form
    # `form` and `checks` over many rows at once (large plans), for kinds whose form does not depend on the shape
    forms: Callable[[FieldColumns, int], Forms] | None = None

    @property
    def patchable(self) -> bool:
        return not self.data


def _none(_m: Any, _s: Sequence[int]) -> list[Problem]:
    return []


no_checks = _none  # the `checks` of kinds whose message alone cannot be wrong (callers skip the call)


def length_message(expected: int, got: int) -> str:
    """TorchLean's words for a flat initializer of the wrong length (docs/SAMPLER.md section 6); an expected count
    past MAX_ELEMENTS (a shape validation refuses anyway) is written as a bound, never as a huge number."""
    if expected > MAX_ELEMENTS:
        return f"torch.runtimeInit: flat initializer length mismatch (expected 2^63 or more, got {got})"
    return f"torch.runtimeInit: flat initializer length mismatch (expected {expected}, got {got})"


def _check_flat(f: plan_pb2.Flat, shape: Sequence[int]) -> list[Problem]:
    out = []
    expected, got = numel_at_most(shape, MAX_ELEMENTS), len(f.values)  # an untrusted shape: no big product
    if got != expected:
        out.append(("init.flat.values", length_message(expected, got)))
    nonfinite = np.flatnonzero(~np.isfinite(np.asarray(f.values, dtype=np.float64)))
    if nonfinite.size:
        out.append(("init.flat.values", f"flat values must be finite ({nonfinite.size} not finite, first at index {nonfinite[0]})"))
    return out


ORTHOGONAL_MAX_WORK = 4096**3  # rows * cols * min(rows, cols): the factorization's time grows with it


def _matrix(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) of the matrix an orthogonal parameter is viewed as (rank >= 2): shape[0] and the rest's product."""
    return int(shape[0]), numel_at_most(shape[1:], MAX_ELEMENTS)


def _orthogonal(o: plan_pb2.Orthogonal, shape: Sequence[int]) -> Orthogonal:
    rows, cols = _matrix(shape) if len(shape) >= 2 else (0, 0)
    return Orthogonal(o.gain, o.seed, rows, cols)


def orthogonal_work(shape: Sequence[int]) -> int:
    """The factorization work of an orthogonal parameter of `shape` (rank >= 2): rows * cols * min(rows, cols),
    what ORTHOGONAL_MAX_WORK caps per parameter and per plan."""
    rows, cols = _matrix(shape)
    return rows * cols * min(rows, cols)


def _check_orthogonal(o: plan_pb2.Orthogonal, shape: Sequence[int]) -> list[Problem]:
    out = _rank2_problems("orthogonal", "orthogonal", shape)
    if out:
        return out
    if not math.isfinite(o.gain) or o.gain == 0.0:  # proto3 omits a zero: an unset gain reads 0, never PyTorch's 1
        out.append(
            (
                "init.orthogonal.gain",
                'orthogonal gain must be finite and not 0 (an omitted gain is 0: write "gain": 1 for PyTorch\'s default)',
            )
        )
    if orthogonal_work(shape) > ORTHOGONAL_MAX_WORK:
        rows, cols = _matrix(shape)
        out.append(
            (
                "init.orthogonal",
                f"an orthogonal {rows} x {cols} matrix is too large to factorize: rows * cols * "
                f"min(rows, cols) must be at most 4096^3 ({ORTHOGONAL_MAX_WORK})",
            )
        )
    return out


def _exact_rank(what: str, field: str, shape: Sequence[int], ranks: tuple[int, ...]) -> list[Problem]:
    if len(shape) in ranks:
        return []
    want = f"{ranks[0]} dimensions" if len(ranks) == 1 else f"{ranks[0]} to {ranks[-1]} dimensions"
    return [(f"init.{field}", f"{what} expects {want}, got {shape_str(shape)}")]


def _check_eye(m: plan_pb2.Eye, shape: Sequence[int]) -> list[Problem]:
    return _exact_rank("eye", "eye", shape, (2,))


def _check_dirac(m: plan_pb2.Dirac, shape: Sequence[int]) -> list[Problem]:
    out = _exact_rank("dirac", "dirac", shape, (3, 4, 5))
    if m.groups < 1:  # proto3 omits a zero: an unset groups reads 0, never PyTorch's 1
        out.append(("init.dirac.groups", 'dirac groups must be at least 1 (an omitted groups is 0: write "groups": 1)'))
    elif not out and shape[0] % m.groups:
        out.append(("init.dirac.groups", f"dirac groups ({m.groups}) must divide the output channels ({shape[0]})"))
    return out


def _check_sparse(m: plan_pb2.Sparse, shape: Sequence[int]) -> list[Problem]:
    out = _exact_rank("sparse", "sparse", shape, (2,))
    if not 0.0 <= m.sparsity <= 1.0:  # NaN fails too
        out.append(("init.sparse.sparsity", f"sparse sparsity must be in [0, 1], got {m.sparsity}"))
    if not (math.isfinite(m.std) and m.std >= 0.0):
        out.append(("init.sparse.std", f"sparse std must be finite and >= 0, got {m.std}"))
    return out


def _check_flat_ref(r: plan_pb2.FlatRef, _s: Sequence[int]) -> list[Problem]:
    return [] if r.payload_id else [("init.flat_ref.payload_id", "payload id must not be empty")]


def _check_safetensors(r: plan_pb2.SafetensorsRef, _s: Sequence[int]) -> list[Problem]:
    if not r.path or not r.tensor:
        return [("init.safetensors", "safetensors reference needs both path and tensor")]
    if r.dtype and dtypes.by_enum(r.dtype) is None:
        return [("init.safetensors.dtype", f"unknown dtype enum value {r.dtype}")]
    return []


def _rank2_problems(what: str, field: str, shape: Sequence[int]) -> list[Problem]:
    """The violation of an initializer that needs a matrix (`what`: the message's start) on a rank-0/1 shape."""
    if len(shape) >= 2:
        return []
    return [(f"init.{field}", f"{what} initialization expects at least 2 dimensions, got {shape_str(shape)}")]


def _rank2(who: str, field: str) -> Callable[[Any, Sequence[int]], list[Problem]]:
    return lambda _m, shape: _rank2_problems(f"torch.runtimeInit: {who}", field, shape)


def _symmetric(bound: float, seed: int) -> Uniform:
    return Uniform(-bound, bound, seed)


def _xavier_label(fan_in: int, fan_out: int) -> str:
    return f"xavier_uniform(fan_in={fan_in}, fan_out={fan_out})"


def _kaiming_label(fan_in: int) -> str:
    return f"kaiming_uniform(fan_in={fan_in})"


def _all(n: int) -> npt.NDArray[np.bool_]:
    return np.ones(n, dtype=bool)


def _const_forms(value: float) -> Callable[[FieldColumns, int], Forms]:
    return lambda f, n: Forms.of(Const, {"value": np.full(n, value)}, _all(n))


def _direct(field: str, json: str, form: type[Distribution]) -> InitKind:
    """A kind whose message holds its form's fields as they are (uniform, normal, truncated normal): its value form,
    its checks of one message and of a large plan's columns all come from the form class (its fields and RULES)."""
    names = [f.name for f in dataclasses.fields(cast(Any, form))]
    read = operator.attrgetter(*names)
    where = f"init.{field}"

    def checks(m: Any, _s: Sequence[int]) -> list[Problem]:  # the first rule the message breaks
        for rule in form.RULES:
            if not rule.holds(m):
                return [(where, rule.message(m))]
        return []

    def forms(f: FieldColumns, n: int) -> Forms:  # the rows that break no rule
        fields = {name: f(name) for name in names}
        columns = SimpleNamespace(**fields)
        ok = _all(n)
        with np.errstate(all="ignore"):
            for rule in form.RULES:
                ok &= rule.holds(columns)
        return Forms.of(form, fields, ok)

    return InitKind(field=field, json=json, seeded=True, data=False, form=lambda m, s: form(*read(m)), checks=checks, forms=forms)


def _symmetric_forms(bound: npt.NDArray[np.float64], seed: npt.NDArray[np.uint64]) -> Forms:
    return Forms.of(Uniform, {"lo": -bound, "hi": bound, "seed": seed}, _all(bound.shape[0]))


def _xavier_forms(f: FieldColumns, n: int) -> Forms:
    return _symmetric_forms(xavier_bound(f("fan_in"), f("fan_out")), f("seed"))


def _kaiming_forms(f: FieldColumns, n: int) -> Forms:
    return _symmetric_forms(kaiming_bound(f("fan_in")), f("seed"))


def _table() -> dict[str, InitKind]:
    kinds = [
        InitKind(
            field="zeros",
            json="zeros",
            seeded=False,
            data=False,
            form=lambda m, s: Const(0.0),
            checks=_none,
            describe=lambda m, s: "zeros",
            forms=_const_forms(0.0),
        ),
        InitKind(
            field="ones",
            json="ones",
            seeded=False,
            data=False,
            form=lambda m, s: Const(1.0),
            checks=_none,
            describe=lambda m, s: "ones",
            forms=_const_forms(1.0),
        ),
        _direct("uniform", "uniform", Uniform),
        _direct("normal", "normal", Normal),
        InitKind(
            field="xavier_uniform",
            json="xavierUniform",
            seeded=True,
            data=False,
            form=lambda m, s: _symmetric(xavier_bound(m.fan_in, m.fan_out), m.seed),
            checks=_none,
            describe=lambda m, s: _xavier_label(m.fan_in, m.fan_out),
            forms=_xavier_forms,
        ),
        InitKind(
            field="kaiming_uniform",
            json="kaimingUniform",
            seeded=True,
            data=False,
            form=lambda m, s: _symmetric(kaiming_bound(m.fan_in), m.seed),
            checks=_none,
            describe=lambda m, s: _kaiming_label(m.fan_in),
            forms=_kaiming_forms,
        ),
        InitKind(field="flat", json="flat", seeded=False, data=True, form=lambda m, s: Inline(m.values), checks=_check_flat),
        InitKind(
            field="xavier_uniform_for_shape",
            json="xavierUniformForShape",
            seeded=True,
            data=False,
            form=lambda m, s: _symmetric(xavier_bound(*fan_in_out(s)), m.seed),
            checks=_rank2("Xavier", "xavier_uniform_for_shape"),
            describe=lambda m, s: _xavier_label(*fan_in_out(s)),
        ),
        InitKind(
            field="kaiming_uniform_for_shape",
            json="kaimingUniformForShape",
            seeded=True,
            data=False,
            form=lambda m, s: _symmetric(kaiming_bound(fan_in_out(s)[0]), m.seed),
            checks=_rank2("Kaiming", "kaiming_uniform_for_shape"),
            describe=lambda m, s: _kaiming_label(fan_in_out(s)[0]),
        ),
        InitKind(
            field="flat_ref", json="flatRef", seeded=False, data=True, form=lambda m, s: PayloadRef(m.payload_id), checks=_check_flat_ref
        ),
        InitKind(
            field="safetensors",
            json="safetensors",
            seeded=False,
            data=True,
            form=lambda m, s: Checkpoint(m.path, m.tensor, m.dtype),
            checks=_check_safetensors,
        ),
        _direct("truncated_normal", "truncatedNormal", TruncNormal),
        # computed from the whole matrix, so its values are data like a payload's (and not allowed in a patch)
        InitKind(
            field="orthogonal",
            json="orthogonal",
            seeded=True,
            data=True,
            form=_orthogonal,
            checks=_check_orthogonal,
            describe=lambda m, s: f"orthogonal(gain={_g(m.gain)})",
        ),
        # sampler spec version 5: computed whole for every backend, like the orthogonal matrix
        InitKind(field="eye", json="eye", seeded=False, data=True, form=lambda m, s: Eye(), checks=_check_eye),
        InitKind(field="dirac", json="dirac", seeded=False, data=True, form=lambda m, s: Dirac(int(m.groups)), checks=_check_dirac),
        InitKind(
            field="sparse", json="sparse", seeded=True, data=True, form=lambda m, s: Sparse(m.sparsity, m.std, m.seed), checks=_check_sparse
        ),
    ]
    return {k.field: k for k in kinds}


KINDS: dict[str, InitKind] = _table()  # by oneof field, in field-number order
# messages name initializers as plans spell them (the JSON names), like the field paths of violations
_NOT_SET = "initializer is not set (expected one of " + ", ".join(k.json for k in KINDS.values()) + ")"


def kind_of(init: plan_pb2.Init) -> InitKind | None:
    """The table entry of the kind `init` sets, None when it sets none."""
    which = init.WhichOneof("kind")
    return None if which is None else KINDS[which]


def _problems(kind: InitKind, init: plan_pb2.Init, shape: Sequence[int], patch: bool) -> list[Problem]:
    """Form problems of an initializer of `kind` (references to payloads and files are checked where they are held);
    empty when the form is valid. A patch may not use flat kinds."""
    which = kind.field
    if patch and kind.data:
        return [
            (
                f"init.{which}",
                f"a patch cannot use {kind.json} values (patches take "
                f"{', '.join(k.json for k in KINDS.values() if k.patchable)} initializers)",
            )
        ]
    if kind.checks is _none:  # most kinds of most plans: no call at all
        return []
    return kind.checks(getattr(init, which), shape)


@dataclass(frozen=True, slots=True)
class Reading:
    """An initializer read once, for a parameter or patch of a shape and dtype: all that validation and resolution
    take from the table, so neither enters it again. With problems, nothing past them is set."""

    kind: InitKind | None  # None: no initializer set
    problems: list[Problem]
    form: ValueForm | None = None
    kernel: Kernel | None = None  # a distribution's kernel arguments (None for data)
    range_problem: Problem | None = None  # the 8-bit range rule's verdict where the plan bounds the values
    work: int = 0  # an orthogonal matrix's factorization steps (orthogonal_work) within the cap, for the plan's sum


def read(init: plan_pb2.Init | None, shape: Sequence[int], dt: dtypes.DTypeInfo | None = None, patch: bool = False) -> Reading:
    """An initializer's form problems (a patch may not use flat kinds) and, when it has none, its value form, kernel arguments and the range
    rule's verdict for `dt` (referenced data, whose largest |value| only its holder knows, is judged with
    `range_problem` once read).

    Args:
        init: the Init (None or unset: a problem).
        shape: the full shape its values cover (a patch's part, if it has one).
        dt: the parameter's dtype, for the range rule (None: not judged).
        patch: the Init belongs to a patch.

    Returns:
        The reading.
    """
    kind = None if init is None else kind_of(init)
    if init is None or kind is None:
        return Reading(kind, [("init", _NOT_SET)])
    work = 0
    if kind.field == "orthogonal" and len(shape) >= 2 and not patch:  # counted even when its message is wrong
        work = orthogonal_work(shape)
        work = work if work <= ORTHOGONAL_MAX_WORK else 0  # one over the cap is its parameter's own problem
    problems = _problems(kind, init, shape, patch)
    if problems:
        return Reading(kind, problems, work=work)
    form = kind.form(getattr(init, kind.field), shape)
    verdict = None if dt is None else range_problem(dt, form, kind.field)
    return Reading(kind, problems, form, form.own_kernel(), verdict, work)


def value_form(init: plan_pb2.Init, shape: Sequence[int]) -> ValueForm:
    """What element i of a parameter of this full shape is; `init` must set a kind (validated)."""
    kind = kind_of(init)
    if kind is None:
        raise ValueError("initializer is not set")
    return kind.form(getattr(init, kind.field), shape)


def with_seed(init: plan_pb2.Init, seed: int) -> plan_pb2.Init:
    """A copy of `init` with its seed set to `seed` (unchanged for unseeded kinds)."""
    out = plan_pb2.Init()
    out.CopyFrom(init)
    kind = kind_of(out)
    if kind is not None and kind.seeded:
        getattr(out, kind.field).seed = seed
    return out


SEEDED_JSON = frozenset(name for k in KINDS.values() if k.seeded for name in (k.field, k.json))


# -- what a file should look like -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Moments:
    """What a value form promises: mean, standard deviation, value bounds, kurtosis and density."""

    mean: float
    std: float
    lo: float
    hi: float
    kurtosis: float  # of the distribution: for the standard error of the sample standard deviation
    density: str  # "normal", "uniform", "point", or "" when no curve is drawn


def _g(x: float) -> str:
    return f"{x:.4g}"


def label(init: plan_pb2.Init, shape: Sequence[int]) -> str:
    """A short description of an initializer for tables, e.g. "normal(0, 0.02)"."""
    kind = kind_of(init)
    if kind is None:
        return "-"
    msg = getattr(init, kind.field)
    if kind.describe is not None:
        return kind.describe(msg, shape)
    return kind.form(msg, shape).describe() or kind.field


def _truncated(m: float, s: float, lo: float, hi: float) -> Moments:
    """Moments of normal(m, s) conditioned on [lo, hi] (and on the sampler's own |z| <= Z_MAX)."""
    if s <= 0:
        return Moments(m, 0.0, m, m, 0.0, "point")
    a, b = max((lo - m) / s, -Z_MAX), min((hi - m) / s, Z_MAX)

    # raw moments of the standard normal on [a, b]: E z^k = (I_k(b) - I_k(a)) / mass, by the recursion
    # I_k = -z^(k-1) phi(z) + (k - 1) I_(k-2) of the integrals of z^k phi(z)
    def phi(z: float) -> float:
        return math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

    def big_phi(z: float) -> float:
        return 0.5 * math.erfc(-z / math.sqrt(2))

    mass = big_phi(b) - big_phi(a)
    ints = [mass, phi(a) - phi(b)]
    for k in range(2, 5):
        ints.append(a ** (k - 1) * phi(a) - b ** (k - 1) * phi(b) + (k - 1) * ints[k - 2])
    e1, e2, e3, e4 = (ints[k] / mass for k in range(1, 5))
    var = max(e2 - e1 * e1, 0.0)
    m4 = e4 - 4 * e1 * e3 + 6 * e1 * e1 * e2 - 3 * e1**4
    kurt = m4 / (var * var) if var > 0 else 0.0
    return Moments(m + s * e1, s * math.sqrt(var), m + s * a, m + s * b, kurt, "")  # no density curve
