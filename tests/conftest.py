"""Fixtures and hooks shared by the tests: the CPU backend, a client of a module's `server` fixture, and JAX's
CPU device count. The plain helpers live in support.py (`from support import ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under xdist, the controller fills numba's disk cache before the workers start (prebuild --cpu: the
    kernels shared out between the cores, each compiled once). On a fresh clone every worker, server and
    subprocess would otherwise compile every kernel itself, at the same time; later runs only load them."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    done = subprocess.run([sys.executable, "-m", "paraminit_server.prebuild", "--cpu"], capture_output=True, text=True)
    if done.returncode:
        raise pytest.UsageError(f"compiling the CPU kernels failed:\n{done.stderr[-4000:]}")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(done.stdout.strip())


@pytest.fixture(scope="session")
def cpu_backend() -> Any:
    from paraminit_server.backends.cpu import CpuBackend

    return CpuBackend()


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    """A client of the module's `server` fixture."""
    with Client(target_of(server)) as c:
        yield c
