"""Zero-copy leases on the client: arrays that alias the server's buffer, released exactly once.

SHM leases map the segment and expose numpy arrays; CUDA_IPC leases open the
IPC handle once and expose cupy arrays. Either converts to torch without a copy
(torch.from_numpy, torch.from_dlpack).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from paraminit import cuda, dtypes, times
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client.arrays import arrays_from_buffer, numpy_dtype
from paraminit_client.errors import InvalidArgument, ParaminitError

SHM_DIR = "/dev/shm"
log = logging.getLogger(__name__)
UNMAP_POLL = 0.2  # seconds between looks at an SHM mapping whose views outlived release()


def _map_shm(name: str, size: int) -> mmap.mmap:
    if "/" in name or not name:
        raise ParaminitError(grpc.StatusCode.INTERNAL, f"server sent a bad segment name {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as exc:
        raise ParaminitError(
            grpc.StatusCode.FAILED_PRECONDITION, f"cannot open shared-memory segment {name!r} ({exc}); is the server on this host?"
        ) from None
    try:
        return mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)


def _import_cupy() -> Any:
    try:
        import cupy  # optional: only CUDA_IPC leases need it
    except ImportError:
        raise ParaminitError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "CUDA_IPC leases need CuPy: pip install 'paraminit[gpu-cuda13]' on CUDA 13, 'paraminit[gpu]' on CUDA 12",
        ) from None
    return cupy


class _After:
    """What runs once a mapping is unmapped; added to only while it has not run yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: list[Callable[[], None]] = []
        self._done = False

    def add(self, fn: Callable[[], None]) -> bool:
        """Queue fn; False when the unmapping already happened (fn is not queued)."""
        with self._lock:
            if self._done:
                return False
            self._fns.append(fn)
            return True

    def run(self) -> None:
        with self._lock:
            self._done = True
            fns, self._fns = self._fns, []
        for fn in fns:
            try:
                fn()
            except Exception as exc:  # a finalizer must not raise
                log.warning("after closing a CUDA IPC mapping: %s", exc)


def _unmap(cp: Any, ordinal: int, ptr: int, after: _After) -> None:
    """Finish this process's work on the memory, unmap it in its device's context, then run `after`.

    Runs as a finalizer (possibly during garbage collection, on any thread), so it never raises."""
    try:
        with cp.cuda.Device(ordinal):
            cp.cuda.Device(ordinal).synchronize()
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
    except Exception as exc:  # a dead context: nothing more to do for this mapping
        log.warning("closing a CUDA IPC mapping failed: %s", exc)
    after.run()


class _Mapped:
    """An open IPC mapping: the `owner` of the memory every view holds (cupy arrays through their
    MemoryPointer, torch tensors through the DLPack capsule), so it is unmapped when the last view is gone."""

    def __init__(self, cp: Any, ordinal: int, ptr: int) -> None:
        self.after = _After()
        self.finalizer = weakref.finalize(self, _unmap, cp, ordinal, ptr, self.after)
        self.finalizer.atexit = False  # at exit the driver unmaps everything, and CuPy may be torn down first


