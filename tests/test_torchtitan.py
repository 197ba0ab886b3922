"""policy="torchtitan" on torchtitan's Llama 3 debug model: torchtitan's own distributions (std within 2 %,
truncation where it truncates, RoPE caches equal), unknown initializers refused, and FSDP2 over 4 gloo ranks
filling only their shards with the single-process bytes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
llama3 = pytest.importorskip("torchtitan.models.llama3")

from paraminit_client import Client  # noqa: E402
from paraminit_client.torch import UnsupportedModuleError, materialize_module, plan_from_module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def debug_config() -> Any:
    return llama3.llama3_configs["debugmodel"](attn_backend="flex")


def moe_config(fuse_qkv: bool = True, num_experts: int = 16) -> Any:
    """torchtitan's Qwen3 MoE debug model cut to 2 layers of 16 experts (GroupedExperts w1/w2/w3 of 1M elements
    each, a router gate, the expert_bias buffer, attention's wq/wk/wv fused as torchtitan does by default), built
    by torchtitan's own layer builder."""
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    cfg = qwen3.qwen3_configs["debugmodel_moe"](attn_backend="flex")
    cfg.layers = qwen3._build_qwen3_moe_layers(
        n_layers=2,
        dim=256,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        moe_hidden_dim=256,
        num_experts=num_experts,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=cfg.layers[0].attention.rope,
        fuse_qkv=fuse_qkv,
    )
    return cfg


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any, Any]:
    """(ours, torchtitan's, our plan): the debug model materialized by policy torchtitan and by its own
    to_empty + init_weights."""
    cfg = debug_config()
    with torch.device("meta"):
        ours, theirs = cfg.build(), cfg.build()
    plan = plan_from_module(ours, seed=0, policy="torchtitan")
    with Client() as c:
        materialize_module(ours, c, plan=plan)
    torch.manual_seed(0)
    theirs.to_empty(device="cpu")
    theirs.init_weights(buffer_device=torch.device("cpu"))
    return ours, theirs, plan


def test_debug_model_has_torchtitans_distributions(pair: tuple[Any, Any, Any]) -> None:
    ours, theirs, plan = pair
    mine, ref = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == ref.keys() and sum(p.numel() for p in mine.values()) == 6_163_712
    kinds = {p.name: p.init.WhichOneof("kind") for p in plan.params}
    for name, p in mine.items():
        a, b = p.detach(), ref[name].detach()
        assert not a.is_meta and a.dtype == b.dtype and a.shape == b.shape
        if b.std() == 0:  # norms: ones
            assert torch.equal(a, b) and kinds[name] == "ones", name
            continue
        assert abs(a.std().item() / b.std().item() - 1) < 0.02, name
        assert abs(a.mean().item() - b.mean().item()) < 0.02 * b.std().item() + 1e-3, name
    s = 256**-0.5  # dim ** -0.5, as the model's config computes it
    head = next(p for p in plan.params if p.name == "lm_head.weight").init.truncated_normal
    assert (head.std, head.lo, head.hi) == (s, -3 * s, 3 * s)
    assert mine["lm_head.weight"].abs().max().item() <= 3 * s and ref["lm_head.weight"].abs().max().item() <= 3 * s
    assert mine["lm_head.weight"].abs().max().item() > 2.9 * s  # the tails reach the cut, as torchtitan's do
    wo = next(p for p in plan.params if p.name == "layers.3.attention.wo.weight").init.truncated_normal
    assert (wo.std, wo.lo, wo.hi) == (0.02 / (2 * 4) ** 0.5, -2.0, 2.0)  # depth-scaled; trunc_normal_'s a, b
    assert kinds["tok_embeddings.weight"] == "normal"
    wqkv = next(p for p in plan.params if p.name == "layers.0.attention.qkv_linear.wqkv.weight")
    assert len(wqkv.patches) == 3 * 16 and {q.init.WhichOneof("kind") for q in wqkv.patches} == {"truncated_normal"}
    for (n, x), (_, y) in zip(ours.named_buffers(), theirs.named_buffers(), strict=True):
        assert torch.equal(x, y), n  # RoPE caches: the modules' own code


