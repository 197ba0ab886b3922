"""paraminit_client.torch: plans from torch modules, modules filled through a real server on loopback."""

from __future__ import annotations

import copy
import hashlib
import io
import math
import subprocess
import sys
import time
from typing import Any, cast

import grpc
import pytest

pytest.importorskip("torch")
import torch
from torch import nn
from torch.nn import functional as F

from paraminit.peers import is_local_target
from paraminit.v1 import plan_pb2
from paraminit_client import Client
from paraminit_client.errors import ParaminitError
from paraminit_client.exports import Lease
from paraminit_client.torch import (
    UnsupportedModuleError,
    lease_of,
    materialize_module,
    param_seed,
    plan_from_module,
)
from support import server_fixture, wait_until

# -- a GPT-2-shaped model in plain torch.nn ------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


SMALL = {"vocab": 2000, "ctx": 256, "d": 128, "layers": 2, "heads": 4}


def meta(factory: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.device("meta"):
        return factory(*args, **kwargs)


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- fixtures -------------------------------------------------------------------------------


server = server_fixture()


# -- GPT-2 small end to end -----------------------------------------------------------------


def test_gpt2_small_materializes_and_runs(client: Client) -> None:
    torch.manual_seed(0)
    model = meta(GPT)
    t0 = time.perf_counter()
    lease = materialize_module(model, client, seed=1, policy="torch")
    elapsed = time.perf_counter() - t0
    assert isinstance(lease, Lease) and lease_of(model) is lease  # local server: zero-copy SHM
    assert model.lm_head.weight is model.wte.weight
    assert isinstance(model.wte.weight, nn.Parameter) and model.wte.weight.requires_grad
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    n = sum(p.numel() for p in model.parameters())
    assert n == 124_439_808  # GPT-2 small, lm_head tied
    with torch.no_grad():
        logits = model(torch.randint(0, 50257, (1, 16)))
    assert logits.shape == (1, 16, 50257) and torch.isfinite(logits).all()
    w = model.wte.weight.detach()
    assert abs(float(w.mean())) < 1e-3 and abs(float(w.std()) - 1.0) < 2e-3  # 38.6M N(0, 1) samples
    assert elapsed < 30, f"materialize took {elapsed:.1f} s"
    lease.release()


# -- statistics per policy ------------------------------------------------------------------


def check_uniform(t: torch.Tensor, bound: float, name: str) -> None:
    x = t.detach().double().flatten()
    n = x.numel()
    assert float(x.abs().max()) <= bound, name
    assert float(x.max()) > bound * (1 - 20 / n) and float(x.min()) < -bound * (1 - 20 / n), name  # range filled
    sd = bound / math.sqrt(3)
    assert abs(float(x.mean())) < 5 * sd / math.sqrt(n), name
    assert abs(float(x.std()) / sd - 1) < 6 / math.sqrt(n), name


def test_torch_policy_statistics(client: Client) -> None:
    model = meta(GPT, **SMALL)
    materialize_module(model, client, seed=3, delivery="stream", policy="torch")
    w = model.wte.weight.detach().double()
    assert abs(float(w.mean())) < 5 / math.sqrt(w.numel()) and abs(float(w.std()) - 1) < 0.01
    p = model.wpe.weight.detach().double()
    assert abs(float(p.std()) - 1) < 0.02
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name != "lm_head":
            bound = 1 / math.sqrt(mod.in_features)
            check_uniform(mod.weight, bound, name)
            b = mod.bias.detach()
            assert float(b.abs().max()) <= bound and float(b.std()) > bound / 4
        if isinstance(mod, nn.LayerNorm):
            assert torch.equal(mod.weight, torch.ones_like(mod.weight))
            assert torch.equal(mod.bias, torch.zeros_like(mod.bias))


def test_torchlean_policy_statistics(client: Client) -> None:
    model = meta(GPT, **SMALL)
    plan = plan_from_module(model, 3, policy="torchlean")
    kinds = {p.name: p.init.WhichOneof("kind") for p in plan.params}
    assert kinds["wte.weight"] == "normal" and kinds["h.0.c_fc.weight"] == "kaiming_uniform_for_shape"
    assert kinds["h.0.c_fc.bias"] == "zeros" and kinds["ln_f.weight"] == "ones"
    materialize_module(model, client, plan=plan)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name != "lm_head":
            check_uniform(mod.weight, math.sqrt(6 / mod.in_features), name)
            assert torch.equal(mod.bias, torch.zeros_like(mod.bias))


def test_distributions_match_pytorch_own_init(client: Client) -> None:
    """Each layer family against PyTorch's reset_parameters on CPU: same kind, same bounds, same spread."""

    def zoo() -> nn.Module:
        return nn.ModuleDict(
            {
                "linear": nn.Linear(300, 200),
                "bilinear": nn.Bilinear(40, 50, 60),
                "conv1": nn.Conv1d(16, 32, 5),
                "conv2": nn.Conv2d(8, 64, 3),
                "conv3": nn.Conv3d(4, 8, 3),
                "convt": nn.ConvTranspose2d(32, 16, 4),
                "emb": nn.Embedding(500, 32),
                "bag": nn.EmbeddingBag(300, 40),
                "ln": nn.LayerNorm(64),
                "rms": nn.RMSNorm(64),
                "gn": nn.GroupNorm(4, 64),
                "bn": nn.BatchNorm2d(64),
                "inorm": nn.InstanceNorm1d(64, affine=True, track_running_stats=True),
                "mha": nn.MultiheadAttention(64, 4, add_bias_kv=True),
                "mha_kv": nn.MultiheadAttention(64, 4, kdim=32, vdim=48),
                "lstm": nn.LSTM(64, 96, num_layers=2),
                "gru": nn.GRUCell(32, 80),
                "prelu": nn.PReLU(8),
                "tf": nn.Transformer(32, 2, 1, 1, 64, batch_first=True),
            }
        )

    torch.manual_seed(0)
    reference = zoo()
    ours = meta(zoo)
    plan = plan_from_module(ours, 11, policy="torch")
    kinds = {p.name: p.init.WhichOneof("kind") for p in plan.params}
    assert kinds["mha.in_proj_weight"] == "xavier_uniform_for_shape" and kinds["mha.out_proj.bias"] == "zeros"
    assert kinds["mha.bias_k"] == "normal" and kinds["tf.encoder.layers.0.linear1.weight"] == "xavier_uniform_for_shape"
    assert kinds["tf.encoder.layers.0.linear1.bias"] == "uniform"
    materialize_module(ours, client, plan=plan)
    ref = reference.state_dict()
    assert list(ref) == list(ours.state_dict())
    for name, got in ours.state_dict().items():
        want = ref[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if not want.is_floating_point() or bool((want == want.flatten()[0]).all()):  # constants: exactly equal
            assert torch.equal(got, want), name
            continue
        g, w = got.double(), want.double()
        tol = 8 / math.sqrt(g.numel())
        assert abs(float(g.std()) / float(w.std()) - 1) < tol, name
        if kinds[name] != "normal":
            assert float(g.abs().max()) <= float(w.abs().max()) * (1 + tol), name
            assert float(g.abs().max()) >= float(w.abs().max()) * (1 - tol), name


# -- determinism and deliveries -------------------------------------------------------------


def test_same_plan_same_tensors_every_run_and_delivery(client: Client) -> None:
    plans = [plan_from_module(meta(GPT, **SMALL), 42) for _ in range(2)]
    assert plans[0].SerializeToString() == plans[1].SerializeToString()
    results = []
    for delivery in ("shm", "stream", "shm", "auto"):
        model = meta(GPT, **SMALL)
        lease = materialize_module(model, client, delivery=delivery, plan=plans[0])
        assert (lease is None) == (delivery == "stream")
        assert model.lm_head.weight is model.wte.weight
        results.append(values(model))
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for k, v in results[0].items():
            assert torch.equal(v, other[k]), k
    assert not torch.equal(values(meta_materialized(client, 43))["h.0.c_fc.weight"], results[0]["h.0.c_fc.weight"])


def meta_materialized(client: Client, seed: int) -> nn.Module:
    model = meta(GPT, **SMALL)
    materialize_module(model, client, seed=seed, delivery="stream")
    return model  # type: ignore[no-any-return]


def test_dtypes_and_cpu_modules(client: Client) -> None:
    def build() -> nn.Module:
        return nn.ModuleDict(
            {
                "a": nn.Linear(64, 64, dtype=torch.bfloat16),
                "b": nn.Linear(64, 32, dtype=torch.float16),
                "c": nn.Linear(32, 8, dtype=torch.float64),
                "e": nn.Embedding(50, 8, dtype=torch.bfloat16),
            }
        )

    plan = plan_from_module(meta(build), 5)
    assert [plan_pb2.DType.Name(p.dtype) for p in plan.params] == ["DTYPE_BFLOAT16"] * 2 + ["DTYPE_FLOAT16"] * 2 + ["DTYPE_FLOAT64"] * 2 + [
        "DTYPE_BFLOAT16"
    ]
    got = []
    for delivery in ("shm", "stream"):
        m = meta(build)
        materialize_module(m, client, delivery=delivery, plan=plan)
        got.append(values(m))
    cpu = build()  # a module already on the CPU is overwritten in place of PyTorch's values
    materialize_module(cpu, client, plan=plan)
    got.append(values(cpu))
    arrays = client.materialize(plan)
    for name, v in got[0].items():
        assert v.dtype == {"a": torch.bfloat16, "b": torch.float16, "c": torch.float64, "e": torch.bfloat16}[name[0]]
        assert torch.equal(v, got[1][name]) and torch.equal(v, got[2][name]), name
        assert v.view(torch.uint8 if v.dtype != torch.bfloat16 else torch.int16).numpy().tobytes() == arrays[name].tobytes()


def test_seeds_stable_under_adding_a_parameter(client: Client) -> None:
    class Wider(GPT):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.adapter = nn.Linear(SMALL["d"], 16)  # a new parameter

    class Prefixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Parameter(torch.empty(3, 3))  # registered first: shifts every later position
            self.body = GPT(**SMALL)

    base = {p.name: p for p in plan_from_module(meta(GPT, **SMALL), 9).params}
    wider = {p.name: p for p in plan_from_module(meta(Wider, **SMALL), 9).params}
    assert set(wider) - set(base) == {"adapter.weight", "adapter.bias"}
    for name, p in base.items():
        assert wider[name].SerializeToString() == p.SerializeToString(), name
    assert base["h.0.c_fc.weight"].init.uniform.seed == param_seed(9, "h.0.c_fc.weight")
    assert param_seed(9, "x") == int.from_bytes(hashlib.sha256(b"9:x").digest()[:8], "big")
    prefixed = plan_from_module(meta(Prefixed), 9, overrides=lambda n, t: {"zeros": {}} if n == "pre" else None)
    assert {p.name for p in prefixed.params} == {"pre"} | {f"body.{n}" for n in base}
    a, b = meta(GPT, **SMALL), meta(Wider, **SMALL)
    materialize_module(a, client, seed=9)
    materialize_module(b, client, seed=9)
    va, vb = values(a), values(b)
    for k, v in va.items():
        assert torch.equal(v, vb[k]), k


# -- what the policy does not know ----------------------------------------------------------


class Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class MyLinear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def test_unknown_layers_are_reported_not_guessed(client: Client) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), Scale(8), MyLinear(8, 4), nn.Embedding(10, 8, padding_idx=0))

    with pytest.raises(UnsupportedModuleError) as info:
        plan_from_module(meta(build), 0, policy="torch")
    names = [p[0] for p in info.value.problems]
    assert names == ["1.gain", "2.weight", "2.bias"]  # padding_idx is supported: a zero-row plan patch
    text = str(info.value)
    assert "Scale" in text and "MyLinear redefines Linear.reset_parameters" in text

    def overrides(name: str, t: torch.Tensor) -> Any:
        if name == "1.gain":
            return {"ones": {}}
        if name.startswith("2."):
            return plan_pb2.Init(zeros=plan_pb2.Zeros())
        if name == "3.weight":
            return {"normal": {"std": 0.02}}  # no seed: the parameter's derived seed is filled in
        return None

    model = meta(build)
    plan = plan_from_module(model, 0, policy="torch", overrides=overrides)
    assert plan.params[-1].init.normal.seed == param_seed(0, "3.weight")
    materialize_module(model, client, plan=plan)
    assert not model[3].weight[0].any() and model[3].weight[1:].all()  # the override keeps the padding row zero
    assert torch.equal(model[1].gain, torch.ones(8)) and not model[2].weight.any()
    assert abs(float(model[3].weight.detach().std()) - 0.02) < 0.01
    with pytest.raises(ParaminitError):
        plan_from_module(meta(build), 0, overrides=cast(Any, lambda n, t: 1.5))
    with pytest.raises(ValueError, match="not a valid Init"):
        plan_from_module(meta(build), 0, overrides=lambda n, t: {"gaussian": {}})


