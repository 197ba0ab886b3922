"""Checkpoint formats: sharded safetensors that transformers' from_pretrained loads, DCP directories that
dcp.load reads into one process or FSDP2 ranks, written by 1, 2 or 4 ranks, and nothing a loader would take
left behind by a failure or a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paraminit.v1 import plan_pb2
from paraminit_client import Client, cli, param, plan_of
from paraminit_client.checkpoints import DistributedCheckpoint, ShardedSafetensors, format_for, shard_groups
from paraminit_client.errors import InvalidArgument, ParaminitError
from paraminit_client.inspect import inspect_file
from support import run_cli, running_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import torch.distributed as dist  # noqa: E402
from test_hf import gpt2_config, llama_config  # noqa: E402  (the same small configurations)

from paraminit_client.torch import meta_parameters, plan_from_module  # noqa: E402

WORLD_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with Client() as c:
        yield c


def gpt2() -> Any:
    return gpt2_config(n_embd=64, n_layer=3)


def llama() -> Any:
    return llama_config()


def model_plan(config: Any) -> plan_pb2.Plan:
    """The model's own initialization, recorded as transformers builds it."""
    with meta_parameters():
        model = transformers.AutoModelForCausalLM.from_config(config)
    return plan_from_module(model, seed=11)


def mixed_plan() -> plan_pb2.Plan:
    """float32, bfloat16 and float16 tensors, a region, a scalar and a row larger than a small DCP item."""
    return plan_of(
        [
            param("emb", [300, 40], {"normal": {"std": 0.02, "seed": 1}}),
            param("w", [64, 48], {"uniform": {"lo": -0.5, "hi": 0.5, "seed": 2}}, dtype="bfloat16"),
            param("part", [100, 30], {"normal": {"std": 1.0, "seed": 3}}, region=[(10, 70), (0, 30)]),
            param("h", [7, 5, 3], {"truncated_normal": {"std": 1.0, "lo": -2, "hi": 2, "seed": 4}}, dtype="float16"),
            param("scale", [], {"ones": {}}),
            param("wide", [2, 5000], {"normal": {"std": 0.1, "seed": 5}}),
        ]
    )


def same(a: np.ndarray[Any, Any], b: Any) -> bool:
    """Bit for bit: the plan's array and a torch tensor of the same shape and dtype."""
    assert tuple(a.shape) == tuple(b.shape), (a.shape, b.shape)
    raw = b.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bool(np.ascontiguousarray(a).tobytes() == raw)


