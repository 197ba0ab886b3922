"""Correctly rounded log and cos of the CPU kernels (docs/SAMPLER.md section 2.1) against mpmath.

bench/verify_cr.py checks all 2^32 inputs of each function; here a random sample, the edges of the domain
and every hard input of vectors.json, through both the kernels' functions and the test reference.
"""

from __future__ import annotations

import math
from typing import Any

import mpmath
import numba as nb
import numpy as np
import numpy.typing as npt
import pytest
import reference

from paraminit_server.backends.cpu_kernels import cr_math as ck
from paraminit_server.backends.cpu_kernels.cr_tables import tables
from paraminit_server.backends.cpu_kernels.jit import jit as kernel
from support import VECTORS

HARD = VECTORS["hard_inputs"]
SAMPLE = 100_000


@kernel  # cached like the kernels, so a change of any kernel module recompiles it
def _evaluate(ks: Any, fn: int) -> Any:
    """cr_*, plain and the double-double pieces of draws ks (fn 0: log, 1: cos)."""
    n = ks.shape[0]
    cr = np.empty(n)
    plain = np.empty(n)
    hi = np.empty(n)
    lo = np.empty(n)
    ok = np.empty(n, dtype=np.bool_)
    for i in range(n):
        k = ks[i]
        if fn == 0:
            cr[i] = ck.cr_log(k)
            plain[i] = ck.log_plain(ck.log_input(k))
            hi[i], lo[i], ok[i] = ck.log_dd(ck.log_input(k))
        else:
            cr[i] = ck.cr_cos(k)
            plain[i] = ck.cos_plain(ck.cos_input(k))
            hi[i], lo[i], ok[i] = ck.cos_dd(ck.cos_input(k))
    return cr, plain, hi, lo, ok


def _inputs(fn: str, ks: npt.NDArray[np.float64]) -> list[float]:
    u = ks * 2.0**-32
    return (np.where(u <= 1e-6, 1e-6, u) if fn == "log" else (2.0 * math.pi) * u).tolist()


def _edges() -> npt.NDArray[np.float64]:
    """Draws at the ends of the domain, around the log floor and around the zeros and extremes of cos."""
    around = [0, 4294, 4295, 1 << 30, 1 << 31, 3 << 30, (1 << 32) - 1, 1 << 29, 3 << 29, 5 << 29, 7 << 29]
    ks = {k + d for k in around for d in range(-40, 41)} | set(range(0, 4400, 7))
    return np.array(sorted(k for k in ks if 0 <= k < 1 << 32), dtype=np.float64)


@pytest.mark.parametrize("fn", ["log", "cos"])
def test_sample_against_mpmath(fn: str) -> None:
    rng = np.random.default_rng(12 + len(fn))
    ks = np.concatenate([rng.integers(0, 1 << 32, SAMPLE), _edges()]).astype(np.float64)
    cr, plain, hi, lo, ok = _evaluate(ks, 0 if fn == "log" else 1)
    want = np.array([(reference.cr_log if fn == "log" else reference.cr_cos)(x) for x in _inputs(fn, ks)])
    assert np.isfinite(want).all() and np.unique(want).size > SAMPLE // 2
    wrong = np.nonzero(cr.view(np.int64) != want.view(np.int64))[0]
    assert wrong.size == 0, [int(ks[i]) for i in wrong[:10]]
    # decided results are the correctly rounded ones; the rounding test flags almost nothing
    assert (hi[ok] == want[ok]).all()
    assert (~ok).sum() < 20
    # the plain function stays within its documented distance (in ulps) of the correct result
    limit = ck.LOG_PLAIN_ULPS if fn == "log" else ck.COS_PLAIN_ULPS
    assert np.abs(plain.view(np.int64) - want.view(np.int64)).max() <= limit
    # hi + lo is far more accurate than binary64 (checked on a slice: mpmath is slow)
    with mpmath.workprec(200):
        f = mpmath.log if fn == "log" else mpmath.cos
        xs = _inputs(fn, ks[:2000])
        worst = max(
            abs((mpmath.mpf(h) + mpmath.mpf(low) - f(x)) / f(x))
            for x, h, low in zip(xs, hi[:2000].tolist(), lo[:2000].tolist(), strict=True)
        )
    assert worst < mpmath.mpf(2) ** -78


@pytest.mark.parametrize("fn", ["log", "cos"])
def test_hard_inputs(fn: str) -> None:
    cases = HARD[fn]
    assert len(cases) == 40
    ks = np.array([c["k"] for c in cases], dtype=np.float64)
    xs = _inputs(fn, ks)
    assert [repr(x) for x in xs] == [c["x"] for c in cases]
    want = [int(c["cr"], 16) for c in cases]
    assert all(int(c["glibc"], 16) != w for c, w in zip(cases, want, strict=True))
    cr = _evaluate(ks, 0 if fn == "log" else 1)[0]
    assert [int(b) for b in cr.view(np.uint64)] == want
    ref = reference.cr_log if fn == "log" else reference.cr_cos
    assert [int(np.float64(ref(x)).view(np.uint64)) for x in xs] == want


def test_fma_rounds_once() -> None:
    a = 1.0 + 2.0**-30

    @nb.njit
    def both(a: float, b: float, c: float) -> Any:
        return ck.fma(a, b, c), a * b + c

    fused, plain = both(a, a, -(1.0 + 2.0**-29))
    assert fused == 2.0**-60 and plain == 0.0


def test_tables() -> None:
    r = tables()["log_r"]
    assert r[159] == 1.0 and tables()["log_th"][159] == 0.0
    scaled = [math.ldexp(math.frexp(v)[0], 20) for v in r.tolist()]
    assert all(s == int(s) for s in scaled)  # 20 significant bits: m * r - 1 is exact
    ch, sh = tables()["cos_ch"], tables()["cos_sh"]
    assert ch[64] == 0.0 and ch[192] == 0.0 and sh[0] == 0.0 and sh[128] == 0.0 and ch[256] == 1.0
    with mpmath.workprec(200):
        for j in (1, 37, 64, 100, 200, 255):
            ang = mpmath.pi * j / 128
            assert abs(mpmath.mpf(ch[j]) + mpmath.mpf(tables()["cos_cl"][j]) - mpmath.cos(ang)) < mpmath.mpf(2) ** -104
            assert abs(mpmath.mpf(sh[j]) + mpmath.mpf(tables()["cos_sl"][j]) - mpmath.sin(ang)) < mpmath.mpf(2) ** -104
    assert reference.cr_log(1e-6) == ck.LOG_FLOOR
