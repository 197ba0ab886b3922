"""Zero-copy leases on the client: arrays that alias the server's buffer, released exactly once.

SHM leases map the segment and expose numpy arrays; CUDA_IPC leases open the
IPC handle once and expose cupy arrays. Either converts to torch without a copy
(torch.from_numpy, torch.from_dlpack).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any

import grpc
import numpy as np

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client.errors import ParaminitError

SHM_DIR = "/dev/shm"


def _map_shm(name: str, size: int) -> mmap.mmap:
    if "/" in name or not name:
        raise ParaminitError(grpc.StatusCode.INTERNAL, f"server sent a bad segment name {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as exc:
        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"cannot open shared-memory segment {name!r} ({exc}); is the server on this host?") from None
    try:
        return mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)


def _open_cuda_ipc(info: pb.CudaIpcExport) -> Any:
    try:
        import cupy
    except ImportError:
        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION,
                             "CUDA_IPC leases need CuPy: pip install 'paraminit[gpu]' (or cupy-cuda13x)") from None
    try:
        with cupy.cuda.Device(info.device):
            props = cupy.cuda.runtime.getDeviceProperties(info.device)
            uuid = props.get("uuid", b"")
            if info.device_uuid and uuid and info.device_uuid not in (uuid.hex() if isinstance(uuid, bytes) else str(uuid)):
                raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"device {info.device} here is not the server's GPU {info.device_uuid}")
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(info.ipc_handle)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the CUDA IPC handle: {exc}") from None
    mem = cupy.cuda.UnownedMemory(ptr, info.size, None, info.device)
    return cupy.ndarray((info.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)), ptr


_BFLOAT16 = plan_pb2.DTYPE_BFLOAT16


def _cupy_dtype(dtype_enum: int) -> Any:
    from paraminit_client.client import numpy_dtype

    return np.dtype(np.uint16) if dtype_enum == _BFLOAT16 else numpy_dtype(dtype_enum)


class Lease:
    """A held export. `arrays` alias the server's memory; release() (or leaving the with-block) gives it back."""

    def __init__(self, client: Any, info: pb.ExportInfo, auto_renew: bool = False) -> None:
        from paraminit_client.client import arrays_from_buffer

        self._client = client
        self.info = info
        self.lease_id = info.lease.lease_id
        self.expires_at = info.lease.expires_at
        self.plan_digest = info.plan_digest
        self._released = False
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._ipc_ptr: int | None = None
        if info.WhichOneof("buffer") == "shm":
            self._map = _map_shm(info.shm.segment_name, info.shm.size)
            self.buffer: Any = np.frombuffer(self._map, dtype=np.uint8, count=info.shm.size)
            self.arrays: dict[str, Any] = arrays_from_buffer(info.tensors, self.buffer)
        else:
            self.buffer, self._ipc_ptr = _open_cuda_ipc(info.cuda_ipc)
            # cupy has no bfloat16: those tensors are exposed as their uint16 bit patterns (torch() views them back)
            self.arrays = {t.name: self.buffer[t.offset:t.offset + t.nbytes].view(_cupy_dtype(t.dtype))
                           .reshape(tuple(t.shape)) for t in info.tensors}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        if auto_renew:
            ttl = max(1.0, self.expires_at - __import__("time").time())
            self._renewer = threading.Thread(target=self._renew_loop, args=(ttl / 3,), daemon=True,
                                             name="paraminit-renew")
            self._renewer.start()

    def torch(self) -> dict[str, Any]:
        """The arrays as torch tensors sharing the same memory."""
        import torch

        bf16 = {t.name for t in self.info.tensors if t.dtype == _BFLOAT16}
        if self._map is not None:
            return {k: torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16) if k in bf16
                    else torch.from_numpy(v) for k, v in self.arrays.items()}
        return {k: torch.from_dlpack(v).view(torch.bfloat16) if k in bf16  # type: ignore[attr-defined,unused-ignore]
                else torch.from_dlpack(v) for k, v in self.arrays.items()}  # type: ignore[attr-defined,unused-ignore]

    def __reduce__(self) -> Any:
        raise TypeError("a Lease holds a live mapping of the server's memory and cannot be pickled or copied; "
                        "copy its arrays instead")

    def stop_renewing(self) -> None:
        self._stop.set()

    def renew(self, ttl_seconds: float = 0.0) -> float:
        resp = self._client._call(self._client.stub.Renew, pb.RenewRequest(lease_id=self.lease_id, ttl_seconds=ttl_seconds))
        self.expires_at = resp.lease.expires_at
        return self.expires_at

    def _renew_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.renew()
            except (ParaminitError, ValueError):  # lease gone, or the client's channel was closed
                return

    def apply(self, plan: Any) -> str:
        """Re-initialize this lease in place with a plan of the same parameter list (TorchLean's applyPlan)."""
        resp = self._client._call(self._client.stub.Apply, pb.ApplyRequest(lease_id=self.lease_id, plan=plan))
        self.plan_digest = resp.plan_digest
        return str(resp.plan_digest)

    def release(self) -> bool:
        """Give the memory back; safe to call twice. Arrays must not be used afterwards."""
        with self._lock:
            if self._released:
                return False
            self._released = True
        self._stop.set()
        self.arrays = {}
        self.buffer = None
        try:
            resp = self._client._call(self._client.stub.Release, pb.ReleaseRequest(lease_id=self.lease_id))
        finally:
            if self._map is not None:
                with contextlib.suppress(BufferError):  # caller still holds a view; unmapped when it goes
                    self._map.close()
            if self._ipc_ptr is not None:
                import cupy

                cupy.cuda.runtime.ipcCloseMemHandle(self._ipc_ptr)
        return bool(resp.released)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
