"""Topology-independent sharded init: 4 CPU processes on gloo, a 2x2 mesh; every rank fills only its shard,
and the gathered tensors are the single-process materialization bit for bit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo", allow_module_level=True)

from torch import nn  # noqa: E402

from paraminit.v1 import plan_pb2  # noqa: E402
from paraminit_client import Client  # noqa: E402
from paraminit_client.distributed import local_region, materialize_region  # noqa: E402
from paraminit_client.torch import materialize_module, plan_from_module  # noqa: E402

WORLD = 4
SEED = 11


class Shapes(nn.Module):
    """Parameters of awkward shapes: uneven splits, a shard that comes out empty, a padding row, bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(13, 7))
        self.b = nn.Parameter(torch.empty(10, 6, dtype=torch.bfloat16))
        self.c = nn.Parameter(torch.empty(9, 4))
        self.d = nn.Parameter(torch.empty(5))
        self.e = nn.Parameter(torch.empty(3, 8, dtype=torch.float16))
        self.f = nn.Parameter(torch.empty(3, 5))
        self.emb = nn.Embedding(11, 6, padding_idx=4)


def shapes_overrides(name: str, t: torch.Tensor) -> Any:
    return None if name.startswith("emb") else {"normal": {"std": 1.0}}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 18)
        self.down = nn.Linear(18, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def reference(build: Any, client: Client, **kw: Any) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = build()
    materialize_module(model, client, seed=SEED, **kw)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.flatten().view(torch.uint8), y.flatten().view(torch.uint8))


def check_sharded(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    """Every parameter is a DTensor holding exactly its box, allocated alone, with the single-process bytes."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        local = p.to_local()
        box = local_region(p.shape, p.device_mesh, p.placements)
        assert tuple(local.shape) == tuple(b - a for a, b in box), name
        shards = [(pl.dim, p.device_mesh.size(i)) for i, pl in enumerate(p.placements) if pl.is_shard()]
        if shards:  # only the shard is allocated (FSDP2 may pad dim 0 up to an even split)
            dim0 = math.prod(n for d, n in shards if d == 0)
            padded = max(local.numel(), math.ceil(p.shape[0] / dim0) * math.prod(p.shape[1:]) if dim0 > 1 else 0)
            assert local.untyped_storage().nbytes() <= padded * p.element_size() < p.numel() * p.element_size(), name
        assert same_bits(p.full_tensor(), want[name]), name
        assert same_bits(local, want[name][tuple(slice(a, b) for a, b in box)]), name


def worker(rank: int, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with Client() as client:
            # 1. DTensors by hand on the 2-D mesh: Shard on either dim, the same dim twice, Replicate, uneven
            want = reference(Shapes, client, overrides=shapes_overrides)
            assert want["emb.weight"][4].count_nonzero() == 0 and want["a"].count_nonzero() == want["a"].numel()
            layout = {
                "a": (Shard(0), Shard(1)),
                "b": (Shard(1), Shard(0)),
                "c": (Shard(0), Shard(0)),
                "d": (Replicate(), Shard(0)),
                "e": (Replicate(), Replicate()),
                "f": (Shard(0), Shard(0)),
                "emb.weight": (Replicate(), Shard(0)),
            }
            with torch.device("meta"):
                model = Shapes()
            for name, placements in layout.items():
                owner = model.emb if name == "emb.weight" else model
                key = name.rsplit(".", 1)[-1]
                setattr(owner, key, nn.Parameter(distribute_tensor(getattr(owner, key), mesh, list(placements))))
            materialize_module(model, client, seed=SEED, overrides=shapes_overrides)
            check_sharded(model, want)

            # 2. tensor parallelism on the tp dimension, then FSDP2 (HSDP: replicate on dp, shard in the group)
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            want = reference(MLP, client)
            with torch.device("meta"):
                tp_model = MLP()
            parallelize_module(tp_model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            materialize_module(tp_model, client, seed=SEED)
            check_sharded(tp_model, want)
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
            single = MLP()
            single.load_state_dict(want)
            assert torch.allclose(tp_model(x), single(x), atol=1e-6)

            with torch.device("meta"):
                fsdp_model = MLP()
            fully_shard(fsdp_model, mesh=mesh)
            materialize_module(fsdp_model, client, seed=SEED)
            check_sharded(fsdp_model, want)
            out = fsdp_model(x)
            out.sum().backward()
            assert torch.allclose(out, single(x), atol=1e-6)

            # 3. by hand: global shape and region in, local tensor out
            plan = {p.name: p for p in plan_from_module(_meta(Shapes), SEED, overrides=shapes_overrides).params}
            part = materialize_region(plan["a"], [(2, 9), slice(3, None)], client)
            assert same_bits(part, reference(Shapes, client, overrides=shapes_overrides)["a"][2:9, 3:])
            assert isinstance(plan["a"], plan_pb2.Param)
        dist.barrier()  # every rank done with the group before any tears it down (gloo can abort otherwise)
    finally:
        dist.destroy_process_group()


def _meta(build: Any) -> nn.Module:
    with torch.device("meta"):
        module: nn.Module = build()
    return module


@pytest.mark.slow
def test_2x2_mesh_gathers_the_single_process_bytes(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True, start_method="spawn")
