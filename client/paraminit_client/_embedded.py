"""The in-process data plane a Client runs when given no target (the server package is optional)."""

from __future__ import annotations

from typing import Any

import grpc

from paraminit_client.errors import ParaminitError


def start_embedded(backend: str = "cpu", safetensors_dirs: str = "/") -> Any:
    """The in-process data plane. `safetensors_dirs` (colon-separated): the files its plans may read; by default
    every file this process can read, since the allow-list guards a server from its clients, not a process from
    itself."""
    try:
        from paraminit_server import embedded  # optional: the client can be installed alone
    except ImportError as exc:
        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"no target given and the embedded server is not installed ({exc}); "
                             "pass Client('host:port') or install paraminit with its server") from None
    return embedded.InProcess.start(backend, safetensors_dirs=safetensors_dirs)
