"""policy="hf": Hugging Face transformers' own `_init_weights`, as plan initializers.

transformers initializes a model by visiting its modules children first
(`PreTrainedModel.initialize_weights`, each module under the `_init_weights` of
its nearest PreTrainedModel) and then ties weights, so a tied tensor keeps the
values of its source. This module replays that walk on the module tree (meta is
fine: only types, shapes and the config are read) with the rules of the
`_init_weights` implementations it knows:

- ``PreTrainedModel`` (Llama, Mistral, Qwen2 and every family without its own):
  Linear/Conv1-3d/ConvTranspose1-2d weights normal(0, std) with
  std = ``config.initializer_range`` (0.02 when unset), biases zero; Embedding
  normal(0, std) with its ``padding_idx`` row zero (a plan patch); LSTM
  Xavier-uniform weights and zero biases; MultiheadAttention PyTorch's own;
  GroupNorm/BatchNorm and any ``*LayerNorm*``/``*RMSNorm*`` class: weight one,
  bias and running mean zero, running variance one.
- ``GPT2PreTrainedModel``: also Conv1D normal(0, initializer_range) with zero
  bias, and the residual projections ``c_proj.weight`` of GPT2Attention/GPT2MLP
  normal(0, initializer_range / sqrt(2 * n_layer)).
- ``BertPreTrainedModel``: also the LM head's output bias zero.

An implementation is known by the syntax tree of its source (comments and
docstrings aside), so a transformers release that changes a rule makes the
policy report the affected tensors instead of replaying stale rules; so does
any tensor no rule writes, and any module under an `_init_weights` it does not
know. transformers is imported only when this policy runs.

Non-persistent buffers (rotary `inv_freq`, BERT `position_ids`) are not plan
tensors: `fill_buffers` runs the model's own `_init_weights` for the modules that
hold them, with every other tensor marked initialized so only those buffers change.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import math
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paraminit import inits
from paraminit.v1 import plan_pb2
from paraminit_client.errors import MissingPackage
from paraminit_client.rules import Ruling, Verdict
from paraminit_client.torch_rules import mha

__all__ = ["KNOWN", "fill_buffers", "fingerprint", "plan_inits"]

Make = Callable[[int], plan_pb2.Init]  # seed -> Init


@dataclass
class Assigned:
    """What the last rule to write a tensor gave it: an initializer (by seed) and patches, or why it has none
    (`make` None)."""

    make: Make | None
    patches: list[plan_pb2.Patch] = field(default_factory=list)
    why: str = ""

    @classmethod
    def refused(cls, why: str) -> Assigned:
        """Returns: the assignment of a tensor no known rule initializes, and why."""
        return cls(None, why=why)

    def ruling(self, seed: int) -> Ruling:
        """Returns: the assignment as the Ruling for the tensor under `seed`."""
        return Ruling.refused(self.why) if self.make is None else Ruling.of(self.make(seed), self.patches)


def _normal(std: float) -> Make:
    return lambda seed: plan_pb2.Init(normal=plan_pb2.Normal(mean=0.0, std=std, seed=seed))


def _zeros(seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(zeros=plan_pb2.Zeros())


def _ones(seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(ones=plan_pb2.Ones())


def _xavier(seed: int) -> plan_pb2.Init:
    return plan_pb2.Init(xavier_uniform_for_shape=plan_pb2.XavierUniformForShape(seed=seed))


def _zero_row(shape: torch.Size, row: int) -> plan_pb2.Patch:
    patch = plan_pb2.Patch(init=plan_pb2.Init(zeros=plan_pb2.Zeros()))
    patch.box.add(start=row, stop=row + 1)
    for d in shape[1:]:
        patch.box.add(start=0, stop=d)
    return patch


@functools.lru_cache(maxsize=64)
def fingerprint(fn: Any) -> str:
    """SHA-256 (first 16 hex digits) of a function's syntax tree without its docstring: stable across
    comments and formatting, changed by any change of behaviour."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    if (
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    ):
        node.body = node.body[1:]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


# -- the rules of each known `_init_weights` ----------------------------------------------
# A rule gets (model owning the rule, module, qualified name prefix, write) and calls
# write(local key or dotted path under the module, Assigned) for each tensor it initializes.

Write = Callable[[str, Assigned], None]


def _std(config: Any) -> float:
    if hasattr(config, "initializer_range"):
        return float(config.initializer_range or 0.02)
    if hasattr(config, "init_std"):
        return float(config.init_std)
    if hasattr(config, "initializer_factor"):
        return float(config.initializer_factor)
    return float(getattr(config.get_text_config(), "initializer_range", 0.02))


