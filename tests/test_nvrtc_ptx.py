"""The kernel source compiled the way CuPy compiles it, with NVRTC from PyPI, and its PTX checked.

CuPy appends `-ftz=true` to every NVRTC compile, after the caller's options, so
it wins over anything in cupy_backend.NVRTC_OPTIONS: every float32 conversion or
operation the compiler emits flushes subnormals to zero, where the CPU backend
keeps them (docs/SAMPLER.md section 4). The host harness (test_cuda_harness.py)
cannot see that: it builds with plain nvcc. This test builds the real source
(cupy_backend.kernel_source()) with CuPy 14's option set and asserts on the PTX:
no flush-to-zero instruction, no float32 arithmetic at all on outputs, and no
double multiply-add beyond the header's explicit __fma_rn calls.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (the dev extra), loaded with
ctypes: no GPU, driver or CUDA toolkit is needed. The sm_90 cubin's registers and spills
(ptxas -v through NVRTC) are printed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from paraminit_server.backends import cupy_backend as cb

ARCH = "90"  # H100 / H200


def _nvrtc_path() -> Path | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (CUDA 13 layout nvidia/cu13/lib, CUDA 12 nvidia/cuda_nvrtc/lib)."""
    explicit = os.environ.get("PARAMINIT_NVRTC")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob("*/lib/libnvrtc.so.*"))
        if found:
            return found[-1]
    return None


NVRTC = _nvrtc_path()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")]


def cupy_options(arch: str) -> tuple[str, ...]:
    """What CuPy 14.2 hands NVRTC for cp.RawModule(code=..., options=NVRTC_OPTIONS) on this arch.

    core.assemble_cupy_compiler_options adds --std=c++17 (when no -std is given) and include
    paths (which this include-free source does not need); compiler._compile_with_cache_cuda
    appends -ftz=true; compiler._compile_using_nvrtc_no_warning appends the arch
    (-arch=sm_XX for a cubin, -arch=compute_XX for PTX) and --device-as-default-execution-space.
    """
    return (*cb.NVRTC_OPTIONS, "--std=c++17", "-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")


class NvrtcError(RuntimeError):
    pass


def compile_source(source: str, options: tuple[str, ...], cubin: bool = False) -> tuple[bytes, str]:
    """PTX (or, with cubin, the CUBIN) of source and the program log; NvrtcError with the log on failure."""
    assert NVRTC is not None
    lib = ctypes.CDLL(str(NVRTC))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"paraminit_kernels.cu", 0, None, None)
    if rc != 0:
        raise NvrtcError(f"nvrtcCreateProgram returned {rc}")
    try:
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise NvrtcError(f"nvrtcCompileProgram returned {rc}: {log.value.decode(errors='replace')}")
        get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        if get_size(prog, ctypes.byref(size)) != 0:
            raise NvrtcError("no output of the requested kind")
        out = ctypes.create_string_buffer(size.value)
        if get(prog, out) != 0:
            raise NvrtcError("reading the output failed")
        text = log.value.decode(errors="replace")
        return (out.raw[: size.value] if cubin else out.raw[: size.value].rstrip(b"\0")), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


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
def ptx() -> dict[str, str]:
    """Three compiles at once (NVRTC runs without the GIL): PTX, PTX with opaque FMAs, and the sm_ cubin
    (CuPy's default method), the latter with ptxas's resource report in its log."""
    source = cb.kernel_source()
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(compile_source, source, cupy_options(f"compute_{ARCH}"))
        opaque = pool.submit(compile_source, opaque_fma_source(), cupy_options(f"compute_{ARCH}"))
        cubin = pool.submit(compile_source, source, (*cupy_options(f"sm_{ARCH}"), "--ptxas-options=-v"), True)
        binary, log = cubin.result()
        return {"plain": plain.result()[0].decode(), "opaque": opaque.result()[0].decode(), "cubin": str(len(binary)), "ptxas": log}


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


def test_both_kernels_are_in_the_ptx(ptx: dict[str, str]) -> None:
    for name in (cb.FILL_KERNEL, cb.FILL_PLAN_KERNEL):
        assert re.search(rf"\.entry {name}\(", ptx["plain"]), name
    assert int(ptx["cubin"]) > 0
    assert len(opcodes(ptx["plain"])) > 1000  # the whole of log, cos and the tile loops


def test_no_flush_to_zero_and_no_float32_arithmetic(ptx: dict[str, str]) -> None:
    ops = opcodes(ptx["plain"])
    ftz = sorted({o for o in ops if ".ftz" in o})
    assert not ftz, f"flush-to-zero instructions under CuPy's -ftz=true: {ftz}"
    # Outputs are rounded in integer arithmetic; no float32 value is ever computed or converted.
    f32 = sorted({o for o in ops if re.search(r"\.f32(\.|$)", o) and not o.startswith(("ld.", "st.", "mov."))})
    assert not f32, f"float32 instructions: {f32}"


def test_no_contracted_multiply_add(ptx: dict[str, str]) -> None:
    ops = opcodes(ptx["plain"])
    fused = [o for o in ops if o.startswith(("fma.", "mad.")) and not o.startswith("mad.lo.") and ".f" in o]
    assert fused and set(fused) == {"fma.rn.f64"}, sorted(set(fused))
    opaque = opcodes(ptx["opaque"])
    assert sum(o.startswith("call") for o in opaque) > 0  # the calls really went through the opaque function
    fused = [o for o in opaque if o.startswith(("fma.", "mad.")) and ".f" in o and not o.startswith("mad.lo.")]
    assert fused == ["fma.rn.f64"], f"multiply-adds besides the explicit one: {fused}"


def test_registers_and_spills_on_sm90(ptx: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """ptxas's report for sm_90, printed for the notes (pytest -s); both kernels fit a thread's 255 registers."""
    log = ptx["ptxas"]
    lines = [ln.strip() for ln in log.splitlines() if "entry function" in ln or "registers" in ln or "spill" in ln]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == 2 and all(0 < r <= 255 for r in regs), log
    assert len(re.findall(r"bytes spill stores", log)) == 2, log