def test_moe_layers_have_torchtitans_distributions() -> None:
    """The mixture-of-experts layers (3-D grouped expert weights, depth-scaled w2, router gate, the persistent
    expert_bias buffer that torchtitan's _init_self_buffers sets) get torchtitan's own initialization: per tensor
    mean and std within 2 % over at least 1M elements, the buffer exactly."""
    cfg = moe_config()
    with torch.device("meta"):
        ours, theirs = cfg.build(), cfg.build()
    plan = plan_from_module(ours, seed=0, policy="torchtitan")
    kinds = {p.name: p.init.WhichOneof("kind") for p in plan.params}
    assert kinds["layers.0.moe.expert_bias_E"] == "zeros" and ours.layers["0"].moe.expert_bias_E.is_meta  # untouched
    with Client() as c:
        materialize_module(ours, c, plan=plan)
    torch.manual_seed(0)
    theirs.to_empty(device="cpu")
    theirs.init_weights(buffer_device=torch.device("cpu"))
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == ref.keys()
    experts = [n for n in mine if ".inner_experts.w" in n]
    assert len(experts) == 6 and all(mine[n].dim() == 3 and mine[n].numel() >= 1 << 20 for n in experts)
    for name, a in mine.items():
        b = ref[name]
        assert a.dtype == b.dtype and a.shape == b.shape and not a.is_meta, name
        if name.endswith("expert_bias_E") or b.std() == 0:  # the buffer (zeros) and the norms (ones)
            assert torch.equal(a, b), name
            continue
        # two samples of one law: within 2 % over 1M elements or more, within 5 standard errors below that
        n, sd = a.numel(), b.double().std().item()
        tol = 0.02 if n >= 1 << 20 else 5 / n**0.5
        assert abs(a.double().std().item() / sd - 1) < tol, (name, n)
        assert abs(a.double().mean().item() - b.double().mean().item()) < (0.02 if n >= 1 << 20 else 5 * (2 / n) ** 0.5) * sd, name
    w2 = next(p for p in plan.params if p.name == "layers.1.moe.routed_experts.inner_experts.w2_EDF").init.normal
    assert w2.std == 0.02 / (2 * 2) ** 0.5  # depth-scaled from the model's own layer count


def test_fused_or_not_the_logical_tensors_have_the_same_values() -> None:
    """torchtitan draws a fused wqkv as the separate wq, wk and wv it replaces, so that a fused model has the
    unfused one's weights. So does the plan: the MoE model with attention fused (wqkv rows group by group: two
    query heads, a key head, a value head) and unfused, saved through torchtitan's own state_dict hooks (which
    split wqkv into wq/wk/wv), give every logical tensor the same bytes, experts, router and buffers included."""
    models = {}
    for fused in (True, False):
        with torch.device("meta"):
            model = moe_config(fuse_qkv=fused, num_experts=4).build()
        plan = plan_from_module(model, seed=5, policy="torchtitan")
        names = {p.name for p in plan.params}
        assert any(".wqkv." in n for n in names) == fused and any(".wq." in n for n in names) != fused
        with Client() as c:
            materialize_module(model, c, plan=plan)
        models[fused] = model.state_dict()
    fused_sd, plain = models[True], models[False]
    assert fused_sd.keys() == plain.keys() and "layers.0.attention.qkv_linear.wk.weight" in plain
    for name, a in plain.items():
        assert a.std() > 0 or a.abs().max() in (0, 1), name  # no tensor left unwritten
        assert fused_sd[name].dtype == a.dtype and torch.equal(fused_sd[name].view(torch.uint8), a.view(torch.uint8)), name


def test_unknown_initializers_are_refused() -> None:
    cfg = debug_config()
    with torch.device("meta"):
        model = cfg.build()
    model.lm_head._param_init = {"weight": lambda t: t.fill_(0.5), "bias": torch.nn.init.zeros_}
    model.layers["2"].feed_forward.w1._param_init = {
        "weight": __import__("functools").partial(torch.nn.init.trunc_normal_, std=0.02, generator=torch.Generator())
    }
    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(model, seed=0, policy="torchtitan")
    text = str(err.value)
    assert "lm_head.weight" in text and "unknown initializer" in text
    assert "layers.2.feed_forward.w1.weight" in text and "its own generator" in text
    assert len(err.value.problems) == 2


RANK_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.models.llama3 import llama3_configs
from paraminit_client import Client
from paraminit_client.torch import materialize_module, plan_from_module

class Recording(Client):
    def __init__(self):
        super().__init__()
        self.asked = []
    def materialize_into(self, plan, outputs):
        self.asked.append(plan)
        return super().materialize_into(plan, outputs)

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (4,))


def config(model):
    if model == "moe":
        from torchtitan.models import qwen3
        cfg = qwen3.qwen3_configs["debugmodel_moe"](attn_backend="flex")
        cfg.layers = qwen3._build_qwen3_moe_layers(
            n_layers=2, dim=256, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=256, num_experts=16, top_k=2,
            attn_backend="flex", moe_comm_backend="standard", rope=cfg.layers[0].attention.rope)
        return cfg
    return llama3_configs["debugmodel"](attn_backend="flex")


