"""policy="torchtitan": torchtitan's own ``param_init`` replayed as plan initializers.

torchtitan modules carry a ``_param_init`` dict (local parameter name ->
init callable) built from the model's config objects, and ``init_states``
applies it module by module (``protocols/module.py``); a module without one
falls back to its ``reset_parameters``. This policy reads those same
callables and translates each into an Init, so no number is hard-coded
here: Llama 3's ``partial(trunc_normal_, std=0.02)`` (absolute bounds
``a=-2, b=2`` from PyTorch's defaults), the depth-scaled output projections,
``lm_head``'s ``trunc_normal_(std=s, a=-3s, b=3s)``, ``normal_(std=1)`` for
embeddings and ``ones_`` for norms come out of the config as written.

Translated: ``nn.init.trunc_normal_``, ``normal_``, ``uniform_``,
``constant_``, ``zeros_``, ``ones_``, ``orthogonal_`` (bare or as ``functools.partial``),
the fused-QKV wrapper of ``config_utils._fused_qkv_param_init`` (it draws
``wq``, ``wk`` and ``wv`` as tensors of their own and stores them group by
group; the plan does the same with patches whose parts are those tensors,
seeded by their unfused names, so a fused model gets exactly the values of
the unfused one), and ``skip_param_init`` on a tied tensor whose other owner
initializes it. Anything else (an unknown callable, a custom
``generator``, a module overriding ``init_states`` or
``_init_self_parameters``, a plain ``nn.Module`` owner, which torchtitan
never initializes) is refused with the reason, never guessed.

Persistent buffers (the MoE layer's ``expert_bias_E``) are in the plan as
torchtitan's own ``_init_self_buffers`` computes them: it runs on the CPU on a
copy of the module (which stays on meta), and the value is stated as the
constant it is, or as its values when it is small. Non-persistent buffers such
as RoPE caches are not in the plan: ``materialize_module`` computes them with
the modules' own ``_init_self_buffers``.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paraminit.shapes import numel
from paraminit.v1 import plan_pb2
from paraminit_client.errors import require
from paraminit_client.rules import Ruling, Verdict, ones, uniform, zeros
from paraminit_client.torch_rules import INIT_CALLS, init_of_call, rule_of

__all__ = ["fill_buffers", "init_for", "refused_modules"]

BUFFER_VALUES_MAX = 1 << 16  # elements of a non-constant buffer the plan states value by value

# init_states implementations that only re-tie weights before the standard recursion
_PLAIN_INIT_STATES = {"torchtitan.protocols.module.Module.init_states", "torchtitan.models.common.decoder.Decoder.init_states"}


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _titan_module() -> Any:
    """torchtitan's Module base class (imported here: torchtitan is optional and ships no type information)."""
    return require("torchtitan.protocols.module", "policy 'torchtitan'").Module


def refused_modules(root: nn.Module) -> dict[str, str]:
    """Qualified module name -> why its subtree cannot be replayed (an initialization this policy cannot read)."""
    module_cls = _titan_module()
    out: dict[str, str] = {}
    for name, mod in root.named_modules():
        if not isinstance(mod, module_cls):
            continue
        if _qualified(type(mod).init_states) not in _PLAIN_INIT_STATES:
            out[name] = f"{type(mod).__name__} overrides init_states"
        elif type(mod)._init_self_parameters is not module_cls._init_self_parameters:
            out[name] = f"{type(mod).__name__} overrides _init_self_parameters"
        elif type(mod)._init_param is not module_cls._init_param:
            out[name] = f"{type(mod).__name__} overrides _init_param"
    return out


def _closure_var(fn: Any, name: str) -> Any:
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


