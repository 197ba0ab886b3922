"""The paraminit client: validate plans, materialize them into arrays or safetensors files.

A Client picks its transport once, when it is made (`transports`): with no target the server's data plane runs
in this process (CPU backend) and is called directly: the same validation, errors and bytes as a server, with no
sockets, no encoding and arrays filled in place; with a target it talks gRPC to a server. Its methods are the
same either way.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import checkpoints
from paraminit_client.delivery import Delivery
from paraminit_client.errors import ClientClosed, InvalidArgument, ParaminitError
from paraminit_client.exports import Lease
from paraminit_client.grpc_transport import (
    CHANNEL_OPTIONS,
    RETRY_POLICY,
    SERVICE_CONFIG,
    Connection,
    GrpcTransport,
    connect,
    first_response,
    payload_bytes,
    rpc_errors,
    tls_credentials,
)
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

DELIVERIES = (Delivery.SHM, Delivery.CUDA_IPC)  # what export lends


def make_transport(
    target: str | Sequence[str] | None = None, connection: Connection | None = None, safetensors_dirs: Sequence[str] | None = None
) -> Transport:
    """The transport a Client with these arguments uses: in process without a target, else gRPC.

    Args:
        target: None (in process), "host:port", a "dns:///" name, or a list of targets to split plans across.
        connection: how to reach a server (unused in process; default Connection()).
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
    connection = connection or Connection()
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
            workers = [connect(t, connection) for t in targets]
        target = targets[0]
    assert isinstance(target, str)
    return connect(target, connection, workers)


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

    def export(
        self, plan: plan_pb2.Plan, delivery: Delivery | str = Delivery.SHM, *, ttl_seconds: float = 0.0, auto_renew: bool | None = None
    ) -> Lease:
        """Zero-copy handoff: the plan filled into shared memory ("shm", CPU) or one CUDA allocation
        ("cuda_ipc", GPU) on this host, lent under a lease.

        Args:
            plan: the plan.
            delivery: Delivery.SHM or Delivery.CUDA_IPC (or its string, "shm" or "cuda_ipc").
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
        kind = Delivery.parse(delivery, DELIVERIES, f"one of {sorted(d.value for d in DELIVERIES)}")
        if auto_renew is None:
            auto_renew = kind is Delivery.CUDA_IPC
        info = self._transport.export(plan, kind, ttl_seconds)
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
        format: str = "safetensors",
        max_shard_size: int | str | None = None,
    ) -> pb.StreamHeader:
        """Write a checkpoint atomically: each file under a hidden name, given its name only when complete.

        `safetensors` (the default) writes one file at `path`; with `max_shard_size` it writes a directory of
        shards and their index, as transformers' `save_pretrained` does (paraminit_client.checkpoints).
        `dcp` writes a torch.distributed.checkpoint directory; under an initialized process group every rank
        calls this with the same plan and writes its own part. Files are sized up front (a full disk fails
        before any transfer) and each chunk is written as it arrives (paraminit_client.filesink). `durable`
        (the default) writes data with direct I/O where the file system allows and flushes it and the
        directory entries to disk before returning; without it the page cache decides.

        Args:
            plan: the plan.
            path: the file to write (a directory for shards or DCP).
            progress: True for a bar on stderr, or a callable given (bytes written, total bytes): once with 0
                when the header arrives, then after each chunk.
            chunk_bytes: the chunk size asked of a server (0: its default).
            durable: flush data and directory entries before returning.
            format: "safetensors" or "dcp".
            max_shard_size: the largest safetensors shard, in bytes or as a size ("5GB", "500MB"); unset: one file.

        Returns:
            The plan's header (tensor table, total bytes, digest).

        Raises:
            InvalidArgument: an unknown format or a bad shard size.
            FileAccessError: a file cannot be created or written (a missing directory, a full disk).
            ParaminitError: as for `stream`; an invalid plan before anything is written.
        """
        writer = checkpoints.format_for(format, max_shard_size)
        return writer.write(self, plan, Path(path), progress=progress, chunk_bytes=chunk_bytes, durable=durable)


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
