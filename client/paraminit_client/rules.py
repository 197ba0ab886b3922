"""What every initialization policy shares: the walk over a model's tensors, what a rule answers for one tensor,
and the plan initializers rules build.

The policy modules (`torch_rules`, `hf`, `titan`, `recipes`, `replay`, `policies`) all import this one and it
imports none of them, so they stand in a line instead of a circle: a rule answers with a `Ruling` (an initializer,
a refusal with its reason, "not mine", "left to another owner", or a layout that needs the tensor's name), and its
callers ask the ruling rather than the type of what they got.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from paraminit.v1 import plan_pb2

__all__ = [
    "LAZY",
    "UNOWNED",
    "Layout",
    "ModuleWalk",
    "Policy",
    "Rule",
    "Ruling",
    "Verdict",
    "is_plan_tensor",
    "kaiming",
    "module_names",
    "normal",
    "ones",
    "orthogonal",
    "owners",
    "param_seed",
    "symmetric",
    "trunc_normal",
    "uniform",
    "xavier",
    "zeros",
]

LAZY = "uninitialized lazy tensor: run a forward pass first or use the non-lazy layer"
UNOWNED = "state_dict name not found among the module's parameters and persistent buffers"


# -- plan initializers ----------------------------------------------------------------------------------------------


def zeros() -> plan_pb2.Init:
    """Returns: the all-zeros Init."""
    return plan_pb2.Init(zeros=plan_pb2.Zeros())


def ones() -> plan_pb2.Init:
    """Returns: the all-ones Init."""
    return plan_pb2.Init(ones=plan_pb2.Ones())


def uniform(lo: float, hi: float, seed: int) -> plan_pb2.Init:
    """Returns: U(lo, hi) under `seed` (lo == hi states the constant exactly, since lo + u * 0 = lo)."""
    return plan_pb2.Init(uniform=plan_pb2.Uniform(lo=lo, hi=hi, seed=seed))


def symmetric(bound: float, seed: int) -> plan_pb2.Init:
    """Returns: U(-bound, bound) under `seed`."""
    return uniform(-bound, bound, seed)


def normal(std: float, seed: int) -> plan_pb2.Init:
    """Returns: N(0, std^2) under `seed`."""
    return plan_pb2.Init(normal=plan_pb2.Normal(mean=0.0, std=std, seed=seed))


def trunc_normal(mean: float, std: float, a: float, b: float, seed: int) -> plan_pb2.Init:
    """nn.init.trunc_normal_(t, mean, std, a, b): a and b are absolute bounds, as in the plan.

    Returns:
        The truncated normal Init under `seed`.
    """
    return plan_pb2.Init(truncated_normal=plan_pb2.TruncatedNormal(mean=mean, std=std, lo=a, hi=b, seed=seed))


def orthogonal(gain: float, seed: int) -> plan_pb2.Init:
    """nn.init.orthogonal_(t, gain): the plan's deterministic orthogonal (docs/SAMPLER.md 2.3), the same matrix up
    to rounding for the same Gaussian draws.

    Returns:
        The orthogonal Init under `seed`.
    """
    return plan_pb2.Init(orthogonal=plan_pb2.Orthogonal(gain=gain, seed=seed))


def xavier(seed: int) -> plan_pb2.Init:
    """Returns: Xavier-uniform by the tensor's own shape, under `seed`."""
    return plan_pb2.Init(xavier_uniform_for_shape=plan_pb2.XavierUniformForShape(seed=seed))


def kaiming(seed: int) -> plan_pb2.Init:
    """Returns: Kaiming-uniform by the tensor's own shape, under `seed`."""
    return plan_pb2.Init(kaiming_uniform_for_shape=plan_pb2.KaimingUniformForShape(seed=seed))


# -- what a rule answers --------------------------------------------------------------------------------------------


class Verdict(enum.Enum):
    """Which answer a Ruling is."""

    INIT = "init"  # an initializer (and the patches a layer fixes)
    REFUSED = "refused"  # a tensor the rule knows but no initializer states: the reason
    UNKNOWN = "unknown"  # not a tensor this rule knows
    SKIP = "skip"  # left to another owner of the tensor (torchtitan's skip_param_init)
    LAYOUT = "layout"  # an initializer that needs the tensor's name and shape (torchtitan's fused wqkv)


