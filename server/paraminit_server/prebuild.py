"""`python -m paraminit_server.prebuild DIR`: the device kernels compiled ahead of time, for the GPU image's build.

It needs NVRTC (the nvidia-cuda-nvrtc wheel) and neither CuPy, a driver nor a GPU. The image sets
PARAMINIT_CUBIN_DIR to DIR, so the CuPy backend loads these cubins at start instead of compiling
(backends/cubins.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paraminit import exitcodes
from paraminit_server.backends import cubins, cupy_backend


def main(argv: Sequence[str] | None = None) -> int:
    """Build the cubins; exit 0, or 1 with NVRTC's reason on stderr.

    Args:
        argv: the command line (default: sys.argv[1:]).

    Returns:
        The exit code.
    """
    parser = argparse.ArgumentParser(prog="python -m paraminit_server.prebuild", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the cubins go (the image's PARAMINIT_CUBIN_DIR)")
    parser.add_argument("--arch", action="append", help=f"architecture, e.g. 90 for sm_90 (repeatable; default {' '.join(cubins.ARCHS)})")
    args = parser.parse_args(argv)
    try:
        written = cubins.build(cupy_backend.kernel_source(), cupy_backend.NVRTC_OPTIONS, args.directory, args.arch or cubins.ARCHS)
    except (cubins.NvrtcError, OSError) as exc:
        print(f"{parser.prog}: error: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        return exitcodes.ERROR
    for path in written:
        print(f"{path}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
