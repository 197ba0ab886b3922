"""The CPU kernels against the plain reference: invariances, half rounding edge cases, random plans.

Every output is poisoned (all bytes 0xFF) before it is filled, so an element the
kernels skip can never pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numba
import numba as nb
import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_client import plans
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.backends.cpu_kernels import counter_rng, half_rounding
from paraminit_server.backends.cpu_kernels.driver import PIECE
from paraminit_server.plans import sampler
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Formula, ResolvedParam, resolve_unchecked
from support import poisoned

INITS = (
    "zeros",
    "ones",
    "uniform",
    "normal",
    "xavier_uniform",
    "kaiming_uniform",
    "flat",
    "xavier_uniform_for_shape",
    "kaiming_uniform_for_shape",
    "truncated_normal",
)
BACKEND = CpuBackend()


def make_param(
    init: str,
    dt: dtypes.DTypeInfo,
    shape: list[int],
    seed: int = 7,
    region: list[tuple[int, int]] | None = None,
    lo: float = -0.5,
    hi: float = 2.0,
) -> ResolvedParam:
    p = plan_pb2.Param(name="w", shape=shape, dtype=dt.enum)  # type: ignore[arg-type]
    i = p.init
    if init == "uniform":
        i.uniform.lo, i.uniform.hi, i.uniform.seed = lo, hi, seed
    elif init == "normal":
        i.normal.mean, i.normal.std, i.normal.seed = lo, hi - lo, seed
    elif init == "truncated_normal":  # about one element in six needs a second candidate
        t = i.truncated_normal
        t.mean, t.std, t.seed = lo, hi - lo, seed
        t.lo, t.hi = lo - 0.7 * (hi - lo), lo + 2.0 * (hi - lo)
    elif init == "xavier_uniform":
        i.xavier_uniform.fan_in, i.xavier_uniform.fan_out, i.xavier_uniform.seed = 3, 5, seed
    elif init == "kaiming_uniform":
        i.kaiming_uniform.fan_in, i.kaiming_uniform.seed = 7, seed
    elif init in ("xavier_uniform_for_shape", "kaiming_uniform_for_shape"):
        getattr(i, init).seed = seed
    elif init == "flat":
        n = sampler.numel(shape)
        i.flat.values.extend((np.random.default_rng(seed % 2**32).standard_normal(n) * 1e3).tolist())
    else:
        getattr(i, init).SetInParent()
    for a, b in region or []:
        p.region.add(start=a, stop=b)
    return resolve_unchecked(0, p)


def fill(p: ResolvedParam, l_begin: int = 0, n: int | None = None) -> np.ndarray[Any, Any]:
    out = poisoned(p.numel - l_begin if n is None else n, p.dtype.storage)
    BACKEND.fill(p, out, l_begin)
    return out


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


# Several parallel pieces, and rows that end inside a piece.
BIG = [3, PIECE // 2 + 77]


@pytest.mark.parametrize("dt", dtypes.SUPPORTED, ids=lambda d: d.name)
@pytest.mark.parametrize("init", INITS)
def test_threads_and_reference(init: str, dt: dtypes.DTypeInfo) -> None:
    """1 and 2 threads write the same bytes, and a strided region of them matches the reference."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread")
    p = make_param(init, dt, BIG)
    with threads(1):
        one = fill(p)
    with threads(2):
        two = fill(p)
    assert same(one, two)
    # the reference is slow: compare the first and last few hundred elements of every row
    rows = one.reshape(BIG)
    for r0, r1 in ((0, 300), (BIG[1] - 300, BIG[1])):
        sub = dataclasses.replace(p, region=((0, BIG[0]), (r0, r1)))
        assert same(np.ascontiguousarray(rows[:, r0:r1]), reference.materialize(sub))


@pytest.mark.parametrize("dt", dtypes.SUPPORTED, ids=lambda d: d.name)
@pytest.mark.parametrize("init", ["uniform", "normal", "flat", "ones", "truncated_normal"])
def test_chunking_invariance(init: str, dt: dtypes.DTypeInfo) -> None:
    """Filling any sequence of l_begin windows and concatenating gives the one-call bytes."""
    shape = [4, 9, 5000]
    p = make_param(init, dt, shape, region=[(1, 4), (2, 9), (100, 4900)])  # many runs, none at a row start
    whole = fill(p)
    rng = np.random.default_rng(3)
    n = p.numel
    for _ in range(3):
        cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n, 6), [PIECE, 4800, 4801]]))
        cuts = cuts[cuts <= n]
        parts = [fill(p, int(a), int(b - a)) for a, b in itertools.pairwise(cuts)]
        assert same(np.concatenate(parts), whole)