def test_integer_buffers_and_batchnorm(client: Client) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))

    with pytest.raises(UnsupportedModuleError, match="lazy"):
        plan_from_module(meta(build), 0)
    model = meta(lambda: nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU()))
    plan = plan_from_module(model, 0)
    assert "1.num_batches_tracked" not in {p.name for p in plan.params}  # int64: outside the plan's float dtypes
    materialize_module(model, client, plan=plan)
    bn = model[1]
    assert bn.num_batches_tracked.dtype == torch.int64 and int(bn.num_batches_tracked) == 0
    assert torch.equal(bn.running_mean, torch.zeros(16)) and torch.equal(bn.running_var, torch.ones(16))
    check_uniform(model[0].weight, 1 / math.sqrt(27), "conv")
    model(torch.randn(2, 3, 8, 8))
    assert int(bn.num_batches_tracked) == 1


def test_meta_tensors_outside_the_plan_are_refused_before_any_rpc() -> None:
    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mask", torch.ones(4, 4), persistent=False)
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    class NoCalls:
        target = "127.0.0.1:1"

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"unexpected call {name}")

    with pytest.raises(ValueError) as info:
        materialize_module(meta(WithMask), NoCalls())  # type: ignore[arg-type]
    assert "mask" in str(info.value) and "non-persistent" in str(info.value) and "steps" in str(info.value)
    bad = plan_from_module(meta(WithMask), 0)
    bad.params[0].shape[0] = 5
    with pytest.raises(ValueError, match="does not match the module"):
        materialize_module(meta(WithMask), NoCalls(), plan=bad)  # type: ignore[arg-type]


