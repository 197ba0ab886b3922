"""Framework recipes as policies (paraminit_client.recipes): Megatron's against megatron-core's own initialization of
its GPT model, GPT-NeoX's against GPT-NeoX's init functions on transformers' GPT-NeoX, and what a recipe reads from
a model or refuses."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from paraminit_client import Client  # noqa: E402
from paraminit_client.recipes import megatron, neox  # noqa: E402
from paraminit_client.torch import UnsupportedModuleError, param_seed, plan_from_module  # noqa: E402


def same_law(ours: np.ndarray[Any, Any], theirs: np.ndarray[Any, Any], what: str) -> None:
    """Two samples of one law: mean and std within 2 % of the std over 1M elements or more, within 5 standard
    errors below that."""
    a, b = ours.astype(np.float64).reshape(-1), theirs.astype(np.float64).reshape(-1)
    sd, n = float(b.std()), a.size
    assert sd > 0, what
    tol = 0.02 if n >= 1 << 20 else 5 / math.sqrt(n)
    assert abs(float(a.std()) / sd - 1) < tol, (what, n, float(a.std()), sd)
    assert abs(float(a.mean()) - float(b.mean())) < (0.02 if n >= 1 << 20 else 5 * math.sqrt(2 / n)) * sd, what


def compare(plan: Any, reference: dict[str, Any], pooled: dict[str, list[str]]) -> dict[str, str]:
    """Materialize the plan in process and check it against the framework's tensors, one by one (constants exactly)
    and pooled by role across layers (at least 1M elements each); returns each tensor's initializer kind."""
    with Client() as c:
        ours = c.materialize(plan)
    kinds = {p.name: p.init.WhichOneof("kind") for p in plan.params}
    assert set(ours) == set(reference)
    for name, b in reference.items():
        a = ours[name]
        assert a.shape == tuple(b.shape), name
        if kinds[name] in ("zeros", "ones"):
            assert np.array_equal(a, b.numpy()), name
        else:
            same_law(a, b.numpy(), name)
    for role, names in pooled.items():
        a = np.concatenate([ours[n].reshape(-1) for n in names])
        assert a.size >= 1 << 20, role
        same_law(a, np.concatenate([reference[n].numpy().reshape(-1) for n in names]), role)
    return kinds


# -- Megatron -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_gpt() -> Iterator[Any]:
    """megatron-core's GPTModel (local layer spec, 4 layers, width 256), built and initialized by megatron-core itself
    on the CPU in a one-rank gloo group."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        pytest.importorskip("megatron.core")
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            use_cpu_initialization=True,
            init_method_std=0.01,
            params_dtype=torch.float32,
        )
        yield GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=4096, max_sequence_length=256)
    finally:
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def test_megatron_recipe_is_megatrons_own_initialization(megatron_gpt: Any) -> None:
    model = megatron_gpt
    plan = plan_from_module(model, seed=0, policy="megatron")
    reference = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    layers = range(4)
    kinds = compare(
        plan,
        reference,
        {
            "linear_qkv and linear_fc1": [
                f"decoder.layers.{i}.{w}.weight" for i in layers for w in ("self_attention.linear_qkv", "mlp.linear_fc1")
            ],
            "linear_proj and linear_fc2 (output)": [
                f"decoder.layers.{i}.{w}.weight" for i in layers for w in ("self_attention.linear_proj", "mlp.linear_fc2")
            ],
        },
    )
    std = {p.name: p.init.normal.std for p in plan.params if kinds[p.name] == "normal"}
    # read from the model's TransformerConfig: init_method_std 0.01, 4 layers
    assert std["decoder.layers.0.mlp.linear_fc1.weight"] == 0.01 == std["embedding.word_embeddings.weight"]
    assert std["decoder.layers.3.self_attention.linear_proj.weight"] == 0.01 / math.sqrt(8)
    assert kinds["decoder.layers.0.mlp.linear_fc2.bias"] == "zeros" and kinds["decoder.final_layernorm.weight"] == "ones"


def test_megatrons_own_constructor_replayed_is_its_recipe(megatron_gpt: Any) -> None:
    """The default policy records megatron-core's own initialization as its constructor runs (a CPU master weight
    drawn by init_method, split and copied into the parameter): the same plan as the hand-written recipe."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from paraminit_client.torch import meta_parameters

    with warnings.catch_warnings(), meta_parameters():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config=megatron_gpt.config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=4096, max_sequence_length=256
        )
    own, recipe = plan_from_module(model, seed=0), plan_from_module(model, seed=0, policy="megatron")
    assert [p.name for p in own.params] == [p.name for p in recipe.params] and len(own.params) == 53
    assert own == recipe


