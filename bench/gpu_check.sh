#!/usr/bin/env bash
# The whole GPU check in one run, under 5 minutes (each step is capped by what is left): the gpu-marked parity tests and
# bench/gpu.py, on a machine whose python3 already has CuPy and numba (torch, pytest optional) but not this project.
# The packages the image lacks (protobuf, grpcio, ...) travel as wheels: run `make gpu-wheels` here and carry .whl/;
# they are installed offline into a temporary directory, never fetched. Without them, and without those packages in
# the image, the check stops at once with one line saying so.
# Logs go to $OUT (default ./out): env.txt, wheels.log, warm_gpu.log, test_gpu.log, normal_parity.log,
# transport_gpu.log, bench_gpu.log, bench_gpu.json.
#
#   bash bench/gpu_check.sh    # PYTHON=... picks the interpreter, GPU_CHECK_GIB the bench size (default 1)
#
# Exit status: 0 when the tests and the bench ran and passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
# Absolute, so child processes (the CUDA IPC test's client) import the same code from any directory.
export PYTHONPATH="$ROOT/proto:$ROOT/server:$ROOT/client${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
status=0
TMPD=$(mktemp -d)
trap 'rm -rf "$TMPD"' EXIT

say() { printf '%s\n' "$*" | tee -a "$OUT/env.txt"; }
die() { printf 'gpu_check: FAILED: %s\n' "$*" | tee -a "$OUT/env.txt" >&2; exit 1; }

: > "$OUT/env.txt"