@pytest.mark.parametrize("dt", [dtypes.FLOAT32, dtypes.BFLOAT16], ids=lambda d: d.name)
@pytest.mark.parametrize("init", ["uniform", "normal", "kaiming_uniform_for_shape", "flat", "truncated_normal"])
def test_region_partition(init: str, dt: dtypes.DTypeInfo) -> None:
    """The shards of a random grid partition, each filled as its own region, tile the whole tensor."""
    shape = [6, 5, 7, 11]
    whole = fill(make_param(init, dt, shape)).reshape(shape)
    rng = np.random.default_rng(11)
    cuts = [np.unique(np.concatenate([[0, d], rng.integers(0, d + 1, 2)])) for d in shape]
    tiled = poisoned(whole.size, dt.storage).reshape(shape)
    boxes: list[list[tuple[int, int]]] = [[]]
    for c in cuts:
        boxes = [[*b, (int(lo), int(hi))] for b in boxes for lo, hi in itertools.pairwise(c)]
    for box in boxes:
        shard = make_param(init, dt, shape, region=box)
        tiled[tuple(slice(a, b) for a, b in box)] = fill(shard).reshape(shard.out_shape)
    assert same(tiled, whole)


def _half_probe_values() -> np.ndarray[Any, Any]:
    """Doubles that exercise one-rounding into float16 and bfloat16: every value of both formats, the
    midpoints between neighbours (ties) and one double ulp either side of them, subnormals, overflow
    to infinity, signed zeros, infinities and NaNs."""
    import ml_dtypes

    with np.errstate(invalid="ignore"):
        exact = [
            np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64),
            np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64),
        ]
    vals = []
    for e in exact:
        e = np.unique(e[np.isfinite(e)])
        mid = (e[:-1] + e[1:]) / 2  # exact in binary64
        vals += [e, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)]
    top = [
        65504.0,
        65519.99999999999,
        65520.0,
        65536.0,
        float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
        math.ldexp(2.0 - 2.0**-8, 127),
        np.nextafter(math.ldexp(2.0 - 2.0**-8, 127), 0.0),
        1e300,
        np.finfo(np.float64).max,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-26,
        2.0**-133,
        2.0**-134,
        3 * 2.0**-135,
        5e-324,
        1e-300,
        1.0 + 2.0**-8 + 2.0**-30,
        1.0 + 2.0**-11 + 2.0**-40,
    ]
    rng = np.random.default_rng(5)
    wide = rng.standard_normal(20000) * np.exp2(rng.integers(-160, 160, 20000).astype(np.float64))
    out = np.concatenate([*vals, np.array(top), wide])
    out = np.concatenate([out, -out, [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]])
    nan_payloads = np.array([0x7FF0000000000001, 0xFFF0000000000001, 0x7FFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.concatenate([out, nan_payloads.view(np.float64)])


@pytest.mark.parametrize("dt", [dtypes.FLOAT16, dtypes.BFLOAT16], ids=lambda d: d.name)
def test_half_rounding(dt: dtypes.DTypeInfo) -> None:
    """The kernels' float16/bfloat16 bits equal reference.round_half_bits on every probe value."""
    values = _half_probe_values()
    p = dataclasses.replace(make_param("flat", dt, [1]), shape=(values.size,), region=((0, values.size),), values=values)
    got = fill(p)
    want = np.array([reference.round_half_bits(v, dt.fmt) for v in values.tolist()], dtype=np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, first {values[bad[0]]!r}: {got[bad[0]]:#06x} != {want[bad[0]]:#06x}"


@nb.njit(cache=False)
def _half_paths(values: Any, fmt: int) -> Any:
    """half_bits_int and the store_fast path (flags too) of every value, whatever the host compiles for fill."""
    n = values.shape[0]
    ints = np.empty(n, dtype=np.uint16)
    fast = np.empty(n, dtype=np.uint16)
    flags = np.empty(n, dtype=np.int64)
    for i in range(n):
        h = half_rounding.F16 if fmt == 1 else half_rounding.BF16
        ints[i] = half_rounding.half_bits_int(values[i], h)
        flags[i] = half_rounding.store_fast(fast, i, values[i], h)
    return ints, fast, flags


@pytest.mark.parametrize("dt", [dtypes.FLOAT16, dtypes.BFLOAT16], ids=lambda d: d.name)
def test_half_rounding_paths(dt: dtypes.DTypeInfo) -> None:
    """The integer fallback (hosts without F16C) is exact everywhere; the fast store is exact wherever it
    does not flag the element (flags: NaN and nonzero |v| < 2^-126 only)."""
    values = _half_probe_values()
    want = np.array([reference.round_half_bits(v, dt.fmt) for v in values.tolist()], dtype=np.uint16)
    ints, fast, flags = _half_paths(values, dt.fmt)
    assert (ints == want).all()
    ok = flags == 0
    assert (fast[ok] == want[ok]).all()
    with np.errstate(invalid="ignore"):
        rare = np.isnan(values) | ((np.abs(values) < 2.0**-126) & (values != 0))
    assert (flags.astype(bool) == rare).all() and ok.sum() > values.size // 2


@pytest.mark.parametrize("dt", [dtypes.FLOAT32, dtypes.FLOAT64], ids=lambda d: d.name)
def test_native_cast(dt: dtypes.DTypeInfo) -> None:
    """float32/float64 take the binary64 value with one round-to-nearest-even cast."""
    values = _half_probe_values()
    p = dataclasses.replace(make_param("flat", dt, [1]), shape=(values.size,), region=((0, values.size),), values=values)
    got = fill(p)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(dt.storage)
    ok = (got.view(f"u{dt.itemsize}") == want.view(f"u{dt.itemsize}")) | (np.isnan(got) & np.isnan(want))
    assert ok.all()


# Keys whose words key + GOLDEN + i cross a 2^30 (fast-path segment), 2^32 or 2^64 boundary inside the tensor,
# at both parities (normal reads words in pairs).
EDGE_KEYS = [((b - sampler.GOLDEN - k) % 2**64) for b in (1 << 30, 1 << 32, 3 << 30, 1 << 64) for k in (5, 6, 7)]


@pytest.mark.parametrize("key", EDGE_KEYS)
@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_segment_boundaries(init: str, key: int) -> None:
    p = dataclasses.replace(make_param(init, dtypes.FLOAT64, [40]), key=key)
    assert same(fill(p), reference.materialize(p))
    assert same(fill(p, 3, 20), reference.materialize(p)[3:23])


def unmix(z: int) -> int:
    """The x with sampler.mix(x) == z (each step of SplitMix64's finalizer is a bijection)."""
    z ^= (z >> 31) ^ (z >> 62)
    z = (z * pow(sampler.MUL2, -1, 2**64)) % 2**64
    z ^= (z >> 27) ^ (z >> 54)
    z = (z * pow(sampler.MUL1, -1, 2**64)) % 2**64
    z ^= (z >> 30) ^ (z >> 60)
    return (z - sampler.GOLDEN) % 2**64


@pytest.mark.parametrize("key", EDGE_KEYS[::2])
@pytest.mark.parametrize("dt", [dtypes.FLOAT64, dtypes.BFLOAT16], ids=lambda d: d.name)
def test_truncated_normal_segment_boundaries(key: int, dt: dtypes.DTypeInfo) -> None:
    """Candidate 0 of a seed whose key puts a fast-path segment edge inside the tensor (the straddling pair
    takes the exact path), with bounds that reject about one element in three."""
    seed = unmix(key)
    assert sampler.key(seed) == key
    p = resolve_unchecked(
        0, plans.param("w", [40], {"truncatedNormal": {"mean": 0.5, "std": 2.0, "lo": -1.0, "hi": 2.5, "seed": str(seed)}}, dt.name)
    )
    assert same(fill(p), reference.materialize(p))
    assert same(fill(p, 3, 20), reference.materialize(p)[3:23])


@pytest.mark.parametrize("dt", dtypes.SUPPORTED, ids=lambda d: d.name)
def test_truncated_normal_is_normal_inside(dt: dtypes.DTypeInfo) -> None:
    """Candidate 0 is the normal of the same seed: equal wherever that lies in the bounds (binary64), and every
    other element lies in [lo, hi] and differs; no reference needed, so the sample is large."""
    n, mean, std, lo, hi = 300_000, 0.25, 1.5, -1.25, 2.0  # [mean - sigma, mean + 1.17 sigma]: a third rejected
    normal = make_param("normal", dtypes.FLOAT64, [n], seed=99, lo=mean, hi=mean + std)
    v0 = fill(normal)
    trunc = resolve_unchecked(
        0, plans.param("t", [n], {"truncatedNormal": {"mean": mean, "std": std, "lo": lo, "hi": hi, "seed": 99}}, dt.name)
    )
    got = fill(trunc)
    inside = (v0 >= lo) & (v0 <= hi)
    assert 0.25 < 1 - inside.mean() < 0.4
    want_inside = fill(dataclasses.replace(normal, dtype=dt))[inside]
    assert same(got[inside], want_inside)
    wide = got.view(dt.numpy).astype(np.float64) if dt.fmt != dtypes.FMT_NATIVE else got.astype(np.float64)
    slack = 2.0**-7 * 2.0  # one bfloat16 rounding of values up to 2
    assert (wide >= lo - slack).all() and (wide <= hi + slack).all()
    if dt == dtypes.FLOAT64:
        assert (wide[~inside] >= lo).all() and (wide[~inside] <= hi).all()


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 5e-324), (-1e-310, 1e-310), (-1e308, 1e308), (3.0, 3.0), (-math.ldexp(1.0, -1000), 0.0)])
@pytest.mark.parametrize("dt", dtypes.SUPPORTED, ids=lambda d: d.name)
def test_extreme_bounds(lo: float, hi: float, dt: dtypes.DTypeInfo) -> None:
    """Tiny spans (the draw is scaled before the multiply), an infinite span (NaN at u = 0) and lo == hi."""
    p = make_param("uniform", dt, [2, 333], lo=lo, hi=hi)
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference.materialize(p).reshape(-1)
    assert same(fill(p), want)


@pytest.mark.parametrize("key", [((b - sampler.GOLDEN - 1001) % 2**64) for b in (1 << 30, 1 << 32, 1 << 64)])
@pytest.mark.parametrize(("lo", "hi"), [(-0.5, 2.0), (-70000.0, 70000.0), (0.0, 3e-37), (-1e-40, 1e-40)])
@pytest.mark.parametrize("dt", [dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.FLOAT32], ids=lambda d: d.name)
def test_uniform_half_segments(key: int, lo: float, hi: float, dt: dtypes.DTypeInfo) -> None:
    """Each format's own affine kernel, on the unblocked path (bounds that cannot give a rare element) and
    the blocked one, with a fast-path segment edge inside the vector loop, from the start and from an offset."""
    p = dataclasses.replace(make_param("uniform", dt, [2, 1500], lo=lo, hi=hi), key=key)
    want = reference.materialize(p).reshape(-1)
    assert same(fill(p), want)
    assert same(fill(p, 37, 2900), want[37:2937])


def test_small_outputs_and_scalars() -> None:
    for init in INITS:
        for dt in dtypes.SUPPORTED:
            shape = [] if "shape" not in init else [1, 1]
            p = make_param(init, dt, shape)
            assert same(fill(p), reference.materialize(p).reshape(-1))
            empty = make_param(init, dt, [2, 0, 3] if "shape" not in init else [0, 4])
            assert fill(empty).size == 0


@st.composite
def small_plans(draw: Any) -> ResolvedParam:
    init = draw(st.sampled_from(INITS))
    dt = draw(st.sampled_from(dtypes.SUPPORTED))
    rank = draw(st.integers(2 if "shape" in init else 0, 4))
    shape = draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank))
    region = []
    for d in shape:
        a = draw(st.integers(0, d))
        region.append((a, draw(st.integers(a, d))))
    seed = draw(st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)))
    lo = draw(st.one_of(st.floats(-10, 10), st.sampled_from([0.0, -1e300, 1e-310])))
    hi = lo + draw(st.one_of(st.floats(0, 10), st.sampled_from([0.0, 1e-320, 1e300])))
    return make_param(init, dt, shape, seed=seed, region=region, lo=lo, hi=hi)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_plans())
