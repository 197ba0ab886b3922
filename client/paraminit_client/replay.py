"""A model's own initialization code, replayed into plan initializers (the default policy, "own").

PyTorch routes every tensor operation of a model's code through ``__torch_function__``. A `Recorder` is such a mode:
while it is active, each in-place operation on a tracked tensor (a parameter or persistent buffer: a *root*) is not
executed but recorded as what it does to the tensor's values, in distribution terms:

- ``torch.nn.init`` (every function, with every argument: the bounds and standard deviations are PyTorch's own
  arithmetic, since xavier_*, kaiming_* and the rest reach the recorder as the ``uniform_``/``normal_`` they call;
  ``trunc_normal_``, ``orthogonal_``, ``eye_``, ``dirac_`` and ``sparse_`` are recorded as the call itself) and the
  tensor methods model code calls (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_``, ``mul_``, ``div_``,
  ``add_``, ``sub_``, ``neg_``, ``clamp_``, ``erfinv_``, item assignment), through ``.data``, ``.detach()`` and views;
- composition: a later whole write replaces; a scale or shift of a random tensor composes (normal(m, s) * c + d is
  normal(c m + d, |c| s)); ``uniform_`` -> ``erfinv_`` -> ``mul_`` -> ``add_`` -> ``clamp_`` (timm's and older
  PyTorch's ``trunc_normal_``) is a truncated normal; a write into a box (a slice, a row, an index) is a plan patch;
  a copy of another parameter is a tie (the same initializer under the source's seed);
- values computed without randomness (a sinusoidal table, an identity, a constant) are evaluated for that tensor
  alone and carried as data (a constant as zeros, ones or uniform(c, c));
- PyTorch's random generator is never used: values come from the plan's seeds.

Anything else (an in-place operation on a random tensor that has no plan form, values read from torch's generator
or from uninitialized memory, a copy of a tensor computed from others) makes the tensor's value a refusal that names
the call and the file:line of the model code that made it; a later whole write clears it.

The code replayed is the model's own: its constructor, when the model is built under
``paraminit_client.torch.meta_parameters()`` (`capture`: each parameter carries its record), else each module's
``reset_parameters`` (children first, as construction runs them) and then the framework's own entry point
(transformers' ``initialize_weights``, a root ``init_weights()``). A constructor that initializes tensors in its own
code cannot be replayed after the fact: its tensors are refused with that file:line and the way to record it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paraminit import inits
from paraminit.v1 import plan_pb2
from paraminit_client.rules import Ruling

__all__ = ["RECORD_ATTR", "Recorder", "Root", "Unwritten", "capture", "emit", "initial_value", "real_value", "record_of", "replay"]

RECORD_ATTR = "_paraminit_record"  # a parameter built under capture() carries its Root here
DATA_LIMIT = 1 << 24  # elements of deterministic values evaluated for one tensor (128 MiB as binary64)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep

Box = tuple[tuple[int, int], ...]


# -- values -------------------------------------------------------------------------------------------------------
# What a write leaves in a tensor's elements, each kind answering for itself: how a scale and shift, a clamp and
# erfinv change it, whether it is computed (deterministic) or drawn, and the plan initializer that states it.

_PILED = 1e-9  # the most probability a clamp may move onto its bounds and still be the truncated normal


class Value:
    """The common answers; a kind overrides what it can state."""

    drawn = False  # random values under a seed (a copy of them is a tie)

    def affine(self, c: float, d: float) -> Value:
        """The value c * x + d of every element x."""
        return Refused(f"scales or shifts {self.label()}, which no initializer states")

    def divide(self, x: float) -> Value:
        """The value x / c: a scale by 1 / c for draws, the exact quotient for computed values."""
        return self.affine(1.0 / x, 0.0)

    def clamp(self, lo: float, hi: float) -> Value:
        return Refused(f"clamps {self.label()} to [{lo}, {hi}], which no initializer states")

    def erfinv(self) -> Value:
        return Refused(f"applies erfinv_ to {self.label()}, which is not uniform on [-1, 1]")

    def computed(self) -> np.ndarray[Any, np.dtype[np.float64]] | float | str:
        """The values when they are computed without randomness (an array, or a constant), else why not."""
        return f"reads {self.label()}"

    def init(self, seed: int) -> plan_pb2.Init | str:
        return f"{self.label()} has no initializer"

    def label(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Fixed(Value):
    """One constant everywhere."""

    value: float

    def affine(self, c: float, d: float) -> Value:
        return Fixed(c * self.value + d)

    def divide(self, x: float) -> Value:
        return Fixed(self.value / x)

    def clamp(self, lo: float, hi: float) -> Value:
        return Fixed(min(max(self.value, lo), hi))

    def erfinv(self) -> Value:
        return Fixed(_erfinv(self.value))

    def computed(self) -> float:
        return self.value

    def init(self, seed: int) -> plan_pb2.Init | str:
        if self.value == 0.0 and math.copysign(1.0, self.value) > 0:
            return plan_pb2.Init(zeros=plan_pb2.Zeros())
        if self.value == 1.0:
            return plan_pb2.Init(ones=plan_pb2.Ones())
        if not math.isfinite(self.value):
            return f"a constant {self.value}, which no initializer states"
        return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=self.value, hi=self.value, seed=seed))  # lo == hi: exact


@dataclass(frozen=True, eq=False)
class Values(Value):
    """Computed values of the whole tensor (row-major, binary64), carried as data."""

    values: np.ndarray[Any, np.dtype[np.float64]]

    def affine(self, c: float, d: float) -> Value:
        return Values(self.values * c + d)

    def divide(self, x: float) -> Value:
        return Values(self.values / x)

    def clamp(self, lo: float, hi: float) -> Value:
        return Values(np.clip(self.values, lo, hi))

    def erfinv(self) -> Value:
        return Values(torch.erfinv(torch.from_numpy(np.array(self.values))).numpy())

    def computed(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        return self.values

    def init(self, seed: int) -> plan_pb2.Init | str:
        if not np.all(np.isfinite(self.values)):
            return "computed values that are not all finite"
        return plan_pb2.Init(flat=plan_pb2.Flat(values=self.values.reshape(-1).tolist()))


@dataclass(frozen=True)
class UniformDraw(Value):
    lo: float
    hi: float
    drawn = True

    def affine(self, c: float, d: float) -> Value:
        if c == 0.0:
            return Fixed(d)
        return UniformDraw(c * self.lo + d, c * self.hi + d) if c > 0 else UniformDraw(c * self.hi + d, c * self.lo + d)

    def clamp(self, lo: float, hi: float) -> Value:
        return self if lo <= self.lo and self.hi <= hi else super().clamp(lo, hi)

    def erfinv(self) -> Value:
        return ErfDraw(self.lo, self.hi) if -1.0 <= self.lo < self.hi <= 1.0 else super().erfinv()

    def init(self, seed: int) -> plan_pb2.Init | str:
        if self.lo == self.hi:
            return Fixed(self.lo).init(seed)
        if self.lo > self.hi:
            return f"uniform_({self.lo}, {self.hi}) with its bounds reversed"
        return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=self.lo, hi=self.hi, seed=seed))

    def label(self) -> str:
        return f"uniform({self.lo}, {self.hi})"


@dataclass(frozen=True)
class NormalDraw(Value):
    mean: float
    std: float
    drawn = True

    def affine(self, c: float, d: float) -> Value:
        return NormalDraw(c * self.mean + d, abs(c) * self.std) if c else Fixed(d)

    def clamp(self, lo: float, hi: float) -> Value:
        return _clamped_normal(self.mean, self.std, -math.inf, math.inf, lo, hi)

    def init(self, seed: int) -> plan_pb2.Init | str:
        if self.std == 0.0:
            return Fixed(self.mean).init(seed)
        return plan_pb2.Init(normal=plan_pb2.Normal(mean=self.mean, std=self.std, seed=seed))

    def label(self) -> str:
        return f"normal({self.mean}, {self.std})"


@dataclass(frozen=True)
class TruncDraw(Value):
    mean: float
    std: float
    lo: float
    hi: float
    drawn = True

    def affine(self, c: float, d: float) -> Value:
        if c == 0.0:
            return Fixed(d)
        lo, hi = (c * self.lo + d, c * self.hi + d) if c > 0 else (c * self.hi + d, c * self.lo + d)
        return TruncDraw(c * self.mean + d, abs(c) * self.std, lo, hi)

    def clamp(self, lo: float, hi: float) -> Value:
        return self if lo <= self.lo and self.hi <= hi else super().clamp(lo, hi)

    def init(self, seed: int) -> plan_pb2.Init | str:
        tn = plan_pb2.TruncatedNormal(mean=self.mean, std=self.std, lo=self.lo, hi=self.hi, seed=seed)
        return plan_pb2.Init(truncated_normal=tn)

    def label(self) -> str:
        return f"normal({self.mean}, {self.std}) truncated to [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class ErfDraw(Value):
    """scale * erfinv(U[lo, hi)) + shift: a normal truncated to the image of [lo, hi] (the inverse-CDF method)."""

    lo: float
    hi: float
    scale: float = 1.0
    shift: float = 0.0
    drawn = True

    def bounds(self) -> tuple[float, float]:
        a = self.shift + self.scale * _erfinv(self.lo) if self.lo > -1.0 else -math.inf
        b = self.shift + self.scale * _erfinv(self.hi) if self.hi < 1.0 else math.inf
        return (a, b) if self.scale > 0 else (b, a)

    def affine(self, c: float, d: float) -> Value:
        return ErfDraw(self.lo, self.hi, c * self.scale, c * self.shift + d)

    def clamp(self, lo: float, hi: float) -> Value:
        return _clamped_normal(self.shift, abs(self.scale) / math.sqrt(2.0), *self.bounds(), lo, hi)

    def init(self, seed: int) -> plan_pb2.Init | str:
        return truncated(self.shift, abs(self.scale) / math.sqrt(2.0), *self.bounds()).init(seed)


@dataclass(frozen=True)
class OrthogonalDraw(Value):
    gain: float
    drawn = True

    def affine(self, c: float, d: float) -> Value:
        return OrthogonalDraw(self.gain * c) if d == 0.0 else Refused("shifts an orthogonal matrix, which no initializer states")

    def clamp(self, lo: float, hi: float) -> Value:
        return self if lo <= -abs(self.gain) and abs(self.gain) <= hi else super().clamp(lo, hi)

    def init(self, seed: int) -> plan_pb2.Init | str:
        return plan_pb2.Init(orthogonal=plan_pb2.Orthogonal(gain=self.gain, seed=seed))


@dataclass(frozen=True)
class Identity(Value):
    """eye_ (groups 0) or dirac_(groups): the plan's eye and dirac forms; its values where a later step needs them."""

    shape: tuple[int, ...]
    groups: int
    fill: Callable[..., Any] = field(compare=False, repr=False)  # torch.nn.init's own eye_ or dirac_

    def computed(self) -> np.ndarray[Any, np.dtype[np.float64]] | str:
        if math.prod(self.shape) > DATA_LIMIT:
            return f"{self.describe()} of {math.prod(self.shape)} elements, too large to evaluate"
        real = torch.zeros(self.shape, dtype=torch.float64)
        with torch.no_grad():
            self.fill(real) if self.groups == 0 else self.fill(real, groups=self.groups)
        return real.numpy().reshape(-1)

    def _as_values(self) -> Value:
        got = self.computed()
        return Refused(got) if isinstance(got, str) else Values(got)

    def affine(self, c: float, d: float) -> Value:
        return self._as_values().affine(c, d)

    def divide(self, x: float) -> Value:
        return self._as_values().divide(x)

    def clamp(self, lo: float, hi: float) -> Value:
        return self if lo <= 0.0 and hi >= 1.0 else self._as_values().clamp(lo, hi)

    def erfinv(self) -> Value:
        return self._as_values().erfinv()

    def init(self, seed: int) -> plan_pb2.Init | str:
        if self.groups == 0:
            return plan_pb2.Init(eye=plan_pb2.Eye())
        return plan_pb2.Init(dirac=plan_pb2.Dirac(groups=self.groups))

    def describe(self) -> str:
        return "eye_" if self.groups == 0 else f"dirac_(groups={self.groups})"


