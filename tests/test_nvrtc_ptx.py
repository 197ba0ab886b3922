"""The kernel source compiled the way CuPy compiles it, with NVRTC from PyPI, and its PTX checked.

CuPy appends `-ftz=true` to every NVRTC compile, after the caller's options, so
it wins over anything in cupy_backend.NVRTC_OPTIONS: every float32 conversion or
operation the compiler emits flushes subnormals to zero, where the CPU backend
keeps them (docs/SAMPLER.md section 4). The host harness (test_cuda_harness.py)
cannot see that: it builds with plain nvcc. This test builds the real source
(cupy_backend.kernel_source()) with CuPy 14's option set, refuses any compiler
warning, and asserts on the PTX: no flush-to-zero instruction, no float32 arithmetic (outputs are converted from
binary64 by the header's inline cvt.rn), and no double multiply-add beyond the header's explicit __fma_rn calls.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (the dev extra), loaded with
ctypes: no GPU, driver or CUDA toolkit is needed. The sm_90 cubin's registers and spills
(ptxas -v through NVRTC) are printed.
"""

from __future__ import annotations

import contextlib
import io
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from paraminit_server.backends import cubins
from paraminit_server.backends import cupy_backend as cb

ARCH = "90"  # H100 / H200


NVRTC = cubins.nvrtc_library()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")]


def cupy_options(arch: str) -> tuple[str, ...]:
    """What CuPy 14.2 hands NVRTC for cp.RawModule(code=..., options=NVRTC_OPTIONS) on this arch."""
    return cubins.cupy_options(cb.NVRTC_OPTIONS, arch)


compile_source = cubins.nvrtc_compile


# The header's one explicit multiply-add, moved into a function that is never inlined: then any
# fma or mad left anywhere else in the PTX was contracted by the compiler.
FMA_BODY = "return __fma_rn(a, b, c);"
OPAQUE_FMA = 'extern "C" __device__ __noinline__ double pi_fma_opaque(double a, double b, double c) { return __fma_rn(a, b, c); }\n'


def opaque_fma_source() -> str:
    source = cb.kernel_source()
    assert source.count(FMA_BODY) == 1, "pi_fma no longer reads as the test expects"
    source = source.replace(FMA_BODY, "return pi_fma_opaque(a, b, c);")
    return source.replace("typedef unsigned long long pi_u64;", OPAQUE_FMA + "typedef unsigned long long pi_u64;", 1)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three compiles at once (NVRTC runs without the GIL): PTX, PTX with opaque FMAs, and the sm_ cubin (CuPy's
    default method) as the GPU image builds it, `python -m paraminit_server.prebuild DIR --arch 90`, whose output
    carries ptxas's resource report."""
    from paraminit_server import prebuild

    source = cb.kernel_source()
    directory = tmp_path_factory.mktemp("cubins")
    report = io.StringIO()

    def build() -> int:
        with contextlib.redirect_stdout(report):
            return prebuild.main([str(directory), "--arch", ARCH])

    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(compile_source, source, cupy_options(f"compute_{ARCH}"))
        opaque = pool.submit(compile_source, opaque_fma_source(), cupy_options(f"compute_{ARCH}"))
        built = pool.submit(build)
        return {
            "plain": plain.result()[0].decode(),
            "log": plain.result()[1],
            "opaque": opaque.result()[0].decode(),
            "prebuild": built.result(),
            "directory": directory,
            "ptxas": report.getvalue(),
        }


def instructions(text: str) -> list[str]:
    """PTX instruction lines without their predicate guards (no directives, labels, comments or braces)."""
    out = []
    for line in text.splitlines():
        s = line.split("//", 1)[0].strip().rstrip(";")
        if not s or s.startswith((".", "{", "}")) or s.endswith(":"):
            continue
        if s.startswith("@"):
            s = s.split(None, 1)[1]
        out.append(s)
    return out


def opcodes(text: str) -> list[str]:
    return [re.split(r"\s", i, maxsplit=1)[0] for i in instructions(text)]


def test_options_end_with_cupys_forced_ftz() -> None:
    opts = cupy_options("compute_90")
    assert opts.index("-ftz=true") > max(opts.index(o) for o in cb.NVRTC_OPTIONS)


