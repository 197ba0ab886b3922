"""Process CPU seconds to make one new tensor of normal values: an in-process `Client()` against PyTorch.

What a trainer pays for one large parameter, counted as the whole process's CPU time (every thread, numba's and
torch's included, `time.process_time`): `Client().materialize` of a one-tensor plan (the in-process data plane
fills a new buffer) against `torch.empty(n, dtype=...).normal_(0, 0.02)`. Wall seconds are printed beside them;
CPU seconds are what a loaded or shared host makes comparable. Best of --repeat, after one warm-up call each.
Targets: bfloat16 and float16 at least 2x torch (torch's CPU seconds over ours), float32 at least 1.3x.

    python bench/process_cpu.py [--mi-elements 64] [--repeat 5] [--dtypes float32,bfloat16,float16]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import host_line

TARGETS = {"float32": 1.3, "bfloat16": 2.0, "float16": 2.0}


def measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best process CPU seconds, best wall seconds) of `fn` over `repeat` calls after a warm-up call; each call's
    result is dropped before the next, so every call makes a new tensor."""
    fn()
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        del out
    return min(cpu), min(wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mi-elements", type=int, default=64, help="elements of the tensor, in Mi (2^20)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = ap.parse_args()

    import torch

    from paraminit_client import Client, param, plan_of

    n = args.mi_elements << 20
    client = Client()
    print(host_line() + f"; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.mi_elements} Mi elements, best of {args.repeat}")
    head = f"{'dtype':<10} {'ours CPU s':>11} {'torch CPU s':>12} {'x torch (CPU)':>14} {'ours wall s':>12} {'torch wall s':>13}"
    print(head)
    print("-" * len(head))
    verdicts = []
    for name in args.dtypes.split(","):
        plan = plan_of([param("w", [n], {"normal": {"mean": 0.0, "std": 0.02, "seed": 7}}, name)])
        dtype = getattr(torch, name)
        got = client.materialize(plan)["w"]
        assert got.shape == (n,) and float(abs(got.astype("float32")).max()) > 0.0, "a real fill"
        del got
        ours = measure(lambda plan=plan: client.materialize(plan), args.repeat)  # type: ignore[misc]
        theirs = measure(lambda dtype=dtype: torch.empty(n, dtype=dtype).normal_(0.0, 0.02), args.repeat)  # type: ignore[misc]
        ratio = theirs[0] / ours[0]
        print(f"{name:<10} {ours[0]:>11.3f} {theirs[0]:>12.3f} {ratio:>13.2f}x {ours[1]:>12.3f} {theirs[1]:>13.3f}")
        verdicts.append((name, ratio))
    print("\ntargets (process CPU seconds, torch's over ours)")
    for name, ratio in verdicts:
        want = TARGETS.get(name)
        if want is not None:
            print(f"  {name:<10} {ratio:5.2f}x  (target >= {want:.1f}x)  {'ok' if ratio >= want else 'MISSED'}")
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
