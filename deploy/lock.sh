#!/bin/sh
# Regenerates the hash-locked requirement files the Dockerfile installs from.
# Existing pins are kept; to move one: deploy/lock.sh --upgrade-package numpy
# (or --upgrade for all). Needs pip-tools (pip install pip-tools) and PyPI.
set -eu
cd "$(dirname "$0")/.."
compile() {
    pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
        --no-emit-find-links "$@"
}
compile "$@" -o deploy/requirements.lock pyproject.toml
compile "$@" --extra gpu-cuda13 -o deploy/requirements-gpu.lock pyproject.toml
compile "$@" -o deploy/requirements-build.lock deploy/requirements-build.in