# (state_dict name, shape, the seed of a tensor name) -> the ruling for that tensor
Layout = Callable[[str, tuple[int, ...], Callable[[str], int]], "Ruling"]


@dataclass(frozen=True)
class Ruling:
    """What a rule answers for one tensor; make one with its constructors (`of`, `refused`, `unknown`, `skipped`,
    `laid_out`) and read it through `verdict` and the methods, never through the type of a field."""

    verdict: Verdict
    init: plan_pb2.Init = field(default_factory=plan_pb2.Init)  # INIT only
    patches: tuple[plan_pb2.Patch, ...] = ()  # INIT only
    reason: str = ""  # REFUSED only
    layout: Layout | None = field(default=None, compare=False)  # LAYOUT only

    @classmethod
    def of(cls, init: plan_pb2.Init, patches: Sequence[plan_pb2.Patch] = ()) -> Ruling:
        """Returns: the ruling that gives the tensor `init`, with `patches` over it."""
        return cls(Verdict.INIT, init, tuple(patches))

    @classmethod
    def refused(cls, reason: str) -> Ruling:
        """Returns: the ruling that no initializer states the tensor, and why."""
        return cls(Verdict.REFUSED, reason=reason)

    @classmethod
    def unknown(cls) -> Ruling:
        """Returns: the ruling of a rule that does not know the tensor."""
        return cls(Verdict.UNKNOWN)

    @classmethod
    def skipped(cls) -> Ruling:
        """Returns: the ruling that another owner of the tensor initializes it."""
        return cls(Verdict.SKIP)

    @classmethod
    def laid_out(cls, layout: Layout) -> Ruling:
        """Returns: the ruling that `layout` gives once the tensor's name and shape are known."""
        return cls(Verdict.LAYOUT, layout=layout)

    @property
    def decided(self) -> bool:
        """Whether the ruling is an initializer."""
        return self.verdict is Verdict.INIT

    def or_reason(self, otherwise: str) -> plan_pb2.Init | str:
        """The walk's entry for the tensor (see ModuleWalk.inits).

        Args:
            otherwise: the reason to give when the rule did not decide (unknown, skipped, an unresolved layout).

        Returns:
            The Init, the refusal's reason, or `otherwise`.
        """
        if self.verdict is Verdict.INIT:
            return self.init
        return self.reason if self.verdict is Verdict.REFUSED else otherwise

    def then(self, step: Callable[[plan_pb2.Init], Ruling]) -> Ruling:
        """The ruling `step` makes of this one's initializer; any other ruling stays as it is.

        Args:
            step: Init -> the new ruling (patches are the step's to keep).

        Returns:
            step(init) for an INIT, else this ruling.
        """
        return step(self.init) if self.verdict is Verdict.INIT else self

    def lay_out(self, name: str, shape: tuple[int, ...], seed_of: Callable[[str], int]) -> Ruling:
        """A LAYOUT resolved for the tensor `name`; any other ruling as it is.

        Args:
            name: the tensor's state_dict name.
            shape: its shape.
            seed_of: the seed of a tensor name (the walk's).

        Returns:
            The layout's ruling, or this one.
        """
        return self.layout(name, shape, seed_of) if self.layout is not None else self

    def record(self, walk: ModuleWalk, name: str, otherwise: str) -> None:
        """Write the ruling into the walk: walk.inits[name] (see or_reason) and walk.patches[name].

        Args:
            walk: the walk of the policy deciding.
            name: the tensor's state_dict name.
            otherwise: the reason to give when the rule did not decide.
        """
        walk.inits[name] = self.or_reason(otherwise)
        walk.patches[name] = list(self.patches)


# A layer rule gets (module, local key, tensor, seed) and answers for that tensor.
Rule = Callable[[Any, str, torch.Tensor, int], Ruling]


# -- the walk over a model ------------------------------------------------------------------------------------------


