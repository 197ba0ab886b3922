"""policy="hf" against transformers itself (tiny configs built in code), padding_idx, override context,
non-persistent buffers of meta models."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paraminit_client import cli
from support import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from paraminit_client import Client  # noqa: E402
from paraminit_client.torch import (  # noqa: E402
    UnsupportedModuleError,
    materialize_module,
    meta_parameters,
    plan_from_module,
)

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with Client() as c:
        yield c


def gpt2_config(**kw: Any) -> Any:
    base = dict(vocab_size=1000, n_positions=64, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**base, **kw})


def llama_config(**kw: Any) -> Any:
    base = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaConfig(**{**base, **kw})


def on_meta(build: Any) -> Any:
    with torch.device("meta"):
        return build()


def causal(config: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_config(config)


def groups(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Tensors grouped by their name with layer numbers removed (h.0.attn.c_proj.weight -> h.attn.c_proj.weight)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            key = ".".join(part for part in name.split(".") if not part.isdigit())
            out.setdefault(key, []).append(t.detach().float().flatten())
    return out


def test_gpt2_plan_is_transformers_rules() -> None:
    cfg = gpt2_config(initializer_range=0.03)
    plan = {p.name: p for p in plan_from_module(on_meta(lambda: causal(cfg)), seed=0, policy="hf").params}
    assert "lm_head.weight" not in plan  # tied to the token embedding: once, with the embedding's init
    assert plan["transformer.wte.weight"].init.normal.std == 0.03
    assert plan["transformer.h.1.attn.c_attn.weight"].init.normal.std == 0.03
    for proj in ("attn.c_proj.weight", "mlp.c_proj.weight"):
        assert plan[f"transformer.h.2.{proj}"].init.normal.std == 0.03 / math.sqrt(2 * 4)
    assert plan["transformer.h.0.mlp.c_fc.bias"].init.WhichOneof("kind") == "zeros"
    assert plan["transformer.ln_f.weight"].init.WhichOneof("kind") == "ones"
    seeds = {p.init.normal.seed for p in plan.values() if p.init.WhichOneof("kind") == "normal"}
    assert len(seeds) == sum(p.init.WhichOneof("kind") == "normal" for p in plan.values())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_llama_like_families(family: str) -> None:
    cfg = llama_config()
    if family != "llama":
        cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[family]
        cfg = cls(**{k: v for k, v in cfg.to_dict().items() if k in cls().to_dict() or k.endswith("_id")})
    plan = {p.name: p for p in plan_from_module(on_meta(lambda: causal(cfg)), seed=0, policy="hf").params}
    emb = plan["model.embed_tokens.weight"]
    assert emb.init.normal.std == cfg.initializer_range
    assert [(r.start, r.stop) for r in emb.patches[0].box] == [(0, 1), (0, 64)]  # pad_token_id row
    assert emb.patches[0].init.WhichOneof("kind") == "zeros"
    assert plan["model.norm.weight"].init.WhichOneof("kind") == "ones"  # *RMSNorm by name
    assert plan["lm_head.weight"].init.normal.std == cfg.initializer_range


def test_bert_plan() -> None:
    cfg = transformers.BertConfig(
        vocab_size=500,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    plan = {p.name: p for p in plan_from_module(on_meta(lambda: transformers.BertForMaskedLM(cfg)), 0, "hf").params}
    assert plan["cls.predictions.bias"].init.WhichOneof("kind") == "zeros"
    assert "cls.predictions.decoder.weight" not in plan and "cls.predictions.decoder.bias" not in plan
    assert plan["bert.embeddings.word_embeddings.weight"].patches  # padding row


def test_std_per_group_and_initial_loss_match_transformers(client: Client) -> None:
    """The distributions are transformers' (within sampling error), and so is the initial loss."""
    cfg = gpt2_config()
    torch.manual_seed(0)
    theirs = causal(cfg)
    ours = on_meta(lambda: causal(cfg))
    materialize_module(ours, client, policy="hf", seed=1)
    a, b = groups(theirs), groups(ours)
    assert a.keys() == b.keys()
    for key in a:
        x, y = torch.cat(a[key]), torch.cat(b[key])
        if x.std() == 0:
            assert torch.equal(x, y), key  # constants: exactly transformers' ones and zeros
        else:
            assert abs(y.std() / x.std() - 1) < 0.05, (key, float(x.std()), float(y.std()))
            assert abs(float(y.mean())) < 3 * float(y.std()) / math.sqrt(y.numel()) + 1e-4, key
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss_theirs = float(theirs(ids, labels=ids).loss)
        loss_ours = float(ours(ids, labels=ids).loss)
    assert abs(loss_ours - math.log(cfg.vocab_size)) < 0.1 and abs(loss_theirs - math.log(cfg.vocab_size)) < 0.1
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_llama_on_meta_runs_forward(client: Client) -> None:
    """Rotary inv_freq (non-persistent) is computed by the model's own code, bit for bit as when built for real."""
    cfg = llama_config()
    model = on_meta(lambda: causal(cfg))
    assert model.model.rotary_emb.inv_freq.is_meta
    materialize_module(model, client, policy="hf")
    real = causal(cfg)
    for key in ("inv_freq", "original_inv_freq"):
        assert torch.equal(getattr(model.model.rotary_emb, key), getattr(real.model.rotary_emb, key))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert not model.model.embed_tokens.weight[0].any() and model.model.embed_tokens.weight[1:].all()
    with torch.no_grad():
        out = model(torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None])
    assert torch.isfinite(out.logits).all() and abs(float(out.loss) - math.log(cfg.vocab_size)) < 0.5


