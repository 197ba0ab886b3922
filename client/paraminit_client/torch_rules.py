"""PyTorch's own initialization as plan initializers: one rule per layer family, shared by the policies.

A rule gets (module, local key, tensor, seed) and answers with a `rules.Ruling`: an Init, the reason for a known
but inexpressible case, or "unknown" for a tensor it does not know. `LayerRules` is the "torch" and "torchlean"
policy over them, the two told apart by a `Semantics` value; hf.py reuses the rules Hugging Face defers to,
titan.py the ones torchtitan falls back to; distributed.py, torch.py and the checkpoint writers share the dtype
tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from paraminit import dtypes
from paraminit.shapes import fan_in_out
from paraminit.v1 import plan_pb2
from paraminit_client.rules import (
    ModuleWalk,
    Rule,
    Ruling,
    kaiming,
    normal,
    ones,
    orthogonal,
    symmetric,
    trunc_normal,
    uniform,
    xavier,
    zeros,
)

__all__ = [
    "INIT_CALLS",
    "PLAN_DTYPES",
    "SEMANTICS",
    "TORCH",
    "TORCHLEAN",
    "TORCH_DTYPES",
    "LayerRule",
    "LayerRules",
    "NormBase",
    "Semantics",
    "fan_in_uniform",
    "fixed_elements",
    "init_of_call",
    "mha",
    "numpy_to_torch",
    "numpy_view",
    "rule_of",
]

PLAN_DTYPES: dict[torch.dtype, plan_pb2.DType.ValueType] = {getattr(torch, d.name): d.enum for d in dtypes.SUPPORTED}  # type: ignore[misc]
TORCH_DTYPES: dict[int, torch.dtype] = {
    e: getattr(torch, dtypes.by_enum(e).name)  # type: ignore[union-attr]
    for e in plan_pb2.DType.values()
}


# torch.nn.init functions with a plan form: the Init of a call, from its bound arguments and the plan's seed (a
# framework's own generator, if any, is not used). torchtitan's param_init tables and a replayed framework init
# (recipes.replay) both read calls through this one table.
_INIT_CALLS: dict[str, Callable[[Mapping[str, Any], int], plan_pb2.Init]] = {
    "trunc_normal_": lambda a, s: trunc_normal(float(a["mean"]), float(a["std"]), float(a["a"]), float(a["b"]), s),
    "normal_": lambda a, s: plan_pb2.Init(normal=plan_pb2.Normal(mean=float(a["mean"]), std=float(a["std"]), seed=s)),
    "uniform_": lambda a, s: uniform(float(a["a"]), float(a["b"]), s),
    "zeros_": lambda a, s: zeros(),
    "ones_": lambda a, s: ones(),
    "constant_": lambda a, s: uniform(float(a["val"]), float(a["val"]), s),  # lo == hi: the constant
    "orthogonal_": lambda a, s: orthogonal(float(a["gain"]), s),
}
INIT_CALLS = tuple(_INIT_CALLS)  # their names


def init_of_call(name: str, arguments: Mapping[str, Any], seed: int) -> plan_pb2.Init:
    """The Init of a call of torch.nn.init's `name` (one of INIT_CALLS) with these bound arguments.

    Args:
        name: the function's name.
        arguments: its bound arguments, defaults applied.
        seed: the plan's seed for the tensor.

    Returns:
        The Init.
    """
    return _INIT_CALLS[name](arguments, seed)


def _fans(shape: torch.Size) -> tuple[int, int]:
    """PyTorch's fans are the spec's: [out, in, *kernel] gives in*prod(kernel), out*prod(kernel)."""
    return fan_in_out(shape)


def _inv_sqrt(n: float) -> float:
    return 1.0 / math.sqrt(n) if n > 0 else 0.0


# -- layer families -----------------------------------------------------------------------
# A rule gets (module, local key, tensor, seed) and answers with a Ruling (rules.Rule).


def fan_in_uniform(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    """Linear and Conv: kaiming_uniform_(a=sqrt(5)) on the weight is U(+-1/sqrt(fan_in)); the bias uses the same
    bound.

    Args:
        mod: the layer.
        key: the tensor's local name.
        t: the tensor.
        seed: its seed.

    Returns:
        The ruling (unknown for a tensor other than weight and bias).
    """
    if key not in ("weight", "bias"):
        return Ruling.unknown()
    return Ruling.of(symmetric(_inv_sqrt(_fans(mod.weight.shape)[0]), seed))


def _bilinear(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    return Ruling.of(symmetric(_inv_sqrt(mod.weight.shape[1]), seed)) if key in ("weight", "bias") else Ruling.unknown()


def _embedding(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    """normal(0, 1); a padding_idx row is zero through a plan patch (fixed_elements)."""
    return Ruling.of(normal(1.0, seed)) if key == "weight" else Ruling.unknown()


def fixed_elements(mod: nn.Module, key: str, t: torch.Tensor) -> list[plan_pb2.Patch]:
    """Elements a layer fixes whatever its initializer: Embedding's and EmbeddingBag's padding_idx row is zero.

    Args:
        mod: the owning layer.
        key: the tensor's local name.
        t: the tensor.

    Returns:
        The patches (none for most tensors).
    """
    pad = getattr(mod, "padding_idx", None)
    if key != "weight" or pad is None or not isinstance(mod, nn.Embedding | nn.EmbeddingBag) or t.dim() != 2:
        return []
    patch = plan_pb2.Patch(init=zeros())
    patch.box.add(start=pad, stop=pad + 1)
    patch.box.add(start=0, stop=t.shape[1])
    return [patch]


def _norm(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    if key in ("weight", "running_var"):
        return Ruling.of(ones())
    if key in ("bias", "running_mean"):
        return Ruling.of(zeros())
    return Ruling.unknown()


def _rnn(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    """RNN/LSTM/GRU and cells: every tensor U(+-1/sqrt(hidden_size))."""
    return Ruling.of(symmetric(_inv_sqrt(mod.hidden_size), seed))


def mha(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    """nn.MultiheadAttention's own tensors (its out_proj is a Linear, see LayerRules).

    Args:
        mod: the attention layer.
        key: the tensor's local name.
        t: the tensor.
        seed: its seed.

    Returns:
        The ruling (unknown for a tensor MultiheadAttention does not initialize itself).
    """
    if key in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return Ruling.of(xavier(seed))
    if key == "in_proj_bias":
        return Ruling.of(zeros())
    if key in ("bias_k", "bias_v"):  # xavier_normal_: std = sqrt(2 / (fan_in + fan_out))
        fan_in, fan_out = _fans(t.shape)
        return Ruling.of(normal(math.sqrt(2.0 / (fan_in + fan_out)) if fan_in + fan_out else 0.0, seed))
    return Ruling.unknown()


def _prelu(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
    """A constant c is uniform(c, c): exact, since lo + u * 0 = lo."""
    return Ruling.of(uniform(float(mod.init), float(mod.init), seed)) if key == "weight" else Ruling.unknown()


NormBase = nn.modules.batchnorm._NormBase
_ConvNd = nn.modules.conv._ConvNd


@dataclass(frozen=True)
class Semantics:
    """What sets one layer-rule policy apart from another, as data the one LayerRules reads (no policy is told
    by its name).

    `redraw`, when set, replaces what PyTorch draws for the families that draw at random (Linear, Conv, Bilinear,
    MultiheadAttention, the RNNs): TorchLean's runtime takes Kaiming-uniform for rank >= 2 and zeros below.
    `transformer_xavier`: nn.Transformer's own _reset_parameters, which draws every matrix under it Xavier-uniform
    again (TorchLean has no such step)."""

    name: str
    redraw: Callable[[torch.Tensor, int], plan_pb2.Init] | None = None
    transformer_xavier: bool = True


TORCH = Semantics("torch")
TORCHLEAN = Semantics("torchlean", redraw=lambda t, seed: kaiming(seed) if t.dim() >= 2 else zeros(), transformer_xavier=False)
SEMANTICS = (TORCH, TORCHLEAN)


@dataclass(frozen=True)
class _Family:
    base: type[Any]
    method: str  # the method holding its initialization
    rule: Rule
    drawn: bool  # a Semantics' redraw applies


# first match wins
_FAMILIES: list[_Family] = [
    _Family(nn.Linear, "reset_parameters", fan_in_uniform, True),
    _Family(_ConvNd, "reset_parameters", fan_in_uniform, True),
    _Family(nn.Bilinear, "reset_parameters", _bilinear, True),
    _Family(nn.Embedding, "reset_parameters", _embedding, False),
    _Family(nn.EmbeddingBag, "reset_parameters", _embedding, False),
    _Family(nn.LayerNorm, "reset_parameters", _norm, False),
    _Family(nn.RMSNorm, "reset_parameters", _norm, False),
    _Family(nn.GroupNorm, "reset_parameters", _norm, False),
    _Family(NormBase, "reset_parameters", _norm, False),
    _Family(nn.MultiheadAttention, "_reset_parameters", mha, True),
    _Family(nn.RNNBase, "reset_parameters", _rnn, True),
    _Family(nn.RNNCellBase, "reset_parameters", _rnn, True),
    _Family(nn.PReLU, "reset_parameters", _prelu, False),
]


@dataclass(frozen=True)
class LayerRule:
    """A module's rule under some Semantics, or why it has none (`rule` None: an unknown type, or a redefined
    initialization)."""

    rule: Rule | None
    why: str = ""

    def apply(self, mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
        """The rule's ruling for one tensor; a refusal with `why` when there is no rule.

        Args:
            mod: the module.
            key: the tensor's local name.
            t: the tensor.
            seed: its seed.

        Returns:
            The ruling.
        """
        return Ruling.refused(self.why) if self.rule is None else self.rule(mod, key, t, seed)


def _redrawn(rule: Rule, redraw: Callable[[torch.Tensor, int], plan_pb2.Init]) -> Rule:
    """`rule`, its initializers replaced by `redraw` (its refusals and unknown tensors kept)."""

    def redrawn(mod: Any, key: str, t: torch.Tensor, seed: int) -> Ruling:
        return rule(mod, key, t, seed).then(lambda _: Ruling.of(redraw(t, seed)))

    return redrawn


def rule_of(mod: nn.Module, semantics: Semantics = TORCH) -> LayerRule:
    """The module's rule, or why there is none (unknown type, or a redefined initialization).

    Args:
        mod: the module owning a tensor.
        semantics: the policy's reading of the rules (default: PyTorch's own).

    Returns:
        The LayerRule.
    """
    for family in _FAMILIES:
        if isinstance(mod, family.base):
            if getattr(type(mod), family.method, None) is getattr(family.base, family.method):
                redraw = semantics.redraw if family.drawn else None
                return LayerRule(family.rule if redraw is None else _redrawn(family.rule, redraw))
            return LayerRule(None, f"{type(mod).__name__} redefines {family.base.__name__}.{family.method}")
    return LayerRule(None, f"no initialization rule for {type(mod).__name__}")


class LayerRules:
    """ "torch" and "torchlean": each layer's own rule for its tensors, then the rules containers apply over their
    children (MultiheadAttention zeroes out_proj.bias; nn.Transformer, where the Semantics says so, re-initializes
    every tensor of rank > 1 with Xavier-uniform)."""

    def __init__(self, semantics: Semantics = TORCH) -> None:
        self.semantics = semantics
        self.name = semantics.name

    def assign(self, walk: ModuleWalk) -> None:
        """The Policy protocol: every tensor the walk collects, by its owning layer's rule."""
        for name in walk.collect():
            owner, key = walk.owners[name]
            t = walk.tensors[name]
            walk.inits[name] = (
                rule_of(owner, self.semantics)
                .apply(owner, key, t, walk.seed_of(name))
                .or_reason(f"{walk.kinds[name]} has no rule for its tensor {key!r}")
            )
            walk.patches[name] = fixed_elements(owner, key, t)
        for prefix, mod in walk.module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            if isinstance(mod, nn.MultiheadAttention) and rule_of(mod).rule is not None and f"{dot}out_proj.bias" in walk.inits:
                walk.inits[f"{dot}out_proj.bias"] = zeros()
            if isinstance(mod, nn.Transformer) and self.semantics.transformer_xavier:
                redefined = type(mod)._reset_parameters is not nn.Transformer._reset_parameters
                for name, p in mod.named_parameters(prefix=prefix):
                    if p.dim() > 1 and name in walk.inits:
                        walk.inits[name] = (
                            f"{type(mod).__name__} redefines Transformer._reset_parameters" if redefined else xavier(walk.seed_of(name))
                        )