@dataclass(frozen=True)
class SparseDraw(Value):
    """sparse_(sparsity, std): the plan's counter-based sparse form (docs/SAMPLER.md 2.6)."""

    sparsity: float
    std: float
    drawn = True

    def affine(self, c: float, d: float) -> Value:
        return SparseDraw(self.sparsity, abs(c) * self.std) if d == 0.0 else super().affine(c, d)

    def init(self, seed: int) -> plan_pb2.Init | str:
        return plan_pb2.Init(sparse=plan_pb2.Sparse(sparsity=self.sparsity, std=self.std, seed=seed))


@dataclass(frozen=True)
class Refused(Value):
    """Values no initializer states, and why: every later step keeps the refusal until a whole write replaces it."""

    why: str

    def affine(self, c: float, d: float) -> Value:
        return self

    def clamp(self, lo: float, hi: float) -> Value:
        return self

    def erfinv(self) -> Value:
        return self

    def computed(self) -> str:
        return self.why

    def init(self, seed: int) -> str:
        return self.why


class Unwritten(Refused):
    """What a parameter made from torch.empty holds until the model's code writes it: code that runs later (a
    framework's init_weights) may still, so the default policy replays that for it."""


def _erfinv(x: float) -> float:
    return float(torch.erfinv(torch.tensor(x, dtype=torch.float64)))


def truncated(mean: float, std: float, lo: float, hi: float) -> Value:
    """normal(mean, std) cut to [lo, hi], as the plan's truncated normal states it (or a normal when unbounded)."""
    if math.isinf(lo) and math.isinf(hi):
        return NormalDraw(mean, std)
    if math.isinf(lo) or math.isinf(hi):
        return Refused(f"a normal truncated on one side only ([{lo}, {hi}]), which no initializer states")
    if lo > mean - 0.5 * std or hi < mean + 0.5 * std:
        return Refused(f"a normal({mean}, {std}) truncated to [{lo}, {hi}], narrower than the truncated normal allows")
    return TruncDraw(mean, std, lo, hi)


def _clamped_normal(mean: float, std: float, na: float, nb: float, lo: float, hi: float) -> Value:
    """clamp(x, lo, hi) of a normal on [na, nb]: the truncated normal where the clamp moves (almost) no probability
    onto its bounds, refused where it would pile values there."""
    if std == 0.0:
        return Fixed(min(max(mean, lo), hi))

    def cdf(x: float) -> float:
        return 0.5 * math.erfc(-(x - mean) / (std * math.sqrt(2.0)))

    total = cdf(nb) - cdf(na)
    piled = (max(0.0, cdf(min(lo, nb)) - cdf(na)) + max(0.0, cdf(nb) - cdf(max(hi, na)))) / total if total > 0 else 1.0
    if piled > _PILED:
        return Refused(f"clamps a normal({mean}, {std}) on [{na}, {nb}] to [{lo}, {hi}], piling values on a bound")
    return truncated(mean, std, max(lo, na), min(hi, nb))