# -- leases ---------------------------------------------------------------------------------


def test_lease_is_kept_on_the_module_and_reinitializes_in_place(client: Client) -> None:
    model = meta(GPT, **SMALL)
    lease = materialize_module(model, client, seed=1)
    assert lease is not None and lease_of(model) is lease
    w = model.h[0].c_fc.weight
    before = w.detach().clone()
    lease.apply(plan_from_module(model, 2))  # same tensors, new seed: the module sees it without a copy
    assert model.h[0].c_fc.weight is w and not torch.equal(w.detach(), before)
    fresh = meta(GPT, **SMALL)
    materialize_module(fresh, client, seed=2, delivery="stream")
    assert torch.equal(w.detach(), fresh.h[0].c_fc.weight.detach())
    del w  # a view of the lease kept past its release would hold the Release back until it goes
    second = materialize_module(model, client, seed=1)  # again: the previous lease is given back
    assert wait_until(lambda: lease.lease_id not in {s.lease.lease_id for s in client.leases()})
    assert second is not None
    kept = values(model)
    copied = copy.deepcopy(model)  # copies and pickles carry their tensors, not the lease
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert lease_of(copied) is None and lease_of(loaded) is None and lease_of(model) is second
    second.release()  # on the CPU the tensors hold the mapping: still readable, unchanged
    for m in (model, copied, loaded):
        for k, v in m.state_dict().items():
            assert torch.equal(v, kept[k]), k
    assert loaded.lm_head.weight is loaded.wte.weight and copied.lm_head.weight is copied.wte.weight


