"""Running the service: gRPC server, health and reflection, warm-up, graceful shutdown."""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from paraminit import wire
from paraminit.hostmem import tune_malloc_for_streams
from paraminit.v1 import init_service_pb2 as pb
from paraminit_server import backends, errors
from paraminit_server.backends import choice, shm
from paraminit_server.backends.jit_cache import prepare_jit_cache
from paraminit_server.config import ServerConfig
from paraminit_server.plane.materializer import Materializer, max_request_bytes
from paraminit_server.plans import scanner
from paraminit_server.rpc import peer_user
from paraminit_server.rpc.auth import AuthInterceptor, Endpoint, TokenAuth, server_credentials
from paraminit_server.rpc.edge import Edge
from paraminit_server.rpc.metrics import Metrics
from paraminit_server.rpc.service import InitServicer
from paraminit_server.rpc.status import MalformedRequest

log = logging.getLogger("paraminit.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InitService"].full_name
# SERVING from bind to exit, whatever the InitService reports: a liveness probe that restarts only a process
# that no longer answers, never one that is compiling or draining (readiness checks SERVICE_NAME).
LIVENESS_SERVICE = "liveness"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
GRPC_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.so_reuseport", 0)]


@dataclass
class Running:
    """A started server: the port it bound and the pieces shutdown needs."""

    server: grpc.aio.Server
    edge: Edge
    port: int
    plane: Materializer
    servicer: InitServicer
    health: health.aio.HealthServicer
    config: ServerConfig
    metrics: Metrics | None = None
    metrics_port: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    warm_error: str = ""  # set when warm-up raised; serve() then exits non-zero

    _health_lock: threading.Lock = field(default_factory=threading.Lock)

    def set_serving(self, serving: bool) -> None:
        """Readiness (the overall and the InitService status); SERVING is never set once draining began, whichever
        thread asks (warm-up finishing while a drain starts), since both steps hold one lock."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._health_lock:
            if (serving and self.plane.admission.draining.is_set()) or self.edge.closed:
                return
            for name in ("", SERVICE_NAME):
                self.edge.call(self.health.set(name, status))
            if self.metrics is not None:
                self.metrics.serving.set(1 if serving else 0)

    def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING and refuse new work at once, let streams finish within the grace, free leases."""
        grace = self.config.drain_seconds if grace is None else grace
        with self._health_lock:
            self.plane.admission.draining.set()
        self.set_serving(False)
        deadline = time.monotonic() + grace
        self.plane.admission.wait_idle(grace)
        self.plane.sources.wait_uploads(deadline - time.monotonic())  # uploads drain too
        # drained: every status NOT_SERVING (liveness too: the process is leaving) and frozen, as grpc_health's
        # graceful shutdown intends, so nothing that finishes late can report SERVING again
        with self._health_lock:
            if not self.edge.closed:
                self.edge.call(self.health.enter_graceful_shutdown())
                self.edge.call(self.server.stop(1.0))
                self.edge.close()
        self.servicer.stalls.close()
        self.plane.close()
        if self.metrics is not None:
            self.metrics.close()


def start(config: ServerConfig, backend: backends.Backend | None = None, warm_up_async: bool = True) -> Running:
    """Build, bind and start a server; warm-up (kernel compilation) runs before SERVING, except that a CPU server
    started asynchronously serves once its cached kernels are loaded and compiles the rest while serving."""
    tune_malloc_for_streams()
    backend = backend or choice.create(config.backend, config.device, config.threads or None)
    tokens = TokenAuth.load(config.auth_tokens_file, config.auth_tokens)
    if backend.delivery == backends.SHM:
        try:
            shm.instance_tag()  # take this instance's lock; segments of instances that died go now
        except errors.ResourceExhausted as exc:  # streams still work; SHM exports are refused with this reason
            log.warning("%s; SHM exports will be refused until it is", exc)
    plane = Materializer(config, backend)
    metrics = Metrics() if config.metrics_port else None
    servicer = InitServicer(plane, tokens, metrics)
    address = bind_address(config.host, config.port)
    check_port_free(config.host, config.port)
    if (config.tls_cert or config.tls_key) and not (config.tls_cert and config.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
    edge = Edge(config.workers, config.max_rpcs, config.max_stall, caller_key(tokens), servicer.refused)
    try:
        server, health_servicer, port = edge.call(_build(edge, servicer, tokens, address, credentials, _grpc_options(plane)))
    except BaseException:
        edge.close()
        raise
    if address.startswith("unix:"):
        servicer.endpoint = Endpoint((), address[5:])
    else:
        servicer.endpoint = Endpoint((port,), "", peer_user.listening_hosts(config.host))
    running = Running(server, edge, port, plane, servicer, health_servicer, config, metrics)
    if metrics is not None:
        try:
            running.metrics_port = _serve_metrics(config, plane, metrics)
        except BaseException:  # nothing of a server that did not start stays behind (its Unix socket file)
            edge.call(server.stop(None))
            edge.close()
            if address.startswith("unix:"):
                with contextlib.suppress(OSError):
                    os.unlink(address[5:])
            raise
    running.set_serving(False)
    edge.call(health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING))
    edge.call(server.start())

    def warm() -> None:
        try:
            # large plans are read by the compiled scanner: loaded (or, on a cold cache, compiled) before SERVING,
            # so that no request waits for it and no import runs in this thread once requests, or an exit, can come
            scanner.warm_up()
            preload = getattr(backend, "preload", None)
            if warm_up_async and preload is not None:
                # CPU: SERVING once the cached kernels are loaded; what the cache lacks compiles below, and a
                # request that needs it first waits for it (a cold cache then costs the first requests, not
                # the time to SERVING).
                preload()
                running.set_serving(True)  # unless draining began (set_serving checks under its lock)
            backend.warm_up()
        except Exception as exc:
            if not warm_up_async:
                raise
            running.set_serving(False)
            running.warm_error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            running.ready.set()
            return
        running.set_serving(True)
        running.ready.set()

    if warm_up_async:
        threading.Thread(target=warm, name="paraminit-warmup", daemon=True).start()
    else:
        warm()
    return running


