"""Initialization policies: what decides each tensor's initializer in plan_from_module. One protocol, one registry.

A policy is given a `ModuleWalk` (the model, its seed, the owner of every state_dict tensor) and sets the initializer
of every distinct floating-point tensor, or the reason it has none. Built in, by name:

- "torch": PyTorch's own distributions, layer by layer (`torch_rules.LayerRules`), with the container rules of
  `nn.MultiheadAttention` and `nn.Transformer`;
- "torchlean": the same layers under TorchLean's runtime semantics (`torch_rules.TORCHLEAN`, a `Semantics` value);
- "hf": transformers' own `_init_weights` (`paraminit_client.hf`);
- "torchtitan": torchtitan's `init_weights` translated (`paraminit_client.titan`);
- "megatron", "neox", "olmo": the recipes of `paraminit_client.recipes`, whose functions also make one with other
  settings (`recipes.megatron(sigma=0.01)`), and `recipes.replay(...)` for any framework's initialization code.

A new policy is one class with a `name` and `assign(walk)` (`rules.Policy`, `rules.ModuleWalk`: the walk and the
rule types live in `rules`, which imports no policy module, so the policy modules import it and not each other):
pass an instance to plan_from_module, or `register` a factory under a name (the CLI's `--policy` offers the
built-in names).

Example:
    >>> from paraminit_client import policies
    >>> class AllZeros:
    ...     name = "zeros"
    ...     def assign(self, walk):
    ...         for name in walk.collect():
    ...             walk.inits[name] = plan_pb2.Init(zeros=plan_pb2.Zeros())
    >>> plan = plan_from_module(model, seed=0, policy=AllZeros())  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from paraminit_client import hf, recipes, replay, titan
from paraminit_client.errors import InvalidArgument
from paraminit_client.rules import LAZY, ModuleWalk, Policy, Ruling, is_plan_tensor, module_names, owners, param_seed
from paraminit_client.torch_rules import TORCH, TORCHLEAN, LayerRules

__all__ = [
    "BUILT_IN",
    "HFInit",
    "LayerRules",
    "ModuleWalk",
    "OwnInit",
    "Policy",
    "TorchtitanInit",
    "is_plan_tensor",
    "module_names",
    "owners",
    "param_seed",
    "policy_of",
    "register",
]


class HFInit:
    """ "hf": transformers' own _init_weights per distinct tensor (paraminit_client.hf); a tied tensor takes the
    initialization of its tie source."""

    name = "hf"

    def assign(self, walk: ModuleWalk) -> None:
        names: dict[int, list[str]] = {}
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in walk.module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and is_plan_tensor(t):
                names.setdefault(id(t), []).append(name)
                first.setdefault(id(t), (name, t))
        for i, (got, chosen) in hf.plan_inits(walk.module, names).items():
            name, t = first[i]
            walk.tensors[name] = t
            owner = walk.owners.get(chosen)
            walk.kinds[name] = type(owner[0]).__name__ if owner else "?"
            if nn.parameter.is_lazy(t):
                walk.inits[name] = LAZY
            else:
                got.ruling(walk.seed_of(name)).record(walk, name, "")


class TorchtitanInit:
    """ "torchtitan": torchtitan's init_weights translated module by module (paraminit_client.titan); a tied
    tensor is judged by every module that owns it."""

    name = "torchtitan"

    def assign(self, walk: ModuleWalk) -> None:
        """The Policy protocol: every tensor the walk collects, from its owners' param_init tables."""
        ties, refused = titan.tied_owners(walk.module), titan.refused_modules(walk.module)
        for name in walk.collect():
            owner, t = walk.owners[name], walk.tensors[name]
            why = next((f"{r} (module {m!r})" for m, r in refused.items() if not m or name.startswith(m + ".")), None)
            got = (
                Ruling.refused(why)
                if why
                else titan.init_for([owner, *[o for o in ties.get(id(t), []) if o != owner]], t, walk.seed_of(name))
            )
            # a fused wqkv: its parts drawn as the unfused tensors they are
            got.lay_out(name, tuple(t.shape), walk.seed_of).record(walk, name, f"{walk.kinds[name]} has no rule for {owner[1]!r}")