def test_auto_delivery_falls_back_to_stream(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_local_target("127.0.0.1:5") and is_local_target("localhost:5") and is_local_target("[::1]:5") and is_local_target("unix:/s")
    assert is_local_target("dns:///localhost:5") and not is_local_target("10.0.0.7:5") and not is_local_target("trainer-0:5")
    want = values(meta_materialized(client, 4))

    def refuse(*args: Any, **kwargs: Any) -> Lease:  # what a forwarded port that only looks local answers
        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION, "cannot open shared-memory segment")

    monkeypatch.setattr(client, "export", refuse)
    model = meta(GPT, **SMALL)
    assert materialize_module(model, client, seed=4) is None and lease_of(model) is None
    for k, v in values(model).items():
        assert torch.equal(v, want[k]), k
    with pytest.raises(ParaminitError):
        materialize_module(meta(GPT, **SMALL), client, seed=4, delivery="shm")


# -- torch stays optional -------------------------------------------------------------------


def test_client_never_imports_torch_and_the_extra_is_named() -> None:
    code = (
        "import sys; import paraminit_client, paraminit_client.client, paraminit_client.exports, "
        "paraminit_client.plans, paraminit_client.cli; assert 'torch' not in sys.modules, 'torch imported'; "
        "sys.modules['torch'] = None\n"
        "try:\n    import paraminit_client.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'paraminit[torch]'" in out


def test_a_policy_is_one_class_chosen_by_name_or_passed() -> None:
    """Every policy, built in or new, goes through one protocol: an object with `name` and `assign(walk)`, passed
    as itself or registered under a name; the built-in names are objects of the same protocol."""
    from paraminit_client import policies, recipes

    model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4), nn.Embedding(10, 4, padding_idx=0))

    class Constant:
        name = "constant"

        def __init__(self, value: float) -> None:
            self.value = value

        def assign(self, walk: policies.ModuleWalk) -> None:
            for name in walk.collect():
                walk.inits[name] = plan_pb2.Init(normal=plan_pb2.Normal(mean=self.value, std=0.0, seed=walk.seed_of(name)))

    plan = plan_from_module(model, seed=3, policy=Constant(0.5))
    assert [p.name for p in plan.params] == list(model.state_dict()) and all(p.init.normal.mean == 0.5 for p in plan.params)
    policies.register("constant-test", lambda: Constant(0.25))
    with pytest.raises(ValueError, match="exists already"):
        policies.register("constant-test", lambda: Constant(0.0))
    by_name = plan_from_module(model, seed=3, policy="constant-test")
    assert all(p.init.normal.mean == 0.25 for p in by_name.params)
    # the built-in names are objects of the same protocol, and give what the name gives
    for name in policies.BUILT_IN:
        pol = policies.policy_of(name)
        assert pol.name == name and callable(pol.assign), name
    torch_plan = plan_from_module(model, seed=3, policy=policies.policy_of("torch"))
    assert torch_plan == plan_from_module(model, seed=3, policy="torch")
    assert next(p for p in torch_plan.params if p.name == "2.weight").patches  # the padding row, fixed by the layer
    assert plan_from_module(model, seed=3, policy=recipes.neox(num_layers=2, d_model=4)).params[0].init.normal.std > 0
    with pytest.raises(ValueError, match="policy must be one of"):
        plan_from_module(model, seed=3, policy="no-such-policy")
    with pytest.raises(ValueError, match="needs assign"):
        plan_from_module(model, seed=3, policy=object())  # type: ignore[arg-type]


