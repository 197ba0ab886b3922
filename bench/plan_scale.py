"""Plans of many small parameters: validate and materialize, in process and through a server, against PyTorch.

N parameters of [16, 16] float32, each `normal(0, 0.02)` with its own seed (the shape of a mixture-of-experts
model's tensor count). Rows, for each N:
- build: the plan message (client side, not counted below);
- validate: `Client.validate` in process;
- in process: `Client().materialize` (CPU backend in this process);
- PyTorch: `torch.empty(16, 16).normal_(0, 0.02)` N times (the same tensors);
- server: `Client(target).materialize` from a `paraminit serve` subprocess, and the server's RSS before and
  after (VmRSS) and its peak (VmHWM).
Targets: in process >= 1.0x PyTorch; through a server (STREAM) >= 1.0x PyTorch at 100k parameters and
>= 0.5x at 600k, within the server's default memory budget; validate 100k parameters < 0.2 s. The host's CPU model
and `ndarray.fill` GB/s are printed first, to tell hosts apart. Times are best and median of --repeat (1 for counts over 100k).

    python bench/plan_scale.py [--counts 10000,100000,600000] [--repeat 3] [--no-server]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for sub in ("proto", "server", "client", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from _common import PIDS, host_line, serve  # noqa: E402

from paraminit.v1 import plan_pb2  # noqa: E402
from paraminit_client import Client  # noqa: E402

SHAPE = (16, 16)
SERVER_TARGETS = {100_000: 1.0, 600_000: 0.5}  # N -> x PyTorch through a server


def make_plan(n: int) -> Any:
    """n parameters of SHAPE, normal(0, 0.02), seed i."""
    plan = plan_pb2.Plan()
    for i in range(n):
        p = plan.params.add(name=f"e{i}", shape=SHAPE)
        p.init.normal.std, p.init.normal.seed = 0.02, i
    return plan


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="10000,100000,600000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    os.environ.setdefault("PARAMINIT_THREADS", str(args.threads))
    torch: Any = None
    try:
        import torch as torch_module

        torch = torch_module
        torch.set_num_threads(args.threads)
    except ImportError as exc:
        print(f"torch rows skipped: {exc}")
    print(f"{host_line()}; {args.threads} threads; shape {list(SHAPE)} float32 normal; best and median")
    local = Client()
    local.materialize(make_plan(2))  # waits for the kernels (compiled or loaded) outside the timings
    head = f"{'N':>8} {'what':<34} {'best s':>8} {'median s':>9} {'us/param':>9} {'x PyTorch':>10}"
    checks: list[tuple[str, float, float, bool]] = []  # name, got, want, higher is better
    results: dict[int, dict[str, list[float]]] = {}
    notes: list[str] = []
    for n in counts:
        repeat = args.repeat if n <= 100_000 else 1
        row: dict[str, list[float]] = {}
        t = time.perf_counter()
        plan = make_plan(n)
        row["build plan (client side)"] = [time.perf_counter() - t]
        row["validate, in process"] = timed(functools.partial(local.validate, plan), repeat)
        row["materialize, in process"] = timed(functools.partial(local.materialize, plan), repeat)
        if torch is not None:
            row["PyTorch empty + normal_"] = timed(lambda n=n: [torch.empty(SHAPE).normal_(0.0, 0.02) for _ in range(n)], repeat)
        results[n] = row
        if not args.no_server:
            try:
                with serve(env={"PARAMINIT_THREADS": str(args.threads)}) as target, Client(target) as remote:
                    pid = PIDS[target]
                    before = rss(pid)[0]
                    row["materialize, server (STREAM)"] = timed(functools.partial(remote.materialize, plan), repeat)
                    after, peak = rss(pid)
                    notes.append(
                        f"N={n}: server RSS {before / 1e6:.0f} MB before, {after / 1e6:.0f} MB after, "
                        f"peak {peak / 1e6:.0f} MB ({(peak - before) / n:.0f} bytes/param over start)"
                    )
            except Exception as exc:  # a limit (plan size, message size) is a result too
                notes.append(f"N={n}: server failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        print(head)
        print("-" * len(head))
        ref = min(row["PyTorch empty + normal_"]) if "PyTorch empty + normal_" in row else None
        for name, times in row.items():
            x = f"{ref / min(times):.2f}" if ref and name.startswith("materialize") else "-"
            print(f"{n:>8} {name:<34} {min(times):>8.3f} {statistics.median(times):>9.3f} {min(times) / n * 1e6:>9.1f} {x:>10}", flush=True)
        if ref:
            checks.append((f"N={n} in process vs PyTorch", ref / min(row["materialize, in process"]), 1.0, True))
            server = row.get("materialize, server (STREAM)")
            if n in SERVER_TARGETS:
                got = ref / min(server) if server else 0.0  # a server that failed (a limit) misses its target
                checks.append((f"N={n} server vs PyTorch", got, SERVER_TARGETS[n], True))
        if n == 100_000:
            checks.append(("N=100000 validate seconds", min(row["validate, in process"]), 0.2, False))
    local.close()
    for line in notes:
        print(line)
    print("\ntargets")
    for name, got, want, higher in checks:
        ok = got >= want if higher else got <= want
        print(f"  {name:<40} {got:8.3f}  (target {'>=' if higher else '<='} {want})  {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