class OwnInit:
    """ "own" (the default): the model's own initialization code, replayed (paraminit_client.replay). A model built
    under torch.meta_parameters() carries what its constructor did; otherwise each module's reset_parameters and the
    framework's entry point (transformers' initialize_weights, a root init_weights()) are run again on the model,
    and a constructor that initializes in its own code is refused with its file:line. Non-parameter tensors that are
    real (buffers under meta_parameters) keep the values the model's code computed."""

    name = "own"

    def assign(self, walk: ModuleWalk) -> None:
        names = walk.collect()
        roots: dict[str, replay.Root] = {}
        pending = []
        for name in names:
            t = walk.tensors[name]
            rec = replay.record_of(t)
            if rec is not None:
                roots[name] = rec
            elif t.is_meta or isinstance(t, nn.Parameter):
                pending.append(name)
        failures: dict[int, str] = {}
        # what a framework runs after construction (torchtitan's and OLMo-core's init_weights, or any root
        # init_weights when the constructor left tensors unwritten), over what the constructor did
        late = replay.late_init(walk.module, unwritten=bool(pending)) if roots else None
        if late is not None:
            held = [(walk.tensors[n], r) for n in names if (r := replay.record_of(walk.tensors[n], unwritten=True)) is not None]
            rec_, failures = replay.replay(walk.module, [], init=late, start=held)
            roots = {name: rec_.add_root(walk.tensors[name]) for name in [*roots, *pending]}
            pending = []
        elif pending:
            rec_, failures = replay.replay(walk.module, [walk.tensors[n] for n in pending])
            for name in pending:
                roots[name] = rec_.add_root(walk.tensors[name])
        by_tensor = {id(t): name for name, t in walk.tensors.items()}  # every root's tensor is one of the walk's

        def seed_of(root: replay.Root) -> int | str:
            name = by_tensor.get(id(root.tensor))
            return walk.seed_of(name) if name is not None else "copies the values of a tensor that is not in the plan"

        modules = dict(walk.module.named_modules(remove_duplicate=False))
        replayed = replay.replayed_names(walk.module)
        pending_set = set(pending)
        for name in names:
            t, kind = walk.tensors[name], walk.kinds[name]
            key = walk.owners[name][1]
            if name not in roots:  # a real buffer: the values the model's code computed
                walk.inits[name] = replay.real_value(t).init(walk.seed_of(name))
                continue
            if name in pending_set:
                why = _not_replayable(name, modules, failures, replayed)
                if why is not None:
                    walk.inits[name] = why
                    continue
            got = replay.emit(roots[name], seed_of)
            if late is not None and failures:  # the model's own last step cannot be replayed: never guess past it
                got = Ruling.refused(
                    f"{got.reason + '; ' if got.reason else ''}{type(walk.module).__name__}.init_weights() "
                    f"failed when replayed: {next(iter(failures.values()))}; name the framework's policy or pass overrides"
                )
            got.record(
                walk,
                name,
                f"{kind}.{key} is never written by the initialization code paraminit can replay (reset_parameters, "
                "transformers' initialize_weights, init_weights); build the model under "
                "paraminit_client.torch.meta_parameters() so its constructor is recorded"
                if name in pending_set
                else f"{kind}.{key} is made on meta and never written by the model's constructor",
            )


def _not_replayable(name: str, modules: dict[str, nn.Module], failures: dict[int, str], replayed: frozenset[str]) -> str | None:
    """Why a tensor's initialization cannot be replayed after construction: a module above it whose constructor
    initializes in its own code, or whose replayed code failed."""
    parts = name.split(".")[:-1]
    for i in range(len(parts) + 1):
        mod = modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        if id(mod) in failures:
            return failures[id(mod)]
        where = replay.constructor_inits(cast(Any, type(mod)), replayed)
        if where is not None:
            return (
                f"{type(mod).__name__}'s constructor initializes tensors in its own code ({where}), which runs only "
                "when the model is built: build it under paraminit_client.torch.meta_parameters() (or with "
                "plan_from_constructor) so that code is recorded"
            )
    return None


_REGISTRY: dict[str, Callable[[], Policy]] = {
    "own": OwnInit,
    "torch": lambda: LayerRules(TORCH),
    "torchlean": lambda: LayerRules(TORCHLEAN),
    "hf": HFInit,
    "torchtitan": TorchtitanInit,
    **recipes.RECIPES,
}
BUILT_IN = tuple(_REGISTRY)  # the names paraminit ships (the CLI's --policy choices)


def register(name: str, factory: Callable[[], Policy]) -> None:
    """Make a policy available by name to plan_from_module and materialize_module.

    Args:
        name: the name callers pass as `policy`.
        factory: makes the policy (called once per plan).

    Raises:
        InvalidArgument: (a ValueError) the name is taken.
    """
    if name in _REGISTRY:
        raise InvalidArgument(f"a policy named {name!r} exists already")
    _REGISTRY[name] = factory


def policy_of(policy: str | Policy) -> Policy:
    """The policy a name stands for, or the object itself.

    Args:
        policy: a registered name or a Policy.

    Returns:
        The policy.

    Raises:
        InvalidArgument: (a ValueError) an unknown name, or an object without `assign`.
    """
    if isinstance(policy, str):
        factory = _REGISTRY.get(policy)
        if factory is None:
            raise InvalidArgument(f"policy must be one of {tuple(_REGISTRY)} or a Policy object, got {policy!r}")
        return factory()
    if not callable(getattr(policy, "assign", None)):
        raise InvalidArgument(f"a policy object needs assign(walk), got {type(policy).__name__}")
    return policy
