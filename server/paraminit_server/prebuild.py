"""`python -m paraminit_server.prebuild`: kernels compiled ahead of time, so that a server starts without compiling.

`prebuild DIR` writes the device kernels (cubins) for the GPU image's build. It needs NVRTC (the
nvidia-cuda-nvrtc wheel) and neither CuPy, a driver nor a GPU, and prints each cubin with ptxas's report of its
kernels' registers and spills. The image sets PARAMINIT_CUBIN_DIR to DIR, so the CuPy backend loads these
cubins at start instead of compiling (backends/cubins.py).

`prebuild --cpu` fills numba's disk cache (NUMBA_CACHE_DIR) with every CPU kernel and the plan scanner. Numba
compiles under one lock per process, so the work is shared out between processes, one per usable core by
default: each compiles its share once and the others load it from the cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from paraminit import exitcodes
from paraminit_server import host_limits
from paraminit_server.backends import cubins, cupy_backend


def main(argv: Sequence[str] | None = None) -> int:
    """Build the cubins, or the CPU kernels' cache; exit 0, or 1 with the reason on stderr.

    Args:
        argv: the command line (default: sys.argv[1:]).

    Returns:
        The exit code.
    """
    parser = argparse.ArgumentParser(prog="python -m paraminit_server.prebuild", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="where the cubins go (the image's PARAMINIT_CUBIN_DIR)")
    parser.add_argument("--arch", action="append", help=f"architecture, e.g. 90 for sm_90 (repeatable; default {' '.join(cubins.ARCHS)})")
    parser.add_argument("--cpu", action="store_true", help="compile the CPU kernels into numba's disk cache (NUMBA_CACHE_DIR)")
    parser.add_argument("--processes", type=int, default=0, help="processes compiling CPU kernels (default: one per usable core)")
    parser.add_argument("--share", help=argparse.SUPPRESS)  # K/N: one process's share (what --cpu starts)
    args = parser.parse_args(argv)
    if args.share:
        index, _, count = args.share.partition("/")
        return _cpu_share(int(index), int(count))
    if not args.cpu and not args.directory:
        parser.error("name a directory for the cubins, or --cpu")
    if args.cpu and (code := _cpu(parser.prog, args.processes or host_limits.default_threads() or os.cpu_count() or 1)):
        return code
    if not args.directory:
        return 0
    try:
        written = cubins.build(cupy_backend.kernel_source(), cupy_backend.NVRTC_OPTIONS, args.directory, args.arch or cubins.ARCHS)
    except (cubins.NvrtcError, OSError) as exc:
        print(f"{parser.prog}: error: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        return exitcodes.ERROR
    for built in written:
        print(f"{built.path}: {built.path.stat().st_size} bytes")
        for line in built.resources:
            print(f"  {line}")
    return 0


def _cpu(prog: str, processes: int) -> int:
    """Start `processes` processes, each compiling its share of the CPU kernels; wait for all."""
    from paraminit_server.backends import jit_cache

    cache = jit_cache.prepare_jit_cache()  # the children inherit the environment it settles
    if cache.warning:
        print(f"{prog}: {cache.warning}", file=sys.stderr)
    started = time.perf_counter()
    command = [sys.executable, "-m", "paraminit_server.prebuild", "--share"]
    children = [subprocess.Popen([*command, f"{k}/{processes}"]) for k in range(processes)]
    failed = [k for k, child in enumerate(children) if child.wait() != 0]
    if failed:
        print(f"{prog}: error: {len(failed)} of {processes} kernel-compiling processes failed", file=sys.stderr)
        return exitcodes.ERROR
    print(f"CPU kernels ready in numba's cache ({processes} processes, {time.perf_counter() - started:.1f} s)")
    return 0


def _cpu_share(index: int, count: int) -> int:
    from paraminit_server.backends.cpu import CpuBackend
    from paraminit_server.plans import scanner

    CpuBackend().compile_share(index, count)
    if index == count - 1:
        scanner.warm_up()
    return 0


if __name__ == "__main__":
    sys.exit(main())