async def _build(
    edge: Edge,
    servicer: InitServicer,
    tokens: TokenAuth | None,
    address: str,
    credentials: grpc.ServerCredentials | None,
    options: list[tuple[str, Any]],
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The aio server with every service, bound (on the loop: grpc.aio objects belong to it)."""
    server = grpc.aio.server(options=options, interceptors=[AuthInterceptor(tokens)] if tokens else [])
    server.add_generic_rpc_handlers((_service_handler(servicer, edge),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server, edge)
    with _private_umask(address.startswith("unix:")):  # a Unix socket is 0600 from its bind on, never wider
        port = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    if address.startswith("unix:"):
        os.chmod(address[5:], 0o600)  # only the server's user connects (auth.peer_identity relies on it)
    return server, health_servicer, port


def caller_key(tokens: TokenAuth | None) -> Callable[[tuple[Any, ...], str], str]:
    """Who a call is for the edge's per-caller share of --max-rpcs, from what its headers say at no cost: its
    token's identity, else its peer's host (the port differs per connection)."""

    def key(metadata: tuple[Any, ...], peer: str) -> str:
        ident = tokens.identify(metadata) if tokens is not None else None
        return f"token:{ident}" if ident is not None else peer.rpartition(":")[0] or peer

    return key


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _register_reflection_v1_descriptor() -> None:
    """Put grpc/reflection/v1/reflection.proto in the default pool, as v1alpha's file under the v1 package (the two
    protos are identical but for the package), so reflection can describe the v1 service too."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return  # a grpcio-reflection with its own v1 module got there first
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp.name, fdp.package = name, "grpc.reflection.v1"
    fdp.options.Clear()
    for msg in fdp.message_type:
        for f in msg.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for m in svc.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(fdp)


def documented_files() -> dict[str, bytes]:
    """The contract's FileDescriptorProtos with their comments (source info), by file name, from the descriptor
    set `make proto` writes beside the generated code; empty when it is missing."""
    raw = importlib.resources.files("paraminit.v1").joinpath("contract.binpb")
    try:
        files = descriptor_pb2.FileDescriptorSet.FromString(raw.read_bytes()).file
    except (OSError, DecodeError):
        return {}
    return {f.name: f.SerializeToString() for f in files}


class DocumentedReflection(reflection_aio.ReflectionServicer):  # type: ignore[misc]
    """Reflection whose paraminit files carry the .proto comments (formulas, checksum layout, size rules), so a
    client generated from reflection alone sees the whole contract; other files as the pool has them. Each
    stream counts against --max-rpcs like any other call."""

    def __init__(self, service_names: tuple[str, ...], edge: Edge) -> None:
        super().__init__(service_names)
        self._documented = documented_files()
        self._edge = edge

    async def ServerReflectionInfo(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async with self._edge.admitted("ServerReflectionInfo", context):
            async for response in super().ServerReflectionInfo(request_iterator, context):
                if response.HasField("file_descriptor_response"):
                    files = response.file_descriptor_response.file_descriptor_proto
                    for k, raw in enumerate(files):
                        name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                        if name in self._documented:
                            files[k] = self._documented[name]
                yield response


def enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server, edge: Edge) -> None:
    """Server reflection as grpc.reflection.v1 (what newer clients such as grpcurl ask first) and v1alpha.

    grpcio-reflection implements v1alpha only; v1 has the same messages (same fields and numbers) under
    another package, so the same servicer answers both, with v1alpha's message classes on the wire.
    """
    _register_reflection_v1_descriptor()
    names = (*service_names, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = DocumentedReflection(names, edge)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),))


