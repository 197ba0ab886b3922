"""Initialization recipes of large-model training frameworks, as policies of plan_from_module.

A recipe states every tensor of a transformer by its role: weights (linear layers and embeddings) normal with the
recipe's standard deviation, output projections (the attention's and the MLP's last linear layer, which feed the
residual stream) with a depth-scaled one, biases zero, norm weights one. The depth and width come from the model's
own config object where it has one (Megatron's TransformerConfig, a transformers config), else from its structure
(the longest list of identical blocks, the first embedding's width), or from the recipe's arguments.

- `megatron`: Megatron-LM's `init_method_normal(sigma)` and, on output projections, `scaled_init_method_normal(sigma,
  num_layers)`: sigma / sqrt(2 L). sigma is the config's `init_method_std` (or `initializer_range`), else 0.02.
- `neox`: GPT-NeoX's `small_init` (sqrt(2 / (5 d))) and, on output projections, `wang_init` (2 / (L sqrt(d))).

Output projections are told by the qualified name of their layer (its last components: `linear_proj`,
`linear_fc2`, `attention.dense`, `c_proj`, `o_proj`, `down_proj`, `out_proj`, `wo`, `w2`, `fc2`, ...) or by class
(Megatron's `RowParallelLinear`); pass `output_layers` for other names. Anything else (a 1-D tensor that is neither a
bias nor a norm's, a buffer) is refused with the reason, never guessed.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from paraminit.v1 import plan_pb2
from paraminit_client.torch_rules import INIT_CALLS, init_of_call

if TYPE_CHECKING:
    from paraminit_client.policies import ModuleWalk

__all__ = ["OUTPUT_LAYERS", "RECIPES", "Recipe", "Replay", "megatron", "neox", "olmo", "replay"]

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
                need = "depth and width: pass num_layers= and d_model=" if self.uses_width else "depth: pass num_layers="
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

    def assign(self, walk: ModuleWalk) -> None:
        """The policies.Policy protocol: every tensor the walk collects, from the framework's own calls."""
        walk.inits.update(self.inits(walk.module, walk.entries()))

    def inits(self, module: nn.Module, tensors: dict[str, tuple[nn.Module, str, str, int]]) -> dict[str, plan_pb2.Init | str]:
        """An Init (or why none) per tensor, from the last torch.nn.init call the framework's code made on it.

        Args:
            module: the model, on the meta device.
            tensors: every tensor of the plan, by state_dict name: (owning module, key, owner's name, seed).

        Returns:
            name -> Init, or the reason it has none.
        """
        import torch

        params = {id(mod._parameters.get(key)): name for name, (mod, key, _, _) in tensors.items() if key in mod._parameters}
        calls: dict[str, tuple[str, dict[str, object]]] = {}  # name -> (nn.init function, its arguments)
        other: dict[str, str] = {}  # name -> an in-place operation on it that no recorded call came after

        def recorder(fname: str) -> Callable[..., object]:
            real = getattr(torch.nn.init, fname)
            signature = inspect.signature(real)

            def record(tensor: object, *args: object, **kwargs: object) -> object:
                name = params.get(id(tensor))
                if name is None:
                    return real(tensor, *args, **kwargs)
                bound = signature.bind(tensor, *args, **kwargs)
                bound.apply_defaults()
                calls[name] = (fname, dict(bound.arguments))
                other.pop(name, None)
                return tensor  # nothing to fill on meta

            return record

        class Watch(torch.overrides.TorchFunctionMode):
            """Flags any other in-place operation on a parameter (a rescale, a copy): its effect is not in a call."""

            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                fname = getattr(func, "__name__", "")
                if args and fname.endswith("_") and not fname.startswith("__"):
                    name = params.get(id(args[0]))
                    if name is not None:
                        other[name] = fname
                return func(*args, **(kwargs or {}))

        real_generator = torch.Generator

        class MetaSafeGenerator(real_generator):  # type: ignore[misc, valid-type]
            """torch.Generator("meta") fails; a framework's seeded generator only feeds calls that are recorded."""

            def __new__(cls, device: Any = "cpu") -> Any:
                return real_generator("cpu" if str(device) == "meta" else device)

        saved = {f: getattr(torch.nn.init, f) for f in INIT_CALLS}
        try:
            for f in INIT_CALLS:
                setattr(torch.nn.init, f, recorder(f))
            torch.Generator = MetaSafeGenerator  # type: ignore[misc]
            with Watch():
                self.init(module)
        except Exception as exc:  # the framework's code cannot run on this model: every tensor says why
            why = f"{self.name}'s initialization cannot run on this model: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return dict.fromkeys(tensors, why)
        finally:
            for f, fn in saved.items():
                setattr(torch.nn.init, f, fn)
            torch.Generator = real_generator  # type: ignore[misc]
        out: dict[str, plan_pb2.Init | str] = {}
        for name, (mod, key, _, seed) in tensors.items():
            if name in other:
                out[name] = f"{self.name}'s initialization also writes {name} with {other[name]}, which no initializer states"
            elif name not in calls:
                out[name] = f"{self.name}'s initialization never sets {type(mod).__name__}.{key} through torch.nn.init"
            else:
                out[name] = init_of_call(*calls[name], seed)
        return out


def replay(init: Callable[[nn.Module], object], name: str = "replay") -> Replay:
    """A policy that runs a framework's own initialization code on the meta model, each torch.nn.init call
    (normal_, trunc_normal_, uniform_, zeros_, ones_, constant_, orthogonal_) recording its distribution for the
    tensor instead of filling it. A tensor the code never sets that way, or also writes otherwise (a rescale, a
    copy), is refused. The framework's own random generator is not used: the plan's seeds make the values.

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


RECIPES: dict[str, Callable[[], Recipe | Replay]] = {"megatron": megatron, "neox": neox, "olmo": olmo}  # policies registers these