class CudaMapping:
    """An opened CUDA IPC handle: the peer's allocation mapped on this process's ordinal for the same GPU.

    The server names its GPU by UUID because ordinals differ between processes (CUDA_VISIBLE_DEVICES);
    an empty export carries no handle and maps nothing. The mapping stays open while any view of it is
    alive, even after close(): unmapping under a live view would make its next use an illegal address,
    which poisons this process's CUDA context."""

    def __init__(self, info: pb.CudaIpcExport, cp: Any = None, uuid_of: cuda.UuidOf | None = None) -> None:
        self.cp = cp if cp is not None else _import_cupy()
        self.size = int(info.size)
        self.ptr: int | None = None
        self._mapped: _Mapped | None = None
        try:
            self.ordinal = cuda.local_ordinal(self.cp, info.device_uuid, uuid_of) if info.device_uuid else int(info.device)
        except Exception as exc:  # not visible here, or no usable driver: the caller may fall back to STREAM
            raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the CUDA IPC handle: {exc}") from None
        if self.size and len(info.ipc_handle) != cuda.IPC_HANDLE_BYTES:
            raise ParaminitError(
                grpc.StatusCode.INTERNAL, f"server sent a CUDA IPC handle of {len(info.ipc_handle)} bytes, expected {cuda.IPC_HANDLE_BYTES}"
            )
        with self.cp.cuda.Device(self.ordinal):
            if self.size == 0:  # an empty plan: nothing was allocated, nothing to open
                self.array: Any = self.cp.empty(0, dtype=self.cp.uint8)
                return
            try:
                self.ptr = int(self.cp.cuda.runtime.ipcOpenMemHandle(bytes(info.ipc_handle)))
            except self.cp.cuda.runtime.CUDARuntimeError as exc:
                raise ParaminitError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the CUDA IPC handle: {exc}") from None
            self._mapped = _Mapped(self.cp, self.ordinal, self.ptr)
            mem: Any = None
            try:
                mem = self.cp.cuda.UnownedMemory(self.ptr, self.size, self._mapped, self.ordinal)
                self.array = self.cp.ndarray((self.size,), dtype=self.cp.uint8, memptr=self.cp.cuda.MemoryPointer(mem, 0))
            except BaseException:
                mem = None  # the traceback keeps this frame: it must not keep the mapping
                self.close()
                raise

    def close(self, then: Callable[[], None] | None = None) -> bool:
        """Drop this object's hold on the mapping, exactly once. CUDA's IPC rules: the exporter may free the
        allocation only after every importer closed its handle.

        Returns:
            True when the memory was unmapped now (or nothing was mapped): `then` is not called. False
            when views of it are still alive: it is unmapped when the last of them is gone, and `then`
            runs after that (from a finalizer, on whichever thread drops the view: it must be quick).
        """
        mapped, self._mapped = self._mapped, None
        self.ptr = None
        self.array = None
        if mapped is None:
            return True
        finalizer, after = mapped.finalizer, mapped.after
        del mapped  # the last reference unless a view holds one: then the finalizer runs here
        if not finalizer.alive:
            return True
        return then is None or not after.add(then)


def _bit_patterns(dtype_enum: int) -> bool:
    """Whether a dtype reaches numpy only through ml_dtypes (bfloat16, the 8-bit floats): cupy and torch.from_numpy
    know none of them, so they see its bit patterns and torch() views those back."""
    dt = dtypes.by_enum(dtype_enum)
    return dt is not None and dt.via_ml_dtypes


def _cupy_dtype(dtype_enum: int) -> Any:
    dt = dtypes.by_enum(dtype_enum)
    return dt.storage if dt is not None and _bit_patterns(dtype_enum) else numpy_dtype(dtype_enum)


_live: weakref.WeakSet[Lease] = weakref.WeakSet()  # leases of remote clients not yet released
_at_exit = threading.Lock()
_at_exit_registered = False
EXIT_RELEASE_TIMEOUT = 5.0


def _release_at_exit() -> None:
    """Release what this process still holds, so short jobs do not leave leases to their TTL: a lease
    outlives its process only when the process is killed outright (and then its TTL reclaims it). A forked
    child's exit releases nothing: the leases it inherited are its parent's."""
    for lease in list(_live):
        if lease.pid != os.getpid():
            continue
        with contextlib.suppress(Exception):  # a closed channel, a server gone: the TTL reclaims it
            if lease.released:  # released while views were alive: the mapping's finalizer never runs at exit
                lease._send_release(EXIT_RELEASE_TIMEOUT)  # and the driver unmaps everything as the process ends
            else:
                lease.release(timeout=EXIT_RELEASE_TIMEOUT)