def test_random_plans_match_reference(p: ResolvedParam) -> None:
    with np.errstate(over="ignore"):
        want = reference.materialize(p).reshape(-1)
    assert same(fill(p), want)
    if p.numel > 2:
        assert same(np.concatenate([fill(p, 0, 2), fill(p, 2)]), want)


def test_formulas_cover_all_initializers() -> None:
    assert {make_param(i, dtypes.FLOAT32, [2, 2]).formula for i in INITS} == set(Formula)


@pytest.mark.parametrize("dt", dtypes.SUPPORTED, ids=lambda d: d.name)
@pytest.mark.parametrize(
    ("lo", "hi"),
    [(-1e308, 1e308), (-1e-40, 1e-40), (0.0, 3e-37), (-(2.0**-70), 2.0**-70), (1e-300, 1e-299), (-70000.0, 70000.0), (0.0, 0.0)],
)
def test_uniform_extreme_bounds(lo: float, hi: float, dt: dtypes.DTypeInfo) -> None:
    """Bounds that give NaN (hi - lo overflows), infinities, exact zeros and 16-bit subnormals take the
    kernels' rare path, block by block, and still match the reference."""
    p = make_param("uniform", dt, [3, 1700], lo=lo, hi=hi)
    got = fill(p)
    want = reference.materialize(p).reshape(-1)
    assert same(got, want)


