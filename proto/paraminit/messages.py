"""The data plane's results (paraminit.results) as the contract's messages, encoded once: the gRPC edge answers
with them, and the client's local transport, which hands its callers the same messages a server sends, encodes the
in-process door's results with the same functions, so both doors give the same bytes."""

from __future__ import annotations

import time
from collections.abc import Iterable

from paraminit import times
from paraminit.results import CUDA_IPC, SHM, STREAM, ExportInfo, Lease, LeaseStatus, ServerInfo, StreamHeader, TensorSpan
from paraminit.v1 import init_service_pb2 as pb

DELIVERY_ENUMS: dict[str, int] = {STREAM: pb.DELIVERY_STREAM, SHM: pb.DELIVERY_SHM, CUDA_IPC: pb.DELIVERY_CUDA_IPC}
DELIVERY_NAMES = {v: k for k, v in DELIVERY_ENUMS.items()}


def tensor_infos(spans: Iterable[TensorSpan]) -> list[pb.TensorInfo]:
    """Where each tensor lies, in plan order, as the contract's TensorInfo messages.

    Args:
        spans: a tensor table.

    Returns:
        One TensorInfo per tensor.
    """
    return [
        pb.TensorInfo(name=s.name, dtype=s.dtype, shape=s.shape, offset=s.offset, nbytes=s.nbytes)  # type: ignore[arg-type]
        for s in spans
    ]


def lease_message(lease: Lease) -> pb.Lease:
    """The contract's Lease.

    Args:
        lease: a lease.

    Returns:
        Its message.
    """
    return pb.Lease(
        lease_id=lease.lease_id,
        expires_at=times.timestamp(lease.expires_at),
        nbytes=lease.nbytes,
        delivery=DELIVERY_ENUMS[lease.delivery],  # type: ignore[arg-type]
    )


def lease_status_message(status: LeaseStatus, now: float | None = None) -> pb.LeaseStatus:
    """The contract's LeaseStatus, its age counted to `now` (epoch seconds; default: the clock).

    Args:
        status: a lease's status.
        now: the time its age is counted to.

    Returns:
        Its message.
    """
    age = (time.time() if now is None else now) - status.created
    return pb.LeaseStatus(lease=lease_message(status.lease), age=times.duration(age), owner=status.owner, plan_digest=status.plan_digest)


def export_info_message(info: ExportInfo) -> pb.ExportInfo:
    """The contract's ExportInfo (its shm or cuda_ipc buffer set, even for an empty plan).

    Args:
        info: an export.

    Returns:
        Its message.
    """
    out = pb.ExportInfo(plan_digest=info.plan_digest)
    out.lease.CopyFrom(lease_message(info.lease))
    out.tensors.extend(tensor_infos(info.tensors))
    if info.lease.delivery == SHM:
        out.shm.SetInParent()
        out.shm.segment_name = info.shm_name
        out.shm.size = info.size
        return out
    out.cuda_ipc.SetInParent()
    out.cuda_ipc.ipc_handle = info.ipc_handle
    out.cuda_ipc.size = info.size
    if info.device is not None:
        out.cuda_ipc.device = info.device.ordinal
        out.cuda_ipc.device_uuid = info.device.uuid
    return out


def stream_header_message(header: StreamHeader) -> pb.StreamHeader:
    """The contract's StreamHeader, whole (no checksum: a transport that splits it adds one).

    Args:
        header: a stream's header.

    Returns:
        Its message.
    """
    return pb.StreamHeader(
        plan_digest=header.plan_digest,
        safetensors_prefix=header.safetensors_prefix,
        data_bytes=header.data_bytes,
        tensors=tensor_infos(header.tensors),
    )


def server_info_message(info: ServerInfo) -> pb.GetInfoResponse:
    """The contract's GetInfoResponse.

    Args:
        info: what a server says of itself.

    Returns:
        Its message.
    """
    d, c = info.device, info.limits
    return pb.GetInfoResponse(
        version=info.version,
        backend=info.backend,
        device=pb.DeviceInfo(
            kind=d.kind, name=d.name, uuid=d.uuid, ordinal=d.ordinal, memory_total=d.memory_total, memory_free=d.memory_free
        ),
        limits=pb.Limits(
            max_plan_bytes=c.max_plan_bytes,
            max_param_bytes=c.max_param_bytes,
            max_concurrent_requests=c.max_concurrent_requests,
            max_chunk_bytes=c.max_chunk_bytes,
            max_leased_bytes=c.max_leased_bytes,
            max_leases_per_client=c.max_leases_per_client,
        ),
        dtypes=info.dtypes,  # type: ignore[arg-type]
        deliveries=[DELIVERY_ENUMS[d] for d in info.deliveries],  # type: ignore[misc]
    )
