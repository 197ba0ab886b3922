"""A fake CuPy over one simulated host, for the CUDA paths' logic without a GPU.

`FakeCupy` is the `cupy` module as one simulated process sees it; every process of a `World` (one simulated
host) keeps device memory in NumPy buffers of that world, so a handle exported on the server side opens on the
client side, and every runtime call is logged with the device that was current on the calling thread. Writes to
fake device arrays are logged the same way: `writes_outside_context` lists the writes made outside their
device's context (a `buf[a:b] = 0` on an RPC thread whose current device is 0). Fresh device memory holds
POISON, so stale bytes that reach a peer show up.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POISON = 0xAB  # what fresh fake device memory holds: stale bytes that must never reach a peer


@dataclass(frozen=True)
class Gpu:
    """One physical device: its UUID (16 raw bytes) and PCI bus id."""

    uuid: bytes
    pci: str

    @property
    def props_uuid(self) -> bytes:
        """What CuPy's getDeviceProperties gives: the C array as a C string, cut at the first zero byte."""
        return self.uuid.split(b"\0", 1)[0]


GPU_A = Gpu(bytes.fromhex("5a1f00c200112233445566778899aabb"), "0000:1B:00.0")  # zero bytes inside
GPU_B = Gpu(bytes.fromhex("0b7e3c419a2d4c6f8e1b2f3a4b5c6d7e"), "0000:3B:00.0")  # starts with a zero nibble
GPU_C = Gpu(bytes.fromhex("c3c3c3c3111122223333444455556666"), "0000:5E:00.0")  # no zero byte at all


class CudaError(RuntimeError):
    """Stands in for cupy_backends' CUDARuntimeError: the status code is what matters."""

    def __init__(self, status: int) -> None:
        super().__init__(
            f"status {status}: out of memory" if status == 2 else f"status {status}: an illegal memory access was encountered"
        )  # both mention memory: only the status may decide
        self.status = status


class OutOfMemoryError(MemoryError):
    """Named like CuPy's pool error (cupy.cuda.memory.OutOfMemoryError)."""


@dataclass
class Alloc:
    host: np.ndarray[Any, Any]
    gpu: Gpu
    freed: bool = False


@dataclass
class World:
    """One simulated host: the allocations on its GPUs, the open IPC mappings, and an event log."""

    gpus: list[Gpu]
    log: list[tuple[Any, ...]] = field(default_factory=list)
    allocs: dict[int, Alloc] = field(default_factory=dict)
    mapped: dict[int, int] = field(default_factory=dict)  # importer address -> allocation
    next_ptr: int = 1 << 40
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: list[Any] = field(default_factory=list)

    def address(self) -> int:
        with self.lock:
            self.next_ptr += 1 << 30
            return self.next_ptr

    def host(self, ptr: int) -> np.ndarray[Any, Any]:
        a = self.allocs[self.mapped.get(ptr, ptr)]
        assert not a.freed, "use of freed device memory"
        return a.host

    def events(self, *names: str) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[1] in names]


class DeviceArray(np.ndarray):  # type: ignore[type-arg]
    """A fake cupy.ndarray: NumPy memory that logs every write with the calling thread's current device."""

    proc: FakeCupy | None = None
    device_id: int = -1
    memptr: Any = None  # as cupy's ndarray.data: every view holds its memory (and the memory's owner)

    def __new__(cls, shape: Any, dtype: Any = np.uint8, memptr: Any = None) -> DeviceArray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        host = memptr.mem.host[memptr.offset : memptr.offset + n]
        arr = host.view(dt).reshape(shape).view(cls)
        arr.proc, arr.device_id, arr.memptr = memptr.mem.proc, memptr.mem.device_id, memptr
        return arr

    def __array_finalize__(self, obj: Any) -> None:
        self.proc = getattr(obj, "proc", None)
        self.device_id = getattr(obj, "device_id", -1)
        self.memptr = getattr(obj, "memptr", None)

    @property  # type: ignore[override]
    def device(self) -> Any:
        """cupy.ndarray.device: the array's cupy.cuda.Device (a context manager)."""
        assert self.proc is not None
        return self.proc.cuda.Device(self.device_id)

    def _wrote(self) -> None:
        if self.proc is not None:
            self.proc.record("write", array_device=self.device_id)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._wrote()
        super().__setitem__(key, value)

    def fill(self, value: Any) -> None:
        self._wrote()
        super().fill(value)

    def get(self, out: Any = None) -> np.ndarray[Any, Any]:
        host = np.asarray(self)
        if out is None:
            return host.copy()
        np.copyto(out, host)
        return out  # type: ignore[no-any-return]


class FakeMemory:
    """cupy.cuda.memory.Memory: a cudaMalloc on the current device, freed when the last reference goes."""

    def __init__(self, proc: FakeCupy, size: int) -> None:
        proc.record("malloc", size=size)
        if proc.malloc_failures:
            raise CudaError(proc.malloc_failures.pop(0))
        self.proc, self.size, self.device_id = proc, size, proc.current()
        self.ptr = proc.world.address() if size else 0
        self.host = np.full(size, POISON, dtype=np.uint8)
        if size:
            proc.world.allocs[self.ptr] = Alloc(self.host, proc.gpu(self.device_id))

    def __del__(self) -> None:
        if getattr(self, "ptr", 0):
            self.proc.world.allocs[self.ptr].freed = True
            self.proc.record("free", ptr=self.ptr)