# -- GPT-NeoX -------------------------------------------------------------------------------------------------------


def test_neox_recipe_is_gpt_neoxs_small_init_and_wang_init() -> None:
    """GPT-NeoX initializes linear and embedding weights with small_init and the attention's and MLP's output
    projections with wang_init (its init_functions.py; transformers carries them for xLSTM, used here as the
    reference), biases zero, norms one."""
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    from transformers.models.xlstm.modeling_xlstm import small_init_method, wang_init_method

    layers, width = 4, 256
    config = GPTNeoXConfig(
        vocab_size=4096,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=1024,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    ref_model = GPTNeoXForCausalLM(config)
    small, wang = small_init_method(width), wang_init_method(layers, width)
    with torch.no_grad():
        for name, mod in ref_model.named_modules():
            if isinstance(mod, nn.Linear | nn.Embedding):
                (wang if name.endswith(("attention.dense", "mlp.dense_4h_to_h")) else small)(mod.weight)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.fill_(1.0)
                mod.bias.zero_()
    with torch.device("meta"):
        ours = GPTNeoXForCausalLM(config)
    plan = plan_from_module(ours, seed=1, policy="neox")
    reference = {k: v.detach() for k, v in ref_model.state_dict().items() if v.is_floating_point()}
    kinds = compare(
        plan,
        reference,
        {
            "dense_h_to_4h": [f"gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight" for i in range(layers)],
            "dense_4h_to_h (output)": [f"gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight" for i in range(layers)],
        },
    )
    std = {p.name: p.init.normal.std for p in plan.params if kinds[p.name] == "normal"}
    assert std["gpt_neox.layers.2.attention.dense.weight"] == 2 / layers / math.sqrt(width)
    assert std["gpt_neox.embed_in.weight"] == math.sqrt(2 / (5 * width))


# -- what a recipe reads and refuses --------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Tiny(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))


def test_a_recipe_reads_depth_and_width_from_structure_and_takes_output_names() -> None:
    with torch.device("meta"):
        model = Tiny()
    plan = plan_from_module(model, seed=0, policy=megatron(sigma=0.05, output_layers=("proj",)))
    std = {p.name: p.init.normal.std for p in plan.params if p.init.WhichOneof("kind") == "normal"}
    assert std["blocks.1.up.weight"] == 0.05 == std["embed.weight"]
    assert std["blocks.1.proj.weight"] == 0.05 / math.sqrt(2 * 3)  # 3 blocks: the longest list of one class
    neo = {
        p.name: p.init.normal.std
        for p in plan_from_module(model, seed=0, policy=neox(output_layers=("proj",))).params
        if p.init.WhichOneof("kind") == "normal"
    }
    assert neo["blocks.0.up.weight"] == math.sqrt(2 / (5 * 32))  # width: the embedding's
    assert neo["blocks.0.proj.weight"] == 2 / 3 / math.sqrt(32)


def test_a_recipe_refuses_what_it_cannot_read() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.empty(4))  # neither a bias nor a norm's

    with torch.device("meta"):
        no_depth = nn.Sequential(nn.Linear(4, 4))  # no config, no list of blocks, no embedding
        odd = Odd()
    with pytest.raises(UnsupportedModuleError, match="needs the model's depth: pass num_layers="):
        plan_from_module(no_depth, seed=0, policy="megatron")
    with pytest.raises(UnsupportedModuleError, match="needs the model's depth and width"):
        plan_from_module(no_depth, seed=0, policy=neox(num_layers=2))
    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(odd, seed=0, policy=megatron(num_layers=2))
    assert [p[0] for p in err.value.problems] == ["scale"] and "neither a bias nor a norm" in str(err.value)