def _present(mod: nn.Module, key: str) -> bool:
    return isinstance(getattr(mod, key, None), torch.Tensor)


def _base(model: Any, mod: nn.Module, write: Write) -> None:
    """PreTrainedModel._init_weights."""
    std = _std(model.config)
    if isinstance(mod, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.ConvTranspose1d | nn.ConvTranspose2d):
        if _present(mod, "weight"):
            write("weight", Assigned(_normal(std)))
        if _present(mod, "bias"):
            write("bias", Assigned(_zeros))
    elif isinstance(mod, nn.LSTM):
        for name, _ in mod.named_parameters():
            if "weight" in name:
                write(name, Assigned(_xavier))
            elif "bias" in name:
                write(name, Assigned(_zeros))
    elif isinstance(mod, nn.Embedding):
        pad = [_zero_row(mod.weight.shape, mod.padding_idx)] if mod.padding_idx is not None else []
        write("weight", Assigned(_normal(std), pad))
    elif isinstance(mod, nn.MultiheadAttention):
        for key, t in mod._parameters.items():
            if t is not None:
                got = mha(mod, key, t, 0)
                if got.verdict is Verdict.INIT:
                    write(key, Assigned(_same_kind(got.init)))
        if mod.in_proj_bias is not None and mod.out_proj.bias is not None:
            write("out_proj.bias", Assigned(_zeros))
    elif (
        isinstance(mod, nn.GroupNorm | nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d)
        or "LayerNorm" in type(mod).__name__
        or "RMSNorm" in type(mod).__name__
    ):
        for key, make in (("weight", _ones), ("bias", _zeros), ("running_mean", _zeros), ("running_var", _ones)):
            if _present(mod, key) and (key in ("weight", "bias") or _present(mod, "running_mean")):
                write(key, Assigned(make))


def _same_kind(init: plan_pb2.Init) -> Make:
    """An Init built with some seed, rebuilt for any seed."""

    def make(seed: int) -> plan_pb2.Init:
        return inits.with_seed(init, seed)

    return make


def _gpt2(model: Any, mod: nn.Module, write: Write) -> None:
    """GPT2PreTrainedModel._init_weights."""
    _base(model, mod, write)
    family = _module_of(model, "GPT2PreTrainedModel")
    from transformers.pytorch_utils import Conv1D

    cfg = model.config
    if isinstance(mod, Conv1D):
        write("weight", Assigned(_normal(float(cfg.initializer_range))))
        if _present(mod, "bias"):
            write("bias", Assigned(_zeros))
    if isinstance(mod, family.GPT2Attention | family.GPT2MLP):
        write("c_proj.weight", Assigned(_normal(float(cfg.initializer_range) / math.sqrt(2 * cfg.n_layer))))


def _bert(model: Any, mod: nn.Module, write: Write) -> None:
    """BertPreTrainedModel._init_weights (its buffer copies are fill_buffers' business)."""
    _base(model, mod, write)
    family = _module_of(model, "BertPreTrainedModel")
    if isinstance(mod, family.BertLMPredictionHead):
        write("bias", Assigned(_zeros))


def _module_of(model: Any, cls_name: str) -> Any:
    for cls in type(model).__mro__:
        if cls.__name__ == cls_name:
            return sys.modules[cls.__module__]
    raise LookupError(cls_name)