def test_adapters_take_one_argument_shape() -> None:
    """torch, JAX and distributed entry points read alike: what to materialize first, then `client=None` (an
    in-process Client() for the call), every option by keyword; each has an Example. Without a client, a module
    and a region materialize in process, and a delivery that leaves a lease is refused (its lease needs a client)."""
    import inspect

    from paraminit_client import distributed, param
    from paraminit_client import jax as pjax
    from paraminit_client import torch as ptorch

    for fn, what in (
        (ptorch.materialize_module, ["module"]),
        (pjax.materialize, ["plan"]),
        (distributed.materialize_region, ["param", "region"]),
    ):
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == [*what, "client"], (fn.__name__, positional)
        assert params[len(what)].default is None
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(what) + 1 :]), fn.__name__
        assert "Example:" in (fn.__doc__ or ""), fn.__name__
    with torch.device("meta"):
        model = nn.Linear(8, 4)
    assert ptorch.materialize_module(model, seed=3) is None
    assert not model.weight.is_meta and model.weight.std() > 0 and model.bias.abs().max() > 0
    w = param("w", [6, 5], {"normal": {"std": 1, "seed": 2}})
    with Client() as c:
        whole = c.materialize(plan_pb2.Plan(params=[w]))["w"]
    rows = distributed.materialize_region(w, [(2, 5), slice(None)])
    assert rows.numpy().tobytes() == whole[2:5].tobytes()
    with torch.device("meta"):
        again = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="lease"):
        ptorch.materialize_module(again, delivery="shm")