# -- sharded safetensors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [gpt2, llama], ids=["gpt2", "llama"])
def test_sharded_safetensors_load_with_from_pretrained(client: Client, tmp_path: Path, config: Any) -> None:
    """Forced small shards: save_pretrained's names and index, every key loaded (none missing or unexpected),
    every tensor the plan's bytes."""
    cfg = config()
    plan = model_plan(cfg)
    out = tmp_path / "ckpt"
    header = client.materialize_to_file(plan, out, max_shard_size="64KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted([*shards, "model.safetensors.index.json"])
    want = client.materialize(plan)
    assert index["metadata"]["total_size"] == header.data_bytes == sum(v.nbytes for v in want.values())
    assert set(index["weight_map"]) == set(want) and len(header.tensors) == len(want)
    cfg.save_pretrained(out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    for name, values in want.items():
        assert same(values, state[name]), name
    report = inspect_file(out, plan)  # the directory reads as one checkpoint
    assert report.ok and len(report.rows) == len(want), [r.problems for r in report.rows if r.problems]
    assert report.metadata["plan_digest"] == header.plan_digest == client.validate(plan).plan_digest


def test_sharding_follows_save_pretrained_rule() -> None:
    assert shard_groups([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert shard_groups([], 8) == []


def test_one_shard_is_model_safetensors_and_stale_files_go(client: Client, tmp_path: Path) -> None:
    """A plan under the limit is model.safetensors with no index, as save_pretrained writes it; an earlier
    sharded write's index and shards, which a loader would take instead, are removed, other files kept."""
    plan = mixed_plan()
    out = tmp_path / "ckpt"
    client.materialize_to_file(plan, out, max_shard_size=20_000)
    assert (out / "model.safetensors.index.json").exists()
    (out / "config.json").write_text("{}")
    client.materialize_to_file(plan, out, max_shard_size="1GB")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    want = client.materialize(plan)
    from safetensors.numpy import load_file

    got = load_file(out / "model.safetensors")
    assert all(got[k].shape == v.shape and got[k].tobytes() == np.ascontiguousarray(v).tobytes() for k, v in want.items())


def test_shards_from_a_server_are_the_in_process_bytes(client: Client, tmp_path: Path) -> None:
    plan = mixed_plan()
    client.materialize_to_file(plan, tmp_path / "local", max_shard_size=20_000)
    with running_server() as r, Client(f"127.0.0.1:{r.port}", timeout=60) as remote:
        remote.materialize_to_file(plan, tmp_path / "remote", max_shard_size=20_000)
    names = sorted(os.listdir(tmp_path / "local"))
    assert len(names) > 2 and names == sorted(os.listdir(tmp_path / "remote"))
    for n in names:
        assert (tmp_path / "local" / n).read_bytes() == (tmp_path / "remote" / n).read_bytes(), n


class _FailingSource:
    """A client whose stream of the shard holding t4 breaks before its data (shards are read in parallel)."""

    def __init__(self, inner: Client) -> None:
        self.inner = inner

    def validate(self, plan: plan_pb2.Plan) -> Any:
        return self.inner.validate(plan)

    def materialize(self, plan: plan_pb2.Plan) -> Any:
        return self.inner.materialize(plan)

    def stream(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0, check_crc: bool = True) -> Any:
        header, chunks = self.inner.stream(plan, chunk_bytes=chunk_bytes, check_crc=check_crc)
        if "t4" not in [p.name for p in plan.params]:
            return header, chunks

        def broken() -> Iterator[Any]:
            chunks.close()  # type: ignore[attr-defined]
            raise ParaminitError(__import__("grpc").StatusCode.UNAVAILABLE, "the stream broke")
            yield

        return header, broken()


def test_a_failed_sharded_write_leaves_the_previous_checkpoint(client: Client, tmp_path: Path) -> None:
    """A shard that fails: no shard or index of the failed write, no hidden file, and the complete checkpoint
    written before it still there, whole (nothing is renamed until every shard is complete)."""
    plan = mixed_plan()
    out = tmp_path / "ckpt"
    client.materialize_to_file(plan, out, max_shard_size=20_000)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    other = plan_of([param(f"t{k}", [4000], {"normal": {"std": 1.0, "seed": 100 + k}}) for k in range(6)])
    with pytest.raises(ParaminitError, match="the stream broke"):
        ShardedSafetensors(20_000).write(_FailingSource(client), other, out)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_bad_shard_sizes_and_formats_are_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"params": [{"name": "w", "shape": [4], "init": {"ones": {}}}]}))
    for extra, said in (
        (["--max-shard-size", "5 parsecs"], "5GB, 500MB, 2GiB"),
        (["--max-shard-size", "0"], "not a positive size"),
        (["--format", "pickle"], "safetensors, dcp"),
        (["--format", "dcp", "--max-shard-size", "1GB"], "one data file per rank"),
    ):
        code, _, err = run_cli(capsys, "materialize", str(plan_file), "-o", str(tmp_path / "out"), *extra)
        assert code == cli.EXIT_USAGE and said in err, (extra, err)
        assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidArgument):
        format_for("dcp", "1GB")


