"""Exhaustive check of the correctly rounded log and cos of the CPU kernels (docs/SAMPLER.md section 2.1).

Every one of the 2^32 draws k gives one input per function: log(max(k * 2^-32, 1e-6)) and
cos((2.0 * pi) * (k * 2^-32)). For each chunk of draws this compares
- ours: cpu_kernels.cr_math.cr_log / cr_cos (the double-double pass, its rounding test and the FIX tables), and the
  plain functions' distance in ulps from the correct result (cr_tables.LOG_PLAIN_ULPS / COS_PLAIN_ULPS);
- the oracle, which shares no code with them: x87 extended precision (numpy longdouble, glibc's logl/cosl,
  64-bit significands) decides the rounding when its value is farther than ORACLE_BOUND (relative, 2^-62,
  2 ulps of the 64-bit format; glibc documents 1) from a binary64 rounding boundary; every other input goes to
  mpmath, at 128 bits, redone at 400 bits when even that lies within 2^-120 of a boundary. The largest
  longdouble error seen on a sample of the mpmath inputs is recorded, as a check on ORACLE_BOUND.
Chunks run in worker processes; finished chunks are recorded in a JSON summary, so an interrupted run
resumes where it stopped.

    .venv/bin/python bench/verify_cr.py                 # all of log and cos, 2 workers
    .venv/bin/python bench/verify_cr.py --fix-tables    # print the FIX tables of cpu_kernels/cr_tables.py

The FIX tables come from running every input through the double-double pass and deciding the flagged
ones (about 1e-6 of them) with mpmath; the full run above then re-checks everything independently.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from paraminit_server.backends.cpu_kernels import cr_math as ck
from paraminit_server.backends.cpu_kernels.jit import parallel as kernel_parallel

FUNCS = ("log", "cos")
ORACLE_BOUND = 2.0**-62
WORST_SAMPLE = 2000
TOTAL = 1 << 32


@kernel_parallel  # cached on the kernels' sources too: a change in cr_math recompiles it
def _ours(k0: int, n: int, fn: int) -> Any:
    """Correctly rounded results, plain results and the rounding-test flags of draws k0 .. k0 + n - 1."""
    cr = np.empty(n)
    plain = np.empty(n)
    flagged = np.zeros(n, dtype=np.bool_)
    for i in nb.prange(n):
        k = np.float64(k0 + i)
        if fn == 0:
            x = ck.log_input(k)
            hi, _, ok = ck.log_dd(x)
            plain[i] = ck.log_plain(x)
        else:
            x = ck.cos_input(k)
            hi, _, ok = ck.cos_dd(x)
            plain[i] = ck.cos_plain(x)
        cr[i] = hi
        flagged[i] = not ok
    for i in range(n):
        if flagged[i]:
            k = np.float64(k0 + i)
            cr[i] = ck.cr_log(k) if fn == 0 else ck.cr_cos(k)
    return cr, plain, flagged


@kernel_parallel
def _flagged(k0: int, n: int, fn: int) -> Any:
    """Draws in [k0, k0 + n) whose double-double result fails the rounding test, with that hi."""
    flags = np.zeros(n, dtype=np.bool_)
    his = np.empty(n)
    for i in nb.prange(n):
        k = np.float64(k0 + i)
        if fn == 0:
            hi, _, ok = ck.log_dd(ck.log_input(k))
        else:
            hi, _, ok = ck.cos_dd(ck.cos_input(k))
        flags[i] = not ok
        his[i] = hi
    idx = np.nonzero(flags)[0]
    return idx + k0, his[idx]


def inputs(fn: str, k: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """The binary64 inputs of draws k, as the spec writes them (NumPy, not the kernels)."""
    u = k.astype(np.float64) * 2.0**-32
    if fn == "log":
        return np.where(u <= 1e-6, 1e-6, u)
    return (2.0 * math.pi) * u


def mp_round(fn: str, x: float) -> float:
    """The binary64 nearest fn(x), by mpmath; raises if 400 bits cannot decide it."""
    import mpmath

    for prec in (128, 400):
        with mpmath.workprec(prec):
            c = _mp_try(mpmath, fn, x, prec)
        if c is not None:
            return c
    raise RuntimeError(f"{fn}({x!r}) undecided at 400 bits")


def _mp_try(mpmath: Any, fn: str, x: float, prec: int) -> float | None:
    """fn(x) rounded to binary64 at the current mpmath precision, or None when too close to a midpoint."""
    v = mpmath.log(x) if fn == "log" else mpmath.cos(x)
    c = float(v)
    mid = (mpmath.mpf(c) + math.nextafter(c, math.inf if v > c else -math.inf)) / 2
    return c if abs(v - mid) > abs(v) * mpmath.ldexp(1, 8 - prec) else None


def oracle(fn: str, x: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.float64], int, float]:
    """Correctly rounded fn(x): longdouble where it decides, mpmath elsewhere; (result, mpmath count, the
    largest relative longdouble error seen on the first WORST_SAMPLE mpmath inputs)."""
    import mpmath

    xl = x.astype(np.longdouble)
    yl = np.log(xl) if fn == "log" else np.cos(xl)
    c = yl.astype(np.float64)
    d = (yl - c.astype(np.longdouble)).astype(np.float64)  # exact difference, then one tiny rounding
    half_gap = np.abs(np.nextafter(c, np.where(d > 0, np.inf, -np.inf)) - c) / 2
    close = np.abs(np.abs(d) - half_gap) <= np.abs(c) * ORACLE_BOUND
    idx = np.nonzero(close)[0]
    with mpmath.workprec(128):
        for i in idx.tolist():
            r = _mp_try(mpmath, fn, float(x[i]), 128)
            c[i] = r if r is not None else mp_round(fn, float(x[i]))
    worst = 0.0
    with mpmath.workprec(200):
        for i in idx[:WORST_SAMPLE].tolist():
            exact = mpmath.log(float(x[i])) if fn == "log" else mpmath.cos(float(x[i]))
            hi = float(yl[i])  # the 64-bit significand is hi + lo exactly
            approx = mpmath.mpf(hi) + float(yl[i] - np.longdouble(hi))
            worst = max(worst, float(abs((approx - exact) / exact)))
    return c, int(idx.size), worst


def check_chunk(job: tuple[str, int, int]) -> dict[str, Any]:
    """Compare ours and the oracle on draws [k0, k0 + n)."""
    fn, k0, n = job
    t0 = time.perf_counter()
    cr, plain, flagged = _ours(k0, n, FUNCS.index(fn))
    k = np.arange(k0, k0 + n, dtype=np.uint64)
    want, n_mp, worst = oracle(fn, inputs(fn, k))
    bad = np.nonzero(cr.view(np.int64) != want.view(np.int64))[0]
    dist = np.abs(plain.view(np.int64) - want.view(np.int64))
    return {
        "fn": fn,
        "k0": k0,
        "n": n,
        "mismatches": int(bad.size),
        "mismatch_k": [int(k0 + i) for i in bad[:20].tolist()],
        "flagged": int(flagged.sum()),
        "mpmath": n_mp,
        "oracle_worst_rel": worst,
        "plain_max_ulps": int(dist.max()),
        "seconds": time.perf_counter() - t0,
    }


def fix_tables(chunk: int) -> None:
    """Print the FIX tables: flagged draws whose double-double hi is not the correctly rounded result."""
    for f, fn in enumerate(FUNCS):
        t0 = time.perf_counter()
        fixes: dict[int, int] = {}
        n_flag = 0
        for k0 in range(0, TOTAL, chunk):
            ks, his = _flagged(k0, chunk, f)
            n_flag += ks.size
            for k, hi in zip(ks.tolist(), his.tolist(), strict=True):
                want = mp_round(fn, float(inputs(fn, np.array([k], dtype=np.uint64))[0]))
                if want != hi:
                    d = int(np.float64(want).view(np.int64)) - int(np.float64(hi).view(np.int64))
                    fixes[k] = d
            print(f"\r{fn}: {k0 + chunk:>10} / {TOTAL} flagged {n_flag} fixes {len(fixes)}", end="", file=sys.stderr, flush=True)
        print(f"\n{fn}: {n_flag} flagged, {len(fixes)} fixes, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(f"{fn.upper()}_FIX: dict[int, int] = {{")
        items = [f"{k}: {d}" for k, d in sorted(fixes.items())]
        for i in range(0, len(items), 6):
            print("    " + ", ".join(items[i : i + 6]) + ",")
        print("}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", type=Path, default=Path("bench/verify_cr_summary.json"))
    ap.add_argument("--chunk-bits", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--functions", default="log,cos")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many chunks per function (0: all)")
    ap.add_argument("--fix-tables", action="store_true")
    args = ap.parse_args()
    chunk = 1 << args.chunk_bits
    if args.fix_tables:
        fix_tables(chunk)
        return
    summary: dict[str, Any] = json.loads(args.summary.read_text()) if args.summary.exists() else {}
    summary.setdefault("chunks", {})
    jobs = []
    for fn in args.functions.split(","):
        todo = [k0 for k0 in range(0, TOTAL, chunk) if f"{fn}:{k0}:{chunk}" not in summary["chunks"]]
        jobs += [(fn, k0, chunk) for k0 in (todo[: args.limit] if args.limit else todo)]
    total = len(jobs)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for done, r in enumerate(pool.imap_unordered(check_chunk, jobs), 1):
            summary["chunks"][f"{r['fn']}:{r['k0']}:{r['n']}"] = r
            args.summary.write_text(json.dumps(summary, indent=0))
            el = time.perf_counter() - t0
            print(
                f"\r[{'#' * (30 * done // total):<30}] {done}/{total} chunks, {el:.0f} s, "
                f"eta {el / done * (total - done):.0f} s, last {r['fn']} mismatches {r['mismatches']}",
                end="",
                file=sys.stderr,
                flush=True,
            )
    print(file=sys.stderr)
    for fn in FUNCS:
        rs = [r for r in summary["chunks"].values() if r["fn"] == fn]
        if not rs:
            continue
        tot = {key: sum(r[key] for r in rs) for key in ("n", "mismatches", "flagged", "mpmath", "seconds")}
        print(
            f"{fn}: {tot['n']} inputs ({tot['n'] / TOTAL:.1%} of 2^32), mismatches {tot['mismatches']}, "
            f"flagged by the rounding test {tot['flagged']}, decided by mpmath {tot['mpmath']}, "
            f"largest longdouble error 2^{math.log2(max(r['oracle_worst_rel'] for r in rs) or 2.0**-999):.1f}, "
            f"plain max ulps {max(r['plain_max_ulps'] for r in rs)}, worker time {tot['seconds']:.0f} s"
        )


if __name__ == "__main__":
    main()
