#!/bin/sh
# Builds the CPU and GPU images without any registry and runs them the way compose and the Deployment do.
#
#   sudo deploy/image-check.sh          (or: make image-check)
#
# 1. Base: when docker.io/library/python:3.11-slim-bookworm is not in the local store, it is made with mmdebstrap
#    from Debian bookworm (Debian's python3 3.11, python3-venv, `python` linked) and tagged under that name, so the
#    Dockerfile builds unchanged. The host's CA bundle is copied in, for builders behind a TLS-inspecting proxy.
# 2. Build: the `cpu` target, with BuildKit (buildx when present, else the classic client's built-in BuildKit).
# 3. Run hardened: read-only root, UID 10001, every capability dropped, no-new-privileges, the two tmpfs mounts
#    owned by the service user. Checks time to SERVING (the image carries a compiled numba cache), the liveness and
#    readiness health names, the image's HEALTHCHECK, and /metrics.
# 4. Materializes examples/mlp.json from a second container and checks the file on the host.
# 5. A root-owned cache tmpfs (the old compose mistake) does not stop the server: it caches under /tmp instead.
# 6. SIGTERM in the middle of a 192 MiB stream: the stream completes, the server exits 0.
# 7. Compose without a build: the image is also tagged paraminit:cpu (what docker-compose.yml names), and
#    `docker compose up` (or Compose v1's `docker-compose up`) with --no-build starts the server from it, waits for it
#    to be healthy and runs the one-shot client, which materializes examples/mlp.json into the project's out/.
# 8. The GPU image (same base; cupy-cuda13x, the CUDA runtime with its headers and NVRTC from PyPI wheels, no NVIDIA
#    registry) is built, and the kernels compile inside it, hardened and without a GPU, through CuPy's own compiler
#    path with its full option set (deploy/gpu-compile-check.py).
#
# Needs root, a Docker daemon (started here from `dockerd` when none answers), for the base mmdebstrap, and Compose:
#   apt-get install -y docker.io mmdebstrap docker-compose
# Environment: IMAGE (default paraminit:check), GPU_IMAGE (default paraminit:check-gpu), TARGETS ("cpu", the
# default; "cpu gpu" or "gpu" add the 881 MB GPU image: `make image-check GPU=1`), BASE_REBUILD=1 rebuilds the base, MAX_READY_S (default 3).
set -eu

cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-paraminit:check}
GPU_IMAGE=${GPU_IMAGE:-paraminit:check-gpu}
TARGETS=${TARGETS:-cpu}
BASE=docker.io/library/python:3.11-slim-bookworm
MAX_READY_S=${MAX_READY_S:-3}
NAME=paraminit-check-$$
NET=$NAME
WORK=$(mktemp -d)
CLIENT_OPTS="--read-only --user 10001:10001 --cap-drop ALL --security-opt no-new-privileges:true"
TMPFS_TMP="/tmp:rw,nosuid,nodev,size=1g,uid=10001,gid=10001,mode=1777"
TMPFS_CACHE="/var/cache/paraminit:rw,nosuid,nodev,size=1g,uid=10001,gid=10001,mode=0700"

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