def param_seed(seed: int, name: str) -> int:
    """The seed of one parameter: SHA-256 of "seed:name", first 8 bytes big-endian.

    It depends on the name only, so adding, removing or reordering other
    parameters never changes this parameter's values.

    Args:
        seed: the model's seed.
        name: the parameter's state_dict name.

    Returns:
        The parameter's 64-bit seed.
    """
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def owners(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """The owner of every state_dict tensor; a shared module appears under each of its names.

    Args:
        module: the model.

    Returns:
        state_dict name -> (owning module, local key).
    """
    out: dict[str, tuple[nn.Module, str]] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, p in mod._parameters.items():
            if p is not None:
                out[dot + key] = (mod, key)
        for key, b in mod._buffers.items():
            if b is not None and key not in mod._non_persistent_buffers_set:
                out[dot + key] = (mod, key)
    return out


def module_names(module: nn.Module) -> dict[int, str]:
    """Qualified names of the model's submodules, by identity.

    Args:
        module: the model.

    Returns:
        id(submodule) -> its qualified name ("" for the root).
    """
    return {id(m): n for n, m in module.named_modules(remove_duplicate=False)}


def is_plan_tensor(t: torch.Tensor) -> bool:
    """Whether a plan can hold it: floating point (integer and bool buffers are left to the module).

    Args:
        t: a state_dict tensor.

    Returns:
        True for floating-point and complex tensors.
    """
    return t.is_floating_point() or t.is_complex()


class ModuleWalk:
    """One plan_from_module call's model and what its policy decides: `tensors` (state_dict name -> tensor, one name
    per distinct tensor, in plan order), `kinds` (the owning module's class name, for messages), `inits` (an Init,
    or why there is none) and `patches` (elements a layer fixes, e.g. an Embedding's padding row)."""

    def __init__(self, module: nn.Module, seed: int) -> None:
        self.module, self.seed = module, seed
        self.owners = owners(module)
        self.tensors: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}
        self.inits: dict[str, plan_pb2.Init | str] = {}
        self.patches: dict[str, list[plan_pb2.Patch]] = {}

    def seed_of(self, name: str) -> int:
        """The seed of the tensor `name`: param_seed(seed, name)."""
        return param_seed(self.seed, name)

    def collect(self) -> list[str]:
        """Record every distinct floating-point tensor of state_dict() (by identity, tied ones once, under their
        first name, in its order) and return the names a policy decides: the rest (lazy tensors, names with no
        owning module) get their reason here."""
        seen: set[int] = set()
        decide = []
        for name, t in self.module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            if not is_plan_tensor(t):
                continue
            self.tensors[name] = t
            owner = self.owners.get(name)
            self.kinds[name] = type(owner[0]).__name__ if owner else "?"
            if nn.parameter.is_lazy(t):
                self.inits[name] = LAZY
            elif owner is None:
                self.inits[name] = UNOWNED
            else:
                decide.append(name)
        return decide

    def entries(self) -> dict[str, tuple[nn.Module, str, str, int]]:
        """collect(), as the recipes read it: name -> (owning module, local key, owner's qualified name, seed)."""
        names = module_names(self.module)
        return {n: (o, k, names.get(id(o), ""), self.seed_of(n)) for n in self.collect() for o, k in [self.owners[n]]}

    def ruling(self, name: str) -> Ruling:
        """What the policy decided for `name`, as a Ruling. Policies write `inits` as an Init or a reason string
        (the public protocol, see Policy); this is the one place that tells the two apart.

        Args:
            name: a tensor the policy decided.

        Returns:
            Ruling.of(init, patches) or Ruling.refused(reason).

        Raises:
            KeyError: the policy left `name` undecided.
        """
        got = self.inits[name]
        return Ruling.refused(got) if isinstance(got, str) else Ruling.of(got, self.patches.get(name, ()))


class Policy(Protocol):
    """What plan_from_module takes as `policy` besides a registered name."""

    @property
    def name(self) -> str:
        """What refusals call it."""

    def assign(self, walk: ModuleWalk) -> None:
        """Set walk.tensors (usually through walk.collect()), and walk.inits and walk.patches for each."""