def test_sigterm_mid_write_leaves_nothing_a_loader_takes(tmp_path: Path) -> None:
    """The CLI ended by SIGTERM while its shards are being written: no shard, index or hidden file stays."""
    plan_file = tmp_path / "plan.json"
    params = [{"name": f"layer{k}.weight", "shape": [1024, 1024], "init": {"normal": {"std": 0.02, "seed": k}}} for k in range(48)]
    plan_file.write_text(json.dumps({"params": params}))
    out = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraminit_client.cli", "materialize", str(plan_file), "-o", str(out), "--max-shard-size", "8MB", "-q"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_dir() and any(n.endswith(".part") for n in os.listdir(out)):
                break
            time.sleep(0.005)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM
    assert os.listdir(out) == []


# -- DCP ---------------------------------------------------------------------------------------------------


def _load_single(path: Path, plan: plan_pb2.Plan, client: Client) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    want = client.materialize(plan)
    from paraminit_client.torch_rules import TORCH_DTYPES

    state = {p.name: torch.full(list(want[p.name].shape), 7.0, dtype=TORCH_DTYPES[p.dtype]) for p in plan.params}  # poisoned
    if not dist.is_initialized():
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path))
    else:
        dcp.load(state, checkpoint_id=str(path))
    return state


def full_plan() -> plan_pb2.Plan:
    """mixed_plan without its region parameter (whose global tensor the checkpoint does not hold whole)."""
    plan = mixed_plan()
    del plan.params[2]
    return plan


