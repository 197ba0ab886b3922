"""8-bit float parameters: paraminit against PyTorch making the same tensor, time and peak memory.

PyTorch cannot draw into float8 directly: the usual way is `torch.empty(shape, dtype=float32)`, `normal_` (or
`uniform_`, `trunc_normal_`), then `.to(torch.float8_e4m3fn)`, which holds the float32 tensor (4 bytes an element)
beside the output and rounds twice (float64 -> float32 -> float8 is what its draw and cast amount to). paraminit
(in process, `Client().materialize`) rounds once from binary64 straight into the output's bytes.

Each measurement runs in a fresh child process, so its peak memory is its own: the growth of the child's peak
resident set (VmHWM, reset just before the call) over its resident set before the call (after imports and a small
warm-up call that loads the kernels). Time: best of --repeat calls in that child. Targets: paraminit at least 2x torch's time, and its peak
growth at most the output plus one fill window (64 MiB).

    python bench/float8.py [--mib 256] [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for sub in ("proto", "server", "client", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from _common import host_line  # noqa: E402

WINDOW = 64 << 20  # backends/cpu.py FILL_WINDOW: the span a fill works on
INITS = {
    "normal": ({"normal": {"std": 0.02, "seed": 1}}, lambda t, torch: t.normal_(0.0, 0.02)),
    "uniform": ({"uniform": {"lo": -0.1, "hi": 0.1, "seed": 2}}, lambda t, torch: t.uniform_(-0.1, 0.1)),
    "truncated_normal": (
        {"truncatedNormal": {"std": 0.02, "lo": -0.04, "hi": 0.04, "seed": 3}},
        lambda t, torch: torch.nn.init.trunc_normal_(t, 0.0, 0.02, -0.04, 0.04),
    ),
}


def _status(field: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Set the peak resident set (VmHWM) to the current one (Linux: `5` to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(who: str, init: str, dtype: str, n: int, repeat: int, threads: int) -> None:
    """One measurement, printed as JSON: best seconds and peak growth of the first timed call."""
    if who == "torch":
        import torch

        torch.set_num_threads(threads)
        target = getattr(torch, dtype)
        draw = INITS[init][1]

        def make(count: int) -> object:
            return draw(torch.empty(count, dtype=torch.float32), torch).to(target)
    else:
        os.environ.setdefault("PARAMINIT_THREADS", str(threads))
        from paraminit_client import Client, param, plan_of

        client = Client()
        spec = INITS[init][0]

        def make(count: int) -> object:
            return client.materialize(plan_of([param("w", [count], spec, dtype)]))["w"]

    make(1 << 16)  # loads kernels and warms allocators
    _reset_peak()
    before = _status("VmRSS")
    best = float("inf")
    growth = 0
    for k in range(repeat):
        t0 = time.perf_counter()
        out = make(n)
        best = min(best, time.perf_counter() - t0)
        if k == 0:
            growth = _status("VmHWM") - before
        del out
    print(json.dumps({"seconds": best, "peak_growth": growth}))


def run_child(who: str, init: str, dtype: str, n: int, repeat: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", who, init, dtype, str(n), str(repeat), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="output size per tensor, MiB (one byte an element)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        who, init, dtype, n, repeat, threads = args.child
        child(who, init, dtype, int(n), int(repeat), int(threads))
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("torch is not installed: this bench compares with PyTorch (make venv installs it)")
    n = args.mib << 20
    print(host_line())
    print(
        f"{args.mib} MiB 8-bit outputs ({n} elements), {args.threads} threads, best of {args.repeat}; peak = growth of "
        "the child's peak RSS (VmHWM) during the first call"
    )
    print(f"{'case':<36} {'paraminit s':>11} {'torch s':>9} {'x torch':>8} {'peak MiB':>9} {'torch peak':>10}")
    targets: list[tuple[str, float, float, bool]] = []
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        for init in INITS:
            ours = run_child("paraminit", init, dtype, n, args.repeat, args.threads)
            theirs = run_child("torch", init, dtype, n, args.repeat, args.threads)
            ratio = theirs["seconds"] / ours["seconds"]
            case = f"{init} {dtype}"
            print(
                f"{case:<36} {ours['seconds']:11.3f} {theirs['seconds']:9.3f} {ratio:7.2f}x "
                f"{ours['peak_growth'] / 2**20:9.0f} {theirs['peak_growth'] / 2**20:10.0f}"
            )
            targets.append((case, ratio, ours["peak_growth"], ours["peak_growth"] <= n + WINDOW))
    print("\ntargets")
    for case, ratio, peak, ok in targets:
        print(f"  {case:<36} {ratio:6.2f}x torch  (target >= 2.00x)  {'ok' if ratio >= 2 else 'MISSED'}")
        print(
            f"  {case:<36} peak {peak / 2**20:6.0f} MiB  (target <= output + 64 MiB = "
            f"{(n + WINDOW) / 2**20:.0f} MiB)  {'ok' if ok else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
