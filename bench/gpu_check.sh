#!/usr/bin/env bash
# The whole GPU check in one run, under 8 minutes (BUDGET below: 435 s of steps; each step is capped by what
# is left of it, and a step with too little left is skipped and says so): a two-process CUDA IPC probe, the kernels
# compiled (NVRTC through CuPy) while the CPU kernels are compiled into a shared numba cache, the gpu-marked parity
# tests (kernels, large plans, payloads, patches, IPC into a second process and torch) and bench/gpu.py, on a machine whose python3 already has CuPy and
# numba (torch, pytest optional) but not this project. CuPy cannot travel with the check (its wheel is over the
# carry limit); without a CuPy that imports and a device it sees, the check stops at once with one line saying so.
# The packages the image lacks (protobuf, grpcio, ...) travel as wheels: run `make gpu-wheels` here and carry .whl/;
# they are installed offline into a temporary directory, never fetched. Without them, and without those packages in
# the image, the check stops at once with one line saying so.
# Results go to $OUT (default ./out), at most 4 files, since the device machine hands back only a few: summary.txt,
# env.txt, bench_gpu.json and logs.tar.gz, which holds every step's log (ipc_probe.log, wheels.log, warm_gpu.log,
# warm_cpu.log, test_gpu.log, bench_gpu.log; a step killed by its timeout
# leaves what it wrote). The archive is made however the check ends.
# When the environment refuses CUDA IPC (a sandbox such as gVisor, or containers without a shared IPC/PID
# namespace), the probe says so and the IPC tests are skipped with that reason (PARAMINIT_CUDA_IPC_REFUSED).
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
# Every step's log goes into one archive, however the check ends (a `die`, a timeout, the end).
# shellcheck disable=SC2329  # called from the EXIT trap
bundle_logs() {
    local logs=()
    for f in "$OUT"/*.log; do [ -e "$f" ] && logs+=("$(basename "$f")"); done
    if [ "${#logs[@]}" -gt 0 ] && tar -czf "$OUT/logs.tar.gz" -C "$OUT" "${logs[@]}"; then
        (cd "$OUT" && rm -f "${logs[@]}")
    fi
}
trap 'bundle_logs; rm -rf "$TMPD"' EXIT
# One numba cache for every process of the check: the compile step fills it, the servers and tests load from it.
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$TMPD/numba}"

say() { printf '%s\n' "$*" | tee -a "$OUT/env.txt"; }
die() { printf 'gpu_check: FAILED: %s\n' "$*" | tee -a "$OUT/env.txt" >&2; exit 1; }

: > "$OUT/env.txt"

# CuPy and a device first: without them nothing below can run, and this is the one line a dry run prints.
if ! cupy_err=$("$PY" - 2>&1 <<'PYEOF'
import sys
def first(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
try:
    import cupy
except Exception as exc:
    sys.exit(f"CuPy does not import ({first(exc)}); the device image provides cupy-cuda13x, which cannot be carried")
try:
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    sys.exit(f"CuPy {cupy.__version__} imports but finds no usable CUDA driver ({first(exc)})")
if count == 0:
    sys.exit(f"CuPy {cupy.__version__} imports but sees no CUDA device")
PYEOF
); then
    die "$(printf '%s\n' "$cupy_err" | tail -n 1) [python: $PY]"
fi

# Wheels first: they go before the image's own packages on PYTHONPATH, which every child process inherits.
# GPU_CHECK_WHEELS names another directory than .whl (the script's own tests point it at an empty one).
WHEEL_DIR="${GPU_CHECK_WHEELS:-.whl}"
WHEELS=0
if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
    WHEELS=1
    SITE="$TMPD/site"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEEL_DIR"/*.whl \
            > "$OUT/wheels.log" 2>&1 || die "installing the wheels in .whl/ failed (see $OUT/wheels.log): are they for this Python?"
    else  # no pip in the image: a wheel is a zip of what goes into site-packages
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "$WHEEL_DIR"/*.whl \
            > "$OUT/wheels.log" 2>&1 || die "unpacking the wheels in .whl/ failed (see $OUT/wheels.log)"
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

# Everything the server, the client and the tests import that this check does not bring itself, loaded exactly as
# the tests' child processes will load it (no relaxed version checks: a child could not inherit them).
NEEDED=(paraminit.v1.init_service_pb2 paraminit.v1.init_service_pb2_grpc paraminit_server.rpc.server paraminit_client
        grpc_status google.rpc.status_pb2 crc32c mpmath)
if ! pb_err=$("$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" "${NEEDED[@]}" 2>&1); then
    why=$(printf '%s\n' "$pb_err" | tail -n 1)
    if [ "$WHEELS" = 1 ]; then
        die "the wheels in .whl/ do not make paraminit importable with $PY ($why); rebuild them with 'make gpu-wheels'"
    fi
    die "no wheels in .whl/ and $PY cannot import what paraminit needs ($why): run 'make gpu-wheels' and carry .whl"
fi

# The time budget: every step ends by BUDGET seconds after the start (SECONDS counts from there, set-up included),
# plus at most 5 s of kill grace for each of the 4 steps, so the whole check ends within 435 + 20 s < 8 minutes.
# cap WANT RESERVE gives a step WANT seconds at most, less when RESERVE must stay for the steps after it:
# IPC probe 60, compile 150, tests 300 (leaving bench/gpu.py its 90). Normal parity over 2^24 elements of every
# dtype is test_normal_large_sample, and a STREAM bench from a GPU server is host-bound, so neither is a step of its
# own: their time goes to the tests (large plans as columns, 16-bit payloads, patches). A step with less than
# MIN_STEP seconds left is skipped and says so.
BUDGET=${GPU_CHECK_BUDGET:-435}  # seconds; smaller only to try the script's own paths
MIN_STEP=15
left() { echo $(( BUDGET - SECONDS - $1 )); }
# cap WANT RESERVE: WANT seconds, or less so that RESERVE seconds stay for the later steps (0: out of time).
cap() { local c; c=$(left "$2"); [ "$c" -gt "$1" ] && c=$1; [ "$c" -lt "$MIN_STEP" ] && c=0; echo "$c"; }
skipped() { say "SKIPPED: $1: out of the ${BUDGET}s budget after ${SECONDS}s"; status=1; }

say "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), budget ${BUDGET}s"
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
import cupy
print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion(),
      "devices", cupy.cuda.runtime.getDeviceCount())
PYEOF

# CUDA IPC between two processes, before anything relies on it: hosts that sandbox their workloads may refuse the
# legacy cudaIpc* calls, and that must read as the environment's refusal, not as a bug in the IPC paths.
say "== CUDA IPC probe (export here, map and read in a second process)"
cat > "$TMPD/ipc_probe.py" <<'PYEOF'
import subprocess, sys
import cupy as cp
import numpy as np
N = 2 << 20
CHILD = r"""
import sys
import cupy as cp
import numpy as np
n = int(sys.argv[2])
try:
    ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(sys.argv[1]))
except Exception as exc:
    print("REFUSED cudaIpcOpenMemHandle in the second process:", str(exc).splitlines()[0])
    sys.exit(3)
host = np.empty(n, dtype=np.uint8)
cp.cuda.runtime.memcpy(host.ctypes.data, ptr, n, cp.cuda.runtime.memcpyDeviceToHost)
cp.cuda.runtime.ipcCloseMemHandle(ptr)
ok = np.array_equal(host, (np.arange(n) * 7 % 251).astype(np.uint8))
print("OK" if ok else "WRONG BYTES")
sys.exit(0 if ok else 4)
"""
mem = cp.cuda.Memory(N)
arr = cp.ndarray((N,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
arr[...] = cp.asarray((np.arange(N) * 7 % 251).astype(np.uint8))
cp.cuda.Device().synchronize()
try:
    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(mem.ptr))
except Exception as exc:
    print("REFUSED cudaIpcGetMemHandle:", str(exc).splitlines()[0])
    sys.exit(3)
res = subprocess.run([sys.executable, "-c", CHILD, handle.hex(), str(N)], capture_output=True, text=True, timeout=90)
out, err = res.stdout.strip().splitlines(), res.stderr.strip().splitlines()
print(out[-1] if out else "the second process failed: " + (err[-1] if err else f"exit status {res.returncode}"))
sys.exit(res.returncode)
PYEOF
c=$(cap 60 330)
if [ "$c" -eq 0 ]; then  # timeout 0 would mean no limit at all
    skipped "the CUDA IPC probe"
    rc=1
    printf '%s\n' "skipped: out of time" > "$OUT/ipc_probe.log"
else
    timeout -k 5 "$c" "$PY" "$TMPD/ipc_probe.py" > "$OUT/ipc_probe.log" 2>&1
    rc=$?
fi
probe=$(tail -n 1 "$OUT/ipc_probe.log")
if [ $rc -eq 0 ]; then
    say "   CUDA IPC works between two processes"
elif [ $rc -eq 3 ]; then
    export PARAMINIT_CUDA_IPC_REFUSED="$probe"
    say "   ENVIRONMENT REFUSES CUDA IPC: $probe (the IPC tests below are skipped with this reason)"
else
    say "   CUDA IPC probe FAILED (rc $rc): $probe"
    status=1
fi

# Compile the CUDA kernels (NVRTC; CuPy caches the binary on disk for the steps below) and, at the same time, the CPU
# kernels into NUMBA_CACHE_DIR (cold: 40-100 s), so neither compile is paid inside a test's timeout and a kernel that
# does not build is reported on its own.
say "== CUDA kernels (built ahead of time, loaded and warmed up) and CPU kernels (numba cache), in parallel"
# As the GPU image does at its build: the cubin of this device's architecture by `python -m paraminit_server.prebuild`
# (NVRTC), which the backend then loads instead of compiling (PARAMINIT_CUBIN_DIR, set for every later step too);
# without NVRTC's wheel the backend compiles as before, and the log says which it did.
export PARAMINIT_CUBIN_DIR="$TMPD/kernels"
printf '%s\n' "import os" "import cupy" "from paraminit_server import prebuild" "from paraminit_server.backends import cubins" \
    "from paraminit_server.backends import cupy_backend as cb" "arch = str(cupy.cuda.Device(0).compute_capability)" \
    "print('prebuild sm_' + arch + ': exit', prebuild.main([os.environ['PARAMINIT_CUBIN_DIR'], '--arch', arch]))" \
    "found = cubins.find(cb.kernel_source(), cb.NVRTC_OPTIONS, arch)" \
    "print('kernels: loaded from ' + found.name if found else 'kernels: compiled by CuPy (no prebuilt cubin)')" \
    "b = cb.CupyBackend(0)" "b.warm_up()" "print(b.device())" > "$TMPD/warm_gpu.py"
printf '%s\n' "from paraminit_server.backends.cpu import CpuBackend" "CpuBackend().warm_up()" \
    "print('CPU kernels compiled into', __import__('os').environ['NUMBA_CACHE_DIR'])" > "$TMPD/warm_cpu.py"
c=$(cap 150 290)
if [ "$c" -eq 0 ]; then  # timeout 0 would mean no limit at all
    skipped "the kernel compiles"
    rc=1
    cpu_rc=1
    : > "$OUT/warm_gpu.log"
    : > "$OUT/warm_cpu.log"
else
    timeout -k 5 "$c" "$PY" "$TMPD/warm_cpu.py" > "$OUT/warm_cpu.log" 2>&1 &
    cpu_pid=$!
    timeout -k 5 "$c" "$PY" "$TMPD/warm_gpu.py" > "$OUT/warm_gpu.log" 2>&1
    rc=$?
    wait "$cpu_pid"
    cpu_rc=$?
fi
grep -E '^(prebuild|kernels):' "$OUT/warm_gpu.log" | tee -a "$OUT/env.txt"
tail -n 3 "$OUT/warm_gpu.log" | tee -a "$OUT/env.txt"
tail -n 1 "$OUT/warm_cpu.log" | tee -a "$OUT/env.txt"
say "   CUDA rc $rc, CPU rc $cpu_rc after ${SECONDS}s"
{ [ $rc -ne 0 ] || [ $cpu_rc -ne 0 ]; } && status=1

say "== tests/test_gpu.py tests/test_gpu_service.py"
if ! "$PY" -c "import pytest" 2>/dev/null; then
    say "SKIPPED: pytest is not installed for $PY, so tests/test_gpu.py cannot run here;"
    say "         bench/gpu.py below still checks both ends of every output against reference.py."
    status=1
elif [ "$(cap 300 90)" -eq 0 ]; then
    skipped "the gpu tests"
else
    c=$(cap 300 90)
    # the image's pytest with none of its installed plugins (an incompatible one would fail the whole step)
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 5 "$c" "$PY" -m pytest -m gpu tests/test_gpu.py tests/test_gpu_service.py \
        -v -s -p no:cacheprovider -o addopts=-ra > "$OUT/test_gpu.log" 2>&1
    rc=$?
    grep -E "PASSED|FAILED|ERROR|SKIPPED|differ|^device:|^E |[0-9]+ (passed|failed|skipped|error)" "$OUT/test_gpu.log" \
        | tail -n 60
    # IPC into a second process (its torch tensors aliasing the mapping, where it has torch) for the summary
    grep -E "test_(zero_byte_)?cuda_ipc_in_a_second_process.*(PASSED|FAILED|SKIPPED|ERROR)|torch zero-copy" "$OUT/test_gpu.log" \
        | sed 's/^/   /' >> "$OUT/env.txt"
    [ $rc -eq 124 ] && say "the gpu tests timed out after ${c}s"
    [ $rc -ne 0 ] && status=1
    if grep -q "skipped" "$OUT/test_gpu.log" && ! grep -q "passed" "$OUT/test_gpu.log"; then
        say "the gpu tests skipped everything (no CuPy or no device): nothing was checked"
        status=1
    fi
fi

say "== bench/gpu.py"
c=$(cap 90 0)
if [ "$c" -eq 0 ]; then
    skipped "bench/gpu.py"
else
    timeout -k 5 "$c" "$PY" bench/gpu.py --gib "${GPU_CHECK_GIB:-1}" --repeat 5 --json "$OUT/bench_gpu.json" \
        > "$OUT/bench_gpu.log" 2>&1
    rc=$?
    cat "$OUT/bench_gpu.log"
    # for the summary: parity per initializer and dtype, GB/s against the device copy and torch, the verdict
    grep -E "^(parity |MISMATCH|targets|  (copy|torch|uniform|xavier|kaiming|normal) )" "$OUT/bench_gpu.log" \
        | sed 's/^ */   /' >> "$OUT/env.txt"
    [ $rc -eq 124 ] && say "bench/gpu.py timed out after ${c}s"
    [ $rc -ne 0 ] && status=1
fi

say "== done after ${SECONDS}s: status $status (logs in $OUT)"
grep -E "^(==|SKIPPED|   )|FAILED|ENVIRONMENT|timed out" "$OUT/env.txt" > "$OUT/summary.txt"
exit $status