def _track(lease: Lease) -> None:
    global _at_exit_registered
    with _at_exit:
        if not _at_exit_registered:
            atexit.register(_release_at_exit)
            _at_exit_registered = True
        _live.add(lease)


class Lease:
    """A held export. `arrays` alias the exported memory; release() (or leaving the with-block) gives it back.

    A Lease belongs to the process that made it: in a forked child, release() only drops the child's mapping
    and leaves the lease to its parent."""

    def __init__(self, transport: Any, info: pb.ExportInfo, auto_renew: bool = False) -> None:
        """Args:
            transport: the Client's transport (paraminit_client.transports.Transport): renew, apply, release.
            info: the ExportInfo of the export.
            auto_renew: renew in the background (every third of the TTL) until released.

        Raises:
            ParaminitError: FAILED_PRECONDITION when the memory cannot be mapped here.
        """
        self._transport = transport
        self.pid = os.getpid()
        self.info = info
        self.lease_id = info.lease.lease_id
        self.expires_at = times.epoch(info.lease.expires_at)  # seconds since the Unix epoch
        self.plan_digest = info.plan_digest
        self._released = False
        self._release_sent = False
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._cuda: CudaMapping | None = None
        if info.HasField("shm"):  # the buffer oneof: shm, else cuda_ipc
            self._map = _map_shm(info.shm.segment_name, info.shm.size)
            self.buffer: Any = np.frombuffer(self._map, dtype=np.uint8, count=info.shm.size)
            self.arrays: dict[str, Any] = arrays_from_buffer(info.tensors, self.buffer)
        else:
            self._cuda = CudaMapping(info.cuda_ipc)
            try:
                self.buffer = self._cuda.array
                # cupy has no bfloat16 or 8-bit floats: those tensors are their bit patterns (torch() views them back)
                self.arrays = {
                    t.name: self.buffer[t.offset : t.offset + t.nbytes].view(_cupy_dtype(t.dtype)).reshape(tuple(t.shape))
                    for t in info.tensors
                }
            except BaseException:
                self.buffer = None
                self._cuda.close()
                raise
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        if getattr(transport, "releases_at_exit", False):  # an in-process data plane frees its leases as it closes
            _track(self)
            adopt = getattr(transport, "adopt", None)
            if adopt is not None:
                adopt(self)
        if auto_renew:
            ttl = max(1.0, self.expires_at - time.time())
            self._renewer = threading.Thread(target=self._renew_loop, args=(ttl / 3,), daemon=True, name="paraminit-renew")
            self._renewer.start()

    def torch(self) -> dict[str, Any]:
        """The arrays as torch tensors sharing the same memory."""
        import torch

        if self._map is not None:  # numpy arrays: the torch adapter's zero-copy conversion (ml_dtypes types too)
            from paraminit_client.torch_rules import numpy_to_torch

            return {k: numpy_to_torch(v) for k, v in self.arrays.items()}
        views = {
            t.name: getattr(torch, dtypes.by_enum(t.dtype).name)  # type: ignore[union-attr]
            for t in self.info.tensors
            if _bit_patterns(t.dtype)
        }
        from_dlpack = torch.from_dlpack  # type: ignore[attr-defined,unused-ignore]
        return {k: from_dlpack(v).view(views[k]) if k in views else from_dlpack(v) for k, v in self.arrays.items()}

    def __reduce__(self) -> Any:
        raise InvalidArgument(
            "a Lease holds a live mapping of the server's memory and cannot be pickled or copied; copy its arrays instead"
        )

    def stop_renewing(self) -> None:
        """Stop the background renewal (the lease then lasts to its expiry unless renewed)."""
        self._stop.set()

    def renew(self, ttl_seconds: float = 0.0) -> float:
        """Extend the lease.

        Args:
            ttl_seconds: the new time to live from now (0: the server's default).

        Returns:
            The new expiry (seconds since the Unix epoch).

        Raises:
            ParaminitError: NOT_FOUND once the lease is gone.
        """
        self.expires_at = self._transport.renew(self.lease_id, ttl_seconds)
        return self.expires_at

    def _renew_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.renew()
            except ParaminitError:  # lease gone, or the client was closed
                return

    def apply(self, plan: Any) -> str:
        """Re-initialize this lease in place with a plan of the same parameter list (TorchLean's applyPlan),
        all or nothing.

        Args:
            plan: the plan (same names, shapes and dtypes as the exported one).

        Returns:
            The new plan digest.

        Raises:
            ParaminitError: INVALID_ARGUMENT for an invalid or mismatching plan, NOT_FOUND once the lease is gone.
        """
        digest = self._transport.apply(self.lease_id, plan)
        self.plan_digest = digest
        return str(digest)

    def release(self, timeout: float | None = None) -> bool:
        """Give the memory back; safe to call twice. Arrays must not be used afterwards. Leases of a remote
        client still held at interpreter exit are released then.

        The mapping is closed first and Release sent after, so the server never frees memory this
        process still maps. When views of the lease are still alive (arrays or torch tensors kept past the
        release), the mapping stays open (and a CUDA_IPC lease keeps renewing) until the last of them is gone;
        Release is sent then, from a background thread. In a forked child only the child's mapping is
        closed: the lease is its parent's.

        Args:
            timeout: for the Release call (default: the client's).

        Returns:
            Whether the lease was released now (False when called twice, in a forked child, or when Release
            waits for the last view).

        Raises:
            ParaminitError: the Release call failed (the mapping is closed all the same).
        """
        with self._lock:
            if self._released:
                return False
            self._released = True
        self.arrays = {}
        self.buffer = None
        deferred = False
        mine = self.pid == os.getpid()
        try:
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # a view lives on: Release waits until it is gone (the server would free it)
                    if mine:
                        deferred = True
                        threading.Thread(target=self._release_when_unmapped, daemon=True, name="paraminit-release").start()
            if self._cuda is not None:
                deferred = not self._cuda.close(then=self._release_in_background if mine else None)
        finally:
            released = False
            if not deferred:  # a deferred Release stays known to the exit hook until it is sent
                _live.discard(self)
            if mine and not deferred:
                self._stop.set()
                released = self._send_once() and self._transport.release(self.lease_id, timeout)
        return released

    def _release_when_unmapped(self) -> None:
        """Close an SHM mapping whose views outlived release() once the last of them is gone (looked at every
        UNMAP_POLL seconds), then send Release: the server never recycles memory this process still maps."""
        assert self._map is not None
        while True:
            try:
                self._map.close()
                break
            except BufferError:
                time.sleep(UNMAP_POLL)
        self._send_release()

    def _release_in_background(self) -> None:
        """Called once the last view of a released CUDA_IPC lease is gone and the memory unmapped."""
        threading.Thread(target=self._send_release, daemon=True, name="paraminit-release").start()

    def _send_once(self) -> bool:
        """True the first time: Release is sent once, from release(), the last view's end or the exit hook."""
        with self._lock:
            first, self._release_sent = not self._release_sent, True
        return first

    def _send_release(self, timeout: float | None = None) -> None:
        self._stop.set()
        _live.discard(self)
        if not self._send_once():
            return
        try:
            self._transport.release(self.lease_id, timeout)
        except ParaminitError as exc:  # the client was closed meanwhile: the lease expires
            log.warning("releasing lease %s after its last view went: %s", self.lease_id, exc)

    @property
    def released(self) -> bool:
        """Whether release() was called (the server may still be told, for a CUDA_IPC view that lives on)."""
        return self._released

    @property
    def owes_release(self) -> bool:
        """Whether the server is still to be told: not released yet, or released while a CUDA_IPC view lives on
        (Release goes when the last view does). A closed client keeps its channel open for such a lease."""
        with self._lock:
            return not self._release_sent

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
