"""Exhaustive check of the binary32 log and cos of the normal's 16-bit and 8-bit outputs (cpu_kernels/f32_math.py).

The kernels decide an output word from f32_math.log32 / cos32 only through their error bounds LOG32_REL and
COS32_REL: |cr - f32| <= bound * |f32|, cr the correctly rounded binary64 value (cr_math, itself checked on all
inputs by bench/verify_cr.py). Each function has one input per 32-bit draw k, so this runs all 2^32 of them and
reports the largest relative error (cos: over the draws whose |cos32| is at least COS32_TINY; the kernel leaves the
others undecided). The bounds must be at least MARGIN times the measured maxima; the script exits with status 1
otherwise. The relative errors are computed in binary64 (two roundings: within 2^-52 of the true ratio, far inside
the margin).

    .venv/bin/python bench/verify_f32.py              # both functions, all 2^32 draws each, every core
    NUMBA_NUM_THREADS=1 .venv/bin/python bench/verify_f32.py    # on one core
    .venv/bin/python bench/verify_f32.py --limit 16   # the first 16 chunks of 2^26 draws only (a quick look)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numba as nb
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for sub in ("server", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from _common import cpu_model  # noqa: E402

from paraminit_server.backends.cpu_kernels import cr_math as ck  # noqa: E402
from paraminit_server.backends.cpu_kernels import f32_math as fm  # noqa: E402
from paraminit_server.backends.cpu_kernels.jit import kernel_options  # noqa: E402

TOTAL = 1 << 32
CHUNK = 1 << 26
SUB = 1 << 16
MARGIN = 1.25  # the bounds in f32_math must be at least this many times the measured maxima

# numpy's error model: a division is one instruction (numba's default tests for zero first, which stops vectorizing)
sweep_kernel = kernel_options(parallel=True, error_model="numpy")


@sweep_kernel
def _sweep(k0: int, fn: int) -> Any:
    """Per block of SUB draws from k0 on (CHUNK in all): the largest relative error of log32 (fn 0) or cos32 (fn 1),
    the draw where it occurs, and how many draws cos32 leaves undecided (|cos32| < COS32_TINY)."""
    blocks = CHUNK // SUB
    worst = np.zeros(blocks)
    where = np.zeros(blocks, dtype=np.int64)
    tiny = np.zeros(blocks, dtype=np.int64)
    for b in nb.prange(blocks):
        base = k0 + b * SUB
        err = np.empty(SUB)
        ok = np.empty(SUB, dtype=np.bool_)
        cr = np.empty(SUB)
        approx = np.empty(SUB)
        for i in range(SUB):
            k = base + i
            if fn == 0:
                hi, _, fine = ck.log_dd(ck.log_input(np.float64(k)))
                a = np.float64(fm.log32(np.uint32(k)))
            else:
                hi, _, fine = ck.cos_dd(ck.cos_input(np.float64(k)))
                a = np.float64(fm.cos32(np.uint32(k)))
            cr[i] = hi
            approx[i] = a
            ok[i] = fine
        for i in range(SUB):  # the rare draws whose double-double result is not provably rounded: the exact path
            if not ok[i]:
                kf = np.float64(base + i)
                cr[i] = ck.cr_log(kf) if fn == 0 else ck.cr_cos(kf)
        n_tiny = 0
        for i in range(SUB):
            f = approx[i]
            small = (fn == 1) & (abs(f) < fm.COS32_TINY)
            n_tiny += small
            err[i] = 0.0 if small else abs(cr[i] - f) / abs(f)
        j = np.argmax(err)
        worst[b] = err[j]
        where[b] = base + j
        tiny[b] = n_tiny
    return worst, where, tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=0, help="stop after this many chunks of 2^26 draws per function (0: all)")
    args = ap.parse_args()
    chunks = range(0, TOTAL, CHUNK)
    if args.limit:
        chunks = chunks[: args.limit]
    print(f"host: {cpu_model()}; {nb.get_num_threads()} threads")
    t0 = time.perf_counter()
    _sweep(0, 0)  # compile (or load) outside the timings
    print(f"compiled in {time.perf_counter() - t0:.1f} s")
    failed = False
    for fn, name, bound in ((0, "log32", fm.LOG32_REL), (1, "cos32", fm.COS32_REL)):
        t0 = time.perf_counter()
        worst, where, tiny = 0.0, 0, 0
        for done, k0 in enumerate(chunks, 1):
            w, at, t = _sweep(k0, fn)
            j = int(np.argmax(w))
            if w[j] > worst:
                worst, where = float(w[j]), int(at[j])
            tiny += int(t.sum())
            print(f"\r{name}: {done}/{len(chunks)} chunks, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        n = len(chunks) * CHUNK
        ok = bound >= MARGIN * worst
        failed |= not ok
        extra = f", {tiny} draws with |cos32| < COS32_TINY = 2^{math.log2(fm.COS32_TINY):.0f} (left undecided)" if fn else ""
        print(
            f"{name}: {n} draws ({n / TOTAL:.0%} of 2^32) in {time.perf_counter() - t0:.0f} s; largest relative error "
            f"{worst:.4g} = 2^{math.log2(worst):.3f} at draw {where}{extra}; bound used {bound:.4g} = "
            f"2^{math.log2(bound):.3f}, {bound / worst:.2f}x the maximum (needs >= {MARGIN}x): {'ok' if ok else 'TOO SMALL'}"
        )
    print(
        f"z bound Z32_REL = 2^{math.log2(fm.Z32_REL):.3f}; mean + std * z within E = 2^{math.log2(fm.V32_V):.3f} |v| "
        f"+ 2^{math.log2(fm.V32_P):.3f} |P0|"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
