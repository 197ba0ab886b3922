"""The CUDA kernels' arithmetic checked on the CPU, bit for bit, without a GPU.

paraminit_kernels.cuh is all __host__ __device__, so nvcc builds a host-only
driver around it here: scalar functions are compared with reference.py and
sampler.py, the correctly rounded log and cos with the CPU kernels' (a random
sample, the domain's edges and vectors.json's hard inputs), and whole packed
plans (cupy_backend.pack, the kernels' tile loop and region mapping, emulated
thread by thread) with reference.py and vectors.json. Normal values match
exactly: log and cos are correctly rounded on both sides (docs/SAMPLER.md 2.1).
The header's table block is written by `make kernel-tables` (tests/test_kernel_tables.py).
Skipped without nvcc. The kernel source itself (as the backend inlines it for
NVRTC) is compiled by test_nvrtc_ptx.py, which also checks what plain nvcc
cannot show (CuPy's forced -ftz=true, NVRTC's code for the device branches, no
compiler warning); the float32 store has no device branch any more.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import reference

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_server.backends import cupy_backend as cb
from paraminit_server.backends.cpu_kernels import cr_math, cr_tables
from paraminit_server.plans import sampler
from paraminit_server.plans.plan import Formula, ResolvedParam, resolve_unchecked
from support import CASES, VECTORS, case_param, poisoned, resolved

NVCC = os.environ.get("NVCC") or shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="nvcc not found (set NVCC or put it on PATH)")]

GUARD = 64  # poisoned bytes after the arena: a stray write past the end shows up there

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "paraminit_kernels.cuh"

static std::vector<unsigned char> slurp(const char* path) {
    std::vector<unsigned char> buf;
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); std::exit(2); }
    unsigned char chunk[1 << 16];
    size_t got;
    while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0) buf.insert(buf.end(), chunk, chunk + got);
    std::fclose(f);
    return buf;
}

static int consts() {
    std::printf("BLOCK %d\nEPT %d\nTILE %d\nDESC_WORDS %d\n", PI_BLOCK, PI_EPT, PI_TILE, PI_DESC_WORDS);
    std::printf("W %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", PI_W_OUT, PI_W_N, PI_W_LBEGIN, PI_W_KIND,
                PI_W_OTYPE, PI_W_KEY, PI_W_P0, PI_W_P1, PI_W_VSHIFT, PI_W_BASE, PI_W_RUNLEN, PI_W_NOUTER, PI_W_DIMS,
                PI_W_LO, PI_W_HI, PI_W_SEED);
    std::printf("KIND %d %d %d %d %d\nOTYPE %d %d %d %d %d %d\n", PI_CONST, PI_AFFINE, PI_NORMAL, PI_FLAT,
                PI_TRUNCNORM, PI_F32, PI_F64, PI_F16, PI_BF16, PI_F8E4M3, PI_F8E5M2);
    std::printf("CANDIDATES %d\n", PI_TRUNC_CANDIDATES);
    return 0;
}

// One line per operation: name and hex 64-bit arguments; prints one hex result.
static int scalar() {
    char op[16];
    unsigned long long a, b, c, d;
    while (std::scanf("%15s %llx %llx %llx %llx", op, &a, &b, &c, &d) == 5) {
        unsigned long long r = 0;
        if (!std::strcmp(op, "mix")) r = pi_mix(a);
        else if (!std::strcmp(op, "unit")) r = pi_bits(pi_unit(a, b));
        else if (!std::strcmp(op, "affine")) r = pi_bits(pi_affine(a, b, pi_double(c), pi_double(d)));
        else if (!std::strcmp(op, "normal")) r = pi_bits(pi_normal(a, b, pi_double(c), pi_double(d)));
        else if (!std::strcmp(op, "crlog")) r = pi_bits(pi_cr_log((pi_u32)a));
        else if (!std::strcmp(op, "crcos")) r = pi_bits(pi_cr_cos((pi_u32)a));
        else if (!std::strcmp(op, "f16")) r = pi_f16_bits(pi_double(a));
        else if (!std::strcmp(op, "bf16")) r = pi_bf16_bits(pi_double(a));
        else if (!std::strcmp(op, "f8e4m3")) r = pi_f8e4m3_bits(pi_double(a));
        else if (!std::strcmp(op, "f8e5m2")) r = pi_f8e5m2_bits(pi_double(a));
        else if (!std::strcmp(op, "f32")) r = pi_f32_bits(pi_double(a));
        else if (!std::strcmp(op, "logplain")) r = pi_bits(pi_log_plain((pi_u32)a));
        else if (!std::strcmp(op, "cosplain")) r = pi_bits(pi_cos_plain((pi_u32)a));
        else if (!std::strncmp(op, "nw", 2)) {  // the word the normal store writes for output type nw<otype>
            unsigned char word[8] = {0};
            pi_normal_out(std::atoi(op + 2), word, 0, a, b, pi_double(c), pi_double(d));
            std::memcpy(&r, word, sizeof word);
        }
        else { std::fprintf(stderr, "unknown op %s\n", op); return 2; }
        std::printf("%llx\n", r);
    }
    return 0;
}

// Emulates pi_fill_plan: every tile (in a scrambled order) and every thread of its block.
static int plan(char** argv) {
    std::vector<unsigned char> meta_b = slurp(argv[2]);
    std::vector<unsigned char> vals_b = slurp(argv[3]);
    const long long arena_bytes = std::atoll(argv[4]);
    const int njobs = std::atoi(argv[6]);
    const long long tiles = std::atoll(argv[7]);
    std::vector<long long> meta(meta_b.size() / 8);
    std::memcpy(meta.data(), meta_b.data(), meta_b.size());
    std::vector<double> vals(vals_b.size() / 8 + 1);
    std::memcpy(vals.data(), vals_b.data(), vals_b.size());
    std::vector<unsigned char> arena(arena_bytes, 0xFF);
    const long long stride = 7919;  // prime: visits every tile once, out of order
    for (long long i = 0; i < tiles; ++i) {
        const long long t = (i * stride) % tiles;
        for (int tid = PI_BLOCK - 1; tid >= 0; --tid) pi_plan_tile(arena.data(), meta.data(), njobs, vals.data(), t, tid);
    }
    FILE* f = std::fopen(argv[5], "wb");
    std::fwrite(arena.data(), 1, arena.size(), f);
    std::fclose(f);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 2 && !std::strcmp(argv[1], "consts")) return consts();
    if (argc >= 2 && !std::strcmp(argv[1], "scalar")) return scalar();
    if (argc >= 8 && !std::strcmp(argv[1], "plan")) return plan(argv);
    std::fprintf(stderr, "usage: harness consts | scalar | plan META VALUES ARENA_BYTES OUT NJOBS TILES\n");
    return 2;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Build the host driver (the kernel source itself is compiled for the device, warnings refused, by
    test_nvrtc_ptx.py with NVRTC as CuPy compiles it)."""
    assert NVCC is not None
    work = tmp_path_factory.mktemp("cuda_harness")
    (work / "harness.cu").write_text(DRIVER)
    exe = work / "harness"
    host = subprocess.Popen(
        [
            NVCC,
            "-x",
            "cu",
            "-std=c++17",
            "-O2",
            "-Xcompiler",
            "-ffp-contract=off",
            "-I",
            str(cb.KERNEL_DIR),
            str(work / "harness.cu"),
            "-o",
            str(exe),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    host_log, _ = host.communicate(timeout=300)
    assert host.returncode == 0, f"host harness failed to build:\n{host_log}"
    yield exe


# Plain C++ stand-ins for the intrinsics of the header's device branches (PI_DEVICE_MATH), so that code is built
# and run on the CPU too: bit casts, the explicitly rounded +, -, *, sqrt, fma, and __ldg.
DEVICE_SHIMS = r"""
#include <cmath>
#include <cstring>
#define PI_DEVICE_MATH_ON_HOST 1
static inline long long __double_as_longlong(double x) { long long b; std::memcpy(&b, &x, sizeof b); return b; }
static inline double __longlong_as_double(long long b) { double x; std::memcpy(&x, &b, sizeof x); return x; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dsqrt_rn(double a) { return std::sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
template <class T> static inline T __ldg(const T* p) { return *p; }
"""
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def device_branches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The driver built by the host C++ compiler with the header's device branches (and stand-in intrinsics)."""
    if CXX is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    work = tmp_path_factory.mktemp("cuda_device_branches")
    (work / "harness.cpp").write_text(DRIVER)
    (work / "shims.h").write_text(DEVICE_SHIMS)
    exe = work / "harness"
    res = subprocess.run(
        [
            CXX,
            "-x",
            "c++",
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-include",
            str(work / "shims.h"),
            "-I",
            str(cb.KERNEL_DIR),
            str(work / "harness.cpp"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"device-branch harness failed to build:\n{res.stdout}{res.stderr}"
    return exe


def run_scalar(exe: Path, ops: list[tuple[str, int, int, int, int]]) -> list[int]:
    text = "".join(f"{op} {a:x} {b:x} {c:x} {d:x}\n" for op, a, b, c, d in ops)
    out = subprocess.run([str(exe), "scalar"], input=text, capture_output=True, text=True, check=True, timeout=120)
    got = [int(x, 16) for x in out.stdout.split()]
    assert len(got) == len(ops)
    return got


def dbits(x: float) -> int:
    return int(struct.unpack("<Q", struct.pack("<d", x))[0])


def bits_d(b: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", b))[0])


def run_plan(exe: Path, tmp: Path, jobs: list[cb.Job] | cb.Packed, arena_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    packed = jobs if isinstance(jobs, cb.Packed) else cb.pack(jobs)
    (tmp / "meta.bin").write_bytes(packed.meta.tobytes())
    (tmp / "values.bin").write_bytes(packed.values.tobytes())
    subprocess.run(
        [
            str(exe),
            "plan",
            str(tmp / "meta.bin"),
            str(tmp / "values.bin"),
            str(arena_bytes + GUARD),
            str(tmp / "arena.bin"),
            str(packed.njobs),
            str(packed.total_tiles),
        ],
        check=True,
        timeout=120,
    )
    arena = np.frombuffer((tmp / "arena.bin").read_bytes(), dtype=np.uint8)
    assert (arena[arena_bytes:] == 0xFF).all(), "a job wrote past the end of the arena"
    return arena[:arena_bytes]


def run_launches(exe: Path, tmp: Path, launches: Iterator[cb.Packed], arena_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """fill_plan's launches one after another over one arena: each run's written windows (its descriptors' byte
    ranges) laid over the poisoned arena in launch order."""
    itemsize = {cb.otype(d): d.itemsize for d in dtypes.SUPPORTED}
    arena = poisoned(arena_bytes, np.dtype(np.uint8))
    for k, packed in enumerate(launches):
        (tmp / str(k)).mkdir()
        got = run_plan(exe, tmp / str(k), packed, arena_bytes)
        for row in packed.meta[: packed.njobs * cb.DESC_WORDS].reshape(-1, cb.DESC_WORDS):
            lo = int(row[cb.W_OUT])
            hi = lo + int(row[cb.W_N]) * itemsize[int(row[cb.W_OTYPE])]
            arena[lo:hi] = got[lo:hi]
    return arena


# ---------------------------------------------------------------------------


def test_constants_agree(harness: Path) -> None:
    out = subprocess.run([str(harness), "consts"], capture_output=True, text=True, check=True).stdout.splitlines()
    table = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in out}
    assert table["BLOCK"] == [cb.BLOCK]
    assert table["EPT"] == [cb.EPT]
    assert table["TILE"] == [cb.TILE]
    assert table["DESC_WORDS"] == [cb.DESC_WORDS]
    assert table["W"] == [
        cb.W_OUT,
        cb.W_N,
        cb.W_LBEGIN,
        cb.W_KIND,
        cb.W_OTYPE,
        cb.W_KEY,
        cb.W_P0,
        cb.W_P1,
        cb.W_VSHIFT,
        cb.W_BASE,
        cb.W_RUNLEN,
        cb.W_NOUTER,
        cb.W_DIMS,
        cb.W_LO,
        cb.W_HI,
        cb.W_SEED,
    ]
    assert table["KIND"] == [int(Formula.CONST), int(Formula.AFFINE), int(Formula.NORMAL), int(Formula.FLAT), int(Formula.TRUNCNORM)]
    assert table["CANDIDATES"] == [sampler.TRUNC_CANDIDATES]
    assert table["OTYPE"] == [cb.OTYPE_F32, cb.OTYPE_F64, cb.OTYPE_F16, cb.OTYPE_BF16, cb.OTYPE_F8E4M3, cb.OTYPE_F8E5M2]
    assert sorted({cb.otype(d) for d in dtypes.SUPPORTED}) == table["OTYPE"]  # one output type per dtype
    assert [cb.otype(d) for d in (dtypes.FLOAT32, dtypes.FLOAT64, dtypes.FLOAT16, dtypes.BFLOAT16)] == [0, 1, 2, 3]


def test_known_answers_and_unit_streams(harness: Path) -> None:
    ops: list[tuple[str, int, int, int, int]] = [("mix", 0, 0, 0, 0), ("unit", sampler.key(0), 0, 0, 0)]
    want: list[int] = [0xE220A8397B1DCDAF, dbits(0.30117025575600564)]
    for seed, stream in VECTORS["unit"].items():
        for i, u in enumerate(stream):
            ops.append(("unit", sampler.key(int(seed)), i, 0, 0))
            want.append(dbits(u))
    assert run_scalar(harness, ops) == want


def test_random_scalars_match_reference(harness: Path) -> None:
    rng = np.random.default_rng(20240601)
    m64 = (1 << 64) - 1
    xs = [int(x) for x in rng.integers(0, 2**63, 300, dtype=np.int64)] + [m64, m64 - 1, 1 << 63]
    ops = [("mix", x, 0, 0, 0) for x in xs]
    want = [sampler.mix(x) for x in xs]
    keys = [sampler.key(int(s)) for s in rng.integers(0, 2**62, 40)] + [sampler.key(m64)]
    for key in keys:
        gs = [int(g) for g in rng.integers(0, 2**40, 8)] + [0, m64]  # the counter wraps modulo 2^64
        u = reference.units(key, np.asarray(gs, dtype=np.uint64))
        for g, ui in zip(gs, u.tolist(), strict=True):
            ops.append(("unit", key, g, 0, 0))
            want.append(dbits(ui))
            lo, hi = sorted(rng.uniform(-3, 3, 2).tolist())
            p0, p1 = lo, hi - lo
            ops.append(("affine", key, g, dbits(p0), dbits(p1)))
            want.append(dbits(p0 + ui * p1))
    assert run_scalar(harness, ops) == want


def normal_ref(key: int, g: int, mean: float, std: float) -> float:
    u1, u2 = reference.units(key, np.asarray([2 * g, 2 * g + 1], dtype=np.uint64)).tolist()
    return mean + std * reference.normal_z(u1, u2)


def _cr_draws() -> list[int]:
    """Random draws, the log floor's edge, the zeros and extremes of cos, and every hard input."""
    rng = np.random.default_rng(99)
    around = [0, 4294, 4295, 1 << 30, 1 << 31, 3 << 30, (1 << 32) - 1]
    ks = {k + d for k in around for d in range(-30, 31)} | {int(k) for k in rng.integers(0, 1 << 32, 50_000)}
    ks |= {c["k"] for fn in ("log", "cos") for c in VECTORS["hard_inputs"][fn]}
    ks |= {k for k in list(cr_tables.LOG_FIX) + list(cr_tables.COS_FIX)}
    return sorted(k for k in ks if 0 <= k < 1 << 32)


@pytest.mark.parametrize("fn", ["log", "cos"])
def test_correctly_rounded_functions_match_the_cpu_kernels(harness: Path, fn: str) -> None:
    ks = _cr_draws()
    got = run_scalar(harness, [(f"cr{fn}", k, 0, 0, 0) for k in ks])
    cpu = cr_math.cr_log if fn == "log" else cr_math.cr_cos
    want = [dbits(cpu(float(k))) for k in ks]
    assert len(set(want)) > len(ks) // 2
    assert got == want
    hard = {c["k"]: int(c["cr"], 16) for c in VECTORS["hard_inputs"][fn]}
    assert all(g == hard[k] for k, g in zip(ks, got, strict=True) if k in hard)


@pytest.mark.parametrize("fn", ["log", "cos"])
def test_plain_functions_are_the_cpu_kernels(harness: Path, device_branches: Path, fn: str) -> None:
    """The plain log and cos the device's normal store bounds its values with are the CPU kernels' (the same
    operations give the same values), so the distance bench/verify_cr.py checks on all 2^32 inputs holds for them."""
    from test_cr_math import _evaluate

    ks = _cr_draws()
    _, plain, _, _, _ = _evaluate(np.asarray(ks, dtype=np.float64), 0 if fn == "log" else 1)
    want = [dbits(x) for x in plain.tolist()]
    assert len(set(want)) > len(ks) // 2
    ops = [(f"{fn}plain", k, 0, 0, 0) for k in ks]
    assert run_scalar(harness, ops) == want
    assert run_scalar(device_branches, ops) == want


# A rounding boundary of each narrow output type near 1 (the midpoint after 1): a value straddled there by the
# plain interval makes the normal store take its exact path.
_MIDPOINTS = {dtypes.FLOAT32: 1 + 2.0**-24, dtypes.FLOAT16: 1 + 2.0**-11, dtypes.BFLOAT16: 1 + 2.0**-8}
_MIDPOINTS |= {dtypes.FLOAT8_E4M3FN: 1 + 2.0**-4, dtypes.FLOAT8_E5M2: 1 + 2.0**-3}


@pytest.mark.parametrize("dt", list(_MIDPOINTS), ids=lambda d: d.name)
def test_the_normal_store_takes_the_exact_path_when_undecided(harness: Path, device_branches: Path, dt: dtypes.DTypeInfo) -> None:
    """Narrow normal outputs are stored from a plain interval when both its ends round alike, else from the exact
    value: random elements (nearly all decided), and elements whose mean puts the value on a rounding boundary
    (undecided by construction), give reference.py's words."""
    rng = np.random.default_rng(dt.enum)
    seeds, gs, means, stds = rng.integers(0, 2**62, 300), rng.integers(0, 2**40, 300), rng.normal(0, 1, 300), rng.uniform(0, 3, 300)
    cases = [(sampler.key(int(s)), int(g), float(m), float(sd)) for s, g, m, sd in zip(seeds, gs, means, stds, strict=True)]
    boundary = _MIDPOINTS[dt]
    for s, g in zip(rng.integers(0, 2**62, 200), rng.integers(0, 2**40, 200), strict=True):
        key = sampler.key(int(s))
        cases.append((key, int(g), boundary - normal_ref(key, int(g), 0.0, 1.0), 1.0))  # mean + z lands on it
    values = np.asarray([normal_ref(*c) for c in cases])
    want = [int(w) for w in reference.cast(values, dt).view(f"u{dt.itemsize}").tolist()]
    on_boundary = want[300:]
    assert len(set(on_boundary)) == 2  # both sides of the boundary occur: the exact value decides
    ops = [(f"nw{cb.otype(dt)}", k, g, dbits(m), dbits(sd)) for k, g, m, sd in cases]
    assert run_scalar(harness, ops) == want
    assert run_scalar(device_branches, ops) == want


def test_normal_matches_reference_including_the_floor(harness: Path) -> None:
    rng = np.random.default_rng(7)
    key = sampler.key(0)
    u1 = reference.units(key, 2 * np.arange(1 << 22, dtype=np.uint64))
    floored = np.flatnonzero(u1 <= sampler.NORMAL_U1_FLOOR)
    assert floored.size > 0  # elements whose u1 is clamped to 1e-6
    cases = [(key, int(g), 0.0, 1.0) for g in floored]
    cases += [
        (sampler.key(int(s)), int(g), float(m), float(sd))
        for s, g, m, sd in zip(
            rng.integers(0, 2**62, 400), rng.integers(0, 2**40, 400), rng.normal(0, 1, 400), rng.uniform(0, 3, 400), strict=True
        )
    ]
    ops = [("normal", k, g, dbits(m), dbits(sd)) for k, g, m, sd in cases]
    assert run_scalar(harness, ops) == [dbits(normal_ref(*c)) for c in cases]


def special_doubles(rng: np.random.Generator) -> list[float]:
    """Ties, near-ties, overflow edges and subnormals of float32, float16, bfloat16 and the 8-bit floats, plus
    random bits."""
    xs = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, 5e-324, -5e-324, 2.2250738585072014e-308]
    xs += [65504.0, 65519.99, 65520.0, 65520.00000000001, 65536.0, -65520.0, 1.0004882812509095]
    xs += [
        1.0039062509313226,
        -1.00390625,
        1.00390625,
        3.6e38,
        3.3895313892515355e38,
        3.3961775292304846e38,
        3.4028234663852886e38,
        3.4028235677973366e38,
        3.40282357e38,
        1e39,
    ]
    xs += [448.0, 464.0, 464.00000000000006, 480.0, 57344.0, 61440.0, 61439.99999999999, 1.0625 + 2.0**-40]
    for mant, emin, emax in ((10, -14, 15), (7, -126, 127), (23, -126, 127), (3, -6, 8), (2, -14, 15)):
        for e in [emin - mant - 2, emin - mant - 1, emin - mant, emin - 1, emin, 0, 1, emax]:
            for m in [*rng.integers(0, 1 << (mant + 1), 6).tolist(), 0, 1, (1 << (mant + 1)) - 1]:
                tie = (m + 0.5) * 2.0 ** (e - mant)  # exactly between two representable values
                ulp = math.ulp(tie)
                xs += [tie, -tie, tie + ulp, tie - ulp]
    raw = rng.integers(0, 2**63, 2000, dtype=np.int64).astype(np.uint64)
    raw[::2] |= np.uint64(1 << 63)
    xs += [float(v) for v in raw.view(np.float64) if math.isfinite(float(v))]
    xs += [float(v) for v in rng.normal(0, 1, 500)] + [float(v) for v in rng.normal(0, 1, 200) * 1e-6]
    return xs


def test_half_and_float_casts_match_reference(harness: Path) -> None:
    xs = special_doubles(np.random.default_rng(3))
    ops = [(op, dbits(x), 0, 0, 0) for x in xs for op in ("f16", "bf16", "f32", "f8e4m3", "f8e5m2")]
    want: list[int] = []
    for x in xs:
        want.append(reference.round_half_bits(x, dtypes.FMT_FLOAT16))
        want.append(reference.round_half_bits(x, dtypes.FMT_BFLOAT16))
        with np.errstate(over="ignore"):
            want.append(int(np.asarray([x], dtype=np.float64).astype(np.float32).view(np.uint32)[0]))
        want.append(reference.round_half_bits(x, dtypes.FMT_F8E4M3))
        want.append(reference.round_half_bits(x, dtypes.FMT_F8E5M2))
    assert run_scalar(harness, ops) == want
    nan = bits_d(0x7FF8000000000001)
    assert run_scalar(
        harness,
        [("f16", dbits(nan), 0, 0, 0), ("bf16", dbits(-nan), 0, 0, 0), ("f8e4m3", dbits(nan), 0, 0, 0), ("f8e5m2", dbits(-nan), 0, 0, 0)],
    ) == [
        reference.round_half_bits(nan, dtypes.FMT_FLOAT16),
        reference.round_half_bits(-nan, dtypes.FMT_BFLOAT16),
        reference.round_half_bits(nan, dtypes.FMT_F8E4M3),
        reference.round_half_bits(-nan, dtypes.FMT_F8E5M2),
    ]
    assert run_scalar(harness, [("f8e4m3", dbits(1.0625 + 2.0**-40), 0, 0, 0)]) == [0x39]  # one rounding, not two


def test_vectors_through_the_packed_kernel_path(harness: Path, tmp_path: Path) -> None:
    params = [resolve_unchecked(i, case_param(c)) for i, c in enumerate(CASES)]
    offsets, pos = [], 0
    for p in params:
        offsets.append(pos)
        pos += -(-(p.nbytes + 8) // 8) * 8  # a gap after each tensor must stay untouched
    arena = run_plan(harness, tmp_path, [cb.Job(p, o) for p, o in zip(params, offsets, strict=True)], pos)
    for case, p, off in zip(CASES, params, offsets, strict=True):
        got = arena[off : off + p.nbytes].view(f"u{p.dtype.itemsize}")
        assert [int(x) for x in got] == [int(b, 16) for b in case["bits"]], case["name"]
        assert (arena[off + p.nbytes : off + -(-(p.nbytes + 8) // 8) * 8] == 0xFF).all(), case["name"]


INITS = (
    "zeros",
    "ones",
    "uniform",
    "normal",
    "flat",
    "xavier_uniform",
    "kaiming_uniform",
    "xavier_uniform_for_shape",
    "kaiming_uniform_for_shape",
    "truncated_normal",
)


def random_param(rng: np.random.Generator, index: int, max_numel: int = 6000, max_dim: int = 8) -> ResolvedParam:
    """A random parameter: any initializer and dtype, rank 0-5, often a random region."""
    init = INITS[int(rng.integers(len(INITS)))]
    lo_rank = 2 if init.endswith("for_shape") else 0
    while True:
        shape = [int(d) for d in rng.integers(1, max_dim + 1, int(rng.integers(lo_rank, 6)))]
        if sampler.numel(shape) <= max_numel:
            break
    dt = dtypes.SUPPORTED[int(rng.integers(len(dtypes.SUPPORTED)))]
    p = plan_pb2.Param(name=f"p{index}", shape=shape, dtype=dt.enum)  # type: ignore[arg-type]
    seed = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(2))
    i = p.init
    if init == "zeros":
        i.zeros.SetInParent()
    elif init == "ones":
        i.ones.SetInParent()
    elif init == "uniform":
        lo, hi = sorted(float(x) for x in rng.uniform(-70000, 70000, 2) * 10.0 ** rng.integers(-40, 1))
        i.uniform.lo, i.uniform.hi, i.uniform.seed = lo, hi, seed
    elif init == "normal":
        i.normal.mean, i.normal.std, i.normal.seed = float(rng.normal()), float(rng.uniform(0, 100)), seed
    elif init == "truncated_normal":  # from the narrowest valid interval to about 3 sigma
        t = i.truncated_normal
        t.mean, t.std, t.seed = float(rng.normal()), float(rng.uniform(0, 10)), seed
        t.lo, t.hi = t.mean - t.std * float(rng.uniform(0.5, 3)), t.mean + t.std * float(rng.uniform(0.5, 3))
    elif init == "flat":
        scale = 10.0 ** rng.integers(-45, 40, sampler.numel(shape))
        i.flat.values.extend((rng.normal(0, 1, sampler.numel(shape)) * scale).tolist())
    elif init == "xavier_uniform":
        i.xavier_uniform.fan_in, i.xavier_uniform.fan_out, i.xavier_uniform.seed = (
            int(rng.integers(0, 50)),
            int(rng.integers(0, 50)),
            seed,
        )
    elif init == "kaiming_uniform":
        i.kaiming_uniform.fan_in, i.kaiming_uniform.seed = int(rng.integers(0, 50)), seed
    else:
        getattr(i, init).seed = seed
    if shape and rng.random() < 0.6:
        for d in shape:
            a = int(rng.integers(0, d))
            b = int(rng.integers(a + 1, d + 1))
            p.region.add(start=a, stop=b)
    return resolve_unchecked(index, p)


def random_jobs(rng: np.random.Generator, params: list[ResolvedParam]) -> tuple[list[cb.Job], int]:
    """Each parameter split into 1-3 windows, placed in shuffled order with gaps in one arena."""
    windows: list[tuple[ResolvedParam, int, int]] = []
    for p in params:
        cuts = sorted({0, p.numel, *(int(c) for c in rng.integers(0, p.numel + 1, int(rng.integers(0, 3))))})
        windows += [(p, a, b - a) for a, b in itertools.pairwise(cuts)]
    jobs, pos = [], 0
    for w in rng.permutation(len(windows)):
        p, l_begin, n = windows[int(w)]
        pos += int(rng.integers(0, 3)) * 8
        jobs.append(cb.Job(p, pos, l_begin, n))
        pos += -(-(n * p.dtype.itemsize) // 8) * 8
    return jobs, pos + 8


def reference_window(p: ResolvedParam, l_begin: int, n: int) -> bytes:
    """reference.py's bytes for local elements [l_begin, l_begin + n), global indices found by NumPy."""
    local = np.unravel_index(np.arange(l_begin, l_begin + n, dtype=np.int64), p.out_shape) if p.shape else ()
    g = (
        np.ravel_multi_index(tuple(ix + a for ix, (a, _) in zip(local, p.region, strict=True)), p.shape)
        if p.shape
        else np.zeros(n, dtype=np.int64)
    )
    window = SimpleNamespace(
        formula=p.formula,
        p0=p.p0,
        p1=p.p1,
        key=p.key,
        values=p.values,
        lo=p.lo,
        hi=p.hi,
        seed=p.seed,
        global_indices=lambda: np.asarray(g, dtype=np.int64),
    )
    return reference.cast(reference.values_f64(cast(ResolvedParam, window)), p.dtype).tobytes()


def test_random_windowed_plans_match_reference(harness: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    params = [random_param(rng, i) for i in range(60)]
    # large enough for several tiles, a partial last tile and multi-tile region runs
    params.append(resolve_unchecked(60, _big_region_param()))
    jobs, size = random_jobs(rng, params)
    # windows deep inside a 2^35-element parameter: 64-bit indices and 64-bit division
    for init in ("uniform", "normal"):
        for dt in dtypes.SUPPORTED:
            p, l_begin, n = huge_window(dt.enum, init)
            jobs.append(cb.Job(p, size, l_begin, n))
            size += -(-(n * p.dtype.itemsize) // 8) * 8
    arena = run_plan(harness, tmp_path, jobs, size)
    covered = np.zeros(size, dtype=bool)
    for job in jobs:
        p = job.param
        end = job.offset + job.n * p.dtype.itemsize
        assert arena[job.offset : end].tobytes() == reference_window(p, job.l_begin, job.n), (
            f"{p.name} ({p.initializer}, {p.dtype.name}, region {p.region}, window [{job.l_begin}, +{job.n}))"
        )
        covered[job.offset : end] = True
    assert (arena[~covered] == 0xFF).all(), "bytes outside every job were written"


def test_full_regions_match_reference(harness: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    params = [random_param(rng, i, max_numel=400) for i in range(40)]
    offsets, pos = [], 0
    for p in params:
        offsets.append(pos)
        pos += -(-p.nbytes // 8) * 8
    arena = run_plan(harness, tmp_path, [cb.Job(p, o) for p, o in zip(params, offsets, strict=True)], pos)
    for p, off in zip(params, offsets, strict=True):
        want = reference.materialize(p).reshape(-1)
        assert arena[off : off + p.nbytes].tobytes() == want.tobytes(), (p.name, p.initializer, p.dtype.name)


def _big_region_param() -> plan_pb2.Param:
    p = plan_pb2.Param(name="big", shape=[37, 5, 300], dtype=plan_pb2.DTYPE_BFLOAT16)
    p.init.normal.mean, p.init.normal.std, p.init.normal.seed = 0.5, 3.0, 99
    for a, b in ((3, 30), (1, 4), (0, 300)):
        p.region.add(start=a, stop=b)
    return p


def huge_window(dtype: int, init: str) -> tuple[ResolvedParam, int, int]:
    """The last 3000 elements of a column shard of a [2^21, 2^14] parameter (2^35 elements)."""
    p = plan_pb2.Param(name="huge", shape=[1 << 21, 1 << 14], dtype=dtype)  # type: ignore[arg-type]
    if init == "normal":
        p.init.normal.mean, p.init.normal.std, p.init.normal.seed = 0.25, 2.0, 1 << 62
    else:
        p.init.uniform.lo, p.init.uniform.hi, p.init.uniform.seed = -3.0, 5.0, 12345
    p.region.add(start=1, stop=(1 << 21) - 1)
    p.region.add(start=3, stop=(1 << 14) - 5)
    rp = resolve_unchecked(0, p)
    return rp, rp.numel - 3000, 3000


def test_pack_rejects_bad_windows() -> None:
    p = resolve_unchecked(0, _big_region_param())
    with pytest.raises(ValueError, match="outside"):
        cb.pack([cb.Job(p, 0, p.numel - 1, 2)])
    with pytest.raises(ValueError, match="multiple of its item size"):
        cb.pack([cb.Job(p, 3)])
    empty = cb.pack([cb.Job(p, 0, 5, 0)])
    assert empty.njobs == 0 and empty.total_tiles == 0


def test_device_branches_built_for_the_host_agree(harness: Path, device_branches: Path, tmp_path: Path) -> None:
    """The header's device code paths, run on the CPU, give the bytes of its host paths (which the tests above
    check against reference.py): every scalar operation, and a packed plan through the tile loop."""
    rng = np.random.default_rng(77)
    keys = [sampler.key(int(s)) for s in rng.integers(0, 2**62, 6)]
    ops: list[tuple[str, int, int, int, int]] = []
    for key in keys:
        for g in [int(g) for g in rng.integers(0, 2**40, 40)]:
            ops += [("unit", key, g, 0, 0), ("affine", key, g, dbits(-0.5), dbits(1.5)), ("normal", key, g, dbits(0.25), dbits(2.0))]
    ops += [(op, int(d), 0, 0, 0) for d in rng.integers(0, 2**32, 400) for op in ("crlog", "crcos")]
    ops += [(op, dbits(x), 0, 0, 0) for x in special_doubles(rng) for op in ("f16", "bf16", "f32", "f8e4m3", "f8e5m2")]
    ops += [("mix", int(x), 0, 0, 0) for x in rng.integers(0, 2**63, 50, dtype=np.int64)]
    want = run_scalar(harness, ops)
    wide = [w for o, w in zip(ops, want, strict=True) if not o[0].startswith("f8")]
    assert len(set(wide)) > len(wide) // 4  # not a constant answer
    assert len(set(want) - set(wide)) > 100  # nor for the 8-bit formats (256 patterns at most)
    assert run_scalar(device_branches, ops) == want
    params = [random_param(rng, i) for i in range(30)]
    jobs, size = random_jobs(rng, params)
    (tmp_path / "host").mkdir()
    (tmp_path / "dev").mkdir()
    host = run_plan(harness, tmp_path / "host", jobs, size)
    assert run_plan(device_branches, tmp_path / "dev", jobs, size).tobytes() == host.tobytes()


def test_a_large_plan_packed_as_columns_gives_the_same_bytes(harness: Path, tmp_path: Path, cpu_backend: Any) -> None:
    """A plan of SCAN_MIN+ parameters (a ParamTable) is packed for the device without a ResolvedParam per plain row
    (pack_table): through the kernels' tile loop it writes what the per-parameter packing writes, and what the
    CPU backend writes, for every dtype and kind, with regions, patches and data rows among the columns."""
    from paraminit_client import param, plan_of
    from paraminit_server.plans import columns

    inits = [
        {"normal": {"std": 0.5, "seed": 1}},
        {"uniform": {"lo": -2, "hi": 3, "seed": 2}},
        {"ones": {}},
        {"truncatedNormal": {"std": 1, "lo": -1, "hi": 1.5, "seed": 3}},
        {"kaimingUniformForShape": {"seed": 4}},
    ]
    params = [
        param(f"p{i}", [3 + i % 5, 2 + i % 3], inits[i % len(inits)], dtypes.SUPPORTED[i % 6].name)
        for i in range(max(columns.SCAN_MIN, 1024) + 76)
    ]
    params[5] = param("p5", [40, 30], inits[0], "bfloat16", region=[(3, 17), (4, 29)])
    params[9] = param("p9", [4], {"flat": {"values": [0.5, -1.25, 3.0, 7.0]}}, "float8_e5m2")
    q = params[11].patches.add(init=param("x", [1], {"zeros": {}}).init)
    q.box.add(start=0, stop=1)
    q.box.add(start=0, stop=2)
    params[20] = param("empty", [0, 3], inits[1])
    plan = plan_of(params)
    cols = columns.of(plan)
    assert cols is not None
    table = resolved(plan)
    assert isinstance(table, columns.ParamTable) and len(table) // 2 < int(table.plain.sum()) < len(table)
    offsets, pos = [], 0
    for i in range(len(table)):
        offsets.append(pos)
        pos += -(-(int(table.nbytes[i]) + 8) // 64) * 64  # a poisoned gap after each tensor
    by_columns = run_launches(harness, tmp_path, cb.plan_launches(table, offsets), pos)
    (tmp_path / "rows").mkdir()
    by_rows = run_plan(harness, tmp_path / "rows", [cb.Job(table[i], offsets[i]) for i in range(len(table))], pos)
    assert by_columns.tobytes() == by_rows.tobytes()
    for i in (0, 1, 2, 3, 4, 5, 9, 11, 20, 777, len(table) - 1):
        p = table[i]
        want = poisoned(p.numel, p.dtype.storage)
        cpu_backend.fill(p, want)
        assert by_columns[offsets[i] : offsets[i] + p.nbytes].tobytes() == want.tobytes(), p.name
        assert (by_columns[offsets[i] + p.nbytes : offsets[i] + p.nbytes + 8] == 0xFF).all(), p.name


def test_a_column_shard_of_data_uploads_only_its_own_values(harness: Path, tmp_path: Path, cpu_backend: Any) -> None:
    """A tensor-parallel column shard of a payload lies apart in the tensor: only its own elements travel (in
    local order), not every element between its first and last, and the kernel reads them right."""
    from paraminit_client import param

    values = np.arange(64 * 48, dtype=np.float64) * 0.25 - 300.0
    p = resolve_unchecked(0, param("w", [64, 48], {"flat": {"values": values.tolist()}}, "float32", region=[(0, 64), (12, 24)]))
    packed = cb.pack([cb.Job(p, 0)])
    assert packed.values.size == p.numel == 64 * 12  # not the 63 * 48 + 12 between the shard's ends
    window = cb.pack([cb.Job(p, 0, 100, 300)])
    assert window.values.size == 300
    want = poisoned(p.numel, p.dtype.storage)
    cpu_backend.fill(p, want)
    assert run_plan(harness, tmp_path, packed, p.nbytes).tobytes() == want.tobytes()
    (tmp_path / "w").mkdir()
    got = run_plan(harness, tmp_path / "w", window, 300 * 4)  # the window's elements from the arena's start
    assert got.tobytes() == want[100:400].tobytes()


def test_flat_values_go_to_the_device_a_window_at_a_time(
    harness: Path, tmp_path: Path, cpu_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fill_plan packs flat values (a payload in its own dtype, plan values) a window at a time, so host and device
    hold one window of binary64 values, not the whole plan's: every launch carries at most FLAT_WINDOW values, and
    the launches together write what the CPU backend writes (a column shard gathered, an empty one skipped)."""
    import ml_dtypes

    from paraminit_client import param
    from paraminit_server.plans.columns import SCAN_MIN, ParamTable

    monkeypatch.setattr(cb, "FLAT_WINDOW", 1000)
    rng = np.random.default_rng(3)
    payload = rng.standard_normal(60 * 48).astype(ml_dtypes.bfloat16)  # kept in its own dtype, as an upload is
    params = [
        resolve_unchecked(0, param("big", [5000], {"flat": {"values": rng.standard_normal(5000).tolist()}}, "float32")),
        resolve_unchecked(1, param("norm", [3000], {"normal": {"std": 1.0, "seed": 5}}, "bfloat16")),
        resolve_unchecked(2, param("small", [700], {"flat": {"values": rng.standard_normal(700).tolist()}}, "float16")),
        resolve_unchecked(3, param("empty", [0], {"flat": {}}, "float32")),
    ]
    shard = resolve_unchecked(4, param("shard", [60, 48], {"zeros": {}}, "float8_e4m3fn", region=[(0, 60), (10, 30)]))
    params.append(dataclasses.replace(shard, formula=Formula.FLAT, initializer="flat", values=payload))
    offsets, pos = [], 0
    for p in params:
        offsets.append(pos)
        pos += -(-(p.nbytes + 8) // 64) * 64
    launches = list(cb.plan_launches(ParamTable.of(params), offsets))
    assert len(launches) >= 8 and all(k.values.size <= 1000 for k in launches)
    assert launches[0].values.size == 0 and launches[0].njobs == 1  # the rest in one launch
    got = run_launches(harness, tmp_path, iter(launches), pos)
    for p, off in zip(params, offsets, strict=True):
        want = poisoned(p.numel, p.dtype.storage)
        cpu_backend.fill(p, want)
        assert got[off : off + p.nbytes].tobytes() == want.tobytes(), p.name
        assert (got[off + p.nbytes : off + p.nbytes + 8] == 0xFF).all(), p.name
    assert len(params) < SCAN_MIN  # rows resolved one by one here; the large-plan test above runs a scanned table's flat rows
