"""How the CPU kernels are compiled: numba decorators, one cache key for the whole package, host features, bit casts.

Every kernel is cached on disk. numba keys a cached function on its own bytecode and the stamp of its own source
file only, so a kernel whose callee lives in a sibling module would load stale machine code after that sibling
changed; `KernelCache` adds a digest of every module of this package to the key (and keeps a process whose
sources were edited after it imported them out of the cache). No fastmath anywhere: every
binary64 operation of the spec rounds on its own (no FMA contraction).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba as nb
from llvmlite import ir
from numba import types
from numba.core.caching import FunctionCache
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic

_PACKAGE = Path(__file__).resolve().parent


def _stamps() -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in _PACKAGE.glob("*.py")}


# The modules' stamps as this process imports them (a directory listing, microseconds): a digest read later from
# files edited since would key this process's older code as the new sources, and every later process would load
# it. Such a process compiles without the cache instead.
_IMPORTED = _stamps()


@functools.cache
def sources_digest() -> str | None:
    """SHA-256 over the names and bytes of this package's modules; None when they changed since this process
    imported them (its code is not what the files say: nothing is loaded from or saved to the cache)."""
    if _stamps() != _IMPORTED:
        return None
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class KernelCache(FunctionCache):
    """numba's on-disk cache of one kernel, keyed also on the sources of every kernel module (see the module doc).

    A per-kind kernel (driver._kernels) is a closure whose cells hold other dispatchers; numba keys a closure on
    its pickled cells, and a dispatcher pickles differently in every process, so such a kernel would never load
    from the cache. It is keyed on its qualname instead, which names its kind (kernel_of), while the sources digest
    covers the code of every cell.
    """

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        return None if sources_digest() is None else super().load_overload(sig, target_context)  # type: ignore[no-untyped-call]

    def save_overload(self, sig: Any, data: Any) -> None:
        if sources_digest() is not None:
            super().save_overload(sig, data)  # type: ignore[no-untyped-call]

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        if self._py_func.__closure__ is None:
            return (*super()._index_key(sig, codegen), sources_digest())  # type: ignore[no-untyped-call]
        code = hashlib.sha256(self._py_func.__code__.co_code).hexdigest()
        return (sig, codegen.magic_tuple(), (code, self._py_func.__qualname__), sources_digest())


def _kernel(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """njit(cache=True, nogil=True, **options), cached through KernelCache instead of numba's FunctionCache."""

    def decorate(fn: Callable[..., Any]) -> Any:
        disp = nb.njit(nogil=True, **options)(fn)
        # what Dispatcher.enable_caching does for cache=True, with the package-wide key
        disp._cache = KernelCache(fn)  # type: ignore[no-untyped-call]
        return disp

    return decorate


def kernel_options(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """A kernel decorator with numba options of its own (e.g. parallel, error_model), cached as the kernels are: for
    the checks and benches that run the kernels' functions."""
    return _kernel(**options)


def kernel_of(kind: int, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`_kernel(**options)` for a kernel made per value kind inside a factory: named `<name>_k<kind>`, so each kind's
    kernel has cache files and a cache key of its own."""

    def decorate(fn: Callable[..., Any]) -> Any:
        fn.__qualname__ = fn.__name__ = f"{fn.__name__}_k{int(kind)}"
        return _kernel(**options)(fn)

    return decorate


# Helpers are small and not marked inline: LLVM inlines them after linking, before it vectorizes (numba-level
# inlining only multiplied compile time).
jit = _kernel()
parallel = _kernel(parallel=True)
# The log/cos helpers are too large for LLVM's inliner, and a call in the loop stops vectorization: they are
# inlined by numba.
inline = _kernel(inline="always")


def quiet_inliner_warnings() -> None:
    """numba's inliner reports phi variables of inlined helpers as out of scope; harmless for this code.

    Set at import and again before each compile (backends/cpu.py): a filter added while another thread is inside
    `warnings.catch_warnings` is dropped when that thread leaves it, and the in-process data plane imports the
    kernels on its own thread while the caller's thread goes on importing."""
    warnings.filterwarnings("ignore", message="variable '.*' is not in scope", category=NumbaIRAssumptionWarning)


quiet_inliner_warnings()


def _host_feature(name: str) -> bool:
    """Whether the host CPU (which the kernels are compiled for) has an LLVM feature, e.g. f16c."""
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get(name, False))
    except Exception:  # pragma: no cover - feature query unavailable: take the integer paths
        return False


# Host features are read when a kernel compiles (numba freezes globals); they key numba's cache through the
# codegen's CPU name and feature string.
# A 64-bit vector multiply (AVX-512DQ vpmullq): SplitMix64 runs as is (counter_rng.draw_seg).
WIDE_MULTIPLY = _host_feature("avx512dq")
# LLVM's tuning for Intel server cores (skylake-avx512 .. emeraldrapids) prefers 256-bit vectors, which halves
# the width of the normal kernels' double-double pipeline on hosts with AVX-512 (AMD's tuning already uses 512).
# The normal kernels ask for 512-bit vectors per function (wide_vectors below), only where AVX-512 exists; the
# other kernels keep LLVM's choice.
WIDE_VECTORS = _host_feature("avx512f") and _host_feature("avx512dq")
_WIDE_ATTRS = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')
F16C = _host_feature("f16c")  # binary32 -> float16 conversion (vcvtps2ph)
AVX512BF16 = _host_feature("avx512bf16")  # binary32 -> bfloat16 (vcvtneps2bf16; flushes binary32 subnormals)


def _wide_vectors(typingctx: Any) -> Any:
    """Mark the function being compiled to vectorize 512 bits wide (a no-op without AVX-512)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if WIDE_VECTORS:
            for attr in _WIDE_ATTRS:
                # llvmlite's attribute set accepts only enum attributes by name; string attributes are written
                # into the IR text as they are.
                set.add(builder.function.attributes, attr)
        return context.get_dummy_value()

    return types.none(), codegen


def _f64_bits(typingctx: Any, x: Any) -> Any:
    """Reinterpret a binary64 as its bit pattern, as int64 (a plain LLVM bitcast)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


def _bits_f64(typingctx: Any, x: Any) -> Any:
    """Reinterpret a 64-bit pattern as a binary64 (a plain LLVM bitcast)."""
    if x not in (types.int64, types.uint64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(x), codegen


wide_vectors: Any = intrinsic(_wide_vectors)
f64_bits: Any = intrinsic(_f64_bits)
bits_f64: Any = intrinsic(_bits_f64)