def test_both_kernels_are_in_the_ptx(ptx: dict[str, Any]) -> None:
    for name in (cb.FILL_KERNEL, cb.FILL_PLAN_KERNEL):
        assert re.search(rf"\.entry {name}\(", ptx["plain"]), name
    assert ptx["prebuild"] == 0 and all(p.stat().st_size > 0 for p in ptx["directory"].iterdir())
    assert len(opcodes(ptx["plain"])) > 1000  # the whole of log, cos and the tile loops
    assert "warning" not in ptx["log"], ptx["log"]  # the compiler's warnings are refused, as -Werror would


def test_no_flush_to_zero_and_no_float32_arithmetic(ptx: dict[str, Any]) -> None:
    ops = opcodes(ptx["plain"])
    ftz = sorted({o for o in ops if ".ftz" in o})
    assert not ftz, f"flush-to-zero instructions under CuPy's -ftz=true: {ftz}"
    # No float32 value is ever computed: the one float32 instruction is the output conversion from binary64, written
    # as inline PTX (cvt.rn without .ftz, so subnormals are kept), as are those to float16 and bfloat16.
    f32 = sorted({o for o in ops if re.search(r"\.f32(\.|$)", o) and not o.startswith(("ld.", "st.", "mov."))})
    assert f32 == ["cvt.rn.f32.f64"], f"float32 instructions: {f32}"
    assert {"cvt.rn.f16.f64", "cvt.rn.bf16.f64"} <= set(ops)


def test_no_contracted_multiply_add(ptx: dict[str, Any]) -> None:
    ops = opcodes(ptx["plain"])
    fused = [o for o in ops if o.startswith(("fma.", "mad.")) and not o.startswith("mad.lo.") and ".f" in o]
    assert fused and set(fused) == {"fma.rn.f64"}, sorted(set(fused))
    opaque = opcodes(ptx["opaque"])
    assert sum(o.startswith("call") for o in opaque) > 0  # the calls really went through the opaque function
    fused = [o for o in opaque if o.startswith(("fma.", "mad.")) and ".f" in o and not o.startswith("mad.lo.")]
    assert fused == ["fma.rn.f64"], f"multiply-adds besides the explicit one: {fused}"


def test_registers_and_spills_on_sm90(ptx: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """ptxas's report for sm_90 as prebuild prints it, shown for the notes (pytest -s); both kernels fit a
    thread's 255 registers."""
    log = ptx["ptxas"]
    lines = [ln.strip() for ln in log.splitlines() if "entry function" in ln or "registers" in ln or "spill" in ln]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert sum("entry function" in ln for ln in lines) == 2, log
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == 2 and all(0 < r <= 255 for r in regs), log
    assert len(re.findall(r"bytes spill stores", log)) == 2, log


def test_cubins_built_ahead_of_time_are_found_only_for_their_sources(ptx: dict[str, Any], tmp_path: Path) -> None:
    """`python -m paraminit_server.prebuild DIR` (what the GPU image runs at build, without a GPU; the fixture ran
    it) writes one ELF cubin per architecture; the backend's look-up finds it for that architecture and these
    sources only, so an edited kernel or another device compiles instead of loading stale code."""
    from paraminit_server import prebuild

    directory = ptx["directory"]
    assert ptx["prebuild"] == 0
    (only,) = directory.iterdir()
    assert only.read_bytes()[:4] == cubins.ELF_MAGIC and only.name.startswith("paraminit_kernels.sm_90.")
    assert f"{only}: {only.stat().st_size} bytes" in ptx["ptxas"]
    source = cb.kernel_source()
    assert cubins.find(source, cb.NVRTC_OPTIONS, "90", directory) == only
    assert cubins.find(source, cb.NVRTC_OPTIONS, "80", directory) is None  # not built for sm_80
    assert cubins.find(source + "\n// edited\n", cb.NVRTC_OPTIONS, "90", directory) is None
    assert cubins.find(source, (*cb.NVRTC_OPTIONS, "-G"), "90", directory) is None
    assert prebuild.main([str(tmp_path / "bad"), "--arch", "1"]) == 1  # NVRTC refuses sm_1: exit 1, its reason