class FakeUnownedMemory:
    def __init__(self, proc: FakeCupy, ptr: int, size: int, owner: Any, device_id: int) -> None:
        self.proc, self.ptr, self.size, self.owner, self.device_id = proc, ptr, size, owner, device_id
        self.host = proc.world.host(ptr)[:size]


@dataclass
class FakeMemoryPointer:
    mem: Any
    offset: int


class FakeCupy:
    """The `cupy` module as one process sees it: `visible` lists the World's GPUs in this process's
    ordinal order (CUDA_VISIBLE_DEVICES). The current device is per thread and starts at 0, as in CUDA."""

    def __init__(self, world: World, visible: Sequence[int], name: str) -> None:
        self.world, self.visible, self.name = world, list(visible), name
        self.malloc_failures: list[int] = []  # statuses the next cudaMallocs fail with
        self.empty_failures: list[BaseException] = []
        self._tls = threading.local()
        proc = self

        class Device:
            def __init__(self, device: int | None = None) -> None:
                self.id = proc.current() if device is None else int(device)

            def __enter__(self) -> Device:
                proc._stack().append(proc.current())
                proc._tls.device = self.id
                return self

            def __exit__(self, *exc: object) -> None:
                proc._tls.device = proc._stack().pop()

            def synchronize(self) -> None:
                with self:
                    proc.record("synchronize")

        def ipc_get(ptr: int) -> bytes:
            proc.record("ipcGetMemHandle", ptr=ptr)
            assert ptr in world.allocs and proc.gpu(proc.current()) == world.allocs[ptr].gpu, "wrong device context"
            return b"\0ipc" + ptr.to_bytes(8, "little") + bytes(52)  # 64 bytes with zero bytes inside

        def ipc_open(handle: bytes) -> int:
            assert isinstance(handle, bytes) and len(handle) == 64
            ptr = int.from_bytes(handle[4:12], "little")
            proc.record("ipcOpenMemHandle", ptr=ptr)
            if ptr not in world.allocs or world.allocs[ptr].freed:
                raise CudaError(400)
            mine = world.address()
            world.mapped[mine] = ptr
            return mine

        def ipc_close(mine: int) -> None:
            proc.record("ipcCloseMemHandle", ptr=world.mapped.pop(mine))

        def mem_get_info() -> tuple[int, int]:
            proc.record("memGetInfo")
            return 60 << 30, 80 << 30

        self.cuda = types.SimpleNamespace(
            Device=Device,
            runtime=types.SimpleNamespace(
                CUDARuntimeError=CudaError,
                getDeviceCount=lambda: len(self.visible),
                getDeviceProperties=lambda i: {"name": b"Fake H200", "uuid": self.gpu(i).props_uuid},
                deviceGetPCIBusId=lambda i: self.gpu(i).pci.lower(),
                ipcGetMemHandle=ipc_get,
                ipcOpenMemHandle=ipc_open,
                ipcCloseMemHandle=ipc_close,
                memGetInfo=mem_get_info,
            ),
            memory=types.SimpleNamespace(Memory=lambda size: FakeMemory(self, size)),
            UnownedMemory=lambda ptr, size, owner, device_id: FakeUnownedMemory(self, ptr, size, owner, device_id),
            MemoryPointer=FakeMemoryPointer,
        )

        class Event:
            def record(self) -> None:
                proc.record("event_record")

            def synchronize(self) -> None:
                proc.record("event_synchronize")

        self.cuda.Event = Event
        self.ndarray = DeviceArray
        self.uint8 = np.uint8
        self._pool = types.SimpleNamespace(free_all_blocks=lambda: self.record("free_all_blocks"))

    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack  # type: ignore[no-any-return]

    def current(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def gpu(self, ordinal: int) -> Gpu:
        return self.world.gpus[self.visible[ordinal]]

    def uuid_of(self, ordinal: int) -> bytes | None:
        """What cuDeviceGetUuid says in this process."""
        return self.gpu(ordinal).uuid if 0 <= ordinal < len(self.visible) else None

    def record(self, event: str, **info: Any) -> None:
        self.world.log.append((self.name, event, self.current(), info))

    def get_default_memory_pool(self) -> Any:
        return self._pool

    def asnumpy(self, a: Any, out: Any = None, blocking: bool = True) -> Any:
        self.record("copy_to_host", blocking=blocking, array_device=a.device_id)
        host = np.asarray(a)
        if out is None:
            return host.copy()
        out[...] = host
        return out

    def asarray(self, host: Any) -> DeviceArray:
        """An upload: a device copy of a host array (logged with its size)."""
        src = np.ascontiguousarray(host)
        self.record("upload", nbytes=src.nbytes)
        out = self.empty(src.size, src.dtype)
        out.view(np.uint8)[...] = src.reshape(-1).view(np.uint8)  # type: ignore[index]
        return out

    def empty(self, n: Any, dtype: Any = np.uint8) -> DeviceArray:
        if self.empty_failures:
            raise self.empty_failures.pop(0)
        count = int(np.prod(n))
        mem = types.SimpleNamespace(
            host=np.full(count * np.dtype(dtype).itemsize, POISON, dtype=np.uint8), proc=self, device_id=self.current()
        )
        return DeviceArray((count,), dtype, FakeMemoryPointer(mem, 0))


def writes_outside_context(world: World) -> list[tuple[Any, ...]]:
    return [e for e in world.events("write") if e[2] != e[3]["array_device"]]
