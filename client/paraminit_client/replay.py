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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paraminit.v1 import plan_pb2

__all__ = ["RECORD_ATTR", "Recorder", "Root", "capture", "emit", "initial_value", "real_value", "record_of", "replay"]

RECORD_ATTR = "_paraminit_record"  # a parameter built under capture() carries its Root here
DATA_LIMIT = 1 << 24  # elements of deterministic values evaluated for one tensor (128 MiB as binary64)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep

Box = tuple[tuple[int, int], ...]


# -- values -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class Uniform:
    lo: float
    hi: float


@dataclass(frozen=True)
class Normal:
    mean: float
    std: float


@dataclass(frozen=True)
class Trunc:
    mean: float
    std: float
    lo: float
    hi: float


@dataclass(frozen=True)
class ErfUniform:
    """scale * erfinv(U[lo, hi)) + shift: a normal truncated to the image of [lo, hi] (the inverse-CDF method)."""

    lo: float
    hi: float
    scale: float = 1.0
    shift: float = 0.0


@dataclass(frozen=True)
class Orthogonal:
    gain: float


@dataclass(frozen=True, eq=False)
class Data:
    """Deterministic values of the whole tensor (row-major, binary64)."""

    values: np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class Refused:
    why: str


Value = Const | Uniform | Normal | Trunc | ErfUniform | Orthogonal | Data | Refused
_RANDOM_VALUES = (Uniform, Normal, Trunc, ErfUniform, Orthogonal)


def _erfinv(x: float) -> float:
    return float(torch.erfinv(torch.tensor(x, dtype=torch.float64)))


def affine(v: Value, c: float, d: float) -> Value:
    """The value c * x + d of every element x of `v`."""
    if isinstance(v, Refused):
        return v
    if isinstance(v, Const):
        return Const(c * v.value + d)
    if isinstance(v, Data):
        return Data(v.values * c + d)
    if c == 0.0 and not isinstance(v, ErfUniform):
        return Const(d)
    if isinstance(v, Uniform):
        return Uniform(c * v.lo + d, c * v.hi + d) if c > 0 else Uniform(c * v.hi + d, c * v.lo + d)
    if isinstance(v, Normal):
        return Normal(c * v.mean + d, abs(c) * v.std)
    if isinstance(v, Trunc):
        lo, hi = (c * v.lo + d, c * v.hi + d) if c > 0 else (c * v.hi + d, c * v.lo + d)
        return Trunc(c * v.mean + d, abs(c) * v.std, lo, hi)
    if isinstance(v, ErfUniform):
        return ErfUniform(v.lo, v.hi, c * v.scale, c * v.shift + d)
    if d == 0.0:
        return Orthogonal(v.gain * c)
    return Refused("shifts an orthogonal matrix, which no initializer states")


def _erf_bounds(v: ErfUniform) -> tuple[float, float]:
    a = v.shift + v.scale * _erfinv(v.lo) if v.lo > -1.0 else -math.inf
    b = v.shift + v.scale * _erfinv(v.hi) if v.hi < 1.0 else math.inf
    return (a, b) if v.scale > 0 else (b, a)


def clamp(v: Value, lo: float | None, hi: float | None) -> Value:
    """The value of clamp(x, lo, hi): unchanged where the bounds hold the support, a truncated normal where they
    close an inverse-CDF chain, refused where they would pile mass on a bound."""
    a = -math.inf if lo is None else float(lo)
    b = math.inf if hi is None else float(hi)
    if isinstance(v, Refused):
        return v
    if isinstance(v, Const):
        return Const(min(max(v.value, a), b))
    if isinstance(v, Data):
        return Data(np.clip(v.values, a, b))
    if isinstance(v, ErfUniform | Normal):
        mean, std = (v.shift, abs(v.scale) / math.sqrt(2.0)) if isinstance(v, ErfUniform) else (v.mean, v.std)
        na, nb = _erf_bounds(v) if isinstance(v, ErfUniform) else (-math.inf, math.inf)
        if std == 0.0:
            return Const(min(max(mean, a), b))
        if _mass(mean, std, na, nb, a, b) > _PILED:
            return Refused(f"clamps a normal({mean}, {std}) on [{na}, {nb}] to [{a}, {b}], piling values on a bound")
        return _trunc(mean, std, max(a, na), min(b, nb))
    if isinstance(v, Uniform):
        return v if a <= v.lo and v.hi <= b else Refused(f"clamps uniform({v.lo}, {v.hi}) to [{a}, {b}]")
    if isinstance(v, Trunc):
        return v if a <= v.lo and v.hi <= b else Refused(f"clamps a truncated normal on [{v.lo}, {v.hi}] to [{a}, {b}]")
    if isinstance(v, Orthogonal):
        return v if a <= -abs(v.gain) and abs(v.gain) <= b else Refused("clamps an orthogonal matrix")
    return v


