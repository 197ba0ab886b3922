"""The in-process server a Client starts when given no target (imports the server lazily)."""

from __future__ import annotations

from typing import Any

from paraminit_client.errors import ParaminitError


def start_embedded(backend: str = "numpy") -> Any:
    try:
        from paraminit_server.config import ServerConfig
        from paraminit_server.server import start
    except ImportError as exc:  # the client can be installed alone
        import grpc

        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"no target given and the embedded server is not installed ({exc}); "
                             "pass Client('host:port') or install paraminit with its server") from None
    running = start(ServerConfig.from_env(host="127.0.0.1", port=0, backend=backend, metrics_port=0),
                    warm_up_async=False)
    return running
