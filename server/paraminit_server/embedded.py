"""The one module through which the client embeds the server: a data plane or a loopback server in process."""

from __future__ import annotations

from typing import Any

from paraminit_server import backends
from paraminit_server.__main__ import main as serve_main
from paraminit_server.config import ServerConfig
from paraminit_server.materializer import Materializer
from paraminit_server.server import Running, start

__all__ = ["Materializer", "Running", "ServerConfig", "data_plane", "loopback_server", "serve_main"]


def data_plane(backend: str = "cpu", **config: Any) -> Materializer:
    """A warmed-up data plane in this process: no sockets, no encoding."""
    cfg = ServerConfig.from_env(backend=backend, metrics_port=0, **config)
    b = backends.create(cfg.backend, cfg.device, cfg.threads or None)
    b.warm_up()
    return Materializer(cfg, b)


def loopback_server(backend: str = "cpu", **config: Any) -> Running:
    """A gRPC server on a free loopback port in this process, SERVING when this returns."""
    cfg = ServerConfig.from_env(host="127.0.0.1", port=0, backend=backend, metrics_port=0, **config)
    return start(cfg, warm_up_async=False)

