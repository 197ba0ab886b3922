"""Initialization recipes of large-model training frameworks, as policies of plan_from_module.

A recipe states every tensor of a transformer by its role: weights (linear layers and embeddings) normal with the
recipe's standard deviation, output projections (the attention's and the MLP's last linear layer, which feed the
residual stream) with a depth-scaled one, biases zero, norm weights one. The depth and width come from the model's
own config object where it has one (Megatron's TransformerConfig, a transformers config), else from its structure
(the longest list of identical blocks, the first embedding's width), or from the recipe's arguments.

- `megatron`: Megatron-LM's `init_method_normal(sigma)` and, on output projections, `scaled_init_method_normal(sigma,
  num_layers)`: sigma / sqrt(2 L). sigma is the config's `init_method_std` (or `initializer_range`), else 0.02.
- `neox`: GPT-NeoX's `small_init` (sqrt(2 / (5 d))) and, on output projections, `wang_init` (2 / (L sqrt(d))).
- `olmo`: OLMo-core's own `init_weights`, replayed (`replay` does the same for any framework's code).
- `mup(base, delta)`: μP as the `mup` package's `set_base_shapes` leaves PyTorch's initialization (see `mup`).

Output projections are told by the qualified name of their layer (its last components: `linear_proj`,
`linear_fc2`, `attention.dense`, `c_proj`, `o_proj`, `down_proj`, `out_proj`, `wo`, `w2`, `fc2`, ...) or by class
(Megatron's `RowParallelLinear`); pass `output_layers` for other names. Anything else (a 1-D tensor that is neither a
bias nor a norm's, a buffer) is refused with the reason, never guessed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules.conv import _ConvNd

from paraminit.v1 import plan_pb2
from paraminit_client import replay as recorder
from paraminit_client.errors import InvalidArgument
from paraminit_client.rules import ModuleWalk, Ruling
from paraminit_client.torch_rules import TORCH, LayerRules, fan_in_uniform

__all__ = ["OUTPUT_LAYERS", "RECIPES", "MuP", "Recipe", "Replay", "megatron", "mup", "neox", "olmo", "replay"]

OUTPUT_LAYERS = (
    "linear_proj",  # Megatron: attention output
    "linear_fc2",  # Megatron: MLP output
    "attention.dense",  # GPT-NeoX (transformers' GPTNeoX)
    "dense_4h_to_h",  # GPT-NeoX
    "c_proj",  # GPT-2
    "o_proj",  # Llama, Qwen, Mistral (transformers)
    "down_proj",
    "out_proj",  # nn.MultiheadAttention
    "wo",  # torchtitan
    "w2",
    "fc2",
)
_OUTPUT_CLASSES = ("RowParallelLinear",)  # Megatron builds output projections from this class, and only those
_LAYERS_KEYS = ("num_layers", "num_hidden_layers", "n_layer", "n_layers")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_SIGMA_KEYS = ("init_method_std", "initializer_range")

Std = Callable[[int, int, float], float]  # (width d, layers L, sigma) -> standard deviation


@dataclass(frozen=True)
class Recipe:
    """A depth-aware normal recipe (see the module doc); `num_layers`, `d_model` and `sigma` override what the model
    says of itself."""

    name: str
    weight_std: Std
    output_std: Std
    num_layers: int | None = None
    d_model: int | None = None
    sigma: float | None = None
    output_layers: tuple[str, ...] = OUTPUT_LAYERS
    uses_width: bool = True  # whether the standard deviations depend on d (Megatron's do not)

    def assign(self, walk: ModuleWalk) -> None:
        """The policies.Policy protocol: every tensor the walk collects, by its role."""
        walk.inits.update(self.inits(walk.module, walk.entries()))

    def inits(self, module: nn.Module, tensors: dict[str, tuple[nn.Module, str, str, int]]) -> dict[str, plan_pb2.Init | str]:
        """An Init (or why none) per tensor: name -> (owning module, local key, owner's qualified name, seed).

        Args:
            module: the model (its config and structure give the depth and width).
            tensors: every tensor of the plan, by state_dict name.

        Returns:
            name -> Init, or the reason it has none.
        """
        layers = self.num_layers or int(_config_value(module, _LAYERS_KEYS) or 0) or _block_count(module)
        width = self.d_model or int(_config_value(module, _WIDTH_KEYS) or 0) or _embedding_width(module)
        sigma = self.sigma if self.sigma is not None else float(_config_value(module, _SIGMA_KEYS, float) or 0.02)
        out: dict[str, plan_pb2.Init | str] = {}
        for name, (mod, key, qualified, seed) in tensors.items():
            if not layers or (self.uses_width and not width):
                need = (
                    "depth and width: pass num_layers= and d_model= (--num-layers, --d-model)"
                    if self.uses_width
                    else "depth: pass num_layers= (--num-layers)"
                )
                out[name] = f"recipe {self.name!r} needs the model's {need} (found {layers or 'no'} layers" + (
                    f", width {width or 'unknown'})" if self.uses_width else ")"
                )
                continue
            out[name] = self._one(mod, key, qualified, seed, width or 0, layers, sigma)
        return out

    def _one(self, mod: nn.Module, key: str, qualified: str, seed: int, d: int, layers: int, sigma: float) -> plan_pb2.Init | str:
        cls = type(mod).__name__
        tensor = mod._parameters.get(key)
        if tensor is None:
            return f"{cls}.{key} is a buffer, which recipe {self.name!r} does not initialize"
        if "Norm" in cls:
            return plan_pb2.Init(ones=plan_pb2.Ones()) if key == "weight" else plan_pb2.Init(zeros=plan_pb2.Zeros())
        if key == "bias" or key.endswith("_bias"):
            return plan_pb2.Init(zeros=plan_pb2.Zeros())
        if tensor.dim() < 2:
            return f"{cls}.{key}: a {tensor.dim()}-D tensor that is neither a bias nor a norm's, unknown to recipe {self.name!r}"
        std = (self.output_std if self.is_output(mod, qualified) else self.weight_std)(d, layers, sigma)
        return plan_pb2.Init(normal=plan_pb2.Normal(mean=0.0, std=std, seed=seed))

    def is_output(self, mod: nn.Module, qualified: str) -> bool:
        """Whether a layer is an output projection: by class, or by the last components of its qualified name."""
        if type(mod).__name__ in _OUTPUT_CLASSES:
            return True
        parts = qualified.split(".")
        return any(parts[-len(p.split(".")) :] == p.split(".") for p in self.output_layers)


def megatron(sigma: float | None = None, num_layers: int | None = None, output_layers: tuple[str, ...] = OUTPUT_LAYERS) -> Recipe:
    """Megatron-LM: normal(0, sigma), output projections normal(0, sigma / sqrt(2 L)).

    Args:
        sigma: the standard deviation (default: the config's init_method_std or initializer_range, else 0.02).
        num_layers: L (default: the config's, else the longest list of identical blocks).
        output_layers: the name suffixes of output projections.

    Returns:
        The recipe, for plan_from_module(policy=...).
    """
    return Recipe(
        "megatron", lambda d, n, s: s, lambda d, n, s: s / math.sqrt(2.0 * n), num_layers, None, sigma, output_layers, uses_width=False
    )


def neox(num_layers: int | None = None, d_model: int | None = None, output_layers: tuple[str, ...] = OUTPUT_LAYERS) -> Recipe:
    """GPT-NeoX: small_init normal(0, sqrt(2 / (5 d))), output projections wang_init normal(0, 2 / (L sqrt(d))).

    Args:
        num_layers: L (default: the config's, else the longest list of identical blocks).
        d_model: d (default: the config's hidden size, else the first embedding's width).
        output_layers: the name suffixes of output projections.

    Returns:
        The recipe, for plan_from_module(policy=...).
    """
    return Recipe(
        "neox", lambda d, n, s: math.sqrt(2.0 / (5.0 * d)), lambda d, n, s: 2.0 / n / math.sqrt(d), num_layers, d_model, None, output_layers
    )


def _config_value(module: nn.Module, keys: tuple[str, ...], kind: type[int] | type[float] = int) -> float | None:
    """The first of `keys` set (positive) on a config object of the model (the root's first, then its submodules')."""
    for mod in module.modules():
        config = getattr(mod, "config", None)
        for key in keys:
            value = getattr(config, key, None) if config is not None else None
            if isinstance(value, int | float) and isinstance(value, kind) and not isinstance(value, bool) and value > 0:
                return float(value)
    return None


def _block_count(module: nn.Module) -> int | None:
    """The length of the longest list (or dict) of modules that are all of one class: the transformer's blocks."""
    counts = [
        len(m)
        for m in module.modules()
        if isinstance(m, nn.ModuleList | nn.ModuleDict) and len(m) and len({type(c) for c in m.children()}) == 1
    ]
    return max(counts) if counts else None


def _embedding_width(module: nn.Module) -> int | None:
    for mod in module.modules():
        width = getattr(mod, "embedding_dim", None)
        if isinstance(width, int) and width > 0:
            return width
    return None


# -- a framework's own initialization code, replayed ------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """A framework's own initialization code, run on the meta model with torch.nn.init's functions recording their
    call instead of filling (see `replay`)."""

    name: str
    init: Callable[[nn.Module], object]
    _patches: dict[str, list[plan_pb2.Patch]] = field(default_factory=dict, compare=False, repr=False)  # of the last inits()

    def assign(self, walk: ModuleWalk) -> None:
        """The policies.Policy protocol: every tensor the walk collects, from the framework's own calls."""
        walk.inits.update(self.inits(walk.module, walk.entries()))
        walk.patches.update(self._patches)

    def inits(self, module: nn.Module, tensors: dict[str, tuple[nn.Module, str, str, int]]) -> dict[str, plan_pb2.Init | str]:
        """An Init (or why none) per tensor, from what the framework's code wrote to it (paraminit_client.replay).

        Args:
            module: the model, on the meta device.
            tensors: every tensor of the plan, by state_dict name: (owning module, key, owner's name, seed).

        Returns:
            name -> Init, or the reason it has none.
        """
        owned = {name: mod._parameters.get(key, mod._buffers.get(key)) for name, (mod, key, _, _) in tensors.items()}
        rec, failures = recorder.replay(module, [t for t in owned.values() if t is not None], init=self.init)
        if failures:  # the framework's code cannot run on this model: every tensor says why
            why = f"{self.name}'s initialization cannot run on this model: {next(iter(failures.values()))}"
            return dict.fromkeys(tensors, why)
        seeds = {id(t): seed for name, (_, _, _, seed) in tensors.items() if (t := owned[name]) is not None}

        def seed_of(root: recorder.Root) -> int | str:
            return seeds.get(id(root.tensor), "copies the values of a tensor that is not in the plan")

        self._patches.clear()
        out: dict[str, plan_pb2.Init | str] = {}
        for name, (mod, key, _, _) in tensors.items():
            t = owned[name]
            got = recorder.emit(rec.add_root(t), seed_of) if t is not None else Ruling.unknown()
            out[name] = got.or_reason(f"{self.name}'s initialization never sets {type(mod).__name__}.{key}")
            self._patches[name] = list(got.patches)
        return out


def replay(init: Callable[[nn.Module], object], name: str = "replay") -> Replay:
    """A policy that runs a framework's own initialization code on the meta model, every write it makes to a
    tensor (torch.nn.init's functions, tensor methods, their compositions: paraminit_client.replay) recorded as the
    distribution it gives instead of filling it. A tensor the code never sets, or sets in a way no initializer
    states, is refused. The framework's own random generator is not used: the plan's seeds make the values.

    Args:
        init: runs the framework's initialization on the module, e.g. `lambda m: m.init_weights()`.
        name: what refusals call it.

    Returns:
        The policy, for plan_from_module(policy=...).
    """
    return Replay(name, init)


def olmo() -> Replay:
    """OLMo-core's own `Transformer.init_weights` (its InitMethod: normal, llama, llama_depth, fan_in, ...), replayed.

    Returns:
        The policy, for plan_from_module(policy=...).
    """
    import torch

    return replay(lambda m: m.init_weights(device=torch.device("meta")), "olmo")  # type: ignore[operator]


Shapes = Mapping[str, Sequence[int]]  # parameter name (named_parameters) -> shape


@dataclass(frozen=True)
class MuP:
    """μP's initialization as the `mup` package makes it (see `mup`): PyTorch's own, then `set_base_shapes`'s rescale."""

    base: Shapes
    delta: Shapes | None = None
    name: str = "mup"

    def widths(self, shapes: Shapes) -> dict[str, list[tuple[int, int] | None]]:
        """Per parameter and dimension, (base dim, dim) for a width dimension, None for a fixed one: a dimension is a
        width where base and delta differ (without delta: where base and the model differ), as mup's InfShape."""
        out: dict[str, list[tuple[int, int] | None]] = {}
        for name, shape in shapes.items():
            base = self.base.get(name)
            other = self.delta.get(name) if self.delta is not None else shape
            if base is None or other is None or len(base) != len(shape) or len(other) != len(shape):
                raise InvalidArgument(f"mup: no base shape of rank {len(shape)} for parameter {name!r}")
            out[name] = [None if b == o else (int(b), int(d)) for b, o, d in zip(base, other, shape, strict=True)]
        return out

    def assign(self, walk: ModuleWalk) -> None:
        """The policies.Policy protocol: "torch" for every layer, then MuReadout layers as their reset_parameters
        (zeros with readout_zero_init) times sqrt(width multiplier), and Linear and Conv biases times sqrt(fan-in
        multiplier), as `set_base_shapes(model, base, delta=delta)` rescales them."""
        LayerRules(TORCH).assign(walk)
        widths = self.widths({n: tuple(p.shape) for n, p in walk.module.named_parameters()})
        for prefix, mod in walk.module.named_modules():
            dot = f"{prefix}." if prefix else ""
            weight = widths.get(f"{dot}weight")
            readout = any(c.__name__ == "MuReadout" for c in type(mod).__mro__)
            if weight is None or not (readout or isinstance(mod, nn.Linear | _ConvNd)):
                continue
            if readout and type(mod).__name__ != "MuReadout":
                for key in ("weight", "bias"):
                    walk.inits[f"{dot}{key}"] = f"{type(mod).__name__}: mup policy reads plain MuReadout layers only"
                continue
            main = next((d for d in reversed(weight) if d is not None), None)  # mup's InfShape.main: the last width
            fan_in = weight[1] if len(weight) > 1 else None
            if not readout and isinstance(mod, nn.Linear) and weight[0] is None and fan_in is not None:
                for key in ("weight", "bias"):  # as mup's set_base_shapes asserts (assert_hidden_size_inf)
                    walk.inits[f"{dot}{key}"] = f"{prefix or 'Linear'}: a width fan-in and a fixed fan-out needs mup.MuReadout"
                continue
            for key in ("weight", "bias") if readout else ("bias",):
                name = f"{dot}{key}"
                if name not in walk.tensors or getattr(mod, key, None) is None:
                    continue
                if readout and getattr(mod, "readout_zero_init", False):
                    walk.inits[name] = plan_pb2.Init(zeros=plan_pb2.Zeros())
                    continue
                base = fan_in_uniform(mod, key, walk.tensors[name], walk.seed_of(name)) if readout else walk.ruling(name)
                dims = main if readout else fan_in
                scale = math.sqrt(dims[1] / dims[0]) if dims is not None else 1.0
                walk.inits[name] = base.then(functools.partial(_scaled, scale=scale)).or_reason(
                    f"{type(mod).__name__} has no rule for {key!r}"
                )


def _scaled(init: plan_pb2.Init, scale: float) -> Ruling:
    """An initializer whose values are `scale` times the given one's (uniform and normal; zeros stay)."""
    if scale == 1.0:
        return Ruling.of(init)
    kind = init.WhichOneof("kind")
    out = plan_pb2.Init()
    out.CopyFrom(init)
    if kind == "uniform":
        out.uniform.lo, out.uniform.hi = init.uniform.lo * scale, init.uniform.hi * scale
    elif kind == "normal":
        out.normal.mean, out.normal.std = init.normal.mean * scale, init.normal.std * scale
    elif kind != "zeros":
        return Ruling.refused(f"mup cannot rescale a {kind} initializer")
    return Ruling.of(out)


def _shapes_of(x: nn.Module | Shapes) -> Shapes:
    return {n: tuple(p.shape) for n, p in x.named_parameters()} if isinstance(x, nn.Module) else x


def mup(base: nn.Module | Shapes, delta: nn.Module | Shapes | None = None) -> MuP:
    """μP (Maximal Update Parametrization) as the `mup` package initializes a model: `set_base_shapes(model, base,
    delta=delta)` after PyTorch's own initialization. Dimensions that differ between `base` and `delta` (or, without
    `delta`, between `base` and the model) are widths; MuReadout output layers get nn.Linear's initialization (zeros
    with readout_zero_init) times sqrt(width multiplier), and Linear and Conv biases theirs times sqrt(fan-in
    multiplier), where a multiplier is the model's dimension over the base's. Build the base models on the meta
    device: only shapes are read. (μP's optimizer and output multipliers are training-time, not initialization.)

    Args:
        base: the base model, or its parameter shapes by name.
        delta: a model differing from the base in its width dimensions only, or its shapes (optional).

    Returns:
        The policy, for plan_from_module(policy=...).

    Example:
        >>> with meta_parameters():  # doctest: +SKIP
        ...     base, delta, model = MLP(width=64), MLP(width=128), MLP(width=1024)
        >>> plan = plan_from_module(model, seed=0, policy=recipes.mup(base, delta))  # doctest: +SKIP
    """
    return MuP(_shapes_of(base), _shapes_of(delta) if delta is not None else None)


RECIPES: dict[str, Callable[[], Recipe | Replay]] = {"megatron": megatron, "neox": neox, "olmo": olmo}  # policies registers these