_PILED = 1e-9  # the most probability a clamp may move onto its bounds and still be the truncated normal


def _mass(mean: float, std: float, na: float, nb: float, a: float, b: float) -> float:
    """The probability a normal(mean, std) on [na, nb] puts outside [a, b] (what a clamp would pile on a bound)."""

    def cdf(x: float) -> float:
        return 0.5 * math.erfc(-(x - mean) / (std * math.sqrt(2.0)))

    total = cdf(nb) - cdf(na)
    if total <= 0.0:
        return 1.0
    below = max(0.0, cdf(min(a, nb)) - cdf(na))
    above = max(0.0, cdf(nb) - cdf(max(b, na)))
    return (below + above) / total


def _trunc(mean: float, std: float, lo: float, hi: float) -> Value:
    if math.isinf(lo) and math.isinf(hi):
        return Normal(mean, std)
    if math.isinf(lo) or math.isinf(hi):
        return Refused(f"a normal truncated on one side only ([{lo}, {hi}]), which no initializer states")
    if lo > mean - 0.5 * std or hi < mean + 0.5 * std:
        return Refused(f"a normal({mean}, {std}) truncated to [{lo}, {hi}], narrower than the truncated normal allows")
    return Trunc(mean, std, lo, hi)


def erfinv(v: Value) -> Value:
    if isinstance(v, Uniform) and -1.0 <= v.lo < v.hi <= 1.0:
        return ErfUniform(v.lo, v.hi)
    if isinstance(v, Const | Data):
        values = np.asarray(v.values if isinstance(v, Data) else v.value, dtype=np.float64)
        out = torch.erfinv(torch.from_numpy(np.array(values))).numpy()
        return Data(out) if isinstance(v, Data) else Const(float(out))
    if isinstance(v, Refused):
        return v
    return Refused("applies erfinv_ to a value that is not uniform on [-1, 1]")


# -- where the model's code is --------------------------------------------------------------------------------------