@dataclass(frozen=True)
class FusedQKV:
    """torchtitan's fused ``wqkv`` (``config_utils._fused_qkv_param_init``): ``wq`` ([n_heads * head_dim, *tail]),
    ``wk`` and ``wv`` ([n_kv_heads * head_dim, *tail]) each drawn by `base` as a tensor of its own, then stored as
    [n_kv_heads, heads_per_kv + 2, head_dim, *tail]: per group, its query heads, its key head, its value head."""

    base: Callable[..., Any]
    n_heads: int
    n_kv_heads: int
    head_dim: int

    def plan(self, name: str, shape: tuple[int, ...], seed_of: Callable[[str], int]) -> Ruling:
        """The fused tensor `name` ("...wqkv.weight") as a plan: a patch per group and part, whose part is ``wq``,
        ``wk`` or ``wv`` drawn by the base initializer with the seed of its unfused name ("...wq.weight"), so the
        values are the unfused model's; or why it cannot be.

        Args:
            name: the fused tensor's state_dict name.
            shape: its full shape, [(n_heads + 2 * n_kv_heads) * head_dim, *tail].
            seed_of: the seed of a tensor name (the walk's).

        Returns:
            The base Init with patches covering every element, or the refusal.
        """
        per_kv, hd, n_kv = self.n_heads // self.n_kv_heads, self.head_dim, self.n_kv_heads
        tail = list(shape[1:])
        row = numel(tail)
        if not shape or shape[0] != (self.n_heads + 2 * n_kv) * hd:
            return Ruling.refused(f"fused wqkv of shape {list(shape)} does not hold {self.n_heads} + 2 x {n_kv} heads of {hd}")
        head, _, key = name.rpartition(".")
        parent = head.rpartition(".")[0]
        patches = []
        inits: dict[str, plan_pb2.Init] = {}
        for part in ("wq", "wk", "wv"):
            logical = f"{parent}.{part}.{key}" if parent else f"{part}.{key}"
            got = translate(self.base, seed_of(logical))
            if got.verdict is not Verdict.INIT:
                why = {Verdict.SKIP: "skip_param_init", Verdict.LAYOUT: "a nested fused initializer"}.get(got.verdict, got.reason)
                return Ruling.refused(f"{part} of the fused wqkv: {why}")
            inits[part] = got.init
        for g in range(n_kv):
            first = g * (per_kv + 2) * hd
            for part, at, rows, heads in (
                ("wq", 0, per_kv * hd, self.n_heads),
                ("wk", per_kv * hd, hd, n_kv),
                ("wv", (per_kv + 1) * hd, hd, n_kv),
            ):
                box = [plan_pb2.Range(start=first + at, stop=first + at + rows)] + [plan_pb2.Range(start=0, stop=d) for d in tail]
                own = plan_pb2.Part(shape=[heads * hd, *tail], start=g * rows * row)
                patches.append(plan_pb2.Patch(box=box, init=inits[part], part=own))
        return Ruling.of(zeros(), patches)  # every element is a part's: the base is never seen


def translate(fn: Callable[..., Any], seed: int) -> Ruling:
    """One torchtitan init callable as a Ruling.

    Args:
        fn: the callable of a param_init table (bare, or a functools.partial).
        seed: the tensor's seed.

    Returns:
        Its Init; skipped for skip_param_init; a layout (FusedQKV.plan) for the fused-QKV wrapper; or the refusal
        that says why it cannot be expressed.
    """
    func: Any = fn
    args: tuple[Any, ...] = ()
    kw: dict[str, Any] = {}
    if isinstance(fn, functools.partial):
        func, args, kw = fn.func, fn.args, dict(fn.keywords)
    if getattr(func, "__name__", "") == "skip_param_init" and "torchtitan" in getattr(func, "__module__", ""):
        return Ruling.skipped()
    if "_fused_qkv_param_init" in getattr(func, "__qualname__", ""):
        found = {v: _closure_var(func, v) for v in ("base_init", "n_heads", "n_kv_heads", "head_dim")}
        if any(v is None for v in found.values()):
            return Ruling.refused(f"fused initializer {_qualified(func)} without {', '.join(k for k, v in found.items() if v is None)}")
        fused = FusedQKV(found["base_init"], int(found["n_heads"]), int(found["n_kv_heads"]), int(found["head_dim"]))
        return Ruling.laid_out(fused.plan)
    name = getattr(func, "__name__", "")
    if name not in INIT_CALLS or getattr(nn.init, name) is not func:
        return Ruling.refused(f"unknown initializer {_qualified(func)}")
    try:
        bound = inspect.signature(func).bind(None, *args, **kw)
    except TypeError as exc:
        return Ruling.refused(f"{_qualified(func)} with arguments it does not take: {exc}")
    bound.apply_defaults()
    if bound.arguments.get("generator") is not None:
        return Ruling.refused(f"{_qualified(func)} with its own generator")
    return Ruling.of(init_of_call(name, bound.arguments, seed))


