"""A zoo of public models (torchvision, timm, transformers in small configs) and the check that a plan gives each
tensor its model's own initialization: tests/test_own_init.py and bench/own_init.py run it.

Each model is built natively three times (torch.manual_seed 0, 1 and 2: PyTorch's own initialization) and once under
meta_parameters(), whose plan (the default policy) is materialized. Per tensor: elements equal in all native builds
(constants, a padding row, a sinusoidal table) must be equal in the plan's tensor; the rest must come from the same
distribution (a two-sample Kolmogorov-Smirnov test on up to 100,000 elements at p = 1e-6, and, over at least 10,000
elements, mean within 3% of the standard deviation and standard deviation within 3%).
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

Build = Callable[[], nn.Module]
SAMPLE = 100_000


def _tv(name: str, **kw: Any) -> Build:
    def build() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, **kw)

    return build


def _timm(name: str, **kw: Any) -> Build:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kw)

    return build


_SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "d_model": 64,
    "d_ff": 128,
    "d_kv": 16,
    "num_layers": 2,
    "num_heads": 4,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "head_dim": 16,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "embedding_size": 64,
    "ffn_dim": 128,
    "num_mel_bins": 16,
    "max_source_positions": 64,
    "max_target_positions": 64,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
}


def _hf(model_type: str, auto: str = "AutoModelForCausalLM", **kw: Any) -> Build:
    def build() -> nn.Module:
        import transformers

        config = transformers.AutoConfig.for_model(model_type)
        small = {k: v for k, v in _SMALL.items() if k in config.to_dict() and k not in ("partial_rotary_factor",)}
        config = transformers.AutoConfig.for_model(model_type, **{**small, **kw})
        return getattr(transformers, auto).from_config(config)

    return build


# (name, build): at least 50 models, transformers' in small configs
TORCHVISION = [
    ("tv.resnet18", _tv("resnet18", num_classes=10)),
    ("tv.resnext50_32x4d", _tv("resnext50_32x4d", num_classes=10)),
    ("tv.mobilenet_v2", _tv("mobilenet_v2", num_classes=10)),
    ("tv.mobilenet_v3_small", _tv("mobilenet_v3_small", num_classes=10)),
    ("tv.efficientnet_b0", _tv("efficientnet_b0", num_classes=10)),
    ("tv.regnet_y_400mf", _tv("regnet_y_400mf", num_classes=10)),
    ("tv.googlenet", _tv("googlenet", num_classes=10, aux_logits=False, init_weights=True)),
    ("tv.densenet121", _tv("densenet121", num_classes=10)),
    ("tv.squeezenet1_1", _tv("squeezenet1_1", num_classes=10)),
    ("tv.shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5", num_classes=10)),
    ("tv.mnasnet0_5", _tv("mnasnet0_5", num_classes=10)),
    ("tv.convnext_tiny", _tv("convnext_tiny", num_classes=10)),
    ("tv.swin_t", _tv("swin_t", num_classes=10)),
    ("tv.vit_b_32", _tv("vit_b_32", num_classes=10)),
    ("tv.maxvit_t", _tv("maxvit_t", num_classes=10)),
    ("tv.alexnet", _tv("alexnet", num_classes=10)),
]
TIMM = [
    ("timm.vit_tiny_patch16_224", _timm("vit_tiny_patch16_224", num_classes=10)),
    ("timm.deit_tiny_patch16_224", _timm("deit_tiny_patch16_224", num_classes=10)),
    ("timm.swin_tiny_patch4_window7_224", _timm("swin_tiny_patch4_window7_224", num_classes=10)),
    ("timm.convnext_atto", _timm("convnext_atto", num_classes=10)),
    ("timm.beit_base_patch16_224", _timm("beit_base_patch16_224", num_classes=10, depth=2)),
    ("timm.eva02_tiny_patch14_224", _timm("eva02_tiny_patch14_224", num_classes=10)),
    ("timm.cait_xxs24_224", _timm("cait_xxs24_224", num_classes=10, depth=2)),
    ("timm.coat_tiny", _timm("coat_tiny", num_classes=10)),
    ("timm.levit_128s", _timm("levit_128s", num_classes=10)),
    ("timm.poolformer_s12", _timm("poolformer_s12", num_classes=10)),
    ("timm.maxvit_nano_rw_256", _timm("maxvit_nano_rw_256", num_classes=10)),
    ("timm.efficientformer_l1", _timm("efficientformer_l1", num_classes=10)),
    ("timm.resnet18", _timm("resnet18", num_classes=10)),
    ("timm.efficientnet_b0", _timm("efficientnet_b0", num_classes=10)),
    ("timm.dla34", _timm("dla34", num_classes=10)),
    ("timm.mixer_s16_224", _timm("mixer_s16_224", num_classes=10)),
]
TRANSFORMERS = [
    ("hf.bert", _hf("bert", "AutoModelForMaskedLM")),
    ("hf.roberta", _hf("roberta", "AutoModelForMaskedLM")),
    ("hf.deberta-v2", _hf("deberta-v2", "AutoModelForMaskedLM")),
    ("hf.electra", _hf("electra", "AutoModelForMaskedLM")),
    ("hf.albert", _hf("albert", "AutoModelForMaskedLM")),
    ("hf.distilbert", _hf("distilbert", "AutoModelForMaskedLM", dim=64, hidden_dim=128, n_layers=2, n_heads=4)),
    ("hf.gpt2", _hf("gpt2")),
    ("hf.llama", _hf("llama")),
    ("hf.mistral", _hf("mistral")),
    ("hf.qwen2", _hf("qwen2")),
    ("hf.qwen3", _hf("qwen3")),
    ("hf.gemma", _hf("gemma")),
    ("hf.falcon", _hf("falcon")),
    ("hf.phi", _hf("phi")),
    ("hf.gpt_neox", _hf("gpt_neox")),
    ("hf.opt", _hf("opt", ffn_dim=128, word_embed_proj_dim=64)),
    ("hf.bloom", _hf("bloom")),
    ("hf.olmo", _hf("olmo")),
    ("hf.mixtral", _hf("mixtral")),
    ("hf.qwen3_moe", _hf("qwen3_moe")),
    ("hf.t5", _hf("t5", "AutoModelForSeq2SeqLM")),
    ("hf.bart", _hf("bart", "AutoModelForSeq2SeqLM")),
    ("hf.pegasus", _hf("pegasus", "AutoModelForSeq2SeqLM")),
    ("hf.whisper", _hf("whisper", "AutoModelForSpeechSeq2Seq", vocab_size=51865)),
    ("hf.vit", _hf("vit", "AutoModelForImageClassification")),
    ("hf.deit", _hf("deit", "AutoModel")),
    ("hf.swin", _hf("swin", "AutoModelForImageClassification", embed_dim=16, depths=[1, 1], num_heads=[2, 2])),
    ("hf.convnext", _hf("convnext", "AutoModelForImageClassification", num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])),
    ("hf.dinov2", _hf("dinov2", "AutoModel")),
    ("hf.beit", _hf("beit", "AutoModelForImageClassification")),
    ("hf.starcoder2", _hf("starcoder2")),
    ("hf.stablelm", _hf("stablelm")),
]
ZOO = TORCHVISION + TIMM + TRANSFORMERS
# checked the same way, never used while building the replay
HELD_OUT = [
    ("tv.wide_resnet50_2", _tv("wide_resnet50_2", num_classes=10)),
    ("tv.regnet_x_400mf", _tv("regnet_x_400mf", num_classes=10)),
    ("timm.ghostnet_100", _timm("ghostnet_100", num_classes=10)),
    ("timm.regnetx_002", _timm("regnetx_002", num_classes=10)),
    ("hf.gemma2", _hf("gemma2")),
    ("hf.olmo2", _hf("olmo2")),
    ("hf.mbart", _hf("mbart", "AutoModelForSeq2SeqLM")),
    ("hf.xlm-roberta", _hf("xlm-roberta", "AutoModelForMaskedLM")),
]


@dataclass
class Verdict:
    """One model's outcome: ok (every tensor its own init), refused (the plan names why), or differing tensors."""

    name: str
    tensors: int = 0
    refused: str | None = None
    differ: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.refused is None and not self.differ and self.error is None