def _where() -> str:
    """file:line of the innermost frame of the model's code (outside torch and paraminit)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path.startswith(_HERE) or path.endswith("contextlib.py")):
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
    touched: bool = False  # written at all (even if refused)
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


def record_of(t: torch.Tensor) -> Root | None:
    """The construction record a parameter built under capture() carries, or None."""
    rec = t.__dict__.get(RECORD_ATTR) if hasattr(t, "__dict__") else None
    return rec if isinstance(rec, Root) else None


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
    out: np.ndarray[Any, np.dtype[np.float64]]
    for w in [base, *root.patches]:
        if isinstance(w.value, Refused):
            return w.value.why
        if not isinstance(w.value, Const | Data):
            return f"reads random values ({type(w.value).__name__.lower()})"
    out = np.empty(root.shape, dtype=np.float64)
    for w in [base, *root.patches]:
        region = _slices(w.box) if w.box is not None else ...
        out[region] = w.value.value if isinstance(w.value, Const) else w.value.values.reshape(out[region].shape)  # type: ignore[union-attr]
    return out


def _const_or_data(values: np.ndarray[Any, Any]) -> Const | Data:
    flat = np.asarray(values, dtype=np.float64)
    first = flat.reshape(-1)[0] if flat.size else 0.0
    if flat.size and np.all(flat == first) and np.all(np.signbit(flat) == np.signbit(first)):
        return Const(float(first))
    return Data(flat)


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
            root.base, root.patches, root.touched = initial.base, list(initial.patches), True
        elif initial is not None:
            root.base, root.patches, root.touched = Write(initial, None, None, _where()), [], True
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
        root.touched = True
        where = _where()
        if isinstance(value, Refused):
            value = Refused(f"{value.why} ({where})")
        if box is None or all(a == 0 and b == n for (a, b), n in zip(box, root.shape, strict=True)):
            root.base, root.patches = Write(value, None, origin, where), []
            return
        deterministic = root.base is not None and isinstance(root.base.value, Const | Data)
        has_data = isinstance(value, Data) or any(isinstance(w.value, Data) for w in [root.base, *root.patches] if w)
        if deterministic and isinstance(value, Const | Data) and has_data:
            current = _values(root)
            if isinstance(current, np.ndarray):
                current[_slices(box)] = value.value if isinstance(value, Const) else value.values.reshape(_box_shape(box))
                root.base, root.patches = Write(_const_or_data(current), None, None, where), []
                return
        if root.shadow and isinstance(value, Const | Data) and isinstance(root.base.value if root.base else None, Refused):
            if root.written is None and root.numel <= DATA_LIMIT:  # torch.empty filled part by part: settled once whole
                root.written = np.zeros(root.shape, dtype=np.bool_)
            if root.written is not None:
                root.written[_slices(box)] = True
                return
        if isinstance(value, Data):
            flat = value.values.reshape(-1)
            if not (flat.size and np.all(flat == flat[0])):
                value = Refused("writes computed values into part of a random tensor, which no patch states")
            else:
                value = Const(float(flat[0]))
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
            root.touched = True
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
        part = fn(Data(current[_slices(box)].copy()))
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
            drawn: dict[str, Value] = {"randn": Normal(0.0, 1.0), "rand": Uniform(0.0, 1.0)}
            value = drawn.get(name.removesuffix("_like"), Refused(f"holds {_EMPTY}"))
            self._new_shadow(result, value)
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
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
        if isinstance(v, _RANDOM_VALUES) and origin is not None:
            return  # a scaled copy of a parameter's draws: another tensor's random values
        other = next((a for a in args if not isinstance(a, torch.Tensor)), kwargs.get("other"))
        x = _scalar(other) if other is not None else None
        if name in ("neg", "__neg__"):
            self._new_shadow(result, affine(v, -1.0, 0.0), origin)
        elif x is not None and name in _AFFINE_OPS:
            c, d = _AFFINE_OPS[name](x, float(_scalar(kwargs.get("alpha", 1.0)) or 1.0))
            self._new_shadow(result, affine(v, c, d), origin)

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
            self._set(root, box, Uniform(float(a["a"]), float(a["b"])), None)
        elif name == "normal_":
            self._set(root, box, Normal(float(a["mean"]), float(a["std"])), None)
        elif name == "constant_":
            self._set(root, box, Const(float(a["val"])), None)
        else:  # kaiming_uniform_: PyTorch's own arithmetic for the bound
            fan = nn.init._calculate_correct_fan(a["tensor"], a["mode"])
            gain = nn.init.calculate_gain(a["nonlinearity"], a["a"])
            bound_ = math.sqrt(3.0) * (gain / math.sqrt(fan))
            self._set(root, box, Uniform(-bound_, bound_), None)

    def _source(self, src: Any, what: str) -> tuple[Value, Root | None] | str:
        """The value a write copies from `src`, with the root whose seed it keeps, or why it cannot be stated."""
        s = _scalar(src)
        if s is not None and not (isinstance(src, torch.Tensor) and self.taint_of(src)):
            return Const(s), None
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
                return Data(_arranged(part, obox, order, inverse=True).reshape(tuple(src.shape))), None
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
        return Data(src.detach().to("cpu", torch.float64).numpy().copy()), None

    def _write_from(self, root: Root, box: Box | None, order: tuple[int, ...], view_shape: tuple[int, ...], src: Any, what: str) -> None:
        got = self._source(src, what)
        if isinstance(got, str):
            self._refuse(root, box, got)
            return
        value, origin = got
        if isinstance(value, Data):
            full = np.broadcast_to(value.values.reshape(value.values.shape), view_shape)
            value = _const_or_data(_arranged(np.ascontiguousarray(full), box, order, inverse=False))
        elif origin is not None and box is not None:
            if isinstance(value, _RANDOM_VALUES):
                value = Refused(f"{what}: copies another tensor's random values into part of this one")
        elif origin is not None and origin.shape != root.shape:
            value = Refused(f"{what}: copies random values of a {list(origin.shape)} tensor into a {list(root.shape)} one")
        self._set(root, box, value, origin if isinstance(value, _RANDOM_VALUES) else None)

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
            self._set(root, box, Normal(float(mean), float(std)), None)
        elif name == "uniform_":
            lo, hi = [*args[1:3], None, None][:2]
            lo = kwargs.get("from", 0.0 if lo is None else lo)
            hi = kwargs.get("to", 1.0 if hi is None else hi)
            self._set(root, box, Uniform(float(lo), float(hi)), None)
        elif name == "zero_":
            self._set(root, box, Const(0.0), None)
        elif name == "fill_":
            self._write_from(root, box, order, tuple(target.shape), args[1] if len(args) > 1 else kwargs["value"], "fill_")
        elif name == "copy_":
            self._write_from(root, box, order, tuple(target.shape), args[1] if len(args) > 1 else kwargs["src"], "copy_")
        elif (name in ("mul_", "div_", "add_", "sub_", "neg_") and self._affine(name, root, box, args, kwargs)) or (
            name in ("clamp_", "clip_", "clamp_min_", "clamp_max_") and self._clamp(name, root, box, args, kwargs)
        ):
            pass
        elif name == "erfinv_":
            self._transform(root, box, erfinv, name)
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
                self._transform(root, box, lambda v: _divided(v, x), name)
                return True
        self._transform(root, box, lambda v: affine(v, c, d), name)
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
        self._transform(root, box, lambda v: clamp(v, los, his), name)
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
        target = _arranged_tensor(view, box, order, tuple(args[0].shape)).clone()
        rest = []
        for i, a in enumerate(args[1:]):
            if name == "__setitem__" and i == 0:  # the index: plain, or a tensor of indices (not random ones)
                if any(self.taint_of(t) or t.is_meta for t in _tensors(a)):
                    self._refuse(root, None, "item assignment at indices drawn from torch's random generator")
                    return
            elif isinstance(a, torch.Tensor):
                src = self._source(a, name)
                if isinstance(src, str) or not isinstance(src[0], Const | Data):
                    self._refuse(root, None, src if isinstance(src, str) else f"{name} with another tensor's random values")
                    return
                v = src[0]
                a = torch.tensor(v.value, dtype=torch.float64) if isinstance(v, Const) else torch.from_numpy(v.values)
            rest.append(a)
        with torch.no_grad():
            getattr(torch.Tensor, name)(target, *rest, **{k: v for k, v in kwargs.items() if k != "generator"})
        if name in _RANDOM_INPLACE:
            self._refuse(root, None, f"{name} has no plan form")
            return
        region = _slices(box) if box is not None else ...
        values[region] = _arranged(target.numpy(), box, order, inverse=False).reshape(values[region].shape)
        root.base, root.patches, root.touched = Write(_const_or_data(values), None, None, _where()), [], True

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


_SAME_VALUES = frozenset(("clone", "to", "float", "double", "half", "bfloat16", "contiguous", "detach", "type_as"))
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


def _divided(v: Value, x: float) -> Value:
    if isinstance(v, Const):
        return Const(v.value / x)
    if isinstance(v, Data):
        return Data(v.values / x)
    return affine(v, 1.0 / x, 0.0)


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


def _arranged_tensor(view: torch.Tensor, box: Box | None, order: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The view of the root's values that the model's view is (same element order)."""
    if box is None or not order or list(order) == sorted(order):
        return view.reshape(shape)
    bshape = _box_shape(box)
    squeezed = view.reshape([bshape[d] for d in sorted(order)])
    return squeezed.permute([sorted(order).index(d) for d in order]).reshape(shape)