# class name -> (fingerprints of its `_init_weights` this module replays, rule)
KNOWN: dict[str, tuple[frozenset[str], Callable[[Any, nn.Module, Write], None]]] = {
    "PreTrainedModel": (frozenset({"16f6b97ba572004e"}), _base),  # transformers 5.24
    "GPT2PreTrainedModel": (frozenset({"48876bff97af394c"}), _gpt2),
    "BertPreTrainedModel": (frozenset({"0f820447208f5b69"}), _bert),
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def _refusing(why: str) -> Callable[[Any, nn.Module, Write], None]:
    """The rule of a model whose _init_weights is not replayed: every tensor of every module refused with `why`."""

    def rule(model: Any, mod: nn.Module, write: Write) -> None:
        for key in [*mod._parameters, *mod._buffers]:
            write(key, Assigned.refused(why))

    return rule


def _rule_for(model: Any) -> Callable[[Any, nn.Module, Write], None]:
    """The rule replaying type(model)._init_weights, or one refusing every tensor with why there is none."""
    for cls in type(model).__mro__:
        if "_init_weights" in cls.__dict__:
            known = KNOWN.get(cls.__name__)
            if known is None:
                return _refusing(f"{cls.__name__}._init_weights is not one the hf policy knows")
            if fingerprint(cls.__dict__["_init_weights"]) not in known[0]:
                return _refusing(f"{cls.__name__}._init_weights of this transformers version differs from the one the hf policy replays")
            return known[1]
    return _refusing("no _init_weights")


def _walk(module: nn.Module, prefix: str, owner: Any, pretrained: type[Any], seen: set[int]) -> Iterator[tuple[nn.Module, str, Any]]:
    """(module, prefix, the PreTrainedModel whose _init_weights applies) in initialize_weights' order: children first."""
    for name, child in module.named_children():
        sub = f"{prefix}{name}."
        yield from _walk(child, sub, child if isinstance(child, pretrained) else owner, pretrained, seen)
    if id(module) not in seen:  # _is_hf_initialized: a shared module is initialized once
        seen.add(id(module))
        yield module, prefix, owner


def plan_inits(module: nn.Module, names: dict[int, list[str]]) -> dict[int, tuple[Assigned, str]]:
    """For each distinct tensor (by id; `names`: its state_dict names in order): what the hf policy gives it
    and under which of its names (the tie source, else the first)."""
    tf = _transformers()
    if tf is None:
        raise MissingPackage("transformers", "policy 'hf'")
    pretrained = tf.PreTrainedModel
    owner0 = module if isinstance(module, pretrained) else None
    by_name: dict[str, Assigned] = {}
    rules: dict[int, Callable[[Any, nn.Module, Write], None]] = {}
    for mod, prefix, owner in _walk(module, "", owner0, pretrained, set()):
        rule = (
            _refusing(f"{type(mod).__name__} is not inside a transformers PreTrainedModel")
            if owner is None
            else rules.setdefault(id(owner), _rule_for(owner))
        )

        def write(key: str, got: Assigned, _prefix: str = prefix) -> None:
            by_name[_prefix + key] = got

        rule(owner, mod, write)
    sources = {v for v in (getattr(module, "all_tied_weights_keys", None) or {}).values()}
    out: dict[int, tuple[Assigned, str]] = {}
    for i, ns in names.items():
        chosen = next((n for n in ns if n in sources), ns[0])
        got = by_name.get(chosen)
        out[i] = (got if got is not None else Assigned.refused("no rule of the model's _init_weights initializes it"), chosen)
    return out


def fill_buffers(module: nn.Module, pending: dict[str, tuple[nn.Module, str]], device: torch.device) -> set[str]:
    """Compute the non-persistent buffers in `pending` (qualified name -> (module, key), still on meta) on
    `device` with the model's own _init_weights; returns the names it wrote.

    Every other tensor of the module is marked `_is_hf_initialized` meanwhile, the flag transformers'
    init functions honour for loaded weights, so nothing else changes.
    """
    tf = _transformers()
    if tf is None or not pending:
        return set()
    pretrained = tf.PreTrainedModel
    owner0 = module if isinstance(module, pretrained) else None
    owners = {id(m): o for m, _, o in _walk(module, "", owner0, pretrained, set()) if o is not None}
    by_module: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, (mod, key) in pending.items():
        if id(mod) in owners:
            by_module.setdefault(id(mod), []).append((name, mod, key))
    done: set[str] = set()
    for entries in by_module.values():
        mod = entries[0][1]
        fresh = {}
        for name, _, key in entries:
            old = mod._buffers[key]
            assert old is not None
            mod._buffers[key] = fresh[name] = torch.empty(old.shape, dtype=old.dtype, device=device)
        versions = {name: t._version for name, t in fresh.items()}
        flagged = [
            t
            for t in [*mod.parameters(), *mod.buffers()]
            if all(t is not f for f in fresh.values()) and not getattr(t, "_is_hf_initialized", False)
        ]
        for t in flagged:
            setattr(t, "_is_hf_initialized", True)  # noqa: B010 (an attribute torch does not declare)
        try:
            from transformers import initialization

            with torch.no_grad(), initialization.guard_torch_init_functions():
                owners[id(mod)]._init_weights(mod)
        finally:
            for t in flagged:
                delattr(t, "_is_hf_initialized")
        for name, _, key in entries:
            if fresh[name]._version != versions[name]:
                done.add(name)
            else:  # not the model's to compute: leave it on meta for the caller to report
                mod._buffers[key] = torch.empty(fresh[name].shape, dtype=fresh[name].dtype, device="meta")
    return done
