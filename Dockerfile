# syntax=docker/dockerfile:1.7
#
# Two final targets (cpu is the default, being the last stage):
#   docker build --target cpu -t paraminit:cpu .
#   docker build --target gpu -t paraminit:gpu .   # CuPy on the CUDA 12 runtime
# Wheels are resolved and built in builder stages; the final stages install them
# offline and carry no compiler, no source tree and no pip cache.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu22.04

# ---------------------------------------------------------------------------
# Only what the wheel build needs, so edits to tests/, deploy/ or docs do not
# invalidate the wheel layers.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY proto /src/proto
COPY server /src/server
COPY client /src/client

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheels-cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=source /src /src
# /wheels ends up holding exactly the dependency closure of paraminit, so the
# final stage can install the directory wholesale.
RUN pip wheel --prefer-binary --wheel-dir /wheels /src

# ---------------------------------------------------------------------------
# The GPU image runs Ubuntu's Python 3.11, so its wheels are resolved on that
# same base: a wheel picked under Debian's newer glibc might not install here.
FROM ${CUDA_IMAGE} AS gpu-base
ENV DEBIAN_FRONTEND=noninteractive
# libgomp1 backs Numba's OpenMP threading layer (see NUMBA_THREADING_LAYER).
# Exact apt versions are not pinned: the archive drops superseded patch
# versions, which would break rebuilds; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv libgomp1 \
 && rm -rf /var/lib/apt/lists/*

FROM gpu-base AS wheels-gpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=source /src /src
RUN python3.11 -m venv /opt/build \
 && /opt/build/bin/pip wheel --prefer-binary --wheel-dir /wheels "/src[gpu]"

# ---------------------------------------------------------------------------
FROM gpu-base AS gpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# Numeric UID/GID so Kubernetes can verify runAsNonRoot without a passwd lookup.
RUN groupadd --system --gid 10001 paraminit \
 && useradd --system --uid 10001 --gid paraminit --create-home --home-dir /home/paraminit paraminit \
 && install -d -o 10001 -g 10001 /var/cache/paraminit
# A bind mount keeps the wheels out of every image layer.
RUN --mount=type=bind,from=wheels-gpu,source=/wheels,target=/wheels \
    python3.11 -m venv /opt/paraminit \
 && /opt/paraminit/bin/pip install --no-index --find-links=/wheels /wheels/*.whl
# Numba and CuPy JIT caches must stay writable under a read-only root
# filesystem; Kubernetes mounts an emptyDir at /var/cache/paraminit.
# `threadsafe` makes Numba fail at warm-up, before SERVING, rather than fall
# back to a threading layer that aborts under concurrent requests.
ENV PATH=/opt/paraminit/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/var/cache/paraminit/numba \
    NUMBA_THREADING_LAYER=threadsafe \
    CUPY_CACHE_DIR=/var/cache/paraminit/cupy \
    PARAMINIT_HOST=0.0.0.0 \
    PARAMINIT_PORT=50051 \
    PARAMINIT_METRICS_PORT=9090 \
    PARAMINIT_BACKEND=cupy \
    PARAMINIT_LOG_FORMAT=json
USER 10001:10001
WORKDIR /home/paraminit
EXPOSE 50051 9090
# start-period covers the first Numba/CuPy JIT compilation; `|| exit 1` maps
# any failure to the only non-zero code Docker defines for health checks.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sh", "-c", "paraminit health --target \"127.0.0.1:${PARAMINIT_PORT}\" --timeout 3 || exit 1"]
ENTRYPOINT ["paraminit"]
CMD ["serve"]

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# The slim image lacks libgomp1, and without it Numba falls back to its
# workqueue layer, which aborts the process when gRPC worker threads run
# parallel kernels concurrently. Versions unpinned for the reason given above.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 paraminit \
 && useradd --system --uid 10001 --gid paraminit --create-home --home-dir /home/paraminit paraminit \
 && install -d -o 10001 -g 10001 /var/cache/paraminit
RUN --mount=type=bind,from=wheels-cpu,source=/wheels,target=/wheels \
    python -m venv /opt/paraminit \
 && /opt/paraminit/bin/pip install --no-index --find-links=/wheels /wheels/*.whl
ENV PATH=/opt/paraminit/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/var/cache/paraminit/numba \
    NUMBA_THREADING_LAYER=threadsafe \
    PARAMINIT_HOST=0.0.0.0 \
    PARAMINIT_PORT=50051 \
    PARAMINIT_METRICS_PORT=9090 \
    PARAMINIT_BACKEND=numpy \
    PARAMINIT_LOG_FORMAT=json
USER 10001:10001
WORKDIR /home/paraminit
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sh", "-c", "paraminit health --target \"127.0.0.1:${PARAMINIT_PORT}\" --timeout 3 || exit 1"]
ENTRYPOINT ["paraminit"]
CMD ["serve"]
