"""The binary32 pass of normal and truncated normal into 16-bit and 8-bit outputs (cpu_kernels/f32_math.py) against
the exact path, element by element.

The pass decides an output word when both ends of its error interval round to it; a bound that is too small, or a
word computed wrongly, shows here as a word that differs from the exact path's. Outputs are poisoned first, so an
element left unwritten fails too. The parameters put many values on or near rounding boundaries (a mean on a tie of
the format with a tiny std, values near the largest finite value, subnormal outputs), and the draws of the direct
pass tests include the edges of log and cos (the log floor, u1 near 1, cos near its zeros and extremes).
bench/verify_f32.py checks the bounds of log32 and cos32 on all 2^32 draws; here a sample, so a wrong constant fails
the suite too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from paraminit_server.backends.cpu_kernels import distributions as dist
from paraminit_server.backends.cpu_kernels import f32_math as fm
from paraminit_server.backends.cpu_kernels.counter_rng import GOLDEN, U1, low_draw, mix
from paraminit_server.backends.cpu_kernels.cr_math import cr_cos, cr_log
from paraminit_server.backends.cpu_kernels.half_rounding import BF16, F8E4M3, F8E5M2, F16, half_bits, narrow_bits, store
from paraminit_server.backends.cpu_kernels.jit import AVX512BF16, jit

FORMATS = {
    "float16": (F16, np.uint16),
    "bfloat16": (BF16, np.uint16),
    "float8_e4m3fn": (F8E4M3, np.uint8),
    "float8_e5m2": (F8E5M2, np.uint8),
}
_POISON = 0xA5


@jit
def _exact_normal(dst: Any, x0: Any, p0: float, p1: float, h: Any) -> None:
    """fill_normal's values on the exact path only (cr_log, cr_cos), element by element."""
    for k in range(dst.shape[0]):
        x = x0 + np.uint64(2 * k)
        store(dst, np.uint64(k), dist.normal_exact(low_draw(x), low_draw(x + U1), p0, p1), h)


@jit
def _exact_truncnorm(dst: Any, g0: Any, p0: float, p1: float, lo: float, hi: float, seed: Any, h: Any) -> None:
    """fill_truncnorm's values candidate by candidate on the scalar path (trunc_settle from candidate 0)."""
    keys = np.empty(64, dtype=np.uint64)
    for j in range(64):
        keys[j] = mix(seed + np.uint64(j) * GOLDEN)
    for k in range(dst.shape[0]):
        store(dst, np.uint64(k), dist.trunc_settle(dst, g0 + np.uint64(k), p0, p1, lo, hi, keys, 0, h), h)


def _tie(fmt: str) -> float:
    """A value halfway between two neighbouring words of the format near 1.5 (a rounding boundary)."""
    mant = {"float16": 10, "bfloat16": 7, "float8_e4m3fn": 3, "float8_e5m2": 2}[fmt]
    return 1.5 + 2.0 ** -(mant + 1)