def as_value(values: np.ndarray[Any, Any]) -> Fixed | Values:
    """Computed values: a constant where they are one (the same sign of zero too), else data."""
    flat = np.asarray(values, dtype=np.float64)
    first = flat.reshape(-1)[0] if flat.size else 0.0
    if flat.size and np.all(flat == first) and np.all(np.signbit(flat) == np.signbit(first)):
        return Fixed(float(first))
    return Values(flat)


# -- where the model's code is --------------------------------------------------------------------------------------


def _where() -> str:
    """file:line of the innermost frame of the model's code (outside torch and paraminit)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith((_TORCH_DIR, _HERE, "<paraminit recorder")) or path.endswith("contextlib.py")):
            short = path.split("site-packages" + os.sep, 1)[-1]
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


# -- roots: the tracked tensors and what was written to them --------------------------------------------------------


@dataclass
class Write:
    value: Value
    box: Box | None  # None: the whole tensor
    origin: Root | None  # the root whose seed draws it (a tie), None: its own
    where: str


@dataclass(eq=False)
class Root:
    """A tracked tensor and its writes: `base` for the whole tensor, then `patches` (boxes, applied in order)."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    base: Write | None = None
    patches: list[Write] = field(default_factory=list)
    shadow: bool = False  # a real tensor the model's code made (its operations run too): what its values are drawn as
    written: np.ndarray[Any, np.dtype[np.bool_]] | None = None  # a shadow from torch.empty: elements written since

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))


def record_of(t: torch.Tensor, unwritten: bool = False) -> Root | None:
    """The construction record a parameter built under capture() carries, or None (also when its constructor left
    it unwritten, unless `unwritten`: code that runs after construction, replayed, may write it)."""
    rec = t.__dict__.get(RECORD_ATTR) if hasattr(t, "__dict__") else None
    if not isinstance(rec, Root):
        return None
    if not unwritten and rec.base is not None and isinstance(rec.base.value, Unwritten) and not rec.patches:
        return None
    return rec


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _intersects(x: Box, y: Box) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y, strict=True))