def test_dcp_loads_in_one_process_to_the_plan_bytes(client: Client, tmp_path: Path) -> None:
    """Small items: each parameter stored as several row blocks (a row wider than an item alone); dcp.load
    reads every one back into poisoned tensors, bit for bit."""
    plan = full_plan()
    header = DistributedCheckpoint(item_bytes=4096).write(client, plan, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp"]
    want = client.materialize(plan)
    state = _load_single(tmp_path / "ckpt", plan, client)
    assert header.data_bytes == sum(v.nbytes for v in want.values())
    for name, values in want.items():
        assert same(values, state[name]), name


def test_dcp_from_the_cli_and_a_server(capsys: pytest.CaptureFixture[str], client: Client, tmp_path: Path) -> None:
    plan = full_plan()
    plan_file = tmp_path / "plan.json"
    from google.protobuf import json_format

    plan_file.write_text(json_format.MessageToJson(plan))
    code, _, err = run_cli(capsys, "materialize", str(plan_file), "-o", str(tmp_path / "cli"), "--format", "dcp")
    assert code == 0, err
    with running_server() as r, Client(f"127.0.0.1:{r.port}", timeout=60) as remote:
        remote.materialize_to_file(plan, tmp_path / "remote", format="dcp")
    for where in ("cli", "remote"):
        state = _load_single(tmp_path / where, plan, client)
        assert all(same(v, state[k]) for k, v in client.materialize(plan).items()), where


def dcp_writer(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with Client() as c:
            DistributedCheckpoint(item_bytes=8192).write(c, full_plan(), Path(out))
    finally:
        dist.destroy_process_group()


def fsdp_loader(rank: int, store: str, out: str, result: str) -> None:
    """FSDP2 on 2 ranks: a model whose parameters are the plan's, sharded, loads the checkpoint into its
    DTensor shards; the gathered tensors are written for the parent to compare."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Module()
        model.emb = nn.Parameter(torch.full((300, 40), 7.0))
        model.wide = nn.Parameter(torch.full((2, 5000), 7.0))
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=out)
        full = {k: v.full_tensor() for k, v in state.items()}
        if rank == 0:
            torch.save(full, result)
        dist.barrier()  # both ranks done with the group before either tears it down
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_written_by_1_2_and_4_ranks_loads_to_the_same_tensors(client: Client, tmp_path: Path) -> None:
    """Each world size writes one data file per rank with that rank's share and one metadata; every checkpoint
    loads to the plan's bytes in one process, and into FSDP2 on 2 ranks."""
    import torch.multiprocessing as mp

    plan = full_plan()
    want = client.materialize(plan)
    for world in WORLD_SIZES:
        out = tmp_path / f"w{world}"
        mp.start_processes(
            dcp_writer, args=(world, str(tmp_path / f"store{world}"), str(out)), nprocs=world, join=True, start_method="spawn"
        )
        assert sorted(os.listdir(out)) == sorted([".metadata", *(f"__{r}_0.distcp" for r in range(world))])
        state = _load_single(out, plan, client)
        assert all(same(v, state[k]) for k, v in want.items()), world
    result = tmp_path / "fsdp.pt"
    mp.start_processes(
        fsdp_loader, args=(str(tmp_path / "fsdp-store"), str(tmp_path / "w4"), str(result)), nprocs=2, join=True, start_method="spawn"
    )
    loaded = torch.load(result)
    assert same(want["emb"], loaded["emb"]) and same(want["wide"], loaded["wide"])


def test_torchtitan_takes_the_dcp_checkpoint_as_its_initial_load(client: Client, tmp_path: Path) -> None:
    """torchtitan's Llama 3 debug model (2 layers, q/k/v unfused: a fused wqkv is one parameter that the state
    dict splits into three keys), its own initialization as a plan, written as DCP and read back by
    torchtitan's CheckpointManager.dcp_load the way an initial, model-only load reads a seed checkpoint: every
    tensor of its state dict the plan's bytes."""
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from torchtitan.components.checkpointer import MODEL, ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.models import llama3

    cfg = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    hidden = llama3.compute_ffn_hidden_dim(256, multiple_of=256)
    rope = cfg.layers[0].attention.rope
    cfg.layers = llama3._build_llama3_layers(
        n_layers=2, dim=256, n_heads=16, hidden_dim=hidden, rope=rope, fuse_qkv=False, attn_backend="flex"
    )
    with torch.device("meta"):
        model = cfg.build()
    plan = plan_from_module(model, seed=3)  # its own init_weights, replayed
    client.materialize_to_file(plan, tmp_path / "seed", format="dcp")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(7.0)  # poisoned: what the load does not write stays 7
    wrapper = ModelWrapper(model)
    manager = SimpleNamespace(states={MODEL: wrapper}, sd_adapter=None)
    CheckpointManager.dcp_load(manager, wrapper.state_dict(), checkpoint_id=str(tmp_path / "seed"), from_hf=False, from_quantized=False)  # type: ignore[arg-type]
    want = client.materialize(plan)
    state = model.state_dict()
    assert set(want) == set(state)
    for name, values in want.items():
        assert same(values, state[name]), name


def test_a_plan_over_the_per_plan_limit_is_written_a_shard_at_a_time(tmp_path: Path) -> None:
    """Sharded and DCP writes read the plan a part at a time: the per-plan limit binds each part, not the
    whole (a model larger than one call may hold is written whole); a parameter over the per-parameter limit
    is still refused before anything is written."""
    plan = plan_of([param(f"w{k}", [4096], {"normal": {"std": 1.0, "seed": k}}) for k in range(8)])
    with running_server(max_plan_bytes=40_000) as r, Client(f"127.0.0.1:{r.port}", timeout=60) as c:
        assert not c.validate(plan).fits_limits
        with pytest.raises(ParaminitError) as info:
            c.materialize_to_file(plan, tmp_path / "one.safetensors")
        assert info.value.code.name == "RESOURCE_EXHAUSTED"
        c.materialize_to_file(plan, tmp_path / "shards", max_shard_size=40_000)
        c.materialize_to_file(plan, tmp_path / "dcp", format="dcp")
        assert len(os.listdir(tmp_path / "shards")) == 5
        big = plan_of([param("huge", [20_000], {"zeros": {}})])
        with pytest.raises(ParaminitError) as info:
            c.materialize_to_file(big, tmp_path / "big", max_shard_size=40_000)
        assert info.value.code.name == "RESOURCE_EXHAUSTED" and not (tmp_path / "big").exists()