def _cases(fmt: str) -> list[tuple[float, float]]:
    """(mean, std) pairs for a format: plain, on a tie with a tiny std, near the largest finite value, subnormal."""
    top = {"float16": 65504.0, "bfloat16": 2.0**99, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
    tiny = {"float16": 2.0**-14, "bfloat16": 2.0**-40, "float8_e4m3fn": 2.0**-6, "float8_e5m2": 2.0**-14}[fmt]
    t = _tie(fmt)
    return [
        (0.0, 0.02),
        (0.0, 1.0),
        (-3.0, 0.75),
        (t, 1e-9),  # every value within E of the tie: all undecided, the binary64 path decides
        (t, 2e-7),  # std * z comparable to the interval's width
        (-t, 3e-6),
        (top * 0.97, top * 0.006),  # values past the largest finite value (inf, or e4m3's clamp)
        (0.0, tiny * 0.7),  # mostly subnormal outputs
        (tiny, tiny * 0.1),  # around the smallest normal
        (0.0, 2.0**-48),  # the smallest std the binary32 pass takes
        (1.0, 0.0),
        (0.0, 0.0),
    ]


def _key(seed: int) -> Any:
    return np.uint64(int(mix(np.uint64(seed))))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_normal_fast_equals_exact(fmt: str) -> None:
    """fill_normal (binary32 pass, binary64 fallback) against the exact path, 2^18 elements per (mean, std)."""
    h, storage = FORMATS[fmt]
    n = 1 << 18
    for i, (p0, p1) in enumerate(_cases(fmt)):
        x0 = np.uint64((int(_key(1000 + i)) + int(GOLDEN) + 2 * 977) % 2**64)
        got = np.full(n, _POISON, dtype=storage)
        want = np.full(n, _POISON, dtype=storage)
        dist.fill_normal(got, x0, p0, p1, h)
        _exact_normal(want, x0, p0, p1, h)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (fmt, p0, p1, bad[:10].tolist())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_truncated_normal_fast_equals_exact(fmt: str) -> None:
    """fill_truncnorm (candidate 0 in binary32) against trunc_settle element by element, bounds that reject from
    about 5% to most of the candidates and that sit on rounding boundaries."""
    h, storage = FORMATS[fmt]
    n = 1 << 16
    t = _tie(fmt)
    for i, (p0, p1, lo, hi) in enumerate(
        [(0.0, 0.02, -0.04, 0.04), (0.0, 1.0, -0.5, 0.5), (t, 1e-3, t, t + 0.003), (-t, 0.2, -t - 0.01, 0.0)]
    ):
        seed = np.uint64(4242 + i)
        g0 = np.uint64(1 << 20)
        x0 = np.uint64((int(mix(seed)) + int(GOLDEN) + 2 * int(g0)) % 2**64)
        got = np.full(n, _POISON, dtype=storage)
        want = np.full(n, _POISON, dtype=storage)
        dist.fill_truncnorm(got, x0, g0, p0, p1, lo, hi, seed, h)
        _exact_truncnorm(want, g0, p0, p1, lo, hi, seed, h)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (fmt, p0, p1, lo, hi, bad[:10].tolist())


def _edge_draws() -> np.ndarray[Any, Any]:
    """Draws at the edges of log and cos: the floor (k <= 4294), u1 near 1, and around every quarter turn."""
    around = [0, 4294, 4295, 65535, 65536, 1 << 29, 1 << 30, 3 << 29, 1 << 31, 5 << 29, 3 << 30, 7 << 29, (1 << 32) - 1]
    ks = {(k + d) % (1 << 32) for k in around for d in range(-700, 701)}
    return np.array(sorted(ks), dtype=np.uint32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pass_on_edge_draws(fmt: str) -> None:
    """The binary32 pass on chosen draws (every pair of edge draws, shuffled): each word it decides is the exact one."""
    h, storage = FORMATS[fmt]
    ks = _edge_draws()
    rng = np.random.default_rng(7)
    k1 = np.concatenate([ks, rng.permutation(ks), rng.integers(0, 1 << 32, 4096, dtype=np.uint32)])
    k2 = np.concatenate([rng.permutation(ks), ks, rng.integers(0, 1 << 32, 4096, dtype=np.uint32)])
    n = k1.size
    for p0, p1 in [(0.0, 1.0), (0.0, 0.02), (_tie(fmt), 3e-5), (0.5, 3.0)]:
        ok, big0, big1, e0 = fm.normal32_params(p0, p1)
        assert ok
        got = np.full(n, _POISON, dtype=storage)
        flags = np.empty(n, dtype=np.uint8)
        for b0 in range(0, n, 512):
            s = slice(b0, min(b0 + 512, n))
            pas = {"float16": dist.normal32_f16, "bfloat16": dist.normal32_bf16, "float8_e4m3fn": dist.normal32_f8e4m3}
            pas.get(fmt, dist.normal32_f8e5m2)(got[s], k1[s], k2[s], np.float32(big0), np.float32(big1), np.float32(e0), flags[s])
        want = np.full(n, _POISON, dtype=storage)
        _exact_pairs(want, k1.astype(np.float64), k2.astype(np.float64), p0, p1, h)
        decided = flags == 0
        assert decided.mean() > 0.75  # all but the draws where cos is near zero, and a few more
        bad = np.nonzero(decided & (got != want))[0]
        assert bad.size == 0, (fmt, p0, p1, [(int(k1[i]), int(k2[i])) for i in bad[:5]])


@jit
def _exact_pairs(dst: Any, d1: Any, d2: Any, p0: float, p1: float, h: Any) -> None:
    for k in range(dst.shape[0]):
        store(dst, np.uint64(k), dist.normal_exact(d1[k], d2[k], p0, p1), h)


@jit
def _functions(ks: Any) -> Any:
    n = ks.shape[0]
    l32 = np.empty(n)
    c32 = np.empty(n)
    lc = np.empty(n)
    cc = np.empty(n)
    for i in range(n):
        k = ks[i]
        l32[i] = fm.log32(k)
        c32[i] = fm.cos32(k)
        lc[i] = cr_log(np.float64(k))
        cc[i] = cr_cos(np.float64(k))
    return l32, c32, lc, cc


def test_log32_cos32_within_bounds() -> None:
    """log32 and cos32 within LOG32_REL / COS32_REL of the correctly rounded values on a sample and the edges."""
    rng = np.random.default_rng(11)
    ks = np.concatenate([rng.integers(0, 1 << 32, 300_000, dtype=np.uint32), _edge_draws()])
    l32, c32, lc, cc = _functions(ks)
    assert (np.abs(lc - l32) <= fm.LOG32_REL * np.abs(l32)).all()
    big = np.abs(c32) >= fm.COS32_TINY
    assert (np.abs(cc - c32)[big] <= fm.COS32_REL * np.abs(c32[big])).all()
    assert (~big).sum() < 3000 and (np.abs(cc[~big]) < 2 * fm.COS32_TINY).all()
    assert math.isclose(fm.Z32_REL, fm.LOG32_REL / 2 + fm.COS32_REL + 2.0**-23, rel_tol=0.01)


@jit
def _words(xs: Any, w: Any, h: Any) -> Any:
    n = xs.shape[0]
    got = np.empty(n, dtype=np.int64)
    want = np.empty(n, dtype=np.int64)
    for i in range(n):
        got[i] = fm.word32(xs[i], w)
        v = np.float64(xs[i])
        want[i] = np.int64(half_bits(v, h)) if h[0] <= 45 else np.int64(narrow_bits(v, h))
    return got, want


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_word32_rounds_once(fmt: str) -> None:
    """word32 of binary32 values equals the binary64 rounding of the same values (half_bits / narrow_bits): random
    bit patterns of every magnitude, ties and neighbours of every word of the format, binary32 subnormals."""
    h, _ = FORMATS[fmt]
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    xs = bits.view(np.float32)
    mant = 52 - int(h[0])
    words = np.arange(1 << (16 if storage_bits(fmt) == 16 else 8), dtype=np.uint64)
    ref = np.array([_word_value(fmt, int(wd)) for wd in words.tolist()], dtype=np.float64)
    ref = ref[np.isfinite(ref)]
    ties = ref + np.ldexp(np.ones_like(ref), np.frexp(ref)[1] - mant - 2)  # half an ulp above (a tie or past it)
    cands = np.concatenate([xs, ref.astype(np.float32), ties.astype(np.float32), np.array([1e-40, -1e-45, 0.0, -0.0], dtype=np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        cands = cands[np.isfinite(cands)]
        for c in (cands, np.nextafter(cands, np.float32(np.inf)), np.nextafter(cands, np.float32(-np.inf))):
            c = c[np.isfinite(c)]
            if fmt == "bfloat16" and AVX512BF16:  # the conversion instruction flushes binary32 subnormals (documented)
                c = c[np.abs(c) >= np.float32(2.0**-126)]
            got, want = _words(c, fm.word32_consts(h), h)
            bad = np.nonzero(got != want)[0]
            assert bad.size == 0, (fmt, c[bad[:5]].tolist(), got[bad[:5]].tolist(), want[bad[:5]].tolist())


def storage_bits(fmt: str) -> int:
    return 16 if fmt in ("float16", "bfloat16") else 8


def _word_value(fmt: str, w: int) -> float:
    """The value of a word of the format (NaN for NaN patterns)."""
    import ml_dtypes

    dt = {
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
    }[fmt]
    raw = np.array([w], dtype=np.uint16 if storage_bits(fmt) == 16 else np.uint8)
    return float(raw.view(dt)[0])
