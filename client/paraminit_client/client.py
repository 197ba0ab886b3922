"""The paraminit client: validate plans, materialize them into arrays or safetensors files.

A Client picks its transport once, when it is made (`transports`): with no target the server's data plane runs
in this process (CPU backend) and is called directly: the same validation, errors and bytes as a server, with no
sockets, no encoding and arrays filled in place; with a target it talks gRPC to a server. Its methods are the
same either way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from paraminit.hostmem import tune_malloc_for_streams
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import filesink
from paraminit_client.errors import ClientClosed, FileAccessError, InvalidArgument, ParaminitError
from paraminit_client.exports import Lease
from paraminit_client.grpc_transport import GrpcTransport, first_response, payload_bytes, rpc_errors
from paraminit_client.local_transport import LocalTransport, start_local
from paraminit_client.transports import Chunk, Transport, ValidationReport, land

__all__ = [
    "CHANNEL_OPTIONS",
    "RETRY_POLICY",
    "SERVICE_CONFIG",
    "Client",
    "Connection",
    "ValidationReport",
    "first_response",
    "land",
    "make_transport",
    "or_in_process",
    "rpc_errors",
    "tls_credentials",
]

# gRPC's own retries (gRFC A6), for every InitService method: a call refused before any response (a busy or
# draining server: RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again after an exponential backoff with jitter, or
# after the server's grpc-retry-pushback-ms (a negative pushback, sent for limits no retry can fix, stops it);
# the call's deadline bounds every attempt together. Any gRPC client can use this JSON as its service config.
RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 5,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
}
SERVICE_CONFIG: dict[str, Any] = {"methodConfig": [{"name": [{"service": "paraminit.v1.InitService"}], "retryPolicy": RETRY_POLICY}]}
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
]
DELIVERIES = ("shm", "cuda_ipc")


@dataclass(frozen=True)
class Connection:
    """How a Client reaches a server: its arguments in one value, so the transport is built from what the
    Client was given and nothing is restated on the way.

    timeout: each gRPC call's deadline in seconds (None: none). credentials: channel credentials; override
    `tls_ca`/`tls_cert`/`tls_key`. split_bytes: the size above which a parameter is cut into row regions when
    a plan is split across targets. token: bearer token (None: $PARAMINIT_TOKEN). tls_ca: the CA bundle that
    verifies the server; tls_cert/tls_key: a client certificate (mutual TLS).
    """

    timeout: float | None = None
    credentials: grpc.ChannelCredentials | None = None
    split_bytes: int = 64 << 20
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


def make_transport(
    target: str | Sequence[str] | None = None, connection: Connection = Connection(), safetensors_dirs: Sequence[str] | None = None
) -> Transport:
    """The transport a Client with these arguments uses: in process without a target, else gRPC.

    Args:
        target: None (in process), "host:port", a "dns:///" name, or a list of targets to split plans across.
        connection: how to reach a server (unused in process).
        safetensors_dirs: in process only, the directories whose safetensors files plans may read.

    Returns:
        A LocalTransport or a GrpcTransport.

    Raises:
        InvalidArgument: an empty list of targets, or safetensors_dirs with a target.
        ParaminitError: FAILED_PRECONDITION when no target is given and the server package is not installed.
    """
    if target is None:
        dirs = "/" if safetensors_dirs is None else ":".join(os.fspath(d) for d in safetensors_dirs)
        return start_local(dirs)
    if safetensors_dirs is not None:
        raise InvalidArgument(
            "safetensors_dirs applies in process only; a server's --safetensors-dirs decides which files its plans may read"
        )
    workers: list[GrpcTransport] = []
    if isinstance(target, (list, tuple)):
        targets = list(target)
        if not targets:
            raise InvalidArgument("an empty list of targets")
        if len(targets) > 1:
            workers = [_grpc(t, connection) for t in targets]
        target = targets[0]
    assert isinstance(target, str)
    return _grpc(target, connection, workers)


def _grpc(target: str, c: Connection, workers: Sequence[GrpcTransport] = ()) -> GrpcTransport:
    tune_malloc_for_streams()  # megabyte messages reuse heap memory (paraminit.hostmem); before the channel exists
    options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
    if target.startswith("dns:"):
        # client-side balancing over every address behind the name (a headless Service)
        options.append(("grpc.lb_policy_name", "round_robin"))
    credentials = c.credentials
    if credentials is None and (c.tls_ca or c.tls_cert):
        credentials = tls_credentials(c.tls_ca or "", c.tls_cert or "", c.tls_key or "")
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    token = os.environ.get("PARAMINIT_TOKEN") if c.token is None else c.token
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return GrpcTransport(target, channel, c.timeout, c.split_bytes, workers)


class Client:
    """Validates plans and materializes them, from one paraminit server, several, or the data plane run in
    this process when no target is given.

    Every error it raises is a ParaminitError (`except ParaminitError` catches them all). A Client may be
    shared by threads: in process, calls beyond the data plane's concurrency limit wait for a slot (they are
    this process's own threads), where a server would refuse them. After close() every call raises; a forked
    child frees nothing of its parent's (it makes its own Client()).
    """

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        split_bytes: int = 64 << 20,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        safetensors_dirs: Sequence[str] | None = None,
    ) -> None:
        """Args:
            target: None for the data plane in this process (CPU backend); "host:port" or "dns:///name" for a
                server; a list of targets to split each materialize across.
            timeout: each call's deadline in seconds (None: none; gRPC only).
            credentials: gRPC channel credentials; override `tls_ca`/`tls_cert`/`tls_key`.
            split_bytes: above this many bytes a parameter is cut into row regions when a plan is split.
            token: bearer token (default: $PARAMINIT_TOKEN).
            tls_ca: the CA bundle that verifies the server (TLS); `tls_cert`/`tls_key`: a client certificate.
            safetensors_dirs: in process only, the directories whose safetensors files plans may name; default:
                every file this process can read (a server's own --safetensors-dirs decides for a server).

        Raises:
            InvalidArgument: an empty list of targets, or safetensors_dirs with a target.
            ParaminitError: FAILED_PRECONDITION without a target when the server package is not installed.
        """
        connection = Connection(timeout, credentials, split_bytes, token, tls_ca, tls_cert, tls_key)
        self._transport: Transport = make_transport(target, connection, safetensors_dirs)
        self.target = self._transport.target
        self.timeout = timeout
        self.split_bytes = split_bytes
        self._renewing: weakref.WeakSet[Lease] = weakref.WeakSet()

    @property
    def in_process(self) -> bool:
        """True when this client runs the data plane itself (no target given)."""
        return isinstance(self._transport, LocalTransport)

    @property
    def transport(self) -> Transport:
        """The transport chosen when this client was made."""
        return self._transport

    @property
    def stub(self) -> Any:
        """The generated gRPC stub, for the raw protocol (a client of a server only).

        Raises:
            ParaminitError: FAILED_PRECONDITION in process, where there is no gRPC.
        """
        if not isinstance(self._transport, GrpcTransport):
            raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION, "an in-process client has no gRPC stub")
        return self._transport.stub

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop renewing leases and close the transport: in process, every lease and segment of the data plane is
        freed (after calls running on other threads finish); from a server, the channel closes. Safe to call twice;
        every later call raises ClientClosed. In a forked child it frees nothing of its parent's."""
        for lease in list(self._renewing):
            lease.stop_renewing()
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport:
        """Check a plan without materializing it.

        Args:
            plan: the plan.

        Returns:
            Every violation (limits included), the bytes per parameter and in total, and the plan's digest.

        Raises:
            ParaminitError: the call itself failed (unreachable server, closed client); an invalid plan is
                reported in the result, not raised.
        """
        return self._transport.validate(plan)

    def info(self) -> pb.GetInfoResponse:
        """The server's version, backend, device, limits, dtypes and deliveries.

        Raises:
            ParaminitError: the call failed.
        """
        return self._transport.info()

    def health(self, service: str = "") -> str:
        """The health service's status name (SERVING, NOT_SERVING, ...); in process SERVING once the kernels
        are loaded.

        Args:
            service: the service name to ask about ("" for the server as a whole).

        Raises:
            ParaminitError: the call failed.
        """
        return self._transport.health(service)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server reports SERVING (kernels compiled).

        Args:
            timeout: seconds to wait.

        Raises:
            ParaminitError: DEADLINE_EXCEEDED when not SERVING within `timeout`; ClientClosed after close().
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except ParaminitError as err:
                if isinstance(err, ClientClosed):
                    raise
            if time.monotonic() > deadline:
                raise ParaminitError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.target} not SERVING after {timeout} s")
            time.sleep(0.05)

    def stream(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0, check_crc: bool = True) -> tuple[pb.StreamHeader, Iterator[Chunk]]:
        """Start a STREAM materialization: the header, then the data section's chunks in order.

        Args:
            plan: the plan.
            chunk_bytes: the chunk size asked of a server (0: its default).
            check_crc: from a server, check each chunk's CRC32C here; False leaves it to the consumer (see
                `land`), which may check it on another thread. In process chunks are slabs handed over
                directly, with no CRC (`crc32c` is None). Order and length are checked either way.

        Returns:
            The StreamHeader (safetensors prefix, tensor table, digest) and an iterator of chunks; closing the
            iterator early cancels the materialization.

        Raises:
            ParaminitError: INVALID_ARGUMENT with every violation, RESOURCE_EXHAUSTED over a limit, DATA_LOSS for
                a corrupted or truncated stream, or the call's own failure (also while iterating).
        """
        return self._transport.stream(plan, chunk_bytes, check_crc)

    def export(self, plan: plan_pb2.Plan, delivery: str = "shm", *, ttl_seconds: float = 0.0, auto_renew: bool | None = None) -> Lease:
        """Zero-copy handoff: the plan filled into shared memory ("shm", CPU) or one CUDA allocation
        ("cuda_ipc", GPU) on this host, lent under a lease.

        Args:
            plan: the plan.
            delivery: "shm" or "cuda_ipc".
            ttl_seconds: the lease's time to live (0: the server's default).
            auto_renew: renew the lease in the background until released; default (None) only for CUDA_IPC,
                whose expiry would free device memory kernels of this process may still be using.

        Returns:
            The Lease: `arrays` alias the exported memory; release() (or leaving its with-block) gives it back.

        Raises:
            InvalidArgument: an unknown delivery.
            ParaminitError: INVALID_ARGUMENT for an invalid plan, RESOURCE_EXHAUSTED over a lease or memory limit,
                FAILED_PRECONDITION when the memory cannot be shared with this process.
        """
        if delivery not in DELIVERIES:
            raise InvalidArgument(f"delivery must be one of {sorted(DELIVERIES)}, got {delivery!r}")
        if auto_renew is None:
            auto_renew = delivery == "cuda_ipc"
        info = self._transport.export(plan, delivery, ttl_seconds)
        try:
            lease = Lease(self._transport, info, auto_renew=auto_renew)
        except BaseException:
            with contextlib.suppress(ParaminitError):
                self._transport.release(info.lease.lease_id)
            raise
        if auto_renew:
            self._renewing.add(lease)
        return lease

    def upload_payload(self, values: Any, *, chunk_bytes: int = 1 << 20) -> str:
        """Upload a flat payload of any size; plans name the returned id with {"flatRef": {"payloadId": id}}.
        Payloads belong to this client's identity and expire.

        Args:
            values: a float32/float64/float16/bfloat16 array (any shape; its values in C order).
            chunk_bytes: bytes per upload message.

        Returns:
            The payload id.

        Raises:
            InvalidArgument: another dtype.
            ParaminitError: RESOURCE_EXHAUSTED over the payload limit, or the call's failure.
        """
        raw, dtype, count = payload_bytes(values)
        return self._transport.upload(raw, dtype, count, chunk_bytes)

    def leases(self) -> list[pb.LeaseStatus]:
        """The live leases this caller's identity holds (`paraminit leases` prints them).

        Raises:
            ParaminitError: the call failed.
        """
        return self._transport.leases()

    def release(self, lease_id: str) -> bool:
        """Free a lease by id (one this process no longer holds as a Lease object, e.g. after a crash).

        Args:
            lease_id: the id `leases()` lists.

        Returns:
            False when it was already released.

        Raises:
            ParaminitError: NOT_FOUND for an unknown or foreign lease.
        """
        return self._transport.release(lease_id)

    def renew(self, lease_id: str, ttl_seconds: float = 0.0) -> float:
        """Extend a lease by id.

        Args:
            lease_id: the lease.
            ttl_seconds: the new time to live from now (0: the server's default).

        Returns:
            The new expiry (seconds since the Unix epoch).

        Raises:
            ParaminitError: NOT_FOUND for an unknown or foreign lease.
        """
        return self._transport.renew(lease_id, ttl_seconds)

    def materialize(
        self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0, progress: Callable[[int], None] | None = None
    ) -> dict[str, np.ndarray[Any, Any]]:
        """All parameters as numpy arrays that share one preallocated buffer (no per-chunk copies).

        With several targets (or a dns:/// target) the plan is split across workers and reassembled.

        Args:
            plan: the plan.
            chunk_bytes: the chunk size asked of a server (0: its default).
            progress: called with the bytes of each chunk as it lands.

        Returns:
            Parameter name -> array of the parameter's (region's) shape and dtype (bfloat16 via ml_dtypes).

        Raises:
            ParaminitError: INVALID_ARGUMENT with every violation, RESOURCE_EXHAUSTED over a limit, DATA_LOSS for
                a corrupted stream, or the call's failure.
        """
        return self._transport.materialize(plan, chunk_bytes, progress)

    def materialize_into(self, plan: plan_pb2.Plan, outputs: dict[str, np.ndarray[Any, Any]]) -> None:
        """Fill arrays the caller owns (e.g. a module's tensors as numpy views), one per parameter name.

        In process the kernels write straight into them; from a server the stream is copied into them
        as it arrives, one chunk at a time.

        Args:
            plan: the plan.
            outputs: parameter name -> writable C-contiguous array of the parameter's shape and item size.

        Raises:
            ParaminitError: INVALID_ARGUMENT for an invalid plan, or for an output that is missing, of another shape
                or item size, read-only or not C-contiguous (the same check and message in process and from a
                server, before any output is written); or the call's failure.
        """
        self._transport.materialize_into(plan, outputs)

    def materialize_to_file(
        self,
        plan: plan_pb2.Plan,
        path: str | os.PathLike[str],
        *,
        progress: bool | Callable[[int, int], None] = False,
        chunk_bytes: int = 0,
        durable: bool = True,
    ) -> pb.StreamHeader:
        """Write a safetensors file atomically: a temporary file renamed into place only when complete.

        The file is sized up front (a full disk fails before any transfer) and each chunk is written as
        it arrives (paraminit_client.filesink). `durable` (the default) writes the data with direct I/O
        where the file system allows and flushes it and the directory entry to disk before returning,
        so the file survives a crash once this returns; without it the page cache decides (faster where
        the disk is slower than the network).

        Args:
            plan: the plan.
            path: the file to write.
            progress: True for a bar on stderr, or a callable given (bytes written, total bytes): once with 0
                when the header arrives, then after each chunk.
            chunk_bytes: the chunk size asked of a server (0: its default).
            durable: flush data and directory entry before returning.

        Returns:
            The stream's header (tensor table, digest).

        Raises:
            FileAccessError: the file cannot be created or written (a missing directory, a full disk).
            ParaminitError: as for `stream`.
        """
        dest = Path(path)
        try:
            existing = os.stat(dest)  # follows links: a link is written through, never replaced
        except FileNotFoundError:
            existing = None
        except OSError as exc:
            raise FileAccessError(exc) from None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise FileAccessError(IsADirectoryError(errno.EISDIR, "Is a directory", str(dest)))
        header, chunks = self.stream(plan, chunk_bytes=chunk_bytes, check_crc=False)
        bar = progress_bar(header.data_bytes, dest.name) if progress is True else None
        update: Callable[[int], None] | None = bar.update if bar is not None else None
        if callable(progress):
            update = _cumulative(progress, header.data_bytes)
        try:
            if existing is not None and not stat.S_ISREG(existing.st_mode):
                _write_in_place(dest, header.safetensors_prefix, chunks, update)  # a device, a FIFO: never renamed over
            else:
                _write_atomically(dest.resolve() if dest.is_symlink() else dest, header, chunks, update, durable)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            if bar is not None:
                bar.close()
        return header