# Wheels first: they go before the image's own packages on PYTHONPATH, which every child process inherits.
WHEELS=0
if ls .whl/*.whl >/dev/null 2>&1; then
    WHEELS=1
    SITE="$TMPD/site"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
            > "$OUT/wheels.log" 2>&1 || die "installing the wheels in .whl/ failed (see $OUT/wheels.log): are they for this Python?"
    else  # no pip in the image: a wheel is a zip of what goes into site-packages
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" .whl/*.whl \
            > "$OUT/wheels.log" 2>&1 || die "unpacking the wheels in .whl/ failed (see $OUT/wheels.log)"
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

# Everything the server, the client and the tests import that this check does not bring itself, loaded exactly as
# the tests' child processes will load it (no relaxed version checks: a child could not inherit them).
NEEDED=(paraminit.v1.init_service_pb2 paraminit.v1.init_service_pb2_grpc paraminit_server.server paraminit_client
        grpc_status google.rpc.status_pb2 crc32c mpmath)
if ! pb_err=$("$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" "${NEEDED[@]}" 2>&1); then
    why=$(printf '%s\n' "$pb_err" | tail -n 1)
    if [ "$WHEELS" = 1 ]; then
        die "the wheels in .whl/ do not make paraminit importable with $PY ($why); rebuild them with 'make gpu-wheels'"
    fi
    die "no wheels in .whl/ and $PY cannot import what paraminit needs ($why): run 'make gpu-wheels' and carry .whl"
fi
say "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$OUT/env.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("numpy", "cupy", "numba", "google.protobuf", "grpc", "torch", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"{name:16} {getattr(m, '__version__', '?')}")
    except Exception as exc:  # report, never stop: the checks below say what each missing piece costs
        print(f"{name:16} MISSING ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
try:
    import cupy
    print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion(),
          "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy/cuda unusable:", exc)
PYEOF

# Compile the CUDA kernels first (NVRTC; CuPy caches the binary on disk for the
# steps below), so a kernel that does not build is reported on its own.
say "== CUDA kernels (compile and warm up)"
printf '%s\n' "from paraminit_server.backends.cupy_backend import CupyBackend" "b = CupyBackend(0)" "b.warm_up()" \
    "print(b.device())" > "$TMPD/warm_gpu.py"
timeout 90 "$PY" "$TMPD/warm_gpu.py" > "$OUT/warm_gpu.log" 2>&1
rc=$?
tail -n 3 "$OUT/warm_gpu.log" | tee -a "$OUT/env.txt"
say "   rc $rc after ${SECONDS}s"
[ $rc -ne 0 ] && status=1

# What is left of the 5 minutes, keeping BENCH_RESERVE seconds for the bench.
BUDGET=290
BENCH_RESERVE=50  # the bench checks against reference.py, so it has no numba compile to wait for
left() { local s=$(( BUDGET - SECONDS - $1 )); [ $s -lt 30 ] && s=30; echo $s; }

say "== tests/test_gpu.py"
if "$PY" -c "import pytest" 2>/dev/null; then
    cap=$(left $BENCH_RESERVE)
    timeout "$cap" "$PY" -m pytest -m gpu tests/test_gpu.py tests/test_gpu_service.py -v -s -p no:cacheprovider -o addopts=-ra \
        > "$OUT/test_gpu.log" 2>&1
    rc=$?
    grep -E "PASSED|FAILED|ERROR|SKIPPED|differ|^device:|^E |[0-9]+ (passed|failed|skipped|error)" "$OUT/test_gpu.log" \
        | tail -n 60
    [ $rc -eq 124 ] && say "tests/test_gpu.py timed out after ${cap}s"
    [ $rc -ne 0 ] && status=1
    if grep -q "skipped" "$OUT/test_gpu.log" && ! grep -q "passed" "$OUT/test_gpu.log"; then
        say "tests/test_gpu.py skipped everything (no CuPy or no device): nothing was checked"
        status=1
    fi
else
    say "SKIPPED: pytest is not installed for $PY, so tests/test_gpu.py cannot run here;"
    say "         bench/gpu.py below still checks both ends of every output against reference.py."
    status=1
fi

say "== normal parity (docs/SAMPLER.md 2.1: correctly rounded log/cos, so GPU bytes equal the CPU's, no ulp allowance)"
cap=$(left $BENCH_RESERVE)
timeout "$cap" "$PY" - > "$OUT/normal_parity.log" 2>&1 <<'PYEOF'
import sys
import cupy as cp
import numpy as np
from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.backends.cupy_backend import CupyBackend
from paraminit_server.plan import resolve_param

gpu, cpu = CupyBackend(0), CpuBackend()
n, bad = 1 << 24, 0
for dt in dtypes.SUPPORTED:
    for mean, std, seed in ((0.0, 1.0, 2024), (0.1, 0.02, 7), (-3.0, 1e-3, 2**63 + 5)):
        p = plan_pb2.Param(name="w", shape=[n], dtype=dt.enum)
        p.init.normal.mean, p.init.normal.std, p.init.normal.seed = mean, std, seed
        rp = resolve_param(0, p)
        g = cp.empty(n, dtype=dt.storage)
        g.view(cp.uint8).fill(0xFF)
        gpu.fill(rp, g)
        want = np.empty(n, dtype=dt.storage)
        want.view(np.uint8).fill(0xA5)
        cpu.fill(rp, want)
        got = gpu.to_host(g)
        diff = int((got.view(np.uint8).reshape(n, -1) != want.view(np.uint8).reshape(n, -1)).any(axis=1).sum())
        bad += diff
        print(f"normal {dt.name:<9} mean={mean} std={std} seed={seed}: {diff} of {n} elements differ")
sys.exit(1 if bad else 0)
PYEOF
rc=$?
tail -n 14 "$OUT/normal_parity.log"
[ $rc -eq 124 ] && say "normal parity timed out after ${cap}s"
[ $rc -ne 0 ] && status=1

say "== bench/transport.py --backend cupy (STREAM from a GPU server: device fill, pinned ring, send)"
cap=$(left $BENCH_RESERVE)
[ "$cap" -gt 60 ] && cap=60
timeout "$cap" "$PY" bench/transport.py --backend cupy --mib 256 --repeat 3 > "$OUT/transport_gpu.log" 2>&1
rc=$?
grep -v " INFO " "$OUT/transport_gpu.log" | tail -n 12
[ $rc -eq 124 ] && say "bench/transport.py timed out after ${cap}s"
[ $rc -ne 0 ] && status=1

say "== bench/gpu.py"
cap=$(left 0)
timeout "$cap" "$PY" bench/gpu.py --gib "${GPU_CHECK_GIB:-1}" --repeat 5 --json "$OUT/bench_gpu.json" \
    > "$OUT/bench_gpu.log" 2>&1
rc=$?
cat "$OUT/bench_gpu.log"
[ $rc -eq 124 ] && say "bench/gpu.py timed out after ${cap}s"
[ $rc -ne 0 ] && status=1

say "== done after ${SECONDS}s: status $status (logs in $OUT)"
exit $status