def check(cfg):
    with torch.device("meta"):
        model = cfg.build()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plan = plan_from_module(model, seed=5, policy="torchtitan")
    client = Recording()
    materialize_module(model, client, plan=plan)
    (asked,) = client.asked
    full = {p.name: list(p.shape) for p in plan.params}
    regions = {q.name: [[r.start, r.stop] for r in q.region] for q in asked.params}
    with torch.device("meta"):
        single = cfg.build()
    with Client() as c:
        materialize_module(single, c, plan=plan)
    ref = dict(single.named_parameters())
    equal, local = {}, {}
    for name, p in model.named_parameters():
        local[name] = list(p.to_local().shape)
        equal[name] = bool(torch.equal(p.full_tensor().detach().view(torch.uint8), ref[name].detach().view(torch.uint8)))
    ref_buffers = single.state_dict()
    for name, b in model.state_dict().items():  # persistent buffers (MoE expert_bias): whole on every rank
        if name not in equal and name in full:
            equal[name] = bool(torch.equal(b.detach(), ref_buffers[name].detach()))
    return {"regions": regions, "full": full, "local": local, "equal": equal,
            "placements": {n: str(p.placements) for n, p in model.named_parameters()}}


json.dump({model: check(config(model)) for model in sys.argv[2:]}, open(sys.argv[1] + f".{rank}", "w"))
dist.barrier()  # every rank done with the group before any tears it down (gloo can abort otherwise)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_fsdp2_four_gloo_ranks_fill_only_their_shards(tmp_path: Path) -> None:
    """Each rank fills only its shards (one request) with the single-process bytes: the Llama 3 debug model, and
    the MoE model, whose grouped expert weights shard along the experts (one launch of four ranks for both)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "result"
    models = ["llama3", "moe"]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "4",
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(out), *models],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    for r, by_model in enumerate(results):
        assert sorted(by_model) == sorted(models)
        for model, res in by_model.items():
            assert all(res["equal"].values()), (model, [n for n, ok in res["equal"].items() if not ok])
            assert set(res["regions"]) == set(res["full"])  # one request, every parameter, each its own shard
            assert set(res["equal"]) == set(res["full"])
            for name, shape in res["full"].items():
                if name not in res["placements"]:  # a buffer: not sharded, asked for whole
                    assert res["regions"][name] in ([], [[0, d] for d in shape]), (model, r, name)
                    continue
                rows = shape[0] // 4
                assert res["placements"][name] == "(Shard(dim=0),)", (model, name)
                assert res["regions"][name][0] == [r * rows, (r + 1) * rows], (model, r, name)
                assert res["regions"][name][1:] == [[0, d] for d in shape[1:]], (model, r, name)
                assert res["local"][name] == [rows, *shape[1:]], (model, r, name)
    assert any("expert" in name for name in results[0]["moe"]["placements"])  # the MoE model's experts were sharded


def test_tied_embedding_takes_the_lm_heads_initializer() -> None:
    """Llama 3 1B ties tok_embeddings.weight to lm_head.weight and skips the embedding's init: the one tensor
    gets lm_head's truncated normal (read from the 1B config: std dim**-0.5, cut at 3 sigma)."""
    with torch.device("meta"):
        model = llama3.llama3_configs["1B"](attn_backend="flex").build()
    assert model.tok_embeddings.weight is model.lm_head.weight
    plan = plan_from_module(model, seed=0, policy="torchtitan")
    by = {p.name: p for p in plan.params}
    assert "lm_head.weight" not in by  # a tied tensor appears once, under its first name
    t = by["tok_embeddings.weight"].init.truncated_normal
    s = 2048**-0.5
    assert (t.std, t.lo, t.hi) == (s, -3 * s, 3 * s) and list(by["tok_embeddings.weight"].shape) == [128256, 2048]


def test_the_default_replays_torchtitans_init_weights_after_construction() -> None:
    """Built under meta_parameters(), a torchtitan model's own initialization is its init_weights(), which its
    trainer calls after construction: the default policy replays it over the constructor's record and gives the
    plan of policy="torchtitan" (whose param_init holds trunc_normal_ in functools.partials). The fused wqkv, a
    concatenation of separately drawn q, k and v, is refused by name (the torchtitan policy states it)."""
    from paraminit_client.torch import meta_parameters

    with meta_parameters():
        model = debug_config().build()
    with pytest.raises(UnsupportedModuleError) as err:
        plan_from_module(model, seed=0)
    assert {name for name, _, _ in err.value.problems} == {f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in range(6)}

    def fused(name: str, t: Any) -> Any:
        return {"zeros": {}} if name.endswith("wqkv.weight") else None

    own, titan = plan_from_module(model, 0, overrides=fused), plan_from_module(model, 0, policy="torchtitan", overrides=fused)
    rest = [(a, b) for a, b in zip(own.params, titan.params, strict=True) if not a.name.endswith("wqkv.weight")]
    assert len(rest) == 39 and all(a == b for a, b in rest)  # (the torchtitan policy keeps its wqkv parts as patches)
