"""PyTorch's own initialization as plan initializers: one rule per layer family, shared by the policies.

A rule gets (module, local key, tensor, seed, policy) and returns an Init, a
reason string for a known but inexpressible case, or None for a tensor it does
not know. torch.py walks modules with these; hf.py reuses the ones Hugging Face
defers to; distributed.py and torch.py share the dtype tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from paraminit import dtypes
from paraminit.shapes import fan_in_out
from paraminit.v1 import plan_pb2

_PLAN_DTYPES: dict[torch.dtype, plan_pb2.DType.ValueType] = {getattr(torch, d.name): d.enum for d in dtypes.SUPPORTED}  # type: ignore[misc]
_TORCH_DTYPES: dict[int, torch.dtype] = {
    e: getattr(torch, dtypes.by_enum(e).name)  # type: ignore[union-attr]
    for e in plan_pb2.DType.values()
}


# -- initializers -------------------------------------------------------------------------


def _zeros() -> plan_pb2.Init:
    return plan_pb2.Init(zeros=plan_pb2.Zeros())


def _ones() -> plan_pb2.Init:
    return plan_pb2.Init(ones=plan_pb2.Ones())


def _uniform(lo: float, hi: float, seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=lo, hi=hi, seed=seed))


def _normal(std: float, seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(normal=plan_pb2.Normal(mean=0.0, std=std, seed=seed))


def _trunc_normal(mean: float, std: float, a: float, b: float, seed: int) -> plan_pb2.Init:
    """nn.init.trunc_normal_(t, mean, std, a, b): a and b are absolute bounds, as in the plan."""
    return plan_pb2.Init(truncated_normal=plan_pb2.TruncatedNormal(mean=mean, std=std, lo=a, hi=b, seed=seed))


def _orthogonal(gain: float, seed: int) -> plan_pb2.Init:
    """nn.init.orthogonal_(t, gain): the plan's deterministic orthogonal (docs/SAMPLER.md 2.3), the same matrix up
    to rounding for the same Gaussian draws."""
    return plan_pb2.Init(orthogonal=plan_pb2.Orthogonal(gain=gain, seed=seed))


# torch.nn.init functions with a plan form: the Init of a call, from its bound arguments and the plan's seed (a
# framework's own generator, if any, is not used). torchtitan's param_init tables and a replayed framework init
# (recipes.replay) both read calls through this one table.
_INIT_CALLS: dict[str, Callable[[Mapping[str, Any], int], plan_pb2.Init]] = {
    "trunc_normal_": lambda a, s: _trunc_normal(float(a["mean"]), float(a["std"]), float(a["a"]), float(a["b"]), s),
    "normal_": lambda a, s: plan_pb2.Init(normal=plan_pb2.Normal(mean=float(a["mean"]), std=float(a["std"]), seed=s)),
    "uniform_": lambda a, s: _uniform(float(a["a"]), float(a["b"]), s),
    "zeros_": lambda a, s: _zeros(),
    "ones_": lambda a, s: _ones(),
    "constant_": lambda a, s: _uniform(float(a["val"]), float(a["val"]), s),  # lo == hi: the constant
    "orthogonal_": lambda a, s: _orthogonal(float(a["gain"]), s),
}
INIT_CALLS = tuple(_INIT_CALLS)  # their names


def init_of_call(name: str, arguments: Mapping[str, Any], seed: int) -> plan_pb2.Init:
    """The Init of a call of torch.nn.init's `name` (one of INIT_CALLS) with these bound arguments."""
    return _INIT_CALLS[name](arguments, seed)


