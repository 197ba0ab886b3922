"""paraminit_client.jax on a 2x2 mesh of CPU devices (conftest sets XLA_FLAGS): bytes per shard, layouts, and a
Flax NNX twin of a PyTorch MLP initialized from the PyTorch model's plan."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from paraminit.v1 import plan_pb2  # noqa: E402
from paraminit_client import Client, param, plan_of  # noqa: E402
from paraminit_client import jax as pjax  # noqa: E402

PLAN = plan_of(
    [
        param("emb", [8, 12], {"normal": {"std": 0.02, "seed": 1}}, "bfloat16"),
        param("w", [12, 16], {"truncatedNormal": {"std": 0.02, "lo": -0.04, "hi": 0.04, "seed": 2}}),
        param("k", [6, 4, 8], {"kaimingUniformForShape": {"seed": 3}}, "float16"),
        param("b", [16], {"uniform": {"lo": -1, "hi": 1, "seed": 4}}, "float64"),
        param("g", [4], {"ones": {}}),
        param("f8", [8, 16], {"normal": {"std": 0.5, "seed": 5}}, "float8_e4m3fn"),
    ]
)


class Recording(Client):
    """An in-process client that keeps the plans it was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[plan_pb2.Plan] = []

    def materialize(self, plan: plan_pb2.Plan, **kw: Any) -> dict[str, np.ndarray[Any, Any]]:
        self.plans.append(plan)
        return super().materialize(plan, **kw)


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """float64 arrays for the duration (JAX holds float32 by default)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    if jax.device_count() < 4:
        pytest.skip("JAX was initialized before XLA_FLAGS asked for 4 CPU devices")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))


@pytest.fixture(scope="module")
def whole() -> dict[str, np.ndarray[Any, Any]]:
    with Client() as c:
        return c.materialize(PLAN)


def test_mixed_partition_specs_give_the_single_process_bytes(mesh: Mesh, whole: dict[str, Any]) -> None:
    shardings = {
        "emb": NamedSharding(mesh, P()),
        "w": NamedSharding(mesh, P("x", "y")),
        "k": NamedSharding(mesh, P(None, "y", "x")),
        "b": NamedSharding(mesh, P("y")),
        "f8": NamedSharding(mesh, P("y", "x")),
    }
    layouts = {"w": (1, 0), "k": (2, 0, 1)}
    client = Recording()
    with x64():
        got = pjax.materialize(PLAN, client, shardings=shardings, layouts=layouts)
    for name, want in whole.items():
        arr = got[name]
        perm = layouts.get(name, tuple(range(want.ndim)))
        full = np.ascontiguousarray(want.transpose(perm))
        assert arr.dtype == full.dtype and arr.shape == full.shape, name
        assert np.asarray(arr).tobytes() == full.tobytes(), name
        for shard in arr.addressable_shards:  # every device holds exactly its own slice
            assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(full[shard.index]).tobytes(), name
    assert got["emb"].dtype == jax.numpy.bfloat16 and got["k"].dtype == jax.numpy.float16
    assert got["f8"].dtype == jax.numpy.float8_e4m3fn
    assert got["g"].sharding.device_set == {jax.local_devices()[0]}  # no sharding: one device
    # one request; each sharded tensor asked for by quarter or half boxes, a replicated one once and whole
    (asked,) = client.plans
    regions: dict[str, list[list[tuple[int, int]]]] = {}
    for q in asked.params:
        regions.setdefault(q.name.rsplit("@", 1)[0], []).append([(r.start, r.stop) for r in q.region])
    assert regions["emb"] == [[]] and regions["g"] == [[]]
    assert sorted(regions["w"]) == [[(a, a + 6), (c, c + 8)] for a in (0, 6) for c in (0, 8)]  # plan layout
    assert sorted(regions["k"]) == [[(a, a + 3), (c, c + 2), (0, 8)] for a in (0, 3) for c in (0, 2)]
    assert sorted(regions["b"]) == [[(0, 8)], [(8, 16)]]
    assert sorted(regions["f8"]) == [[(a, a + 4), (c, c + 8)] for a in (0, 4) for c in (0, 8)]


def test_one_sharding_for_all_and_errors(mesh: Mesh, whole: dict[str, Any]) -> None:
    with x64():
        got = pjax.materialize(PLAN, shardings=NamedSharding(mesh, P()))
        with pytest.raises(ValueError, match="permutation"):
            pjax.materialize(PLAN, layouts={"w": (0, 0)})
        with pytest.raises(ValueError, match="'nope'"):
            pjax.materialize(PLAN, shardings={"nope": NamedSharding(mesh, P())})
    assert all(np.asarray(got[n]).tobytes() == whole[n].tobytes() for n in whole)
    assert len(got["w"].sharding.device_set) == 4
    with pytest.raises(ValueError, match="jax_enable_x64"):  # never a silent float32
        pjax.materialize(PLAN)
    region = plan_of([param("r", [4, 4], {"zeros": {}}, region=[(0, 2), (0, 4)])])
    with pytest.raises(ValueError, match="region"):
        pjax.materialize(region)


def test_flax_nnx_twin_of_a_torch_mlp(mesh: Mesh) -> None:
    torch = pytest.importorskip("torch")
    nnx = pytest.importorskip("flax.nnx")
    from paraminit_client.torch import materialize_module, plan_from_module

    with torch.device("meta"):
        tmodel = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    plan = plan_from_module(tmodel, seed=7, policy="torch")
    with Client() as c:
        materialize_module(tmodel, c, plan=plan)

    class Mlp(nnx.Module):  # type: ignore[misc]
        def __init__(self, rngs: Any) -> None:
            self.l0 = nnx.Linear(8, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.l2(jax.nn.relu(self.l0(x)))

    fmodel = Mlp(nnx.Rngs(0))
    arrays = pjax.materialize(
        plan,
        layouts={"0.weight": (1, 0), "2.weight": (1, 0)},
        shardings={
            "0.weight": NamedSharding(mesh, P(None, "x")),
            "2.weight": NamedSharding(mesh, P("y", None)),
            "0.bias": NamedSharding(mesh, P()),
            "2.bias": NamedSharding(mesh, P()),
        },
    )
    for layer, name in ((fmodel.l0, "0"), (fmodel.l2, "2")):
        layer.kernel.set_value(arrays[f"{name}.weight"])
        layer.bias.set_value(arrays[f"{name}.bias"])
    state = tmodel.state_dict()
    for name, leaf in (("0.weight", fmodel.l0.kernel), ("2.weight", fmodel.l2.kernel)):
        assert np.asarray(leaf.get_value()).tobytes() == state[name].numpy().T.copy().tobytes()
    assert np.asarray(fmodel.l0.bias.get_value()).tobytes() == state["0.bias"].numpy().tobytes()
    assert float(np.abs(state["0.weight"].numpy()).max()) > 0  # not all zeros
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    want = tmodel(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(fmodel(x)), want, rtol=1e-5, atol=1e-6)
