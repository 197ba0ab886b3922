"""Device kernels compiled ahead of time: one sm_XX cubin per architecture, built without a GPU, loaded at start.

The GPU image builds them (`python -m paraminit_server.prebuild DIR`): NVRTC, from the nvidia-cuda-nvrtc wheel
through ctypes (no CuPy, driver or device needed), compiles the kernel source for each architecture with the
option set CuPy itself compiles RawModules with. Each file is named by its architecture and a key of the source
and the options, so a cubin of other sources is never loaded: the CuPy backend looks for its device's
architecture and this key (`find`), loads a match with `cupy.RawModule(path=...)` and compiles as before when
there is none (another architecture, an edited kernel). A container then says SERVING without compiling.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

ARCHS = ("80", "90", "100")  # A100; H100 and H200; B200
DIR_ENV = "PARAMINIT_CUBIN_DIR"  # where the backend looks for them (the GPU image sets it)
ELF_MAGIC = b"\x7fELF"


class NvrtcError(RuntimeError):
    """NVRTC is missing or refused the source (the message carries its log)."""


def cupy_options(base: Sequence[str], arch: str) -> tuple[str, ...]:
    """What CuPy 14 hands NVRTC for cupy.RawModule(code=..., options=base) on `arch` ("sm_90": a cubin;
    "compute_90": PTX): core.assemble_cupy_compiler_options adds --std=c++17 (when no -std is given);
    compiler._compile_with_cache_cuda appends -ftz=true, which wins over the caller's options; the NVRTC call
    appends the arch and --device-as-default-execution-space. Include paths are left out: the source has none."""
    return (*base, "--std=c++17", "-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")


def key(source: str, options: Sequence[str]) -> str:
    """16 hex digits naming what a cubin was compiled from."""
    h = hashlib.sha256(source.encode())
    for o in options:
        h.update(b"\0" + o.encode())
    return h.hexdigest()[:16]


def file_name(source: str, base: Sequence[str], arch: str) -> str:
    """The cubin's file name for an architecture ("90"): architecture and key."""
    return f"paraminit_kernels.sm_{arch}.{key(source, cupy_options(base, f'sm_{arch}'))}.cubin"


def find(source: str, base: Sequence[str], arch: str, directory: str | os.PathLike[str] | None = None) -> Path | None:
    """The prebuilt cubin of this source for `arch`, if `directory` (default: $PARAMINIT_CUBIN_DIR) holds one."""
    where = directory if directory is not None else os.environ.get(DIR_ENV)
    if not where:
        return None
    path = Path(where) / file_name(source, base, arch)
    return path if path.is_file() else None


def nvrtc_library() -> Path | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (CUDA 13 layout nvidia/cu13/lib, CUDA 12 nvidia/cuda_nvrtc/lib), or
    $PARAMINIT_NVRTC."""
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


def nvrtc_compile(source: str, options: Sequence[str], cubin: bool = False, name: str = "paraminit_kernels.cu") -> tuple[bytes, str]:
    """PTX (or, with `cubin`, the cubin) of `source`, and NVRTC's program log.

    Args:
        source: CUDA C++ source.
        options: NVRTC options, the arch among them.
        cubin: return the cubin (the arch must be sm_XX), else the PTX.
        name: the program's name in messages.

    Returns:
        (output bytes, log).

    Raises:
        NvrtcError: no NVRTC library, or the compile failed (with its log).
    """
    path = nvrtc_library()
    if path is None:
        raise NvrtcError("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set PARAMINIT_NVRTC)")
    lib = ctypes.CDLL(str(path))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise NvrtcError(f"nvrtcCreateProgram returned {rc}")
    try:
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcError(f"nvrtcCompileProgram returned {rc}: {text}")
        get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        if get_size(prog, ctypes.byref(size)) != 0:
            raise NvrtcError("no output of the requested kind")
        out = ctypes.create_string_buffer(size.value)
        if get(prog, out) != 0:
            raise NvrtcError("reading the output failed")
        return (out.raw[: size.value] if cubin else out.raw[: size.value].rstrip(b"\0")), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Built(NamedTuple):
    """A cubin written by `build`, and ptxas's resource report for it."""

    path: Path
    resources: list[str]  # ptxas -v lines: each kernel's registers, stack frame and spills


def resource_lines(log: str) -> list[str]:
    """The lines of ptxas -v output (NVRTC's log with --ptxas-options=-v) that name a kernel or its resources."""
    return [ln.strip() for ln in log.splitlines() if "entry function" in ln or "registers" in ln or "spill" in ln]


def build(source: str, base: Sequence[str], directory: str | os.PathLike[str], archs: Sequence[str] = ARCHS) -> list[Built]:
    """Compile `source` for each architecture into `directory` (created), each file written whole or not at all.

    ptxas reports each kernel's registers and spills (--ptxas-options=-v, which changes the log and the command
    line the cubin records, not its code, so the file's key leaves it out): a kernel that starts to spill shows
    in the build's output.

    Args:
        source: the kernel source.
        base: the backend's own NVRTC options (CuPy's are added as it adds them).
        directory: where the cubins go.
        archs: architectures, "90" for sm_90.

    Returns:
        The files written, each with its resource report.

    Raises:
        NvrtcError: NVRTC is missing or a compile failed.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    def one(arch: str) -> Built:
        binary, log = nvrtc_compile(source, (*cupy_options(base, f"sm_{arch}"), "--ptxas-options=-v"), cubin=True)
        if binary[:4] != ELF_MAGIC:
            raise NvrtcError(f"sm_{arch}: NVRTC gave {len(binary)} bytes that are not an ELF cubin")
        path = out / file_name(source, base, arch)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(binary)
        os.replace(tmp, path)
        return Built(path, resource_lines(log))

    # NVRTC compiles without the GIL: one architecture per core
    with ThreadPoolExecutor(max(1, min(len(archs), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, archs))