# -- torch.nn.init functions whose meta path records nothing ------------------------------------------------------

_local = threading.local()


def _active() -> Recorder | None:
    stack: list[Recorder] = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def _recorded(fname: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        rec = _active()
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        tensor = a["tensor"]
        found = rec.locate(tensor) if rec is not None else None
        if rec is None or found is None:
            return original(*args, **kwargs)
        root, box, order = found
        if box == ():
            rec._refuse(root, None, f"torch.nn.init.{fname} on a view that is not a box of the tensor")
            return tensor
        if tensor.numel() == 0:
            return tensor
        if fname == "trunc_normal_":
            rec._set(root, box, _trunc(float(a["mean"]), float(a["std"]), float(a["a"]), float(a["b"])), None)
        elif fname == "orthogonal_":
            rec._set(root, box, Orthogonal(float(a["gain"])) if box is None else Refused("orthogonal_ on part of a tensor"), None)
        elif fname == "sparse_":
            rec._refuse(root, box, "sparse_ has no plan form")
        else:  # eye_, dirac_: deterministic, evaluated for this tensor alone
            if tensor.numel() > DATA_LIMIT:
                rec._refuse(root, box, f"{fname} of {tensor.numel()} elements is too large to carry as data")
                return tensor
            real = torch.zeros(tuple(tensor.shape), dtype=torch.float64)
            with torch.no_grad():
                original(real, **{k: v for k, v in a.items() if k != "tensor"})
            rec._write_from(root, box, order, tuple(tensor.shape), real, fname)
        return tensor

    call.__paraminit_original__ = original  # type: ignore[attr-defined]
    return call


_HIGH_LEVEL = ("trunc_normal_", "orthogonal_", "sparse_", "eye_", "dirac_")
_patch_lock = threading.Lock()
_patch_depth = 0
_patched: list[tuple[dict[str, Any], str, Any]] = []


@contextlib.contextmanager
def _init_functions() -> Iterator[None]:
    """torch.nn.init's functions whose meta path records nothing, recorded as calls wherever model code holds them
    (torch.nn.init, `from torch.nn.init import ...` in a loaded module, a module-level table of them)."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            originals = {id(getattr(nn.init, f)): (f, getattr(nn.init, f)) for f in _HIGH_LEVEL}
            wrappers = {i: _recorded(f, fn) for i, (f, fn) in originals.items()}
            for mod in list(sys.modules.values()):
                space = getattr(mod, "__dict__", None)
                if not isinstance(space, dict):
                    continue
                for key, value in list(space.items()):
                    if id(value) in wrappers:
                        _patched.append((space, key, value))
                        space[key] = wrappers[id(value)]
                    elif type(value) is dict and len(value) < 64 and not key.startswith("__"):
                        for k, v in list(value.items()):
                            if id(v) in wrappers:
                                _patched.append((value, k, v))
                                value[k] = wrappers[id(v)]
            real_generator = torch.Generator

            class MetaSafeGenerator(real_generator):  # type: ignore[misc, valid-type]
                """torch.Generator("meta") fails; a framework's seeded generator only feeds recorded calls."""

                def __new__(cls, device: Any = "cpu") -> Any:
                    return real_generator("cpu" if str(device) == "meta" else device)

            _patched.append((torch.__dict__, "Generator", real_generator))
            torch.Generator = MetaSafeGenerator  # type: ignore[misc]
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for space, key, value in reversed(_patched):
                    space[key] = value
                _patched.clear()


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
    if why is not None:
        return Refused(f"holds {why} that the model's code never overwrites")
    return real_value(real)


def real_value(real: torch.Tensor) -> Value:
    """The values a real tensor holds: a constant, or data for a tensor small enough to carry them."""
    flat = real.detach().reshape(-1)
    if flat.numel() and bool((flat == flat[0]).all()) and bool((flat.signbit() == flat[0].signbit()).all()):
        return Const(float(flat[0]))
    if real.numel() > DATA_LIMIT:
        return Refused(f"starts from computed values of {real.numel()} elements, too large to carry as data")
    return _const_or_data(real.detach().to("cpu", torch.float64).numpy())


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


def replay(
    module: nn.Module, tensors: Sequence[torch.Tensor], init: Callable[[nn.Module], object] | None = None
) -> tuple[Recorder, dict[int, str]]:
    """Run a model's initialization code with every tensor of `module` (and `tensors`) a root.

    Args:
        module: the model.
        tensors: tensors to track besides the module's (normally its state_dict's).
        init: the code to run; None: each module's reset_parameters (children first), then transformers'
            initialize_weights for its models, else the root's init_weights().

    Returns:
        The recorder (its roots hold what was written) and, per module id, why its code could not run.
    """
    rec = Recorder()
    for t in [*module.parameters(), *module.buffers(), *tensors]:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not nn.parameter.is_lazy(t):
            rec.add_root(t)
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


def _init(value: Value, seed: int) -> plan_pb2.Init | str:
    if isinstance(value, Refused):
        return value.why
    if isinstance(value, ErfUniform):
        na, nb = _erf_bounds(value)
        value = _trunc(value.shift, abs(value.scale) / math.sqrt(2.0), na, nb)
        if isinstance(value, Refused):
            return value.why
    if isinstance(value, Normal) and value.std == 0.0:
        value = Const(value.mean)
    if isinstance(value, Uniform) and value.lo == value.hi:
        value = Const(value.lo)
    if isinstance(value, Const):
        if value.value == 0.0 and not math.copysign(1.0, value.value) < 0:
            return plan_pb2.Init(zeros=plan_pb2.Zeros())
        if value.value == 1.0:
            return plan_pb2.Init(ones=plan_pb2.Ones())
        if not math.isfinite(value.value):
            return f"a constant {value.value}, which no initializer states"
        return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=value.value, hi=value.value, seed=seed))
    if isinstance(value, Uniform):
        if value.lo > value.hi:
            return f"uniform_({value.lo}, {value.hi}) with its bounds reversed"
        return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=value.lo, hi=value.hi, seed=seed))
    if isinstance(value, Normal):
        return plan_pb2.Init(normal=plan_pb2.Normal(mean=value.mean, std=value.std, seed=seed))
    if isinstance(value, Trunc):
        return plan_pb2.Init(truncated_normal=plan_pb2.TruncatedNormal(mean=value.mean, std=value.std, lo=value.lo, hi=value.hi, seed=seed))
    if isinstance(value, Orthogonal):
        return plan_pb2.Init(orthogonal=plan_pb2.Orthogonal(gain=value.gain, seed=seed))
    assert isinstance(value, Data)  # ErfUniform became Trunc or Normal above
    if not np.all(np.isfinite(value.values)):
        return "computed values that are not all finite"
    return plan_pb2.Init(flat=plan_pb2.Flat(values=value.values.reshape(-1).tolist()))


