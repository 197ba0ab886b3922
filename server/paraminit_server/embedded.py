"""The one module through which the client embeds the server: a data plane in process, or a loopback server.

`InProcess` is what the client's local transport calls: the same data plane,
validation and bytes as a server, reached by plain function calls in one hop.
It answers in the data plane's own results (paraminit.results: tensor tables,
export info, leases, server info), the types the gRPC edge alone encodes to
protobuf; nothing here imports protobuf's messages or gRPC, no CRC is computed,
and a data-plane error becomes a `Failure` (its canonical status name, message
and violations), which the client raises as its own error. The data plane, the
loopback server and the server's command line are imported only when asked for:
a command that only parses the server's flags (`paraminit --help`) loads none of
them, and an in-process client loads the data plane on its starting thread.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Generator, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from paraminit import results
from paraminit.results import Failure, SpanTable
from paraminit.violations import ValidationReport, listed
from paraminit_server import errors
from paraminit_server.config import ServerConfig, add_arguments, from_args
from paraminit_server.plane.caller import Caller

if TYPE_CHECKING:
    from paraminit.v1 import plan_pb2
    from paraminit_server.plane.engine import HostSlab
    from paraminit_server.plane.materializer import Materializer
    from paraminit_server.rpc.server import Running

__all__ = ["Failure", "InProcess", "ServerConfig", "data_plane", "loopback_server", "serve_main"]
log = logging.getLogger("paraminit.server")

# In process every caller is one of this process's own threads: a call beyond the concurrency limit waits in line
# for a slot (as a lock would) instead of being refused, and waits for memory as a server's deadline allows.
IN_PROCESS_QUEUE_WAIT = 24 * 3600.0
IN_PROCESS_MAX_QUEUED = 1 << 20


def data_plane(backend: str = "cpu", **config: Any) -> Materializer:
    """A warmed-up data plane in this process: no sockets, no encoding.

    Args:
        backend: "cpu" (in-process fills need a host backend) or a GPU backend for exports.
        **config: ServerConfig fields (e.g. safetensors_dirs, max_concurrent).

    Returns:
        The data plane, kernels loaded.
    """
    plane = _plane(backend, config)
    preload = getattr(plane.backend, "preload", None)  # CPU: load cached kernels, compile only what this process fills
    if preload is not None:
        preload()
    return plane


def _plane(backend: str, config: dict[str, Any]) -> Materializer:
    """A data plane whose calls can start: the plan scanner ready (numba's first load in a process; large plans
    use it on every backend) and a GPU backend warmed up; on the CPU each fill then loads or compiles the kernels
    it needs. All of it before the plane is handed out: nothing runs on the starting thread once calls can come."""
    from paraminit_server.backends import choice
    from paraminit_server.plane.materializer import Materializer
    from paraminit_server.plans import scanner

    cfg = ServerConfig.from_env(backend=backend, metrics_port=0, **config)
    b = choice.create(cfg.backend, cfg.device, cfg.threads or None)
    scanner.warm_up()
    if getattr(b, "preload", None) is None:
        b.warm_up()
    return Materializer(cfg, b)


def loopback_server(backend: str = "cpu", **config: Any) -> Running:
    """A gRPC server on a free loopback port in this process, SERVING when this returns."""
    from paraminit_server.rpc.server import start  # gRPC, only for a server

    cfg = ServerConfig.from_env(host="127.0.0.1", port=0, backend=backend, metrics_port=0, **config)
    return start(cfg, warm_up_async=False)


def serve_main(argv: list[str] | None = None) -> int:
    """The server's command line (`paraminit-server`), for a client that starts one.

    Args:
        argv: its arguments (default: sys.argv[1:]).

    Returns:
        Its exit code.
    """
    from paraminit_server.__main__ import main  # gRPC, only for a server

    return main(argv)


_START_WAIT = 0.0  # seconds calls in this process have waited for an in-process data plane to start


def start_wait_seconds() -> float:
    """Seconds calls in this process have waited for in-process data planes to start (importing numba and loading
    the cached CPU kernels): a summary tells them apart from plan checks."""
    return _START_WAIT


def start_seconds() -> float:
    """Seconds this process has waited for its in-process data planes to start and has spent loading the cached
    kernels its fills use (0 when no data plane runs here): what a command's summary calls start-up."""
    cpu = sys.modules.get("paraminit_server.backends.cpu")  # only when a fill loaded it: numba is not imported here
    return _START_WAIT + (float(cpu.load_seconds()) if cpu is not None else 0.0)


