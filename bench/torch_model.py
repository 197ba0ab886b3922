"""GPT-2 small in plain torch.nn: PyTorch's own CPU initialization against paraminit, in one run.

Rows: constructing the model on the CPU (PyTorch's reset_parameters, including
the lm_head's discarded init before tying), and building it on `meta` followed
by materialize_module from an embedded Client() with STREAM delivery and with
zero-copy SHM delivery (plan_from_module included), and SHM from a server that pools
released segments (PARAMINIT_SHM_POOL_BYTES), which shows what a fresh tmpfs segment
costs; and the first SHM call of a freshly started server (nothing warm in it). Also the size of the
plan against the size of the weights it names. Targets: in process >= 4x PyTorch's own init, SHM (fresh
segments) >= 2.5x, SHM on a fresh server's first call >= 2.5x; with transformers, meta +
materialize_module(policy="hf") over STREAM from a local server >= 3x GPT2LMHeadModel(config).

    python bench/torch_model.py [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from _common import host_line, serve
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
        first_shm = timed(via(remote, "shm"), 1, release)  # the fresh server's first call
        via(remote, "stream")()
        stream = timed(via(remote, "stream"), args.repeat)
        shm = timed(via(remote, "shm"), args.repeat, release)
    # a server that keeps released segments (PARAMINIT_SHM_POOL_BYTES): the next export reuses pages already
    # faulted in, instead of a fresh tmpfs segment (allocated and first touched: most of the SHM row's time)
    pool_env = {"PARAMINIT_THREADS": str(args.threads), "PARAMINIT_SHM_POOL_BYTES": str(1 << 30)}
    with serve(env=pool_env) as target, Client(target) as remote:
        release(via(remote, "shm")())
        shm_pooled = timed(via(remote, "shm"), args.repeat, release)

    plan_bytes = len(plan.SerializeToString())
    ref = min(pytorch)
    print(
        f"GPT-2 small ({sum(p.numel() for p in on_meta().parameters()):,} parameters), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, best and median of {args.repeat}"
    )
    head = f"{'what':<52} {'best s':>8} {'median s':>9} {'x PyTorch':>10}"
    print(head)
    print("-" * len(head))
    rows = [
        ("PyTorch nn.Module on cpu (own init)", pytorch),
        ("paraminit: meta + plan + materialize, in process", in_process),
        ("paraminit: ... from local server, SHM", shm),
        ("paraminit: ... SHM, a fresh server's first call", first_shm),
        ("paraminit: ... SHM, segments pooled by the server", shm_pooled),
        ("paraminit: ... from local server, STREAM", stream),
        ("  of which: meta build + plan_from_module", plan_s),
    ]
    for name, times in rows:
        print(f"{name:<52} {min(times):>8.3f} {statistics.median(times):>9.3f} {ref / min(times):>10.2f}")
    print(f"{'in-process Client() start (once per process)':<52} {startup:>8.3f}")
    print(host_line())
    print("targets (best against best)")
    for name, times, want in (("in process", in_process, 4.0), ("SHM", shm, 2.5), ("SHM, fresh server's first call", first_shm, 2.5)):
        got = ref / min(times)
        print(f"  {name + ' vs PyTorch own init':<40} {got:6.2f}x  (target >= {want:.1f}x)  {'ok' if got >= want else 'MISSED'}")
    print(
        f"plan {plan_bytes:,} bytes ({len(plan.params)} params) vs weights {weight_bytes:,} bytes: "
        f"{weight_bytes / plan_bytes:,.0f}x smaller"
    )


# -- Hugging Face transformers: policy="hf" against from_config --------------------------


def _hf_groups(model: nn.Module) -> dict[str, torch.Tensor]:
    """Floating tensors grouped by name without layer numbers (h.0.attn.c_proj.weight -> h.attn.c_proj.weight)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            out.setdefault(".".join(p for p in name.split(".") if not p.isdigit()), []).append(t.detach().flatten())
    return {k: torch.cat(v) for k, v in out.items()}


