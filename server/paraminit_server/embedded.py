"""The one module through which the client embeds the server: a data plane in process, or a loopback server.

`InProcess` serves the client's calls with no sockets, no chunk encoding and no
CRC: the same data plane, errors and status codes as a server, reached by plain
function calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_server import backends
from paraminit_server.__main__ import main as serve_main
from paraminit_server.caller import Caller
from paraminit_server.config import ServerConfig
from paraminit_server.layout import Layout, TensorSpan
from paraminit_server.materializer import Materializer, StreamStart
from paraminit_server.server import Running, start
from paraminit_server.service import Handlers, tensor_infos
from paraminit_server.status import status_for

__all__ = ["InProcess", "LocalRpcError", "Materializer", "Running", "ServerConfig", "data_plane", "loopback_server",
           "serve_main"]
T = TypeVar("T")


def data_plane(backend: str = "cpu", **config: Any) -> Materializer:
    """A warmed-up data plane in this process: no sockets, no encoding."""
    cfg = ServerConfig.from_env(backend=backend, metrics_port=0, **config)
    b = backends.create(cfg.backend, cfg.device, cfg.threads or None)
    preload = getattr(b, "preload", None)  # CPU: load cached kernels, compile only what this process fills
    (preload or b.warm_up)()
    return Materializer(cfg, b)


def loopback_server(backend: str = "cpu", **config: Any) -> Running:
    """A gRPC server on a free loopback port in this process, SERVING when this returns."""
    cfg = ServerConfig.from_env(host="127.0.0.1", port=0, backend=backend, metrics_port=0, **config)
    return start(cfg, warm_up_async=False)


class LocalRpcError(grpc.RpcError):  # type: ignore[misc]
    """A failed in-process call, shaped like a failed gRPC call (code, details, status details trailer)."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self._status = status

    def code(self) -> grpc.StatusCode:
        code: grpc.StatusCode = self._status.code
        return code

    def details(self) -> str:
        return str(self._status.details)

    def trailing_metadata(self) -> Any:
        return self._status.trailing_metadata


class _Unary:
    def __init__(self, owner: InProcess, name: str, fn: Callable[[Any, Caller], Any]) -> None:
        self._owner, self._name, self._fn = owner, name, fn

    def __call__(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        return self._owner.call(self._name, self._fn, request, self._owner.caller)


class InProcess:
    """The InitService stub's surface (`stub.Validate(request)`, ...) and direct fills, served in this process.

    Starting returns at once: importing numba and loading the compiled kernels happen on a thread, while
    the caller builds its model; the first call waits for them."""

    def __init__(self, plane: Materializer | Future[Materializer]) -> None:
        if isinstance(plane, Materializer):
            ready: Future[Materializer] = Future()
            ready.set_result(plane)
            plane = ready
        self._ready = plane
        self._handlers: Handlers | None = None
        self.caller = Caller(identity=f"uid:{os.getuid()}", local=True)
        self.Validate = _Unary(self, "Validate", lambda r, c: self.handlers.validate(r, c))
        self.GetInfo = _Unary(self, "GetInfo", lambda r, c: self.handlers.info(r, c))
        self.UploadPayload = _Unary(self, "UploadPayload", lambda r, c: self.handlers.upload(r, c))
        self.Release = _Unary(self, "Release", lambda r, c: self.handlers.release(r, c))
        self.Renew = _Unary(self, "Renew", lambda r, c: self.handlers.renew(r, c))
        self.ListLeases = _Unary(self, "ListLeases", lambda r, c: self.handlers.list_leases(r, c))
        self.Apply = _Unary(self, "Apply", lambda r, c: self.handlers.apply(r, c))

    @classmethod
    def start(cls, backend: str = "cpu", **config: Any) -> InProcess:
        ready: Future[Materializer] = Future()

        def build() -> None:
            try:
                ready.set_result(data_plane(backend, **config))
            except BaseException as exc:  # surfaced by the first call
                ready.set_exception(exc)

        threading.Thread(target=build, name="paraminit-start", daemon=True).start()
        return cls(ready)

    @property
    def plane(self) -> Materializer:
        return self._ready.result()

    @property
    def handlers(self) -> Handlers:
        if self._handlers is None:
            self._handlers = Handlers(self.plane)
        return self._handlers

    def call(self, method: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a data-plane call; errors become LocalRpcError with the status a server would send."""
        try:
            return fn(*args)
        except Exception as exc:
            raise LocalRpcError(status_for(exc, method)) from None

    def Materialize(self, request: pb.MaterializeRequest, timeout: float | None = None, **_: Any) -> list[Any]:
        """Exports (the stream delivery has its own calls below)."""
        return [self.call("Materialize", lambda r, c: self.handlers.export(r, c), request, self.caller)]

    def fill(self, plan: plan_pb2.Plan, outputs: Mapping[str, Any] | None = None) -> tuple[list[TensorSpan], str, Any]:
        """Tensor table, digest and one buffer in stream layout; or, with outputs, fill those arrays in place
        (and return no table: the caller has its arrays)."""
        lay, digest, buf = self.call("Materialize", lambda: self.plane.fill_host(plan, self.caller, outputs))
        return (lay.spans() if outputs is None else []), digest, buf

    def stream(self, plan: plan_pb2.Plan) -> Iterator[pb.StreamHeader | tuple[int, Any]]:
        """A header, then (offset, host slab) pairs: for writing files without an extra copy."""
        it = self.call("Materialize", lambda: self.plane.stream(plan, self.caller))
        try:
            while True:
                item = self.call("Materialize", next, it, None)
                if item is None:
                    return
                if isinstance(item, StreamStart):
                    yield _header(item.layout, item.digest)
                elif isinstance(item, tuple):
                    yield item
        finally:
            it.close()  # frees the slabs and the admission slot when the consumer stops early

    def close(self) -> None:
        try:
            plane = self._ready.result()
        except Exception:  # it never started: nothing to free
            return
        plane.close()


def _header(lay: Layout, digest: str) -> pb.StreamHeader:
    return pb.StreamHeader(plan_digest=digest, safetensors_prefix=lay.prefix, data_bytes=lay.data_bytes,
                           tensors=tensor_infos(lay))
