"""The default policy ("own"): a model's own initialization code, replayed into plan initializers (paraminit_client.replay).

The laws: every torch.nn.init function and the tensor methods model code calls give PyTorch's own distributions
(checked against PyTorch's own fills); compositions compose; parts are patches; copies are ties; deterministic values
are data; what has no plan form is refused with the model's file:line; the framework's generator is never used. The zoo
(tests/zoo.py: torchvision, timm and transformers models) checks whole public models, in process and over a server.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
from torch import nn

import zoo
from paraminit.v1 import plan_pb2
from paraminit_client import Client
from paraminit_client.torch import (
    UnsupportedModuleError,
    materialize_module,
    meta_parameters,
    param_seed,
    plan_from_constructor,
    plan_from_module,
)
from support import server_fixture

server = server_fixture()


def _inits(plan: plan_pb2.Plan) -> dict[str, plan_pb2.Init]:
    return {p.name: p.init for p in plan.params}


def _filled(model: nn.Module, plan: plan_pb2.Plan | None = None) -> dict[str, np.ndarray[Any, Any]]:
    """The model's tensors from the plan, materialized in process into buffers poisoned first."""
    with Client() as client:
        materialize_module(model, client, plan=plan)
    return {k: v.detach().double().numpy() for k, v in model.state_dict().items()}