def compile_seconds() -> float:
    """Seconds this process has spent compiling CPU kernels and the plan scanner (0 when nothing compiled here)."""
    cpu, scanner = sys.modules.get("paraminit_server.backends.cpu"), sys.modules.get("paraminit_server.plans.scanner")
    compiled = float(cpu.compile_seconds()) if cpu is not None else 0.0
    return compiled + (float(scanner.ready_seconds()[1]) if scanner is not None else 0.0)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags (each with its PARAMINIT_* variable and default), for a command that runs one.

    Args:
        parser: the command's parser.
    """
    add_arguments(parser, version=False)


def serve(args: argparse.Namespace) -> int:
    """Run the gRPC server from parsed flags (add_server_arguments) until it is stopped.

    Args:
        args: the parsed flags.

    Returns:
        The server's exit code.

    Raises:
        ValueError: flags the server's configuration refuses (its message says which).
    """
    from paraminit_server.rpc.server import serve as run  # gRPC, only for a server

    return run(from_args(args))


class InProcess:
    """The data plane behind a client's local transport: plain calls in, plain values (or the contract's
    messages, where the client returns them) out; every data-plane error is raised as it is (see `failure`).

    Starting returns at once: importing numba and building the data plane happen on a thread, while the caller
    builds its model, and the first call waits for them. Kernels are not loaded ahead: a fill loads (or compiles)
    the ones it needs, so a call that fills nothing loads none, and no work runs in the background of calls."""

    def __init__(self, plane: Materializer | Future[Materializer]) -> None:
        if not isinstance(plane, Future):
            ready: Future[Materializer] = Future()
            ready.set_result(plane)
            plane = ready
        self._ready = plane
        self.caller = Caller(identity=f"uid:{os.getuid()}", local=True, wait=ServerConfig.admission_wait, queue_wait=IN_PROCESS_QUEUE_WAIT)

    @classmethod
    def start(cls, backend: str = "cpu", **config: Any) -> InProcess:
        """An InProcess whose data plane is built on a helper thread (its errors surface at the first call)."""
        config.setdefault("max_queued", IN_PROCESS_MAX_QUEUED)
        ready: Future[Materializer] = Future()

        def build() -> None:
            try:
                ready.set_result(_plane(backend, config))
            except BaseException as exc:  # surfaced by the first call
                ready.set_exception(exc)

        threading.Thread(target=build, name="paraminit-start", daemon=True).start()
        return cls(ready)

    @property
    def plane(self) -> Materializer:
        global _START_WAIT
        if not self._ready.done():  # a call waits for the start: numba, the cached kernels, the plane
            started = time.perf_counter()
            try:
                return self._ready.result()
            finally:
                _START_WAIT += time.perf_counter() - started
        return self._ready.result()

    @staticmethod
    def failure(exc: Exception) -> Failure:
        """The client's view of an exception a call raised (errors.classify, as the gRPC edge does): ours by the
        code they name, MemoryError as RESOURCE_EXHAUSTED, anything else INTERNAL with an error id that is also
        in the log, and, the caller being this process, the exception's text."""
        err = errors.classify(exc, "process")
        if isinstance(err, errors.Internal):
            return Failure("INTERNAL", f"{err}: {err.detail}")
        return Failure(err.code, str(err), tuple(getattr(err, "violations", ())))

    # -- calls -----------------------------------------------------------------------------

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport:
        report, digest = self.plane.validate(plan, self.caller)
        shown, beyond = listed(tuple(report.violations))
        return ValidationReport(
            report.valid,
            report.fits_limits,
            shown,
            tuple(report.param_bytes),
            int(report.total_bytes),
            digest,
            beyond + report.omitted,
        )

    def info(self) -> results.ServerInfo:
        return self.plane.info()

    def fill(self, plan: plan_pb2.Plan) -> tuple[SpanTable, str, HostSlab]:
        """Tensor table, digest and one buffer in stream layout."""
        lay, digest, buf = self.plane.fill_host(plan, self.caller)
        assert buf is not None, "fill_host returns a buffer when given no outputs"
        return lay.spans(), digest, buf

    def fill_into(self, plan: plan_pb2.Plan, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Fill the caller's arrays in place (parameter name -> array; Materializer.fill_host says which fit)."""
        self.plane.fill_host(plan, self.caller, outputs)

    def stream(self, plan: plan_pb2.Plan, chunk_bytes: int = 0) -> Generator[results.StreamHeader | tuple[int, HostSlab], None, None]:
        """A header, then (offset, host slab) pairs: for writing files without an extra copy."""
        it = self.plane.stream(plan, self.caller, chunk_bytes)
        with contextlib.closing(it):  # frees the slabs and the admission slot when the consumer stops early
            for item in it:
                yield item if isinstance(item, tuple) else item.header()

    def export(self, plan: plan_pb2.Plan, delivery: str, ttl_seconds: float = 0.0) -> results.ExportInfo:
        return self.plane.export(plan, delivery, self.caller, ttl_seconds)

    def upload(self, pieces: Iterable[tuple[int, int, bytes | memoryview]]) -> str:
        """Store a payload from (dtype enum, value count, bytes) pieces (the first sizes it); returns its id."""
        from paraminit_server.plane.materializer import PayloadPiece  # loaded with the data plane

        pid, _payload = self.plane.upload((PayloadPiece(d, n, data) for d, n, data in pieces), self.caller)
        return str(pid)

    def release(self, lease_id: str) -> bool:
        return bool(self.plane.release(lease_id, self.caller))

    def renew(self, lease_id: str, ttl_seconds: float = 0.0) -> float:
        return self.plane.renew(lease_id, self.caller, ttl_seconds).expires_at

    def apply(self, lease_id: str, plan: plan_pb2.Plan) -> str:
        return str(self.plane.apply(lease_id, plan, self.caller))

    def leases(self) -> list[results.LeaseStatus]:
        return self.plane.list_leases(self.caller)

    def close(self) -> None:
        """Free every lease and pooled buffer of this data plane."""
        try:
            plane = self._ready.result()
        except Exception:  # it never started: nothing to free
            return
        plane.close()