def emit(root: Root, seed_of: Callable[[Root], int | str]) -> tuple[plan_pb2.Init | str, list[plan_pb2.Patch]]:
    """A root's plan initializer and patches (or why it has none).

    Args:
        root: the recorded tensor.
        seed_of: the seed of a root (its own, or a tie's source), or why it has none in this plan.

    Returns:
        (Init or reason, patches).
    """
    if root.base is None:
        if root.patches:
            return f"its initialization writes only part of it ({root.patches[0].where})", []
        return "", []

    def seed(w: Write) -> int | str:
        return seed_of(w.origin or root)

    s = seed(root.base)
    if isinstance(s, str):
        return s, []
    base = _init(root.base.value, s)
    if isinstance(base, str):
        return base, []
    patches = []
    for w in root.patches:
        ps = seed(w)
        if isinstance(ps, str):
            return ps, []
        got = _init(w.value, ps)
        if isinstance(got, str):
            return got, []
        if got.WhichOneof("kind") in ("flat", "orthogonal"):
            return f"a {got.WhichOneof('kind')} value in part of the tensor ({w.where}), which no patch states", []
        patch = plan_pb2.Patch(init=got)
        assert w.box is not None
        for a, b in w.box:
            patch.box.add(start=a, stop=b)
        patches.append(patch)
    return base, patches
