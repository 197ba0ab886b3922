"""GPT-2 small in plain torch.nn: PyTorch's own CPU initialization against paraminit, in one run.

Rows: constructing the model on the CPU (PyTorch's reset_parameters, including
the lm_head's discarded init before tying), and building it on `meta` followed
by materialize_module from an embedded Client() with STREAM delivery and with
zero-copy SHM delivery (plan_from_module included). Also the size of the plan
against the size of the weights it names. Target: paraminit >= 3x faster.

    python bench/torch_model.py [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _common import serve
from torch import nn
from torch.nn import functional as F

from paraminit_client import Client
from paraminit_client.exports import Lease
from paraminit_client.torch import materialize_module, plan_from_module

VOCAB, CTX, D, LAYERS, HEADS = 50257, 1024, 768, 12, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.c_attn = nn.Linear(D, 3 * D)
        self.attn_proj = nn.Linear(D, D)
        self.ln_2 = nn.LayerNorm(D)
        self.c_fc = nn.Linear(D, 4 * D)
        self.c_proj = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(D, dim=2))
        x = x + self.attn_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))
        out: torch.Tensor = x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return out


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CTX, D)
        self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight


def on_meta() -> GPT2:
    with torch.device("meta"):
        return GPT2()


def timed(fn: Callable[[], object], repeat: int, after: Callable[[object], None] = lambda _: None) -> list[float]:
    """Seconds of each call; `after` (e.g. releasing a lease) runs outside the timed part."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t)
        after(result)
        del result
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    on_meta()  # the first meta construction registers meta kernels (a one-time cost of the process)
    GPT2()
    pytorch = timed(GPT2, args.repeat)

    t = time.perf_counter()
    local = Client()  # in process, CPU backend; kernels load from numba's cache on a thread
    startup = time.perf_counter() - t
    plan = plan_from_module(on_meta(), seed=0)
    plan_s = timed(lambda: plan_from_module(on_meta(), seed=0), args.repeat)

    def via(client: Client, delivery: str) -> Callable[[], tuple[GPT2, Lease | None]]:
        def run() -> tuple[GPT2, Lease | None]:
            model = on_meta()
            lease = materialize_module(model, client, delivery=delivery, plan=plan_from_module(model, seed=0))
            return model, lease
        return run

    def release(result: object) -> None:
        lease = result[1] if isinstance(result, tuple) else None
        if isinstance(lease, Lease):
            lease.release()

    via(local, "auto")()  # first request waits for the kernels to load
    in_process = timed(via(local, "auto"), args.repeat)
    model, _ = via(local, "auto")()
    weight_bytes = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    local.close()
    with serve(env={"PARAMINIT_THREADS": str(args.threads)}) as target, Client(target) as remote:
        via(remote, "stream")()
        stream = timed(via(remote, "stream"), args.repeat)
        shm = timed(via(remote, "shm"), args.repeat, release)

    plan_bytes = len(plan.SerializeToString())
    ref = min(pytorch)
    print(f"GPT-2 small ({sum(p.numel() for p in on_meta().parameters()):,} parameters), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best and median of {args.repeat}")
    head = f"{'what':<52} {'best s':>8} {'median s':>9} {'x PyTorch':>10}"
    print(head)
    print("-" * len(head))
    rows = [("PyTorch nn.Module on cpu (own init)", pytorch),
            ("paraminit: meta + plan + materialize, in process", in_process),
            ("paraminit: ... from local server, SHM", shm),
            ("paraminit: ... from local server, STREAM", stream),
            ("  of which: meta build + plan_from_module", plan_s)]
    for name, times in rows:
        print(f"{name:<52} {min(times):>8.3f} {statistics.median(times):>9.3f} {ref / min(times):>10.2f}")
    print(f"{'in-process Client() start (once per process)':<52} {startup:>8.3f}")
    print(f"plan {plan_bytes:,} bytes ({len(plan.params)} params) vs weights {weight_bytes:,} bytes: "
          f"{weight_bytes / plan_bytes:,.0f}x smaller")


if __name__ == "__main__":
    main()