def _write_in_place(dest: Path, prefix: bytes, chunks: Iterator[Chunk], update: Callable[[int], None] | None) -> None:
    """Write the stream in order into an existing file that is not a regular file (a device such as /dev/null,
    a FIFO, a terminal): opened for writing as it is, no temporary file, nothing renamed over it."""
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_NOCTTY)
    except OSError as exc:
        raise FileAccessError(exc) from None
    try:
        write_stream(fd, prefix, chunks, update)
    finally:
        os.close(fd)


def write_stream(fd: int, prefix: bytes, chunks: Iterator[Chunk], update: Callable[[int], None] | None = None) -> None:
    """The safetensors prefix then every chunk, in order, to an open descriptor (a pipe, standard output).

    Raises:
        FileAccessError: a write failed (a closed pipe, a full disk).
        ParaminitError: as for `Client.stream`.
    """
    try:
        _write_all(fd, prefix)
        land(chunks, lambda c: _write_all(fd, c.data), update)
    except OSError as exc:
        if isinstance(exc, ParaminitError):
            raise
        raise FileAccessError(exc) from exc


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:  # a short write is legal (a pipe): write the rest
        view = view[os.write(fd, view) :]


def _write_atomically(
    dest: Path, header: pb.StreamHeader, chunks: Iterator[Chunk], update: Callable[[int], None] | None, durable: bool
) -> None:
    """A regular file: written under no name (O_TMPFILE, so a killed process leaves nothing behind) or a hidden
    temporary one where the file system has no O_TMPFILE, then given its name only when complete."""
    fd, tmp = _open_unnamed(dest)
    base = len(header.safetensors_prefix)
    if tmp is not None:
        filesink.track_partial(tmp)
    named: str | None = tmp
    try:
        try:
            if base + header.data_bytes:
                try:
                    os.posix_fallocate(fd, 0, base + header.data_bytes)
                except OSError as exc:  # a full disk: say which file, and how much it needed
                    raise OSError(exc.errno, f"{exc.strerror} (the file needs {base + header.data_bytes} bytes)", str(dest)) from None
            # an unnamed file is reopened (for O_DIRECT) through its descriptor's /proc link
            sink = filesink.open_sink(fd, tmp or f"/proc/self/fd/{fd}", header.safetensors_prefix, header.data_bytes, durable)
            try:
                land(chunks, sink.put, update)
                sink.finish()
            finally:
                sink.close()
            if durable:
                os.fsync(fd)
            os.fchmod(fd, _mode_for(dest))
            if named is None:
                named = _link_unnamed(fd, dest)
                filesink.track_partial(named)
        finally:
            os.close(fd)
        os.replace(named, dest)
        if durable:
            _fsync_dir(dest.parent)
    except BaseException as exc:
        if named is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named)
        if isinstance(exc, OSError) and not isinstance(exc, ParaminitError):
            raise FileAccessError(exc) from exc
        raise
    finally:
        if named is not None:
            filesink.forget_partial(named)