# dtypes numpy knows only through ml_dtypes (bfloat16, the 8-bit floats), which torch.from_numpy does not know
_BIT_PATTERNS: dict[str, dtypes.DTypeInfo] = {d.name: d for d in dtypes.SUPPORTED if d.via_ml_dtypes}
# each such torch dtype -> the integer dtype of its width, which .numpy() knows
_TORCH_BITS: dict[torch.dtype, torch.dtype] = {
    TORCH_DTYPES[d.enum]: {1: torch.uint8, 2: torch.int16}[d.itemsize] for d in _BIT_PATTERNS.values()
}


def numpy_to_torch(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """A numpy array as a torch tensor, zero-copy; ml_dtypes' types (bfloat16, the 8-bit floats), which
    torch.from_numpy does not know, go through a view of their bit patterns.

    Args:
        a: the array.

    Returns:
        A tensor sharing its memory.
    """
    d = _BIT_PATTERNS.get(a.dtype.name)
    if d is not None:
        return torch.from_numpy(a.view(d.storage)).view(TORCH_DTYPES[d.enum])
    return torch.from_numpy(a)


def numpy_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU tensor's memory (bfloat16 and 8-bit floats as their bit patterns), for in-place
    fills.

    Args:
        t: a CPU tensor.

    Returns:
        An array sharing its memory.
    """
    bits = _TORCH_BITS.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()
