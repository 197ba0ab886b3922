"""Per-rank time to an initialized FSDP2-sharded torchtitan Llama 3, three ways (gloo ranks on this host's CPUs).

- paraminit: ``materialize_module(model, Client(), policy="torchtitan")`` on the sharded meta model; each rank
  generates only its own shards (the in-process CPU backend, warmed up first as a running server would be).
- torchtitan init_weights: ``to_empty`` + ``init_weights(buffer_device=...)`` on the sharded model.
- seed checkpoint: torchtitan's workaround for topology-dependent init. One process builds the whole model,
  initializes it and saves it with ``torch.distributed.checkpoint``; then every rank ``to_empty``s its
  sharded model, computes its buffers and loads its shard. Its per-rank time counts the save (every rank
  waits for it) plus the rank's load.

Every rank of a way starts together; the table gives the slowest rank's seconds (a step ends when its
slowest rank does). Before timing, paraminit's bytes are checked: the gathered parameters equal the
single-process materialization of the same plan (rank 0 compares).

    python bench/torchtitan_init.py [--flavor debugmodel] [--ranks 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _build(flavor: str, dtype: str) -> Any:
    import torch
    from torchtitan.models.llama3 import llama3_configs

    with torch.device("meta"):
        model = llama3_configs[flavor](attn_backend="flex").build()
    return model.to(getattr(torch, dtype))


def _shard(model: Any, ranks: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _buffers(model: Any) -> None:
    import torch
    from torchtitan.protocols.module import Module

    for mod in model.modules():
        if isinstance(mod, Module) and mod._buffers:
            mod._init_self_buffers(buffer_device=torch.device("cpu"))


def worker(way: str, flavor: str, dtype: str, ranks: int, ckpt: str) -> dict[str, Any]:
    """One rank of one way; returns its seconds (and, for paraminit on rank 0, the byte check)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from paraminit_client import Client
    from paraminit_client.torch import materialize_module

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    model = _shard(_build(flavor, dtype), ranks)
    out: dict[str, Any] = {"rank": rank}
    client = Client()
    if way == "paraminit":
        warm = torch.nn.Linear(4, 4, device="meta")
        materialize_module(warm, client)  # the backend's kernels loaded, as in a running server
    dist.barrier()
    t0 = time.perf_counter()
    if way == "paraminit":
        materialize_module(model, client, policy="torchtitan")
    elif way == "titan":
        model.to_empty(device="cpu")
        model.init_weights(buffer_device=torch.device("cpu"))
    else:
        model.to_empty(device="cpu")
        _buffers(model)
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd)
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    if way == "paraminit":  # one gathered parameter at a time: rank 0 compares it with the single process
        single = dict(materialize_single(flavor, dtype, client).named_parameters()) if rank == 0 else {}
        equal, count = True, 0
        for n, p in model.named_parameters():
            full = p.full_tensor()
            count += full.numel()
            if rank == 0:
                equal &= bool(torch.equal(full.view(torch.uint8), single[n].detach().view(torch.uint8)))
            del full
        out["bytes_equal"], out["params"] = equal, count
    client.close()
    dist.destroy_process_group()
    return out


def materialize_single(flavor: str, dtype: str, client: Any) -> Any:
    """The whole model in this process, from the same plan: the bytes every sharding must reproduce."""
    from paraminit_client.torch import materialize_module

    single = _build(flavor, dtype)
    materialize_module(single, client, policy="torchtitan")
    return single


def save_seed_checkpoint(flavor: str, dtype: str, ckpt: str) -> float:
    """torchtitan's seed checkpoint: the whole model initialized in one process and saved; returns seconds."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torchtitan.models.llama3  # noqa: F401  (imported before the clock starts, as in the ranks)

    t0 = time.perf_counter()
    model = _build(flavor, dtype)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    dcp.save(model.state_dict(), checkpoint_id=ckpt, no_dist=True)
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(way: str, args: argparse.Namespace, ckpt: str) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(args.ranks),
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    way,
                    "--flavor",
                    args.flavor,
                    "--dtype",
                    args.dtype,
                    "--ranks",
                    str(args.ranks),
                    "--ckpt",
                    ckpt,
                    "--out",
                    f"{tmp}/r{r}.json",
                ],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(args.ranks)
        ]
        codes = [p.wait(args.timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"{way}: ranks exited with {codes}")
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(args.ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.worker, args.flavor, args.dtype, args.ranks, args.ckpt)))
        return
    with tempfile.TemporaryDirectory() as ckpt:
        ours = run_ranks("paraminit", args, ckpt)
        if not ours[0].get("bytes_equal"):
            raise SystemExit("MISMATCH: sharded paraminit bytes differ from the single-process materialization")
        theirs = run_ranks("titan", args, ckpt)
        save_s = save_seed_checkpoint(args.flavor, args.dtype, ckpt)
        load = run_ranks("load", args, ckpt)
    slowest = {w: max(r["seconds"] for r in rs) for w, rs in (("paraminit", ours), ("titan", theirs), ("load", load))}
    rows = [
        ("paraminit materialize_module (torchtitan policy)", slowest["paraminit"]),
        ("torchtitan to_empty + init_weights", slowest["titan"]),
        ("seed checkpoint: save (1 process) + load (per rank)", save_s + slowest["load"]),
    ]
    print(
        f"\nLlama 3 {args.flavor}, {ours[0]['params'] / 1e6:.1f}M parameters, {args.dtype}, FSDP2 over "
        f"{args.ranks} gloo ranks on {os.cpu_count()} CPUs; seconds of the slowest rank"
    )
    print(f"{'way':<54} {'seconds':>8} {'x paraminit':>12}")
    for name, s in rows:
        print(f"{name:<54} {s:8.2f} {s / slowest['paraminit']:12.2f}")
    print(f"  (seed checkpoint: save {save_s:.2f} s, load {slowest['load']:.2f} s; paraminit bytes checked)")


if __name__ == "__main__":
    if str(ROOT / "client") not in sys.path:  # a source tree run without installing
        sys.path[:0] = [str(ROOT / sub) for sub in ("proto", "server", "client")]
    main()