cleanup() {
    docker rm -f "$NAME" "$NAME-cold" "$NAME-stream" >/dev/null 2>&1 || true
    docker network rm "$NET" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

[ "$(id -u)" = 0 ] || fail "run as root (it builds a base image and drives the Docker daemon)"

# --- daemon -----------------------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || fail "no Docker daemon answers and dockerd is not installed (apt-get install docker.io)"
    step "starting dockerd (log: /var/log/paraminit-image-check-dockerd.log)"
    nohup dockerd >/var/log/paraminit-image-check-dockerd.log 2>&1 &
    i=0
    until docker info >/dev/null 2>&1; do
        i=$((i + 1)); [ $i -lt 60 ] || fail "dockerd did not come up"; sleep 1
    done
fi
echo "docker daemon $(docker version --format '{{.Server.Version}}')"

# --- base -------------------------------------------------------------------------------------------------------
if [ "${BASE_REBUILD:-0}" = 1 ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || fail "mmdebstrap is needed to make the base (apt-get install mmdebstrap)"
    step "base: mmdebstrap bookworm -> $BASE"
    t0=$(now)
    # The hooks' $1 (the new root) is expanded by mmdebstrap's shell, not this one.
    # shellcheck disable=SC2016
    mmdebstrap --quiet --variant=minbase --include=ca-certificates,python3,python3-venv \
        --customize-hook='copy-in /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs' \
        --customize-hook='ln -sf /usr/bin/python3 "$1/usr/local/bin/python"' \
        --customize-hook='rm -rf "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
        bookworm - \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" \
      | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
    echo "base built in $(since "$t0") s"
else
    echo "base $BASE present ($(docker image inspect --format '{{.Id}}' "$BASE" | cut -c1-19)); BASE_REBUILD=1 to remake it"
fi

# --- build ------------------------------------------------------------------------------------------------------
rev=$(git rev-parse --short HEAD 2>/dev/null || true)
if [ -n "$rev" ] && ! git diff --quiet HEAD -- proto server client pyproject.toml 2>/dev/null; then
    rev="$rev-dirty"
fi
build() {  # target, tag
    if docker buildx version >/dev/null 2>&1; then
        docker buildx build --load --target "$1" --build-arg "PARAMINIT_REVISION=$rev" -t "$2" . >"$WORK/build-$1.log" 2>&1 \
            || { tail -40 "$WORK/build-$1.log"; fail "build $1"; }
    else
        # Docker CLIs from 23 on need the buildx plugin for BuildKit; Debian's docker.io client (20.10) has it built in.
        client=docker
        [ -x /usr/bin/docker ] && client=/usr/bin/docker
        DOCKER_BUILDKIT=1 "$client" build --progress=plain --target "$1" --build-arg "PARAMINIT_REVISION=$rev" -t "$2" . \
            >"$WORK/build-$1.log" 2>&1 || { tail -40 "$WORK/build-$1.log"; fail "build $1"; }
    fi
}

# --- GPU image: built on the same base, CUDA from PyPI wheels; the kernels compile inside it without a GPU --------
gpu_check() {
    step "build --target gpu -> $GPU_IMAGE (cupy-cuda13x, CUDA runtime headers and NVRTC from PyPI wheels)"
    t0=$(now)
    build gpu "$GPU_IMAGE"
    echo "built in $(since "$t0") s: $(docker image inspect --format '{{.Id}} {{.Size}} bytes' "$GPU_IMAGE")"
    user=$(docker image inspect --format '{{.Config.User}}' "$GPU_IMAGE")
    [ "$user" = "10001:10001" ] || fail "gpu image user is $user"
    step "gpu image, hardened and without a GPU or network: the kernels compile through CuPy's compiler (NVRTC)"
    # shellcheck disable=SC2086
    docker run --rm -i --network none $CLIENT_OPTS --tmpfs "$TMPFS_TMP" --tmpfs "$TMPFS_CACHE" \
        --entrypoint python3 "$GPU_IMAGE" - < deploy/gpu-compile-check.py || fail "the kernels do not compile in $GPU_IMAGE"
}
if [ "$TARGETS" = gpu ]; then
    gpu_check
    step "image-check passed (gpu image only)"
    exit 0
fi

step "build --target cpu -> $IMAGE"
t0=$(now)
build cpu "$IMAGE"
echo "built in $(since "$t0") s: $(docker image inspect --format '{{.Id}} {{.Size}} bytes' "$IMAGE")"
user=$(docker image inspect --format '{{.Config.User}}' "$IMAGE")
entry=$(docker image inspect --format '{{json .Config.Entrypoint}}' "$IMAGE")
health=$(docker image inspect --format '{{json .Config.Healthcheck.Test}}' "$IMAGE")
echo "user=$user entrypoint=$entry healthcheck=$health"
[ "$user" = "10001:10001" ] || fail "image user is $user"
[ "$entry" = '["paraminit-server"]' ] || fail "entrypoint is $entry"
[ "$health" != null ] || fail "image has no HEALTHCHECK"

docker network create "$NET" >/dev/null
client_run() {  # entrypoint, docker run arguments: a client container on the check network, as hardened as the server
    entrypoint=$1
    shift
    # shellcheck disable=SC2086
    docker run --rm --network "$NET" $CLIENT_OPTS --tmpfs "$TMPFS_TMP" --entrypoint "$entrypoint" "$@"
}
wait_serving() {  # name, limit in seconds; prints the seconds it took
    w0=$(now)
    until docker exec "$1" paraminit health --target 127.0.0.1:50051 --timeout 1 >/dev/null 2>&1; do
        [ "$(docker inspect --format "{{.State.Running}}" "$1")" = true ] || { docker logs "$1" >&2; fail "$1 exited"; }
        awk -v s="$(since "$w0")" -v l="$2" 'BEGIN { exit !(s > l) }' && { docker logs "$1" >&2; fail "$1 not SERVING after $2 s"; }
        sleep 0.1
    done
    since "$w0"
}

# --- run hardened -----------------------------------------------------------------------------------------------
step "run hardened: --read-only --user 10001:10001 --cap-drop ALL, tmpfs /tmp and /var/cache/paraminit (uid 10001)"
# shellcheck disable=SC2086
docker run -d --name "$NAME" --network "$NET" $CLIENT_OPTS \
    --tmpfs "$TMPFS_TMP" --tmpfs "$TMPFS_CACHE" --shm-size 256m --memory 2g --cpus 2 \
    -e PARAMINIT_DRAIN_SECONDS=25 "$IMAGE" >/dev/null
ready=$(wait_serving "$NAME" 60)
echo "SERVING ${ready} s after start (limit ${MAX_READY_S} s)"
awk -v s="$ready" -v l="$MAX_READY_S" 'BEGIN { exit !(s <= l) }' || fail "took ${ready} s to become SERVING"
docker logs "$NAME" 2>&1 | head -3
client_run python3 "$IMAGE" -c '
import sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
stub = g.HealthStub(grpc.insecure_channel(sys.argv[1]))
for name in ("liveness", "paraminit.v1.InitService"):
    status = h.HealthCheckResponse.ServingStatus.Name(stub.Check(h.HealthCheckRequest(service=name), timeout=3).status)
    print(f"health {name!r}: {status}")
    assert status == "SERVING", name
' "$NAME:50051"
client_run python3 "$IMAGE" -c '
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
want = ("paraminit_build_info{", "process_resident_memory_bytes ", "process_cpu_seconds_total ", "process_open_fds ",
        "python_gc_collections_total{", "paraminit_serving 1.0", "paraminit_requests_total")
lines = [line for line in text.splitlines() if line.startswith(want)]
print("\n".join(lines[:9]))
missing = [w for w in want[:-1] if not any(line.startswith(w) for line in lines)]
assert not missing, missing
assert "paraminit_device_memory_bytes" not in text, "device memory exported by the CPU backend"
' "http://$NAME:9478/metrics"
printf 'effective limits: '
docker exec "$NAME" python3 -c 'from paraminit_server.config import ServerConfig as C; c = C.from_env(); print(f"threads={c.threads} memory_budget={c.memory_budget}")'

# --- materialize from another container -------------------------------------------------------------------------
step "materialize examples/mlp.json from a second container"
mkdir -p "$WORK/out" && chown 10001:10001 "$WORK/out"
client_run paraminit -v "$PWD/examples:/examples:ro" -v "$WORK/out:/out" "$IMAGE" \
    materialize /examples/mlp.json -o /out/mlp.safetensors --target "$NAME:50051" --no-progress --summary
python3 - "$WORK/out/mlp.safetensors" <<'EOF'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
tensors = {k: v for k, v in header.items() if k != "__metadata__"}
end = max(v["data_offsets"][1] for v in tensors.values())
assert len(data) == 8 + n + end, (len(data), n, end)
assert any(data[8 + n:]), "all-zero payload"
print(f"host check: {sys.argv[1].rsplit('/', 1)[-1]}: {len(tensors)} tensors, {end} bytes, header consistent")
EOF

i=0
until [ "$(docker inspect --format '{{.State.Health.Status}}' "$NAME")" = healthy ]; do
    i=$((i + 1)); [ $i -lt 60 ] || fail "the image's HEALTHCHECK never reported healthy"; sleep 1
done
echo "image HEALTHCHECK: $(docker inspect --format '{{.State.Health.Status}} after {{len .State.Health.Log}} probe(s)' "$NAME")"

# --- unwritable cache -------------------------------------------------------------------------------------------
step "root-owned cache tmpfs (mode 0755, the old compose mistake): still SERVING, from a private cache under /tmp"
# shellcheck disable=SC2086
docker run -d --name "$NAME-cold" --network "$NET" $CLIENT_OPTS --tmpfs "$TMPFS_TMP" --tmpfs /var/cache/paraminit \
    "$IMAGE" >/dev/null
cold=$(wait_serving "$NAME-cold" 120)
echo "SERVING ${cold} s after start; warning logged:"
docker logs "$NAME-cold" 2>&1 | grep -m1 "not writable" || fail "no warning about the unwritable cache"
docker rm -f "$NAME-cold" >/dev/null

# --- SIGTERM mid-stream -----------------------------------------------------------------------------------------
step "SIGTERM while a 192 MiB stream is in flight: the stream completes, exit 0"
# shellcheck disable=SC2086
docker run -d --name "$NAME-stream" --network "$NET" $CLIENT_OPTS --tmpfs "$TMPFS_TMP" --entrypoint python3 "$IMAGE" -c '
import sys, time
from paraminit_client import Client, param, plan_of
plan = plan_of([param("w", [48 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 3}})])
with Client(sys.argv[1]) as c:
    header, chunks = c.stream(plan)
    n = 0
    for i, chunk in enumerate(chunks):
        n += len(chunk.data)
        if i == 0:
            print("first chunk", flush=True)
        time.sleep(0.02)  # a slow consumer keeps the stream in flight across the signal
print(f"stream complete: {n} of {header.data_bytes} bytes", flush=True)
sys.exit(0 if n == header.data_bytes == 192 << 20 else 1)
' "$NAME:50051" >/dev/null
i=0
until docker logs "$NAME-stream" 2>&1 | grep -q "first chunk"; do
    i=$((i + 1)); [ $i -lt 600 ] || { docker logs "$NAME-stream"; fail "stream did not start"; }; sleep 0.1
done
t0=$(now)
docker kill --signal TERM "$NAME" >/dev/null
sleep 0.5
if docker exec "$NAME" paraminit health --target 127.0.0.1:50051 --timeout 1 >/dev/null 2>&1; then
    fail "still SERVING after SIGTERM"
fi
echo "after SIGTERM: readiness NOT_SERVING"
server_rc=$(docker wait "$NAME")
stream_rc=$(docker wait "$NAME-stream")
docker logs "$NAME-stream" 2>&1 | tail -1
echo "server exit code $server_rc after $(since "$t0") s; stream client exit code $stream_rc"
docker logs "$NAME" 2>&1 | tail -3
[ "$server_rc" = 0 ] || fail "server exited $server_rc"
[ "$stream_rc" = 0 ] || fail "stream client exited $stream_rc"

# --- compose, no build ------------------------------------------------------------------------------------------
step "compose: tag $IMAGE as paraminit:cpu, then up --no-build (server healthy, the client materializes mlp.json)"
docker tag "$IMAGE" paraminit:cpu
if docker compose version >/dev/null 2>&1; then
    compose="docker compose"
elif command -v docker-compose >/dev/null; then
    compose=docker-compose
else
    fail "neither docker compose (v2) nor docker-compose (v1) is installed (apt-get install docker-compose)"
fi
# the project in a scratch directory: its own examples/ and out/, so the checkout's out/ is not touched
mkdir -p "$WORK/compose/out" && cp -r examples "$WORK/compose/" && chown 10001:10001 "$WORK/compose/out"
project="$NAME-compose"
# shellcheck disable=SC2086
PARAMINIT_UID=10001 PARAMINIT_GID=10001 $compose -f "$PWD/docker-compose.yml" --project-directory "$WORK/compose" \
    -p "$project" up --no-build --exit-code-from materialize materialize >"$WORK/compose.log" 2>&1 \
    || { tail -30 "$WORK/compose.log"; $compose -p "$project" -f "$PWD/docker-compose.yml" down >/dev/null 2>&1; \
         fail "compose up"; }
grep -m1 "wrote /out/mlp.safetensors" "$WORK/compose.log" || { tail -30 "$WORK/compose.log"; fail "no summary from the client"; }
# shellcheck disable=SC2086
$compose -f "$PWD/docker-compose.yml" --project-directory "$WORK/compose" -p "$project" down >/dev/null 2>&1 || true
[ -s "$WORK/compose/out/mlp.safetensors" ] || fail "compose wrote no out/mlp.safetensors"
echo "compose ($compose) wrote out/mlp.safetensors: $(stat -c %s "$WORK/compose/out/mlp.safetensors") bytes"

case " $TARGETS " in *" gpu "*) gpu_check ;; esac

step "image-check passed"