def _hf_loss(model: nn.Module, vocab: int) -> float:
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def hf_rows(repeat: int) -> None:
    """transformers GPT2LMHeadModel (GPT-2 small config): from_config against meta + materialize_module(policy="hf")."""
    try:
        import transformers
    except ImportError:
        print("transformers rows skipped: transformers is not installed")
        return
    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM, GPT2Config

    def theirs(cfg: GPT2Config) -> nn.Module:
        model: nn.Module = AutoModelForCausalLM.from_config(cfg)
        return model

    def ours(cfg: GPT2Config, client: Client) -> nn.Module:
        with torch.device("meta"):
            model: nn.Module = AutoModelForCausalLM.from_config(cfg)
        materialize_module(model, client, policy="hf")
        return model

    def over_stream(cfg: GPT2Config, client: Client) -> nn.Module:
        with torch.device("meta"):
            model: nn.Module = AutoModelForCausalLM.from_config(cfg)
        materialize_module(model, client, delivery="stream", policy="hf")
        return model

    cfg = GPT2Config()
    with serve() as target, Client(target) as remote:
        over_stream(cfg, remote)
        streamed = timed(lambda: over_stream(cfg, remote), repeat)
    with Client() as client:
        theirs(cfg)
        ours(cfg, client)  # first use: meta kernels, lazy imports
        base = timed(lambda: theirs(cfg), repeat)
        fast = timed(lambda: ours(cfg, client), repeat)
        torch.manual_seed(0)
        a, b = _hf_groups(theirs(cfg)), _hf_groups(ours(cfg, client))
        loss_small = (_hf_loss(theirs(cfg), cfg.vocab_size), _hf_loss(ours(cfg, client), cfg.vocab_size))
        tiny = GPT2Config(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        loss_tiny = (_hf_loss(theirs(tiny), 1000), _hf_loss(ours(tiny, client), 1000))

    print(
        f"\ntransformers {transformers.__version__} GPT2LMHeadModel, GPT-2 small config, "
        f"{torch.get_num_threads()} threads, best and median of {repeat}"
    )
    head = f"{'what':<52} {'best s':>8} {'median s':>9} {'x HF':>10}"
    print(head)
    print("-" * len(head))
    for name, times in (
        ("AutoModelForCausalLM.from_config (HF init)", base),
        ("paraminit: meta + materialize_module(policy=hf)", fast),
        ("  ... from a local server, STREAM", streamed),
    ):
        print(f"{name:<52} {min(times):>8.3f} {statistics.median(times):>9.3f} {min(base) / min(times):>10.2f}")
    got = min(base) / min(streamed)
    print(f"target: STREAM from a local server vs HF init {got:.2f}x (target >= 3.0x)  {'ok' if got >= 3.0 else 'MISSED'}")
    print(f"\n{'group (layers pooled)':<40} {'HF std':>10} {'ours std':>10} {'ratio':>7}")
    for key in a:
        x, y = a[key].float(), b[key].float()
        ratio = f"{float(y.std() / x.std()):.4f}" if x.std() > 0 else "const" if torch.equal(x, y) else "DIFF"
        print(f"{key:<40} {float(x.std()):>10.5f} {float(y.std()):>10.5f} {ratio:>7}")
    print(
        f"\ninitial loss, random tokens (4x64): GPT-2 small: HF {loss_small[0]:.3f}, paraminit hf {loss_small[1]:.3f} "
        f"(ln V = {math.log(cfg.vocab_size):.3f})"
    )
    print(f"tiny GPT-2 (vocab 1000): HF {loss_tiny[0]:.3f}, paraminit hf {loss_tiny[1]:.3f} (ln V = {math.log(1000):.3f})")


if __name__ == "__main__":
    main()
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--repeat", type=int, default=5)
    hf_rows(known.parse_known_args()[0].repeat)