def _mode_for(dest: Path) -> int:
    """The new file's permissions: those of the file it replaces (a 0600 file stays private), else 0644 less the
    umask, as a new file gets."""
    try:
        st = os.stat(dest)
    except OSError:
        return 0o644 & ~_umask()
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o644 & ~_umask()


def _open_unnamed(dest: Path) -> tuple[int, str | None]:
    """(fd, None) for an O_TMPFILE file in dest's directory, else (fd, path) of a hidden temporary file there."""
    directory = str(dest.parent or ".")
    flag = getattr(os, "O_TMPFILE", 0)
    try:
        if flag and os.path.isdir("/proc/self/fd"):
            try:
                return os.open(directory, flag | os.O_WRONLY, 0o600), None
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=directory)
        return fd, tmp
    except OSError as exc:
        raise FileAccessError(exc) from None


def _link_unnamed(fd: int, dest: Path) -> str:
    """Give a complete O_TMPFILE file a hidden name beside dest (renamed over dest next)."""
    # linkat(AT_SYMLINK_FOLLOW) through the descriptor's /proc link: os.link takes linkat only with a dir_fd
    dfd = os.open(dest.parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(100):
            name = f".{dest.name}.{os.urandom(6).hex()}.part"
            try:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dfd, follow_symlinks=True)
                return str(dest.parent / name)
            except FileExistsError:
                continue
    finally:
        os.close(dfd)
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(dest.parent))


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    dfd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def tls_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS verifying the server against `ca` (system roots when empty), with an optional client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = tuple(metadata)
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (works on plaintext loopback channels too)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return _CallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _cumulative(report: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """A per-chunk byte counter that calls `report(bytes so far, total)`; reports (0, total) at once."""
    done = 0

    def update(n: int) -> None:
        nonlocal done
        done += n
        report(done, total)

    report(0, total)
    return update


def progress_bar(total: int, name: str) -> Any:
    """A terminal progress bar of `total` bytes (tqdm, imported when a bar is first drawn: it costs every start)."""
    from tqdm import tqdm

    # "iB" with unit_divisor 1024 reads KiB, MiB, GiB: the units of every size paraminit prints
    return tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=name, leave=True)  # the finished bar stays on screen


@contextlib.contextmanager
def or_in_process(client: Client | None) -> Iterator[Client]:
    """The client an adapter was given, or an in-process Client() for the call, closed after it: every adapter
    (torch, JAX, distributed) takes `client=None` to mean the same thing.

    Args:
        client: the caller's Client, or None.

    Returns:
        A context manager giving a Client.
    """
    if client is not None:
        yield client
        return
    with Client() as own:
        yield own