def _xavier(seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(xavier_uniform_for_shape=plan_pb2.XavierUniformForShape(seed=seed))


def _kaiming(seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(kaiming_uniform_for_shape=plan_pb2.KaimingUniformForShape(seed=seed))


def _fans(shape: torch.Size) -> tuple[int, int]:
    """PyTorch's fans are the spec's: [out, in, *kernel] gives in*prod(kernel), out*prod(kernel)."""
    return fan_in_out(shape)


def _inv_sqrt(n: float) -> float:
    return 1.0 / math.sqrt(n) if n > 0 else 0.0


def _sym(bound: float, seed: int) -> plan_pb2.Init:
    return _uniform(-bound, bound, seed)


# -- layer families -----------------------------------------------------------------------
# A rule gets (module, local key, tensor, seed, policy) and returns an Init, a reason string
# for a known but inexpressible case, or None for a tensor it does not know.

Rule = Callable[[Any, str, torch.Tensor, int, str], "plan_pb2.Init | str | None"]


def _lean(torch_rule: Rule) -> Rule:
    """The same tensors under "torchlean": Kaiming-uniform for rank >= 2, zeros below."""

    def rule(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
        got = torch_rule(mod, key, t, seed, policy)
        if policy == "torchlean" and isinstance(got, plan_pb2.Init):
            return _kaiming(seed) if t.dim() >= 2 else _zeros()
        return got

    return rule


def _fan_in_uniform(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    """Linear and Conv: kaiming_uniform_(a=sqrt(5)) on the weight is U(+-1/sqrt(fan_in)); the bias uses the same bound."""
    if key not in ("weight", "bias"):
        return None
    return _sym(_inv_sqrt(_fans(mod.weight.shape)[0]), seed)


def _bilinear(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    return _sym(_inv_sqrt(mod.weight.shape[1]), seed) if key in ("weight", "bias") else None


def _embedding(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    """normal(0, 1); a padding_idx row is zero through a plan patch (_fixed_elements)."""
    return _normal(1.0, seed) if key == "weight" else None


def _fixed_elements(mod: nn.Module, key: str, t: torch.Tensor) -> list[plan_pb2.Patch]:
    """Elements a layer fixes whatever its initializer: Embedding's and EmbeddingBag's padding_idx row is zero."""
    pad = getattr(mod, "padding_idx", None)
    if key != "weight" or pad is None or not isinstance(mod, nn.Embedding | nn.EmbeddingBag) or t.dim() != 2:
        return []
    patch = plan_pb2.Patch(init=_zeros())
    patch.box.add(start=pad, stop=pad + 1)
    patch.box.add(start=0, stop=t.shape[1])
    return [patch]


def _norm(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    if key in ("weight", "running_var"):
        return _ones()
    if key in ("bias", "running_mean"):
        return _zeros()
    return None


def _rnn(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    """RNN/LSTM/GRU and cells: every tensor U(+-1/sqrt(hidden_size))."""
    return _sym(_inv_sqrt(mod.hidden_size), seed)


def _mha(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    if key in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return _xavier(seed)
    if key == "in_proj_bias":
        return _zeros()
    if key in ("bias_k", "bias_v"):  # xavier_normal_: std = sqrt(2 / (fan_in + fan_out))
        fan_in, fan_out = _fans(t.shape)
        return _normal(math.sqrt(2.0 / (fan_in + fan_out)) if fan_in + fan_out else 0.0, seed)
    return None


def _prelu(mod: Any, key: str, t: torch.Tensor, seed: int, policy: str) -> plan_pb2.Init | str | None:
    """A constant c is uniform(c, c): exact, since lo + u * 0 = lo."""
    return _uniform(float(mod.init), float(mod.init), seed) if key == "weight" else None


_NormBase = nn.modules.batchnorm._NormBase
_ConvNd = nn.modules.conv._ConvNd

# (base class, the method holding its initialization, rule); first match wins.
_FAMILIES: list[tuple[type[Any], str, Rule]] = [
    (nn.Linear, "reset_parameters", _lean(_fan_in_uniform)),
    (_ConvNd, "reset_parameters", _lean(_fan_in_uniform)),
    (nn.Bilinear, "reset_parameters", _lean(_bilinear)),
    (nn.Embedding, "reset_parameters", _embedding),
    (nn.EmbeddingBag, "reset_parameters", _embedding),
    (nn.LayerNorm, "reset_parameters", _norm),
    (nn.RMSNorm, "reset_parameters", _norm),
    (nn.GroupNorm, "reset_parameters", _norm),
    (_NormBase, "reset_parameters", _norm),
    (nn.MultiheadAttention, "_reset_parameters", _lean(_mha)),
    (nn.RNNBase, "reset_parameters", _lean(_rnn)),
    (nn.RNNCellBase, "reset_parameters", _lean(_rnn)),
    (nn.PReLU, "reset_parameters", _prelu),
]


def _rule_of(mod: nn.Module) -> Rule | str:
    """The module's rule, or why there is none (unknown type, or a redefined initialization)."""
    for base, method, rule in _FAMILIES:
        if isinstance(mod, base):
            if getattr(type(mod), method, None) is getattr(base, method):
                return rule
            return f"{type(mod).__name__} redefines {base.__name__}.{method}"
    return f"no initialization rule for {type(mod).__name__}"


# dtypes numpy knows only through ml_dtypes (bfloat16, the 8-bit floats), which torch.from_numpy does not know
_BIT_PATTERNS: dict[str, dtypes.DTypeInfo] = {d.name: d for d in dtypes.SUPPORTED if d.via_ml_dtypes}
# each such torch dtype -> the integer dtype of its width, which .numpy() knows
_TORCH_BITS: dict[torch.dtype, torch.dtype] = {
    _TORCH_DTYPES[d.enum]: {1: torch.uint8, 2: torch.int16}[d.itemsize] for d in _BIT_PATTERNS.values()
}


def _numpy_to_torch(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """Zero-copy; ml_dtypes' types (bfloat16, the 8-bit floats) go through a view of their bit patterns."""
    d = _BIT_PATTERNS.get(a.dtype.name)
    if d is not None:
        return torch.from_numpy(a.view(d.storage)).view(_TORCH_DTYPES[d.enum])
    return torch.from_numpy(a)


def _numpy_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU tensor's memory (bfloat16 and 8-bit floats as their bit patterns), for in-place
    fills."""
    bits = _TORCH_BITS.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()