class Cell(nn.Module):
    """Parameters made on meta, initialized by the test's own code (`init`)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta")))


def _replayed(shapes: dict[str, tuple[int, ...]], init: Any, seed: int = 0) -> tuple[nn.Module, plan_pb2.Plan]:
    from paraminit_client.recipes import replay

    model = Cell(shapes)
    return model, plan_from_module(model, seed, policy=replay(init, "test"))


# -- every torch.nn.init function, with its arguments --------------------------------------------------------------


def test_every_init_function_gives_pytorchs_own_distribution() -> None:
    shapes = {
        "xu": (300, 200),
        "xn": (300, 200),
        "ku": (64, 32, 3, 3),
        "kn": (64, 32, 3, 3),
        "tn": (400, 300),
        "orth": (64, 128),
        "const": (10, 3),
        "eye": (5, 7),
        "dirac": (8, 4, 3, 3),
        "sparse": (200, 50),
    }
    gain = nn.init.calculate_gain("tanh")

    def init(m: nn.Module) -> None:
        nn.init.xavier_uniform_(m.xu, gain=gain)
        nn.init.xavier_normal_(m.xn, gain=0.5)
        nn.init.kaiming_uniform_(m.ku, a=0.1, mode="fan_out", nonlinearity="leaky_relu")
        nn.init.kaiming_normal_(m.kn, mode="fan_out", nonlinearity="relu")
        nn.init.trunc_normal_(m.tn, mean=0.1, std=0.02, a=0.07, b=0.13)
        nn.init.orthogonal_(m.orth, gain=2.0)
        nn.init.constant_(m.const, 0.25)
        nn.init.eye_(m.eye)
        nn.init.dirac_(m.dirac, groups=2)
        nn.init.sparse_(m.sparse, sparsity=0.3, std=0.05)

    model, plan = _replayed(shapes, init)
    got = _inits(plan)
    # bounds and deviations are PyTorch's own arithmetic (the fills reach the recorder as uniform_/normal_)
    assert got["xu"].uniform.hi == gain * math.sqrt(2.0 / 500) * math.sqrt(3.0) == -got["xu"].uniform.lo
    assert got["xn"].normal.std == 0.5 * math.sqrt(2.0 / 500)
    fan_out = 64 * 9
    assert got["ku"].uniform.hi == math.sqrt(3.0) * (math.sqrt(2.0 / (1 + 0.1**2)) / math.sqrt(fan_out))
    assert got["kn"].normal.std == math.sqrt(2.0) / math.sqrt(fan_out)
    tn = got["tn"].truncated_normal
    assert (tn.mean, tn.std, tn.lo, tn.hi) == (0.1, 0.02, 0.07, 0.13)
    assert got["orth"].orthogonal.gain == 2.0 and got["const"].uniform.lo == got["const"].uniform.hi == 0.25
    assert got["eye"].WhichOneof("kind") == "eye" and got["dirac"].dirac.groups == 2  # the plan's own forms (spec 5)
    assert (got["sparse"].sparse.sparsity, got["sparse"].sparse.std) == (0.3, 0.05)
    assert {k: v.seed for k, v in [("xu", got["xu"].uniform), ("kn", got["kn"].normal)]} == {
        "xu": param_seed(0, "xu"),
        "kn": param_seed(0, "kn"),
    }
    values = _filled(model, plan)
    torch.manual_seed(0)
    for name, shape in shapes.items():  # against PyTorch's own fills of the same calls
        ref = nn.Module()
        ref.register_parameter(name, nn.Parameter(torch.full(shape, float("nan"))))
        with torch.no_grad():
            getattr(_Reference, name)(getattr(ref, name))
        want = getattr(ref, name).detach().double().numpy()
        if name in ("const", "eye", "dirac"):
            assert np.array_equal(values[name], want), name
        elif name == "sparse":  # ceil(0.3 * 200) zeros in every column, the rest normal(0, 0.05)
            zeros = values[name] == 0
            assert (zeros.sum(axis=0) == 60).all() and (want == 0).sum(axis=0).tolist() == [60] * 50
            assert zoo.same_distribution(values[name][~zeros], want[want != 0]) is None
        elif name == "orth":
            m = values[name].reshape(64, 128)
            assert np.allclose(m @ m.T, 4.0 * np.eye(64), atol=1e-4)
        else:
            why = zoo.same_distribution(values[name].reshape(-1), want.reshape(-1))
            assert why is None, f"{name}: {why}"
            if name == "tn":
                assert values[name].min() >= 0.07 - 1e-7 and values[name].max() <= 0.13 + 1e-7


class _Reference:
    """The same calls on real tensors, for PyTorch's own values."""

    xu = staticmethod(lambda t: nn.init.xavier_uniform_(t, gain=nn.init.calculate_gain("tanh")))
    xn = staticmethod(lambda t: nn.init.xavier_normal_(t, gain=0.5))
    ku = staticmethod(lambda t: nn.init.kaiming_uniform_(t, a=0.1, mode="fan_out", nonlinearity="leaky_relu"))
    kn = staticmethod(lambda t: nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"))
    tn = staticmethod(lambda t: nn.init.trunc_normal_(t, mean=0.1, std=0.02, a=0.07, b=0.13))
    orth = staticmethod(lambda t: nn.init.orthogonal_(t, gain=2.0))
    const = staticmethod(lambda t: nn.init.constant_(t, 0.25))
    eye = staticmethod(nn.init.eye_)
    dirac = staticmethod(lambda t: nn.init.dirac_(t, groups=2))
    sparse = staticmethod(lambda t: nn.init.sparse_(t, sparsity=0.3, std=0.05))


def test_what_has_no_plan_form_is_refused_with_the_models_line() -> None:
    def init(m: nn.Module) -> None:
        nn.init.sparse_(m.sparse[:3], sparsity=0.5)
        m.drawn.data.exponential_()
        nn.init.normal_(m.mixed)
        with torch.no_grad():
            m.mixed.mul_(m.mixed.detach().sum())  # reads its own random values
            m.product.copy_(torch.randn(4, 4) @ torch.randn(4, 4))  # a product of torch's draws

    with pytest.raises(UnsupportedModuleError) as err:
        _replayed({"sparse": (6, 4), "drawn": (4, 4), "mixed": (4, 4), "product": (4, 4), "never": (3,)}, init)
    problems = {name: why for name, _, why in err.value.problems}
    assert set(problems) == {"sparse", "drawn", "mixed", "product", "never"}
    line = init.__code__.co_firstlineno
    assert "sparse_ on part of a tensor" in problems["sparse"] and f"test_own_init.py:{line + 1}" in problems["sparse"]
    assert "exponential_" in problems["drawn"] and f"test_own_init.py:{line + 2}" in problems["drawn"]
    assert "mul_" in problems["mixed"] and f"test_own_init.py:{line + 5}" in problems["mixed"]
    assert "random generator" in problems["product"] and "never sets" in problems["never"]


# -- tensor methods, views, compositions ------------------------------------------------------------------------


def test_tensor_methods_through_data_detach_and_views_compose() -> None:
    table = torch.tensor([[math.sin(p / 10**i) for i in range(6)] for p in range(5)], dtype=torch.float64)

    def init(m: nn.Module) -> None:
        with torch.no_grad():
            m.scaled.data.normal_(1.0, 2.0)
            m.scaled.detach().mul_(-0.5).add_(3.0)  # normal(1, 2) * -0.5 + 3 = normal(2.5, 1)
            m.chain.uniform_(2 * 0.1 - 1, 2 * 0.9 - 1)  # timm's / older PyTorch's trunc_normal_
            m.chain.erfinv_().mul_(0.02 * math.sqrt(2.0)).add_(0.5)
            m.chain.clamp_(min=0.5 + 0.02 * math.sqrt(2.0) * float(torch.erfinv(torch.tensor(-0.8, dtype=torch.float64))), max=0.6)
            m.padded.normal_(0, 0.02)
            m.padded[0] = 0  # a padding row: a patch
            m.padded.data[:, 3:5].fill_(7.0)  # a column block: another patch
            m.tied.copy_(m.scaled)  # a copy of another parameter: a tie under its seed
            m.table.copy_(table)  # computed without randomness: carried as data
            m.table.T[1:3].zero_()  # a permuted view of a data tensor, evaluated for it
            m.drawn.copy_(torch.randn(4, 6) * 0.25)  # a scale of torch's draws: normal(0, 0.25) under the plan's seed

    shapes = {"scaled": (200, 100), "chain": (300, 100), "padded": (10, 6), "tied": (200, 100), "table": (5, 6), "drawn": (4, 6)}
    model, plan = _replayed(shapes, init, seed=5)
    got = _inits(plan)
    assert got["scaled"].normal.mean == 2.5 and got["scaled"].normal.std == 1.0
    tn = got["chain"].truncated_normal
    edge = 0.02 * math.sqrt(2) * float(torch.erfinv(torch.tensor(0.8, dtype=torch.float64)))
    assert abs(tn.mean - 0.5) < 1e-15 and abs(tn.std - 0.02) < 1e-15  # the clamp's max lies beyond the support
    assert abs(tn.lo - (0.5 - edge)) < 1e-12 and abs(tn.hi - (0.5 + edge)) < 1e-12
    padded = next(p for p in plan.params if p.name == "padded")
    assert [[(r.start, r.stop) for r in q.box] for q in padded.patches] == [[(0, 1), (0, 6)], [(0, 10), (3, 5)]]
    assert got["tied"] == got["scaled"] and got["tied"].normal.seed == param_seed(5, "scaled")
    assert got["drawn"].normal.std == 0.25 and got["drawn"].normal.seed == param_seed(5, "drawn")
    values = _filled(model, plan)
    expected = table.clone()
    expected.T[1:3] = 0
    assert np.array_equal(values["table"], expected.float().double().numpy())
    assert np.array_equal(values["tied"], values["scaled"])
    assert (values["padded"][:, 3:5] == 7.0).all() and not values["padded"][0, [0, 1, 2, 5]].any()  # later patch wins
    torch.manual_seed(0)
    ref = torch.empty(200, 100).normal_(1.0, 2.0).mul_(-0.5).add_(3.0)
    assert zoo.same_distribution(values["scaled"].reshape(-1), ref.double().numpy().reshape(-1)) is None


CAPTURED = functools.partial(nn.init.trunc_normal_, std=0.02, a=-0.04, b=0.04)  # held before any recording


def test_init_functions_are_recorded_however_the_code_holds_them() -> None:
    """A functools.partial made at import time (as torchtitan's configs hold trunc_normal_), a name imported from
    torch.nn.init, a table of them: all reach the recorder, since the functions' own code forwards to it."""
    from torch.nn.init import orthogonal_

    table = {"eye": nn.init.eye_}

    def init(m: nn.Module) -> None:
        CAPTURED(m.a)
        orthogonal_(m.b, gain=3.0)
        table["eye"](m.c)

    _, plan = _replayed({"a": (32, 32), "b": (8, 8), "c": (4, 4)}, init)
    got = _inits(plan)
    assert (got["a"].truncated_normal.std, got["a"].truncated_normal.hi) == (0.02, 0.04)
    assert got["b"].orthogonal.gain == 3.0 and got["c"].WhichOneof("kind") == "eye"
    real = torch.empty(16, 16)
    CAPTURED(real)  # outside a recording the functions are their own again
    assert 0 < float(real.abs().max()) <= 0.04


def test_the_frameworks_generator_is_never_used() -> None:
    def init(m: nn.Module) -> None:
        g = torch.Generator(device="meta")  # a framework's seeded generator (meta-safe while recording)
        g.manual_seed(123)
        nn.init.trunc_normal_(m.w, std=0.02, generator=g)
        with torch.no_grad():
            m.v.normal_(generator=g)

    plans = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        plans.append(_replayed({"w": (64, 64), "v": (64,)}, init)[1])
    assert plans[0] == plans[1]  # the plan's seeds make the values, whatever torch's state


# -- a model's constructor, recorded or refused -------------------------------------------------------------------


class OwnInitNet(nn.Module):
    """A constructor that initializes its layers in its own loop (as torchvision's and timm's models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)
        self.emb = nn.Embedding(12, 16, padding_idx=3)
        self.scale = nn.Parameter(1e-5 * torch.ones(16))  # a layer scale
        self.pos = nn.Parameter(torch.zeros(1, 5, 16))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos, std=0.02)


def test_a_constructor_is_recorded_under_meta_parameters_and_refused_after_the_fact() -> None:
    plan = plan_from_constructor(OwnInitNet, seed=3)
    got = _inits(plan)
    assert got["conv.weight"].normal.std == math.sqrt(2.0) / math.sqrt(16 * 9)
    assert got["fc.weight"].normal.std == 0.01 and got["fc.bias"].WhichOneof("kind") == "zeros"
    assert got["scale"].uniform.lo == got["scale"].uniform.hi == float(np.float32(1e-5))
    assert got["pos"].WhichOneof("kind") == "truncated_normal"
    assert got["bn.running_var"].WhichOneof("kind") == "ones" and got["emb.weight"].normal.std == 1.0
    emb = next(p for p in plan.params if p.name == "emb.weight")
    assert [(r.start, r.stop) for r in emb.patches[0].box] == [(3, 4), (0, 16)]
    with meta_parameters():
        model = OwnInitNet()
    assert plan_from_module(model, 3) == plan  # the record travels with the model
    values = _filled(model)
    assert not values["emb.weight"][3].any() and (values["scale"] == np.float32(1e-5)).all()
    with torch.device("meta"):
        unrecorded = OwnInitNet()
    refusal = r"OwnInitNet's constructor initializes tensors in its own code \(.*test_own_init.py:\d+\)"
    with pytest.raises(UnsupportedModuleError, match=refusal):
        plan_from_module(unrecorded, 3)


class LateInit(nn.Module):
    """A constructor that leaves a tensor to the trainer's init_weights() (as torchtitan's models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))
        self.lin = nn.Linear(8, 8)

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.w, std=0.02)
        nn.init.zeros_(self.lin.bias)


