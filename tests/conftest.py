"""Fixtures and hooks shared by the tests: the CPU backend, a client of a module's `server` fixture, and JAX's
CPU device count. The plain helpers live in support.py (`from support import ...`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

# safetensors.numpy reads bfloat16 by numpy's name for it, which exists once ml_dtypes is imported; paraminit
# itself imports ml_dtypes only when it first makes a bfloat16 array
import ml_dtypes  # noqa: F401
import pytest

from paraminit_client import Client
from paraminit_server.rpc.server import Running
from support import target_of

# JAX tests run on a 2x2 mesh of CPU devices; the flag must be set before JAX initializes its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()


@pytest.fixture(scope="session")
def cpu_backend() -> Any:
    from paraminit_server.backends.cpu import CpuBackend

    return CpuBackend()


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    """A client of the module's `server` fixture."""
    with Client(target_of(server)) as c:
        yield c