def _native(build: Build, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        model = build()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _sample(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return x if x.size <= SAMPLE else rng.choice(x, SAMPLE, replace=False)


def same_distribution(ours: np.ndarray[Any, Any], theirs: np.ndarray[Any, Any]) -> str | None:
    """Why two samples do not come from one distribution (None: they may), by KS and, over 10,000, mean and std."""
    rng = np.random.default_rng(0)
    a, b = np.sort(_sample(ours, rng)), np.sort(_sample(theirs, rng))
    both = np.concatenate([a, b])
    d = float(np.max(np.abs(np.searchsorted(a, both, side="right") / a.size - np.searchsorted(b, both, side="right") / b.size)))
    critical = math.sqrt(-math.log(1e-6 / 2) / 2) * math.sqrt((a.size + b.size) / (a.size * b.size))
    if d > critical:
        stats = f"ours mean {ours.mean():.4g} std {ours.std():.4g}, theirs {theirs.mean():.4g} {theirs.std():.4g}"
        return f"KS D={d:.3f} > {critical:.3f} ({stats})"
    if ours.size >= 10_000:  # 3%, beyond what two samples of these sizes differ by (three standard errors)
        s = float(theirs.std())
        noise = 3 * math.sqrt(1 / ours.size + 1 / theirs.size)
        if abs(float(ours.mean()) - float(theirs.mean())) > (0.03 + noise) * s or abs(float(ours.std()) / s - 1) > 0.03 + noise / math.sqrt(
            2
        ):
            return f"mean/std {ours.mean():.4g}/{ours.std():.4g} vs {theirs.mean():.4g}/{s:.4g}"
    return None


def compare(
    ours: dict[str, torch.Tensor], first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], third: dict[str, torch.Tensor]
) -> list[str]:
    """Tensors whose values are not their model's own initialization (see the module doc)."""
    problems = []
    for name, t in first.items():
        mine = ours.get(name)
        if mine is None:
            problems.append(f"{name}: not materialized")
            continue
        x, y = t.double().numpy().reshape(-1), second[name].double().numpy().reshape(-1)
        z = mine.detach().double().numpy().reshape(-1)
        fixed = (x == y) & (x == third[name].double().numpy().reshape(-1))  # three draws agreeing by chance: never
        if fixed.any() and not np.array_equal(z[fixed], x[fixed]):
            bad = int(np.count_nonzero(z[fixed] != x[fixed]))
            problems.append(f"{name}: {bad} of {int(fixed.sum())} fixed elements differ (e.g. {z[fixed][:3]} vs {x[fixed][:3]})")
            continue
        free = ~fixed
        if free.sum() >= 2:
            why = same_distribution(z[free], np.concatenate([x[free], y[free]]))
            if why is not None:
                problems.append(f"{name}: {why}")
    return problems


def check(name: str, build: Build, seed: int = 0) -> Verdict:
    """Build natively twice and under meta_parameters once; materialize the default plan in process and compare."""
    from paraminit_client import Client
    from paraminit_client.torch import UnsupportedModuleError, materialize_module, meta_parameters, plan_from_module

    verdict = Verdict(name)
    try:
        first, second, third = _native(build, 0), _native(build, 1), _native(build, 2)
        verdict.tensors = len(first)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            with meta_parameters():
                model = build()
        try:
            plan = plan_from_module(model, seed=seed)
        except UnsupportedModuleError as exc:
            verdict.refused = str(exc)
            return verdict
        with Client() as client:
            materialize_module(model, client, plan=plan)
        verdict.differ = compare(dict(model.state_dict()), first, second, third)
    except Exception as exc:  # a harness: the model's outcome records what went wrong
        verdict.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return verdict