def test_bert_buffers_on_meta(client: Client) -> None:
    cfg = transformers.BertConfig(
        vocab_size=500, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32
    )
    model = on_meta(lambda: transformers.BertForMaskedLM(cfg))
    materialize_module(model, client, policy="hf")
    emb = model.bert.embeddings
    assert torch.equal(emb.position_ids, torch.arange(32)[None]) and not emb.token_type_ids.any()
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 9)[None]).logits).all()


def test_unknown_init_weights_is_reported_never_guessed() -> None:
    class Custom(transformers.GPT2Model):
        def _init_weights(self, module: nn.Module) -> None:
            super()._init_weights(module)

    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(on_meta(lambda: Custom(gpt2_config())), 0, "hf")
    assert len(err.value.problems) == len(list(on_meta(lambda: transformers.GPT2Model(gpt2_config())).parameters()))
    assert all("Custom._init_weights is not one the hf policy knows" in why for _, _, why in err.value.problems)


def test_tensor_no_rule_writes_is_reported() -> None:
    model = on_meta(lambda: causal(gpt2_config()))
    model.transformer.h[1].attn.register_parameter("gate", nn.Parameter(torch.empty(4, device="meta")))
    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(model, 0, "hf")
    assert [name for name, _, _ in err.value.problems] == ["transformer.h.1.attn.gate"]
    plan = plan_from_module(model, 0, "hf", overrides=lambda name, t: {"zeros": {}} if name.endswith("gate") else None)
    assert plan.params


def test_override_context_and_old_form() -> None:
    seen: list[tuple[str, str, str]] = []

    def scheme(name: str, t: torch.Tensor, module: nn.Module, module_name: str) -> Any:
        seen.append((name, type(module).__name__, module_name))
        if module_name.endswith("c_proj") and name.endswith(".weight"):
            bound = 0.02 / math.sqrt(2 * 4) * math.sqrt(3)
            return {"uniform": {"lo": -bound, "hi": bound}}
        return None

    plan = {p.name: p for p in plan_from_module(on_meta(lambda: causal(gpt2_config())), 7, "hf", scheme).params}
    assert ("transformer.h.0.attn.c_proj.weight", "Conv1D", "transformer.h.0.attn.c_proj") in seen
    assert ("transformer.wte.weight", "Embedding", "transformer.wte") in seen
    u = plan["transformer.h.3.mlp.c_proj.weight"].init.uniform
    assert u.hi == -u.lo == pytest.approx(0.02 / math.sqrt(8) * math.sqrt(3)) and u.seed != 0
    old = plan_from_module(nn.Linear(3, 2), 0, overrides=lambda name, t: {"ones": {}} if name == "bias" else None)
    assert old.params[1].init.WhichOneof("kind") == "ones"


def test_padding_idx_torch_policy_and_override(client: Client) -> None:
    model = on_meta(lambda: nn.Sequential(nn.Embedding(50, 8, padding_idx=7), nn.EmbeddingBag(40, 8, padding_idx=0)))
    materialize_module(model, client)
    w = model[0].weight.detach()
    assert not w[7].any() and w[:7].all() and w[8:].all() and abs(float(w.std()) - 1) < 0.2
    assert not model[1].weight[0].any() and model[1].weight[1:].all()
    again = on_meta(lambda: nn.Embedding(50, 8, padding_idx=7))
    materialize_module(again, client, overrides=lambda name, t: {"uniform": {"lo": 1, "hi": 2}})
    assert not again.weight[7].any() and (again.weight[:7] >= 1).all()


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


def test_meta_parameters_is_the_way_out(client: Client) -> None:
    with pytest.raises(ValueError, match=r"inv_freq .*meta_parameters\(\)"):
        materialize_module(on_meta(Rotary), client)
    with meta_parameters():
        model = Rotary()
    assert model.proj.weight.is_meta and not model.inv_freq.is_meta
    materialize_module(model, client)
    assert torch.equal(model.inv_freq, Rotary().inv_freq) and model.proj.weight.any()
    assert isinstance(model.proj.weight, nn.Parameter) and model.proj.weight.requires_grad


# -- plan from-module: the hf policy and overrides ------------------------------------------------------------------


HF_SRC = """
import torch


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=8))


def proj_uniform(name, tensor):
    if name.endswith("c_proj.weight"):
        return {"uniform": {"lo": -0.125, "hi": 0.125}}
    return None
"""


def test_plan_from_module_takes_the_hf_policy_and_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "hfmodels.py").write_text(HF_SRC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out, err = run_cli(
        capsys, "plan", "from-module", "hfmodels:tiny_gpt2", "--policy", "hf", "--seed", "3", "--overrides", "hfmodels:proj_uniform"
    )
    assert code == 0, err
    from paraminit_client import plan_from_dict
    from paraminit_client.torch import plan_from_module

    plan = plan_from_dict(json.loads(out))
    import hfmodels  # type: ignore[import-not-found]

    with torch.device("meta"):
        model = hfmodels.tiny_gpt2()
    assert plan == plan_from_module(model, seed=3, policy="hf", overrides=hfmodels.proj_uniform)
    by_name = {p.name: p for p in plan.params}
    assert by_name["transformer.h.0.attn.c_proj.weight"].init.WhichOneof("kind") == "uniform"
    assert by_name["transformer.h.0.attn.c_attn.weight"].init.normal.std == pytest.approx(0.02)
    code, _, err = run_cli(capsys, "plan", "from-module", "hfmodels:tiny_gpt2", "--overrides", "hfmodels:nothing")
    assert code == cli.EXIT_ERROR and "nothing" in err