# -- OLMo-core, replayed --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["normal", "llama", "llama_depth", "fan_in"])
def test_olmo_recipe_is_olmo_cores_own_initialization(method: str) -> None:
    """policy="olmo" replays OLMo-core's Transformer.init_weights on the meta model: every tensor gets the law OLMo-core's
    own initialization gives it (per InitMethod), truncated normals cut exactly where OLMo-core cuts (3 sigma)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("olmo_core")
        from olmo_core.nn.transformer import TransformerConfig
        from olmo_core.nn.transformer.init import InitMethod

    cfg = TransformerConfig.llama_like(d_model=256, vocab_size=4096, n_layers=4, n_heads=4)
    cfg.init_method = InitMethod(method)
    theirs = cfg.build(init_device="cpu")
    theirs.init_weights(device=torch.device("cpu"))
    ours = cfg.build(init_device="meta")
    plan = plan_from_module(ours, seed=3, policy="olmo")
    assert ours.embeddings.weight.is_meta  # replaying fills nothing
    assert plan_from_module(ours, seed=3) == plan  # the default replays the init_weights OLMo-core's trainer calls
    reference = {k: v.detach() for k, v in theirs.state_dict().items() if v.is_floating_point()}
    kinds = compare(plan, reference, {"w1, w3": [f"blocks.{i}.feed_forward.{w}.weight" for i in range(4) for w in ("w1", "w3")]})
    with Client() as c:
        values = c.materialize(plan)
    for p in plan.params:
        if kinds[p.name] == "truncated_normal":
            t = p.init.truncated_normal
            assert (t.lo, t.hi) == (-3 * t.std, 3 * t.std), p.name
            bound = float(reference[p.name].abs().max())
            assert float(np.abs(values[p.name]).max()) <= 3 * t.std and bound <= 3 * t.std * (1 + 1e-6), p.name
    assert set(kinds.values()) >= {"truncated_normal", "ones"}


def test_a_replay_composes_rescales_and_refuses_what_no_initializer_states() -> None:
    from paraminit_client.recipes import replay

    def init(m: nn.Module) -> None:
        nn.init.normal_(m.a.weight, std=0.5)
        nn.init.zeros_(m.a.bias)
        nn.init.normal_(m.b.weight, std=0.5)
        nn.init.normal_(m.c.weight, std=0.5)
        with torch.no_grad():
            m.b.weight.mul_(2.0)  # a rescale after the call composes: normal(0, 1)
            m.c.weight.clamp_(-0.1, 0.1)  # piles values on the bounds: no initializer states that

    with torch.device("meta"):
        model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 4)})
    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(model, seed=0, policy=replay(init, "mine"))
    problems = {name: why for name, _, why in err.value.problems}
    assert set(problems) == {"b.bias", "c.weight", "c.bias"}
    assert "clamps a normal" in problems["c.weight"] and "test_recipes.py:" in problems["c.weight"]
    assert "never sets" in problems["b.bias"]
    plan = plan_from_module(model, seed=0, policy=replay(init, "mine"), overrides=lambda n, t: {"zeros": {}} if n in problems else None)
    b = next(p for p in plan.params if p.name == "b.weight")
    assert b.init.WhichOneof("kind") == "normal" and b.init.normal.std == 1.0 and b.init.normal.seed == param_seed(0, "b.weight")
    with pytest.raises(UnsupportedModuleError, match="olmo's initialization cannot run on this model: AttributeError"):
        plan_from_module(model, seed=0, policy="olmo")  # not an OLMo-core model: no init_weights


# -- μP (the mup package) -------------------------------------------------------------------------------------------


def _mup_models() -> tuple[Any, Any]:
    """An MLP and a small transformer whose width is an argument, each ending in mup's MuReadout."""
    mup = pytest.importorskip("mup")

    class MLP(nn.Module):
        def __init__(self, width: int, zero_readout: bool = False) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(256, width), nn.Linear(width, width), nn.Linear(width, width)
            self.out = mup.MuReadout(width, 10, readout_zero_init=zero_readout)

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    class Transformer(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(512, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(4))
            self.ln = nn.LayerNorm(d)
            self.head = mup.MuReadout(d, 512)

    return MLP, Transformer


@pytest.mark.parametrize("which", ["mlp", "mlp-zero-readout", "transformer"])
def test_mup_recipe_is_the_mup_packages_own_initialization(which: str) -> None:
    """policy=recipes.mup(base, delta) against `mup.set_base_shapes(model, base, delta=delta)` after PyTorch's own
    initialization: every tensor by its law (hidden weights pooled over 1M elements), biases and readouts rescaled by
    the square root of their width multiplier."""
    import mup

    from paraminit_client import recipes
    from paraminit_client.torch import meta_parameters

    mlp, transformer = _mup_models()

    def build(width: int) -> Any:
        return mlp(width, which == "mlp-zero-readout") if which.startswith("mlp") else transformer(width)

    width, base_width, delta_width = (1024, 64, 128) if which.startswith("mlp") else (256, 32, 64)
    torch.manual_seed(0)
    model = build(width)
    with meta_parameters():
        base, delta, ours = build(base_width), build(delta_width), build(width)
    mup.set_base_shapes(model, base, delta=delta)
    reference = {k: v.detach() for k, v in model.state_dict().items()}
    plan = plan_from_module(ours, seed=0, policy=recipes.mup(base, delta))
    if which.startswith("mlp"):
        pooled = {"hidden weights": ["fc2.weight", "fc3.weight"]}
    else:
        pooled = {
            f"block {' and '.join(ws)}": [f"blocks.{i}.{w}.weight" for i in range(4) for w in ws]
            for ws in (("qkv", "proj"), ("fc1",), ("fc2",))
        }
    kinds = compare(plan, reference, pooled)
    bound = {p.name: p.init.uniform.hi for p in plan.params if kinds[p.name] == "uniform"}
    readout = "out" if which.startswith("mlp") else "head"
    if which == "mlp-zero-readout":
        assert kinds["out.weight"] == kinds["out.bias"] == "zeros"
    else:  # nn.Linear's 1/sqrt(fan_in), times sqrt(width / base width)
        assert bound[f"{readout}.weight"] == pytest.approx(math.sqrt(width / base_width) / math.sqrt(width), rel=1e-12)
    if which.startswith("mlp"):
        assert bound["fc1.bias"] == pytest.approx(1 / math.sqrt(256), rel=1e-12)  # a fixed fan-in: not rescaled
        assert bound["fc2.bias"] == pytest.approx(math.sqrt(width / base_width) / math.sqrt(width), rel=1e-12)
        assert bound["fc2.weight"] == pytest.approx(1 / math.sqrt(width), rel=1e-12)  # weights keep PyTorch's


def test_mup_recipe_refuses_what_it_cannot_read() -> None:
    mup = pytest.importorskip("mup")
    from paraminit_client import recipes

    model = nn.Sequential(nn.Linear(8, 16), mup.MuReadout(16, 4))
    with pytest.raises(ValueError, match=re.escape("no base shape of rank 2 for parameter '1.weight'")):
        plan_from_module(model, seed=0, policy=recipes.mup({"0.weight": (8, 4), "0.bias": (4,)}))
    narrow = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # mup asserts an output layer is a MuReadout
    base = {"0.weight": (4, 8), "0.bias": (4,), "1.weight": (4, 4), "1.bias": (4,)}
    with pytest.raises(UnsupportedModuleError, match=re.escape("1: a width fan-in and a fixed fan-out needs mup.MuReadout")):
        plan_from_module(narrow, seed=0, policy=recipes.mup(base))
    shared = nn.Sequential(nn.Linear(8, 16), mup.MuSharedReadout(nn.Parameter(torch.empty(4, 16))))
    base = {n: tuple(p.shape) for n, p in shared.named_parameters()}
    with pytest.raises(UnsupportedModuleError, match="MuSharedReadout: mup policy reads plain MuReadout layers only"):
        plan_from_module(shared, seed=0, policy=recipes.mup(base))