def test_a_later_init_weights_runs_over_what_the_constructor_did() -> None:
    got = _inits(plan_from_constructor(LateInit))
    assert got["w"].truncated_normal.std == 0.02 and got["lin.bias"].WhichOneof("kind") == "zeros"
    assert got["lin.weight"].uniform.hi == pytest.approx(1 / math.sqrt(8))  # the constructor's reset_parameters

    class Broken(LateInit):
        def init_weights(self) -> None:
            raise RuntimeError("needs a device mesh")

    with pytest.raises(UnsupportedModuleError, match=r"w \(Broken\): holds uninitialized memory .* needs a device mesh"):
        plan_from_constructor(Broken)


def test_plain_layers_on_meta_replay_their_reset_parameters_and_keep_ties() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 50, bias=False))
    model[3].weight = model[0].weight  # tied after construction: the embedding's initialization
    got = _inits(plan_from_module(model, 0))
    assert set(got) == {"0.weight", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert got["0.weight"].normal.std == 1.0 and got["1.weight"].uniform.hi == pytest.approx(1 / math.sqrt(8))
    assert got["2.weight"].WhichOneof("kind") == "ones"


def test_versioned_load_from_state_dict_gets_the_models_metadata() -> None:
    class Versioned(nn.Module):
        _version = 2

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
            if local_metadata.get("version") != 2:
                raise ValueError(f"version should be set to 2 instead of {local_metadata.get('version')}")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    with meta_parameters():
        model = nn.Sequential(Versioned())
    values = _filled(model)
    assert values["0.lin.weight"].std() > 0


# -- the zoo: public models, in process and over a server ---------------------------------------------------------


def _zoo_ready() -> None:
    for name in ("torchvision", "timm", "transformers"):
        pytest.importorskip(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in zoo.ZOO + zoo.HELD_OUT])
