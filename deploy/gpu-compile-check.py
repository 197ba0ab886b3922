"""Inside the GPU image, without a GPU: the kernels compile through CuPy's own compiler path.

Run by deploy/image-check.sh (`docker run -i ... python3 - < deploy/gpu-compile-check.py`). It proves what a
device run needs first: CuPy finds the CUDA headers (from the nvidia-cuda-runtime wheel) and NVRTC (from
nvidia-cuda-nvrtc), and both paraminit's kernel source and a CuPy-header kernel (what CuPy's own elementwise
kernels include) compile to sm_90 cubins with CuPy's full option set, its forced -ftz=true included. The one
device query on that path (which arch to compile for) is answered with sm_90; loading a cubin needs the driver
and is left to the device. The cubins built at image build (PARAMINIT_CUBIN_DIR) are there for every
architecture the image ships, named for these sources.
"""

import sys

from cupy._core import core
from cupy.cuda import compiler

from paraminit_server.backends import cubins
from paraminit_server.backends import cupy_backend as cb

ARCH = "90"
compiler._get_arch_for_options_for_nvrtc = lambda arch=None: (f"-arch=sm_{arch or ARCH}", "cubin")
options = (*core.assemble_cupy_compiler_options(tuple(cb.NVRTC_OPTIONS)), "-ftz=true")
print("nvrtc", compiler._get_nvrtc_version(), "options", " ".join(o for o in options if not o.startswith("-I")))
print("include dirs", [o[2:] for o in options if o.startswith("-I")])
failed = 0
# What CuPy prepends to its own elementwise kernels (core.compile_with_cache, prepend_cupy_headers).
own = ("#include <cupy/complex.cuh>\n#include <cupy/carray.cuh>\n#include <cupy/atomics.cuh>\n"
       "#include <cupy/math_constants.h>\n#include <cuda_fp16.h>\n"
       'extern "C" __global__ void k(complex<float>* x, __half* h) { x[0] = x[0] * x[0]; h[0] = __float2half(1.0f); }')
for name, source in (("paraminit_kernels.cu", cb.kernel_source()), ("cupy_headers.cu", own)):
    try:
        cubin, _ = compiler._compile_using_nvrtc_no_warning(source, options, ARCH, name)
    except Exception as exc:
        print(f"{name}: FAILED: {type(exc).__name__}: {str(exc).strip()[:2000]}")
        failed += 1
        continue
    ok = isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    print(f"{name}: sm_{ARCH} cubin of {len(cubin)} bytes" + ("" if ok else " (not an ELF cubin)"))
    failed += not ok
# The cubins the image built at its build (Dockerfile: python -m paraminit_server.prebuild): the backend loads the
# one of its device's architecture instead of compiling, and only when it was built from these very sources.
for arch in cubins.ARCHS:
    prebuilt = cubins.find(cb.kernel_source(), cb.NVRTC_OPTIONS, arch)
    ok = prebuilt is not None and prebuilt.read_bytes()[:4] == cubins.ELF_MAGIC
    print(f"prebuilt sm_{arch}: " + (f"{prebuilt.name}, {prebuilt.stat().st_size} bytes" if ok and prebuilt else "MISSING"))
    failed += not ok
sys.exit(1 if failed else 0)