@contextlib.contextmanager
def _private_umask(private: bool) -> Iterator[None]:
    """umask 0177 while a Unix socket is bound (bind creates it with 0777 & ~umask; a chmod after would leave a
    window). The umask is the process's: this runs once, at startup, before any worker thread writes files."""
    old = os.umask(0o177) if private else None
    try:
        yield
    finally:
        if old is not None:
            os.umask(old)


def _grpc_options(plane: Materializer) -> list[tuple[str, Any]]:
    """GRPC_OPTIONS with the request size limit the memory budget allows (materializer.max_request_bytes)."""
    limit = max_request_bytes(plane.admission.host.limit, plane.config.max_concurrent)
    return [("grpc.max_receive_message_length", limit) if k == "grpc.max_receive_message_length" else (k, v) for k, v in GRPC_OPTIONS]


def bind_address(host: str, port: int) -> str:
    """`host:port`, or a Unix socket given as `unix:/path` (the port is then unused)."""
    if host.startswith("unix:"):
        path = host[5:]
        if not path or len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise ValueError(f"--host {host[:80]!r}: a Unix socket path needs 1 to {UNIX_PATH_MAX} bytes")
        return host
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Raise one clear OSError when a TCP port is taken (grpc would log a multi-line error and a hint)."""
    if host.startswith("unix:") or port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError:
        return  # grpc reports names it cannot resolve
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                raise OSError(f"cannot listen on {bind_address(host, port)}: {exc.strerror}") from None


def listen_address(host: str, port: int) -> str:
    """What a client passes as its target to reach this server."""
    return host if host.startswith("unix:") else bind_address(host, port)


def _lenient_parser(cls: Any, decode: Callable[[bytes], Any] | None = None) -> Any:
    """Parse a request (with `decode` where a hand codec reads it without copies); undecodable bytes become
    a MalformedRequest that the boundary reports as INVALID_ARGUMENT (grpc's own deserializer failure would
    surface as INTERNAL)."""
    read = decode or cls.FromString

    def parse(raw: bytes) -> Any:
        try:
            return read(raw)
        except Exception as exc:  # DecodeError, or recursion limits on hostile input
            return MalformedRequest(f"request is not a valid {cls.DESCRIPTOR.full_name}: {exc}")

    return parse


# Requests read by paraminit.wire: uploaded payload bytes stay views of the received message.
HAND_DECODED: dict[str, Callable[[bytes], Any]] = {"UploadPayload": wire.decode_payload_chunk}


def _service_handler(servicer: InitServicer, edge: Edge) -> grpc.GenericRpcHandler:
    """The InitService methods on the edge (every one request-streaming there, see edge.py); Materialize also
    sends pre-encoded chunk bytes (paraminit.wire)."""
    handlers = {}
    methods = servicer.methods()
    for method in pb.DESCRIPTOR.services_by_name["InitService"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        serialize = wire.serialize_response if method.server_streaming else response_cls.SerializeToString
        handlers[method.name] = edge.handler(
            method.name,
            methods[method.name],
            _lenient_parser(request_cls, HAND_DECODED.get(method.name)),
            serialize,
            method.client_streaming,
            method.server_streaming,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _serve_metrics(config: ServerConfig, plane: Materializer, metrics: Metrics) -> int:
    adm, leases, backend = plane.admission, plane.leases, plane.backend
    metrics.bind(
        inflight=lambda: adm.in_flight,
        inflight_bytes=lambda: adm.in_flight_bytes,
        leases=lambda: len(leases.list()),
        leased_bytes=leases.leased_bytes,
        memory_free=lambda: backend.device().memory_free,
        memory_total=lambda: backend.device().memory_total,
        backend=backend,
        queued=lambda: adm.slots.queued,
    )
    adm.on_queue_wait = metrics.queue_wait.observe
    return metrics.serve(metrics_host(config.host), config.metrics_port if config.metrics_port > 0 else 0)


def metrics_host(host: str) -> str:
    """Where the metrics endpoint listens: the gRPC host, or loopback when gRPC listens on a Unix socket (HTTP
    metrics need a TCP address)."""
    return "127.0.0.1" if host.startswith("unix:") else host


def configure_logging(config: ServerConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("paraminit")
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("error_id", "plan_digest", "method", "bytes", "seconds", "outcome"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit code."""
    configure_logging(config)
    jit = prepare_jit_cache()
    if jit.warning:
        log.warning("%s", jit.warning)
    running = start(config)
    metrics = f" metrics={metrics_host(config.host)}:{running.metrics_port}" if running.metrics_port else ""
    print(f"paraminit listening on {listen_address(config.host, running.port)} backend={running.plane.backend.name}{metrics}", flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: draining for up to %.0f s", signum, config.drain_seconds)
        running.set_serving(False)
        running.plane.admission.draining.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(0.25):
        if running.warm_error:
            log.error("warm-up failed, exiting: %s", running.warm_error)
            running.stop(grace=0)
            shm.release_instance()
            return 1
    running.stop()
    shm.release_instance()  # the lock file goes with the server
    log.info("stopped")
    return 0