def test_segment_draw_forms_agree() -> None:
    """draw_seg's 32-bit form (hosts without a 64-bit vector multiply) equals the plain SplitMix64, checked in
    Python integers on words around segment edges (this host may compile only the other form)."""
    rng = np.random.default_rng(5)
    m64 = (1 << 64) - 1
    for x in [int(v) for v in rng.integers(0, 2**63, 200, dtype=np.int64)] + [m64, (1 << 30) - 1, 1 << 30]:
        c0 = x >> 30
        c = c0 & 0xFFFFFFFF
        c1 = (((((x ^ c0) >> 32) * 0x1CE4E5B9) & 0xFFFFFFFF) << 32) & m64
        a = ((x & 0xFFFFFFFF) ^ c) & 0xFFFFFFFF
        z = (a * 0x1CE4E5B9 + ((a * 0xBF58476D) << 32) + c1) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        assert (z ^ (z >> 31)) & 0xFFFFFFFF == sampler.mix((x - sampler.GOLDEN) & m64) & 0xFFFFFFFF
        assert counter_rng.low_draw(np.uint64(x)) == float(sampler.mix((x - sampler.GOLDEN) & m64) & 0xFFFFFFFF)


def test_fill_plan_batches_small_tensors_bit_for_bit() -> None:
    """fill_plan's one call for many small tensors (every value kind and dtype, subnormal scales, a tensor too
    large to batch, data values, a region) writes exactly what one fill per tensor writes, and the reference's
    values."""
    rng = np.random.default_rng(5)
    kinds = ["uniform", "normal", "truncated_normal", "zeros", "ones", "kaiming_uniform_for_shape", "flat"]
    params = []
    for j in range(160):
        init, dt = kinds[j % len(kinds)], dtypes.SUPPORTED[j % len(dtypes.SUPPORTED)]
        shape = [int(rng.integers(1, 30)), int(rng.integers(1, 30))]
        if j == 8:
            shape = [2, PIECE // 2 + 5]  # above PIECE: filled on its own, in parallel
        region = [(1, shape[0]), (0, shape[1])] if j == 15 and shape[0] > 1 else None
        lo, hi = (0.0, 1e-310) if j % 11 == 1 else (-0.5, 2.0)  # a std that scales the draw instead
        params.append(dataclasses.replace(make_param(init, dt, shape, seed=1000 + j, region=region, lo=lo, hi=hi), index=j, name=f"p{j}"))
    offsets, pos = [], 0
    for p in params:
        pos = -(-pos // 8) * 8
        offsets.append(pos)
        pos += p.nbytes
    got = poisoned(pos, np.dtype(np.uint8))
    BACKEND.fill_plan(ParamTable.of(params), got, offsets)
    for p, off in zip(params, offsets, strict=True):
        one = got[off : off + p.nbytes].view(p.dtype.storage)
        assert same(one, fill(p)), p.name
        if p.numel <= 1000:
            assert same(one, reference.materialize(p).reshape(-1)), p.name