def _covers(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _values(root: Root) -> np.ndarray[Any, np.dtype[np.float64]] | str:
    """The root's current values when they are deterministic (for evaluating an operation on them), else why not."""
    if root.numel > DATA_LIMIT:
        return f"a tensor of {root.numel} elements is too large to evaluate its values ({DATA_LIMIT} at most)"
    base = root.base
    if base is None:
        return "reads values before anything wrote them"
    out = np.empty(root.shape, dtype=np.float64)
    for w in [base, *root.patches]:
        got = w.value.computed()
        if isinstance(got, str):
            return got
        region = _slices(w.box) if w.box is not None else ...
        out[region] = got if isinstance(got, float) else got.reshape(out[region].shape)
    return out


# -- the recorder ---------------------------------------------------------------------------------------------------

_RANDOM_FACTORIES = frozenset(
    ["rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli", "multinomial", "poisson"]
)
_RANDOM_INPLACE = frozenset(["normal_", "uniform_", "random_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_"])
_EMPTY_FACTORIES = frozenset(["empty", "empty_like", "new_empty", "empty_strided"])
_RANDOM, _EMPTY = "values of torch's random generator", "uninitialized memory (torch.empty)"
_NN_INIT_DISPATCHED = frozenset(("uniform_", "normal_", "constant_", "kaiming_uniform_"))  # via __torch_function__
# in-place methods that change no element's value (a flag, the view's own layout, memory placement)
_NOT_VALUES = frozenset(
    [
        "requires_grad_",
        "share_memory_",
        "detach_",
        "t_",
        "transpose_",
        "squeeze_",
        "unsqueeze_",
        "swapdims_",
        "swapaxes_",
        "as_strided_",
        "resize_",
        "resize_as_",
        "set_",
        "retain_grad",
        "record_stream",
    ]
)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _scalar(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, torch.Tensor) and not x.is_meta and x.numel() == 1:
        return float(x.detach().reshape(()).double())
    return None


class Recorder(TorchFunctionMode):
    """Records in-place writes to its roots (see the module doc); every other operation runs as usual, with the
    real tensors that carry torch's random values or uninitialized memory marked, so a copy of them is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.roots: dict[int, list[Root]] = {}  # storage identity -> the roots in it (one, unless views of one buffer)
        self.shadows: dict[int, list[Root]] = {}  # likewise, real tensors drawn by torch's generator -> their draws
        self.frozen: set[int] = set()  # roots whose writes are ignored for now (see replay)
        self._taint: dict[int, str] = {}  # storage identity of a real tensor -> why its values are not the model's
        self._keep: list[object] = []  # keeps the storages behind those identities alive while recording

    # roots and views

    def add_root(self, t: torch.Tensor, initial: Value | Root | None = None) -> Root:
        key = self._key(t)
        root = next(
            (r for r in self.roots.get(key, []) if r.tensor.storage_offset() == t.storage_offset() and r.shape == tuple(t.shape)), None
        )
        if root is None:
            root = Root(t, tuple(t.shape))
            self.roots.setdefault(key, []).append(root)
            self._keep.append(t)
        if isinstance(initial, Root):
            root.base, root.patches = initial.base, list(initial.patches)
        elif initial is not None:
            root.base, root.patches = Write(initial, None, None, _where()), []
        return root

    def shadow_of(self, t: torch.Tensor) -> Root | None:
        """The distribution a real tensor of the model's code was drawn from, when it is one of the whole tensor."""
        found = self.locate(t)
        if found is None or not found[0].shadow or found[1] is not None:
            return None
        return found[0]

    def _new_shadow(self, t: torch.Tensor, value: Value, origin: Root | None = None) -> Root:
        root = Root(t, tuple(t.shape), Write(value, None, origin, _where()), shadow=True)
        key = self._key(t)
        self.shadows[key] = [r for r in self.shadows.get(key, []) if r.tensor.storage_offset() != t.storage_offset()] + [root]
        self._keep.append(t)
        return root

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def locate(self, t: Any) -> tuple[Root, Box | None, tuple[int, ...]] | None:
        """The root a tensor views, the box of it the view covers (None: all of it, in order), and the root's
        dimensions in the view's order; None when `t` views no root."""
        if not isinstance(t, torch.Tensor):
            return None
        try:
            key = self._key(t)
        except (RuntimeError, NotImplementedError):
            return None
        start = t.storage_offset()
        root = next(
            (r for r in [*self.roots.get(key, []), *self.shadows.get(key, [])] if 0 <= start - r.tensor.storage_offset() < max(r.numel, 1)),
            None,
        )
        if root is None:
            return None
        shape, strides = root.shape, root.strides()
        off = t.storage_offset() - root.tensor.storage_offset()
        if off == 0 and t.numel() == root.numel and t.is_contiguous():
            return root, None, tuple(range(len(shape)))
        coords = []
        rest = off
        for n, s in zip(shape, strides, strict=True):
            coords.append((rest // s) if n else 0)
            rest -= coords[-1] * s
        if rest != 0 or any(c >= n for c, n in zip(coords, shape, strict=True) if n):
            return root, (), ()  # not a box: () marks it
        box = [(c, c + 1) for c in coords]
        order: list[int] = []
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size == 1:
                continue
            d = next((d for d in range(len(shape)) if shape[d] > 1 and strides[d] == stride and d not in order), None)
            if d is None or coords[d] + size > shape[d]:
                return root, (), ()
            box[d] = (coords[d], coords[d] + size)
            order.append(d)
        whole = all(a == 0 and b == n for (a, b), n in zip(box, shape, strict=True))
        return root, (None if whole and order == sorted(order) else tuple(box)), tuple(order)

    # writes

    def _refuse(self, root: Root, box: Box | None, why: str) -> None:
        self._set(root, box, Refused(why), None)

    def _set(self, root: Root, box: Box | None, value: Value, origin: Root | None) -> None:
        where = _where()
        if isinstance(value, Refused):  # a refusal names the model's line
            value = Refused(f"{value.why} ({where})")
        if box is None or all(a == 0 and b == n for (a, b), n in zip(box, root.shape, strict=True)):
            root.base, root.patches = Write(value, None, origin, where), []
            if root.shadow:  # its values are what the shadow says now, not the memory it was made from
                self._taint.pop(self._safe_key(root.tensor), None)
            return
        part = value.computed()
        computed = not isinstance(part, str)
        carried = isinstance(value, Values) or any(isinstance(w.value, Values) for w in [root.base, *root.patches] if w)
        if computed and carried and root.base is not None and not isinstance(root.base.value.computed(), str):
            current = _values(root)
            if isinstance(current, np.ndarray):  # data stays data: the part is written into it
                current[_slices(box)] = part if isinstance(part, float) else np.asarray(part).reshape(_box_shape(box))
                root.base, root.patches = Write(as_value(current), None, None, where), []
                return
        if root.shadow and computed and isinstance(root.base.value if root.base else None, Refused):
            if root.written is None and root.numel <= DATA_LIMIT:  # torch.empty filled part by part: settled once whole
                root.written = np.zeros(root.shape, dtype=np.bool_)
            if root.written is not None:
                root.written[_slices(box)] = True
                return
        if isinstance(value, Values):  # (a constant is a Fixed already)
            value = Refused("writes computed values into part of a random tensor, which no patch states")
        root.patches = [p for p in root.patches if p.box is not None and not _covers(box, p.box)]
        root.patches.append(Write(value, box, origin, where))

    def _transform(self, root: Root, box: Box | None, step: Callable[[Value], Value], what: str) -> None:
        where = _where()

        def fn(v: Value) -> Value:  # a refusal this step makes names the model's line
            out = step(v)
            return Refused(f"{what}: {out.why} ({where})") if isinstance(out, Refused) and not isinstance(v, Refused) else out

        if root.base is None:
            self._refuse(root, box, f"{what} on a tensor nothing wrote before")
            return
        if box is None or all(a == 0 and b == n for (a, b), n in zip(box, root.shape, strict=True)):
            root.base = dataclasses.replace(root.base, value=fn(root.base.value))
            root.patches = [dataclasses.replace(p, value=fn(p.value)) for p in root.patches]
            return
        same = [i for i, p in enumerate(root.patches) if p.box == box]
        if same and not any(p.box is not None and _intersects(p.box, box) for p in root.patches[same[-1] + 1 :]):
            p = root.patches[same[-1]]
            root.patches[same[-1]] = dataclasses.replace(p, value=fn(p.value))
            return
        if not any(p.box is not None and _intersects(p.box, box) for p in root.patches):
            self._set(root, box, fn(root.base.value), root.base.origin)
            return
        current = _values(root)
        if isinstance(current, str):
            self._refuse(root, box, f"{what} on part of a tensor written in overlapping parts ({current})")
            return
        part = fn(Values(current[_slices(box)].copy()))
        self._set(root, box, part, None)

    # the mode

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        module = getattr(func, "__module__", None)
        if module is not None and name in _NN_INIT_DISPATCHED and module != "torch._tensor":  # nn.init's, or a wrapper of it
            target = args[0] if args else kwargs.get("tensor")
            found = self.locate(target)
            if found is not None:
                if self._safe_key(found[0].tensor) not in self.frozen:
                    self._nn_init(func, name, found, args, kwargs)
                return target
            return func(*args, **kwargs)
        out_target = kwargs.get("out")
        writes = (name.endswith("_") and not name.startswith("__") and name not in _NOT_VALUES) or name == "__setitem__"
        if name == "__set__" and getattr(func, "__self__", None) is torch._C.TensorBase.__dict__["data"]:
            writes = True
        found = self.locate(args[0]) if args and writes else None
        if found is None and out_target is not None:
            found = self.locate(out_target)
            if found is not None:
                self._out(func, name, found, args, kwargs)
                return out_target
        if found is None and writes and args and name in _RANDOM_INPLACE and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            base = args[0]._base if args[0]._base is not None else args[0]
            if self._safe_key(base) != -1:  # a real tensor drawn in place: its draws are what it holds
                why = self.taint_of(base)
                self._new_shadow(base, Refused(f"holds {why}") if why else real_value(base))
                found = self.locate(args[0])
        if found is not None and not found[0].shadow and self._safe_key(found[0].tensor) in self.frozen:
            return None if name in ("__setitem__", "__set__") else args[0]
        if found is not None:
            self._inplace(func, name, found, args, kwargs)
            if not found[0].shadow:
                return None if name in ("__setitem__", "__set__") else args[0]
        result = func(*args, **kwargs)
        if found is not None and found[0].written is not None and found[0].written.all():
            shadow = found[0]  # every element written with computed values: the tensor holds them now
            shadow.base, shadow.patches, shadow.written = Write(real_value(shadow.tensor), None, None, _where()), [], None
        self._mark(name, args, kwargs, result)
        self._draws(name, args, kwargs, result)
        return result

    def _draws(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], result: Any) -> None:
        """Real tensors whose values are draws the plan can state: torch.randn/rand, and scales, shifts and copies of
        whole drawn tensors (nn.Parameter(torch.randn(n, d) * 0.02))."""
        if not isinstance(result, torch.Tensor) or not result.is_floating_point():
            return
        if name in ("randn", "rand", "empty", "empty_like", "new_empty", "randn_like", "rand_like"):
            drawn: dict[str, Value] = {"randn": NormalDraw(0.0, 1.0), "rand": UniformDraw(0.0, 1.0)}
            value = drawn.get(name.removesuffix("_like"), Unwritten(f"holds {_EMPTY}"))
            self._new_shadow(result, value)
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name == "cat" and args and isinstance(args[0], list | tuple) and len(args[0]) == 1:
            tensors, name = list(args[0]), "clone"  # the concatenation of one tensor is a copy of it
        if len(tensors) != 1:
            return
        located = self.locate(tensors[0])
        source = located[0] if located is not None and located[1] is None else None
        if source is None or source.base is None or source.patches or source.tensor.shape != result.shape:
            return
        v = source.base.value
        origin = source.base.origin if source.shadow else source.base.origin or source
        pad = args[1] if name == "pad" and len(args) > 1 else kwargs.get("pad")
        if name in _SAME_VALUES or (name == "pad" and pad is not None and not any(pad)):
            self._new_shadow(result, v, origin)
            return
        if v.drawn and origin is not None:
            return  # a scaled copy of a parameter's draws: another tensor's random values
        other = next((a for a in args if not isinstance(a, torch.Tensor)), kwargs.get("other"))
        x = _scalar(other) if other is not None else None
        if name in ("neg", "__neg__"):
            self._new_shadow(result, v.affine(-1.0, 0.0), origin)
        elif x is not None and name in _AFFINE_OPS:
            c, d = _AFFINE_OPS[name](x, float(_scalar(kwargs.get("alpha", 1.0)) or 1.0))
            self._new_shadow(result, v.affine(c, d), origin)

    def _mark(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], result: Any) -> None:
        """Which real tensors hold torch's random values or uninitialized memory (so copying them is refused)."""
        why = _RANDOM if name in _RANDOM_FACTORIES else _EMPTY if name in _EMPTY_FACTORIES else None
        inputs = [t for t in _tensors((args, kwargs)) if not t.is_meta]
        if why is None:
            for t in inputs:
                why = why or self._taint.get(self._safe_key(t))
        if name.endswith("_") and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            key = self._safe_key(args[0])
            if name in _RANDOM_INPLACE:
                self._taint[key] = _RANDOM
                self._keep.append(args[0])
            elif name in ("fill_", "zero_") and args[0].numel() * args[0].element_size() == args[0].untyped_storage().nbytes():
                self._taint.pop(key, None)
            elif why is not None:
                self._taint[key] = why
                self._keep.append(args[0])
            return
        if why is None:
            return
        for t in _tensors(result):
            if not t.is_meta:
                self._taint[self._safe_key(t)] = why
                self._keep.append(t)

    def _safe_key(self, t: torch.Tensor) -> int:
        try:
            return self._key(t)
        except (RuntimeError, NotImplementedError):
            return -1

    def taint_of(self, t: torch.Tensor) -> str | None:
        return None if t.is_meta else self._taint.get(self._safe_key(t))

    def _nn_init(
        self, func: Any, name: str, found: tuple[Root, Box | None, tuple[int, ...]], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> None:
        root, box, _ = found
        bound = inspect.signature(getattr(nn.init, name)).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if box == ():
            self._refuse(root, None, f"torch.nn.init.{name} on a view that is not a box of the tensor")
            return
        if a["tensor"].numel() == 0:
            return
        if name == "uniform_":
            self._set(root, box, UniformDraw(float(a["a"]), float(a["b"])), None)
        elif name == "normal_":
            self._set(root, box, NormalDraw(float(a["mean"]), float(a["std"])), None)
        elif name == "constant_":
            self._set(root, box, Fixed(float(a["val"])), None)
        else:  # kaiming_uniform_: PyTorch's own arithmetic for the bound
            fan = nn.init._calculate_correct_fan(a["tensor"], a["mode"])
            gain = nn.init.calculate_gain(a["nonlinearity"], a["a"])
            bound_ = math.sqrt(3.0) * (gain / math.sqrt(fan))
            self._set(root, box, UniformDraw(-bound_, bound_), None)

    def _source(self, src: Any, what: str) -> tuple[Value, Root | None] | str:
        """The value a write copies from `src`, with the root whose seed it keeps, or why it cannot be stated."""
        s = _scalar(src)
        if s is not None and not (isinstance(src, torch.Tensor) and self.taint_of(src)):
            return Fixed(s), None
        if not isinstance(src, torch.Tensor):
            return f"{what} with a {type(src).__name__}"
        located = self.locate(src)
        if located is not None:
            other, obox, order = located
            if obox == ():
                return f"{what} from a view of another tensor that is not a box of it"
            values = _values(other)
            if isinstance(values, np.ndarray):
                part = values if obox is None else values[_slices(obox)]
                return Values(_arranged(part, obox, order, inverse=True).reshape(tuple(src.shape))), None
            if obox is None and other.base is not None and not other.patches:
                return other.base.value, (other.base.origin if other.shadow else other.base.origin or other)
            return f"{what} from a part of another tensor's random values ({values})"
        if src.is_meta:
            return f"{what} from a tensor computed from others, which no initializer states"
        why = self.taint_of(src)
        if why is not None:
            return f"{what} from {why}"
        if src.numel() > DATA_LIMIT:
            return f"{what} from a tensor of {src.numel()} elements, too large to carry as data"
        return Values(src.detach().to("cpu", torch.float64).numpy().copy()), None

    def _write_from(self, root: Root, box: Box | None, order: tuple[int, ...], view_shape: tuple[int, ...], src: Any, what: str) -> None:
        got = self._source(src, what)
        if isinstance(got, str):
            self._refuse(root, box, got)
            return
        value, origin = got
        if isinstance(value, Values):
            full = np.broadcast_to(value.values, view_shape)
            value = as_value(_arranged(np.ascontiguousarray(full), box, order, inverse=False))
        elif origin is not None and box is not None and value.drawn:
            value = Refused(f"{what}: copies another tensor's random values into part of this one")
        elif origin is not None and origin.shape != root.shape:
            value = Refused(f"{what}: copies random values of a {list(origin.shape)} tensor into a {list(root.shape)} one")
        self._set(root, box, value, origin if value.drawn else None)

    def _inplace(
        self, func: Any, name: str, found: tuple[Root, Box | None, tuple[int, ...]], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> None:
        root, box, order = found
        target = args[0]
        if box == ():
            self._refuse(root, None, f"{name} on a view that is not a box of the tensor")
            return
        if name == "__setitem__":
            sub = target[args[1]]
            located = self.locate(sub) if sub.numel() else None
            if sub.numel() == 0:
                return
            if located is not None and located[1] != ():
                _, sbox, sorder = located
                self._write_from(root, sbox, sorder, tuple(sub.shape), args[2], "item assignment")
                return
            self._evaluate(func, name, root, None, tuple(range(len(root.shape))), args, kwargs)
            return
        if target.numel() == 0:
            return
        if name == "__set__":  # param.data = other
            self._write_from(root, box, order, tuple(target.shape), args[1], ".data assignment")
            return
        # the framework's generator (kwargs["generator"]) is never used: the plan's seeds make the values
        if name == "normal_":
            mean, std = [*args[1:3], None, None][:2]
            mean = kwargs.get("mean", 0.0 if mean is None else mean)
            std = kwargs.get("std", 1.0 if std is None else std)
            self._set(root, box, NormalDraw(float(mean), float(std)), None)
        elif name == "uniform_":
            lo, hi = [*args[1:3], None, None][:2]
            lo = kwargs.get("from", 0.0 if lo is None else lo)
            hi = kwargs.get("to", 1.0 if hi is None else hi)
            self._set(root, box, UniformDraw(float(lo), float(hi)), None)
        elif name == "zero_":
            self._set(root, box, Fixed(0.0), None)
        elif name == "fill_":
            self._write_from(root, box, order, tuple(target.shape), args[1] if len(args) > 1 else kwargs["value"], "fill_")
        elif name == "copy_":
            self._write_from(root, box, order, tuple(target.shape), args[1] if len(args) > 1 else kwargs["src"], "copy_")
        elif (name in ("mul_", "div_", "add_", "sub_", "neg_") and self._affine(name, root, box, args, kwargs)) or (
            name in ("clamp_", "clip_", "clamp_min_", "clamp_max_") and self._clamp(name, root, box, args, kwargs)
        ):
            pass
        elif name == "erfinv_":
            self._transform(root, box, lambda v: v.erfinv(), name)
        elif name in _RANDOM_INPLACE:
            self._refuse(root, box, f"{name} draws a distribution no initializer states")
        else:
            self._evaluate(func, name, root, box, order, args, kwargs)

    def _affine(self, name: str, root: Root, box: Box | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if name == "neg_":
            c, d = -1.0, 0.0
        else:
            x = _scalar(other)
            if x is None or (isinstance(other, torch.Tensor) and (other.is_meta or self.taint_of(other))):
                return False
            alpha = _scalar(kwargs.get("alpha", 1.0))
            if name in ("div_",) and kwargs.get("rounding_mode") is not None:
                return False
            c, d = {
                "mul_": (x, 0.0),
                "div_": (1.0 / x if x else math.inf, 0.0),
                "add_": (1.0, x * (alpha or 1.0)),
                "sub_": (1.0, -x * (alpha or 1.0)),
            }[name]
            if name == "div_":
                self._transform(root, box, lambda v: v.divide(x), name)
                return True
        self._transform(root, box, lambda v: v.affine(c, d), name)
        return True

    def _clamp(self, name: str, root: Root, box: Box | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        rest = list(args[1:])
        if name == "clamp_min_":
            lo, hi = (rest[0] if rest else kwargs.get("min")), None
        elif name == "clamp_max_":
            lo, hi = None, (rest[0] if rest else kwargs.get("max"))
        else:
            lo = rest[0] if rest else kwargs.get("min")
            hi = rest[1] if len(rest) > 1 else kwargs.get("max")
        los, his = _scalar(lo) if lo is not None else None, _scalar(hi) if hi is not None else None
        if (lo is not None and los is None) or (hi is not None and his is None):
            return False
        self._transform(root, box, lambda v: v.clamp(-math.inf if los is None else los, math.inf if his is None else his), name)
        return True

    def _evaluate(
        self, func: Any, name: str, root: Root, box: Box | None, order: tuple[int, ...], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        """Any other in-place operation: run for real on the tensor's deterministic values, when they are."""
        values = _values(root)
        if isinstance(values, str):
            self._refuse(root, None, f"{name} {values}, which no initializer states")
            return
        whole = torch.from_numpy(values)
        view = whole if box is None else whole[_slices(box)]
        target = torch.from_numpy(np.ascontiguousarray(_arranged(view.numpy(), box, order, inverse=True)).reshape(tuple(args[0].shape)))
        rest = []
        for i, a in enumerate(args[1:]):
            if name == "__setitem__" and i == 0:  # the index: plain, or a tensor of indices (not random ones)
                if any(self.taint_of(t) or t.is_meta for t in _tensors(a)):
                    self._refuse(root, None, "item assignment at indices drawn from torch's random generator")
                    return
            elif isinstance(a, torch.Tensor):
                src = self._source(a, name)
                got = src if isinstance(src, str) else src[0].computed()
                if isinstance(got, str):
                    self._refuse(root, None, f"{name} with {got}")
                    return
                a = torch.tensor(got, dtype=torch.float64) if isinstance(got, float) else torch.from_numpy(got)
            rest.append(a)
        with torch.no_grad():
            getattr(torch.Tensor, name)(target, *rest, **{k: v for k, v in kwargs.items() if k != "generator"})
        if name in _RANDOM_INPLACE:
            self._refuse(root, None, f"{name} has no plan form")
            return
        region = _slices(box) if box is not None else ...
        values[region] = _arranged(target.numpy(), box, order, inverse=False).reshape(values[region].shape)
        root.base, root.patches = Write(as_value(values), None, None, _where()), []

    def _out(
        self, func: Any, name: str, found: tuple[Root, Box | None, tuple[int, ...]], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> None:
        """func(..., out=root): evaluated for real on CPU when its inputs are deterministic (torch.eye(n, out=w))."""
        root, box, order = found
        target = kwargs.pop("out")
        kwargs.pop("requires_grad", None)
        if name in _RANDOM_FACTORIES:
            self._refuse(root, box, f"{name}(out=...) draws {_RANDOM}")
            return
        if any(t.is_meta for t in _tensors((args, kwargs))):
            self._refuse(root, box, f"{name}(out=...) from tensors computed from others")
            return
        kwargs["device"] = "cpu" if "device" in kwargs else kwargs.get("device")
        if kwargs["device"] is None:
            kwargs.pop("device")
        try:
            got = func(*args, **kwargs)
        except Exception as exc:  # the model's call, refused with what it said
            self._refuse(root, box, f"{name}(out=...) cannot be evaluated: {exc}")
            return
        self._write_from(root, box, order, tuple(target.shape), got.reshape(target.shape), f"{name}(out=...)")


_SAME_VALUES = frozenset(("clone", "to", "float", "double", "half", "bfloat16", "contiguous", "detach", "type_as", "to_dense"))
_AFFINE_OPS: dict[str, Callable[[float, float], tuple[float, float]]] = {
    "mul": lambda x, a: (x, 0.0),
    "__mul__": lambda x, a: (x, 0.0),
    "__rmul__": lambda x, a: (x, 0.0),
    "div": lambda x, a: (1.0 / x, 0.0),
    "__truediv__": lambda x, a: (1.0 / x, 0.0),
    "add": lambda x, a: (1.0, x * a),
    "__add__": lambda x, a: (1.0, x),
    "__radd__": lambda x, a: (1.0, x),
    "sub": lambda x, a: (1.0, -x * a),
    "__sub__": lambda x, a: (1.0, -x),
    "__rsub__": lambda x, a: (-1.0, x),
}


def _arranged(a: np.ndarray[Any, Any], box: Box | None, order: tuple[int, ...], *, inverse: bool) -> np.ndarray[Any, Any]:
    """Values in a view's element order <-> the box's row-major order (a permuted view, e.g. w.t(), as its box)."""
    if box is None or not order or list(order) == sorted(order):
        return a.reshape(-1) if not inverse else a
    bshape = _box_shape(box)
    sizes = [bshape[d] for d in order]
    rank = sorted(range(len(order)), key=lambda i: order[i])
    if inverse:  # box order -> view order
        squeezed = a.reshape([bshape[d] for d in sorted(order)])
        return np.transpose(squeezed, [sorted(order).index(d) for d in order])
    return np.transpose(a.reshape(sizes), rank).reshape(-1)


# -- torch.nn.init functions whose meta path records nothing ------------------------------------------------------

_local = threading.local()


def _active() -> Recorder | None:
    stack: list[Recorder] = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def _record_call(fname: str, original: Callable[..., Any], a: dict[str, Any]) -> Any:
    """One call of torch.nn.init's `fname` with its bound arguments `a`: recorded when a recorder is active on this
    thread and the tensor is one of its roots, else run by the function's own code (`original`)."""
    rec = _active()
    tensor = a["tensor"]
    found = rec.locate(tensor) if rec is not None else None
    if rec is None or found is None:
        return original(**a)
    root, box, order = found
    if box == ():
        rec._refuse(root, None, f"torch.nn.init.{fname} on a view that is not a box of the tensor")
        return tensor
    if tensor.numel() == 0:
        return tensor
    if fname == "trunc_normal_":
        rec._set(root, box, truncated(float(a["mean"]), float(a["std"]), float(a["a"]), float(a["b"])), None)
    elif fname == "orthogonal_":
        rec._set(root, box, OrthogonalDraw(float(a["gain"])) if box is None else Refused("orthogonal_ on part of a tensor"), None)
    elif fname == "sparse_":
        if box is None and tensor.dim() == 2:
            rec._set(root, None, SparseDraw(float(a["sparsity"]), float(a["std"])), None)
        else:
            rec._refuse(root, box, "sparse_ on part of a tensor, which no patch states")
    elif box is None and ((fname == "eye_" and tensor.dim() == 2) or (fname == "dirac_" and 3 <= tensor.dim() <= 5)):
        groups = int(a.get("groups", 1))
        rec._set(root, None, Identity(tuple(tensor.shape), 0 if fname == "eye_" else groups, original), None)
    else:  # eye_, dirac_ into a part: deterministic, evaluated for this tensor alone
        if tensor.numel() > DATA_LIMIT:
            rec._refuse(root, box, f"{fname} of {tensor.numel()} elements is too large to carry as data")
            return tensor
        real = torch.zeros(tuple(tensor.shape), dtype=torch.float64)
        with torch.no_grad():
            original(real, **{k: v for k, v in a.items() if k != "tensor"})
        rec._write_from(root, box, order, tuple(tensor.shape), real, fname)
    return tensor


_HIGH_LEVEL = ("trunc_normal_", "orthogonal_", "sparse_", "eye_", "dirac_")
_HOOK = "__paraminit_record_call__"  # the name the swapped code calls, in torch.nn.init's globals
_patch_lock = threading.Lock()
_patch_depth = 0
_saved: list[tuple[Any, Any]] = []  # (function, its own code) while swapped; (torch, Generator)


def _forwarding_code(fname: str, fn: Any) -> Any:
    """A code object with `fn`'s parameters (its defaults stay on the function) whose body hands them, bound by name,
    to _record_call through torch.nn.init's global _HOOK."""
    params, names, star = [], [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"torch.nn.init.{fname} takes *args or **kwargs: cannot be recorded by its code")
        if p.kind == p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name if p.default is p.empty else f"{p.name}=None")
        names.append(p.name)
    text = f"def {fname}({', '.join(params)}):\n    return {_HOOK}({fname!r}, {{{', '.join(f'{n!r}: {n}' for n in names)}}})\n"
    space: dict[str, Any] = {}
    exec(compile(text, f"<paraminit recorder of torch.nn.init.{fname}>", "exec"), space)
    return space[fname].__code__


@contextlib.contextmanager
def _init_functions() -> Iterator[None]:
    """torch.nn.init's functions whose meta path records nothing, recorded as calls however model code holds them
    (torch.nn.init.f, `from torch.nn.init import f`, a table of them, a functools.partial of one): the functions'
    own code is swapped for one that forwards to _record_call (which runs the original code for anything that is
    not a recorder's root) for as long as any recording runs, and put back after."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            own: dict[str, Callable[..., Any]] = {}
            for fname in _HIGH_LEVEL:
                fn = getattr(nn.init, fname)
                original = types.FunctionType(fn.__code__, fn.__globals__, fname, fn.__defaults__, fn.__closure__)
                original.__kwdefaults__ = fn.__kwdefaults__
                own[fname] = original
                code = _forwarding_code(fname, fn)
                _saved.append((fn, fn.__code__))
                fn.__code__ = code
            vars(nn.init)[_HOOK] = lambda fname, a: _record_call(fname, own[fname], a)
            real_generator = torch.Generator

            class MetaSafeGenerator(real_generator):  # type: ignore[misc, valid-type]
                """torch.Generator("meta") fails; a framework's seeded generator only feeds recorded calls."""

                def __new__(cls, device: Any = "cpu") -> Any:
                    return real_generator("cpu" if str(device) == "meta" else device)

            _saved.append((torch, real_generator))
            torch.Generator = MetaSafeGenerator  # type: ignore[misc]
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for fn, code in reversed(_saved):
                    if fn is torch:
                        torch.Generator = code  # type: ignore[misc]
                    else:
                        fn.__code__ = code
                _saved.clear()
                vars(nn.init).pop(_HOOK, None)


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Run the enclosed code with `rec` recording (this thread's tensor operations, and the nn.init calls)."""
    stack: list[Recorder] = getattr(_local, "stack", None) or []
    _local.stack = stack
    stack.append(rec)
    try:
        with _init_functions(), rec:
            yield rec
    finally:
        stack.pop()


@contextlib.contextmanager
def capture() -> Iterator[Recorder]:
    """Record a model's construction: each parameter registered meanwhile becomes a root carrying its Root
    (RECORD_ATTR), so its constructor's initialization travels with the model (see torch.meta_parameters)."""
    with recording(Recorder()) as rec:
        yield rec


def initial_value(rec: Recorder, real: torch.Tensor) -> Value | Root:
    """What a parameter made from real values (moved to meta at registration) starts as."""
    shadow = rec.shadow_of(real)
    if shadow is not None and shadow.base is not None:
        return shadow if shadow.patches else shadow.base.value
    why = rec.taint_of(real)
    if why == _EMPTY:
        return Unwritten(f"holds {why} that the model's code never overwrites")
    if why is not None:
        return Refused(f"holds {why} that the model's code never overwrites")
    return real_value(real)


def real_value(real: torch.Tensor) -> Value:
    """The values a real tensor holds: a constant, or data for a tensor small enough to carry them (as_value's
    rule; a larger one is looked at in its own dtype, without a binary64 copy)."""
    if real.numel() <= DATA_LIMIT:
        return as_value(real.detach().to("cpu", torch.float64).numpy())
    flat = real.detach().reshape(-1)
    if bool((flat == flat[0]).all()) and bool((flat.signbit() == flat[0].signbit()).all()):
        return Fixed(float(flat[0]))
    return Refused(f"starts from computed values of {real.numel()} elements, too large to carry as data")


# -- replay after the fact -----------------------------------------------------------------------------------------

_REPLAYED = frozenset(("reset_parameters", "_reset_parameters"))
_HF_REPLAYED = frozenset(("post_init", "init_weights", "_init_weights", "initialize_weights", "_initialize_weights", "tie_weights"))
_INIT_NAMES = frozenset(
    (
        *(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")),
        *_RANDOM_INPLACE,
        "zero_",
        "fill_",
        "copy_",
        "mul_",
        "trunc_normal_tf_",
        "lecun_normal_",
        "variance_scaling_",
        "apply",
        "named_apply",
        *_HF_REPLAYED,
        *_REPLAYED,
    )
)


@functools.lru_cache(maxsize=512)
def constructor_inits(cls: Any, replayed: frozenset[str]) -> str | None:
    """file:line of the first initialization call a class's constructor makes in its own code (following its own
    methods it calls on self), other than the methods replayed after the fact; None when it makes none."""
    seen: set[str] = set()

    def scan(fn: Any, depth: int) -> str | None:
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is None or code.co_filename.startswith(_TORCH_DIR) or depth > 3:
            return None
        try:
            source = textwrap.dedent(inspect.getsource(fn))
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError):
            return None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func
            called = callee.attr if isinstance(callee, ast.Attribute) else callee.id if isinstance(callee, ast.Name) else ""
            if called in replayed:
                continue
            if called in _INIT_NAMES:
                return f"{code.co_filename.split('site-packages' + os.sep, 1)[-1]}:{code.co_firstlineno + node.lineno - 1}"
            if (
                isinstance(callee, ast.Attribute)
                and isinstance(callee.value, ast.Name)
                and callee.value.id == "self"
                and called not in seen
            ):
                seen.add(called)
                method = getattr(cls, called, None)
                if method is not None and callable(method) and not isinstance(method, type):
                    got = scan(method, depth + 1)
                    if got:
                        return got
        return None

    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and not (klass.__module__ or "").startswith("torch."):
            got = scan(init, 0)
            if got:
                return got
    return None


def _hf_models(module: nn.Module) -> list[nn.Module]:
    """The top-most transformers PreTrainedModels in the tree (their initialize_weights covers the rest)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None:
        return []
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, base):
            found.append(m)
            return
        for c in m.children():
            walk(c)

    walk(module)
    return found


@contextlib.contextmanager
def _hf_flags_cleared(module: nn.Module) -> Iterator[None]:
    """transformers skips modules and tensors flagged initialized: clear the flags for the replay, then restore."""
    saved: list[tuple[Any, Any]] = []
    for obj in [*module.modules(), *module.parameters(), *module.buffers()]:
        if "_is_hf_initialized" in getattr(obj, "__dict__", {}):
            saved.append((obj, obj.__dict__.pop("_is_hf_initialized")))
    try:
        yield
    finally:
        for obj in [*module.modules(), *module.parameters(), *module.buffers()]:
            getattr(obj, "__dict__", {}).pop("_is_hf_initialized", None)
        for obj, value in saved:
            obj.__dict__["_is_hf_initialized"] = value


# frameworks whose models are initialized after construction by a call of the trainer's, and that call
_AFTER_CONSTRUCTION: dict[str, Callable[[nn.Module], object]] = {
    "torchtitan": lambda m: m.init_weights(),  # type: ignore[operator]
    "olmo_core": lambda m: m.init_weights(device=torch.device("meta")),  # type: ignore[operator]
}


def late_init(module: nn.Module, unwritten: bool = False) -> Callable[[nn.Module], object] | None:
    """The initialization run after construction: torchtitan's and OLMo-core's init_weights (their trainers call it),
    or, when the constructor left tensors `unwritten`, a root init_weights(); None for transformers models (whose
    post_init runs inside the constructor) and for models whose constructor is their whole initialization (timm's
    call their init_weights themselves)."""
    if _hf_models(module) or not callable(getattr(module, "init_weights", None)):
        return None
    framework = (type(module).__module__ or "").split(".")[0]
    if framework in _AFTER_CONSTRUCTION:
        return _AFTER_CONSTRUCTION[framework]
    return (lambda m: m.init_weights()) if unwritten else None  # type: ignore[operator]


def replay(
    module: nn.Module,
    tensors: Sequence[torch.Tensor],
    init: Callable[[nn.Module], object] | None = None,
    start: Sequence[tuple[torch.Tensor, Root]] = (),
) -> tuple[Recorder, dict[int, str]]:
    """Run a model's initialization code with every tensor of `module` (and `tensors`) a root.

    Args:
        module: the model.
        tensors: tensors to track besides the module's (normally its state_dict's).
        init: the code to run; None: each module's reset_parameters (children first), then transformers'
            initialize_weights for its models, else the root's init_weights().
        start: tensors with what they hold before the code runs (their construction records).

    Returns:
        The recorder (its roots hold what was written) and, per module id, why its code could not run.
    """
    rec = Recorder()
    for t in [*module.parameters(), *module.buffers(), *tensors]:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not nn.parameter.is_lazy(t):
            rec.add_root(t)
    for t, record in start:
        rec.add_root(t, record)
    failures: dict[int, str] = {}
    with recording(rec), torch.no_grad():
        if init is not None:
            try:
                init(module)
            except Exception as exc:  # the framework's code cannot run here: every tensor says why
                failures[id(module)] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return rec, failures
        first = _first_owners(module)
        for mod in _post_order(module):
            fn = getattr(type(mod), "reset_parameters", None) or getattr(type(mod), "_reset_parameters", None)
            if fn is None:
                continue
            # a tensor tied after construction (lm_head.weight = wte.weight) keeps its first owner's initialization
            rec.frozen = {
                rec._safe_key(t)
                for t in [*mod._parameters.values(), *mod._buffers.values()]
                if t is not None and first.get(id(t), mod) is not mod
            }
            try:
                fn(mod)
            except Exception as exc:
                failures[id(mod)] = f"{type(mod).__name__}.reset_parameters() failed: {type(exc).__name__}: {str(exc)[:200]}"
            finally:
                rec.frozen = set()
        models = _hf_models(module)
        for model in models:
            with _hf_flags_cleared(model):
                try:
                    model.initialize_weights()  # type: ignore[operator]
                except Exception as exc:
                    failures[id(model)] = f"{type(model).__name__}.initialize_weights() failed: {type(exc).__name__}: {str(exc)[:200]}"
        if not models and callable(getattr(module, "init_weights", None)):
            try:
                module.init_weights()  # type: ignore[operator]
            except Exception as exc:
                failures[id(module)] = f"{type(module).__name__}.init_weights() failed: {type(exc).__name__}: {str(exc)[:200]}"
    return rec, failures


def _first_owners(module: nn.Module) -> dict[int, nn.Module]:
    """id(tensor) -> the module owning it under its first state_dict name (a tied tensor's initialization is its)."""
    out: dict[int, nn.Module] = {}
    for _, mod in module.named_modules(remove_duplicate=False):
        for t in [*mod._parameters.values(), *mod._buffers.values()]:
            if t is not None:
                out.setdefault(id(t), mod)
    return out


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for c in m.children():
            walk(c)
        out.append(m)

    walk(module)
    return out


def replayed_names(module: nn.Module) -> frozenset[str]:
    """The methods replay() runs for this model (so a constructor calling them needs no recording)."""
    names = set(_REPLAYED)
    if _hf_models(module):
        names |= _HF_REPLAYED
    elif callable(getattr(module, "init_weights", None)):
        names.add("init_weights")
    return frozenset(names)


# -- plan initializers ---------------------------------------------------------------------------------------------


def emit(root: Root, seed_of: Callable[[Root], int | str]) -> Ruling:
    """A root's plan initializer and patches, as the Ruling every policy's rules give.

    Args:
        root: the recorded tensor.
        seed_of: the seed of a root (its own, or a tie's source), or why it has none in this plan.

    Returns:
        The Init with its patches; the refusal, with why; unknown when nothing wrote the tensor.
    """
    if root.base is None:
        if root.patches:
            why = next((p.value.init(0) for p in root.patches if isinstance(p.value, Refused)), None)
            return _refusal(why if isinstance(why, str) else f"its initialization writes only part of it ({root.patches[0].where})")
        return Ruling.unknown()

    def seed(w: Write) -> int | str:
        return seed_of(w.origin or root)

    s = seed(root.base)
    if isinstance(s, str):
        return _refusal(s)
    base = root.base.value.init(s)
    if isinstance(base, str):
        return _refusal(base)
    patches = []
    for w in root.patches:
        ps = seed(w)
        if isinstance(ps, str):
            return _refusal(ps)
        got = w.value.init(ps)
        if isinstance(got, str):
            return _refusal(got)
        if not inits.KINDS[str(got.WhichOneof("kind"))].patchable:
            return Ruling.refused(f"a {got.WhichOneof('kind')} value in part of the tensor ({w.where}), which no patch states")
        patch = plan_pb2.Patch(init=got)
        assert w.box is not None
        for a, b in w.box:
            patch.box.add(start=a, stop=b)
        patches.append(patch)
    return Ruling.of(base, patches)


def _refusal(why: str) -> Ruling:
    """A reason as a refusal; an empty one says nothing was written (what emit has always meant by "")."""
    return Ruling.refused(why) if why else Ruling.unknown()