def buffer_init(mod: nn.Module, key: str) -> Ruling:
    """A persistent buffer as the module's own ``_init_self_buffers`` computes it, run on the CPU on a shallow copy
    with its own buffer table (the module keeps its meta buffers): a constant as zeros, ones or a constant, other
    values as Flat when there are at most BUFFER_VALUES_MAX of them.

    Args:
        mod: the torchtitan module holding the buffer.
        key: the buffer's local name.

    Returns:
        The buffer's Init, or the refusal.
    """
    clone = copy.copy(mod)
    clone._buffers = dict(mod._buffers)
    clone._init_self_buffers(buffer_device=torch.device("cpu"))  # type: ignore[operator]
    value = clone._buffers.get(key)
    if value is None or value.is_meta:
        return Ruling.refused(f"{type(mod).__name__}._init_self_buffers does not compute {key!r}")
    flat = value.detach().to(torch.float64).reshape(-1)
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        return Ruling.refused(f"{type(mod).__name__}._init_self_buffers gives {key!r} non-finite values")
    if not flat.numel() or bool((flat == flat[0]).all()):
        c = float(flat[0]) if flat.numel() else 0.0
        return Ruling.of(zeros() if c == 0.0 else ones() if c == 1.0 else uniform(c, c, 0))  # lo == hi: the constant
    if flat.numel() > BUFFER_VALUES_MAX:
        return Ruling.refused(
            f"{type(mod).__name__}._init_self_buffers gives {key!r} {flat.numel()} distinct values, more than a plan states"
        )
    return Ruling.of(plan_pb2.Init(flat=plan_pb2.Flat(values=flat.tolist())))


def init_for(owners: list[tuple[nn.Module, str]], t: Any, seed: int) -> Ruling:
    """What torchtitan's init_states gives a tensor, from its owners (the first, then those it is tied to).

    Args:
        owners: (module, local key) of each owner, the first first.
        t: the tensor.
        seed: its seed.

    Returns:
        The first owner's Init (or fused layout); else the refusal with every owner's reason; unknown without
        owners.
    """
    module_cls = _titan_module()
    reasons = []
    for mod, key in owners:
        if not isinstance(mod, module_cls):
            reasons.append(f"{type(mod).__name__} is not a torchtitan Module: init_states never initializes it")
            continue
        if key in mod._buffers:  # a persistent buffer: _init_self_buffers computes it
            return buffer_init(mod, key)
        table = mod._param_init
        if table is None:  # torchtitan falls back to reset_parameters: PyTorch's own rule
            layer = rule_of(mod)
            if layer.rule is None:
                reasons.append(f"no param_init, and for reset_parameters: {layer.why}")
                continue
            got = layer.apply(mod, key, t, seed)
            if not got.decided:
                reasons.append(got.reason or f"{type(mod).__name__} has no rule for {key!r}")
                continue
            return got
        fn = table.get(key)
        if fn is None:
            reasons.append(f"{type(mod).__name__}'s param_init has no entry for {key!r}")
            continue
        got = translate(fn, seed)
        if got.verdict is Verdict.SKIP:
            reasons.append(f"skip_param_init on {type(mod).__name__}.{key} and no tied owner initializes it")
        elif got.verdict is Verdict.REFUSED:
            reasons.append(got.reason)
        else:
            return got
    return Ruling.refused("; ".join(reasons)) if reasons else Ruling.unknown()


def tied_owners(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(tensor) -> every (module, local key) holding it, in module order (weight tying shows as several)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, mod in root.named_modules(remove_duplicate=False):
        for key, p in mod._parameters.items():
            if p is not None and (mod, key) not in out.get(id(p), []):
                out.setdefault(id(p), []).append((mod, key))
    return out


def _pending(root: nn.Module) -> Iterator[nn.Module]:
    for mod in root.modules():
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            yield mod


def fill_buffers(root: nn.Module, device: Any) -> None:
    """Compute the buffers still on meta (RoPE caches) with each torchtitan module's own _init_self_buffers."""
    module_cls = _titan_module()
    for mod in list(_pending(root)):
        if isinstance(mod, module_cls):
            mod._init_self_buffers(buffer_device=device)