def test_zoo_model_gets_its_own_initialization(name: str) -> None:
    _zoo_ready()
    verdict = zoo.check(name, dict(zoo.ZOO + zoo.HELD_OUT)[name])
    assert verdict.error is None, verdict.error
    assert not verdict.differ, "\n".join(verdict.differ[:10])  # never silently different
    assert verdict.refused is None, verdict.refused


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in zoo.ZOO + zoo.HELD_OUT])
def test_zoo_model_has_the_same_bytes_over_a_server(server: Any, name: str) -> None:
    _zoo_ready()
    build = dict(zoo.ZOO + zoo.HELD_OUT)[name]
    with meta_parameters():
        model = build()
    plan = plan_from_module(model, seed=9)
    with Client() as local:
        here = local.materialize(plan)
    with Client(f"127.0.0.1:{server.port}") as remote:
        streamed = remote.materialize(plan)
        lease = remote.export(plan, "shm")
        try:
            shared = {k: v.copy() for k, v in lease.arrays.items()}
        finally:
            lease.release()
    assert set(here) == set(streamed) == set(shared) == {p.name for p in plan.params}
    for k, v in here.items():
        assert v.tobytes() == streamed[k].tobytes() == shared[k].tobytes(), k


if __name__ == "__main__":  # a quick look: python tests/test_own_init.py [name prefixes]
    sys.exit(pytest.main([__file__, "-q"]))
