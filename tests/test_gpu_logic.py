"""The CUDA paths' logic without a GPU: device identity, IPC export and release order, device contexts, OOM.

On the fake CuPy of tests/fakes/cupy.py (`FakeCupy`, one per simulated process, over one simulated host, `World`):
every runtime call and every write to a fake device array is logged with the device current on the calling
thread, and a write outside its device's context fails a test, which is how a `buf[a:b] = 0` on an RPC thread
(current device 0) is caught. tests/test_gpu.py and tests/test_gpu_service.py stay the device truth.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import paraminit.cuda as cuda
from fakes.cupy import (
    GPU_A,
    GPU_B,
    GPU_C,
    POISON,
    CudaError,
    FakeCupy,
    FakeMemory,
    FakeMemoryPointer,
    OutOfMemoryError,
    World,
    writes_outside_context,
)
from paraminit import dtypes
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_client import exports as client_exports
from paraminit_server import errors
from paraminit_server.backends import CUDA_IPC, DEVICE, DeviceInfo, ExportHandle, cubins
from paraminit_server.backends import cupy_backend as cb
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.config import ServerConfig
from paraminit_server.plane import materializer
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.materializer import Materializer, StreamStart
from paraminit_server.plans.plan import Formula, ResolvedParam
from support import running_server, target_of

MiB = 1 << 20
CUDA_ERROR_ILLEGAL_ADDRESS = 700


@pytest.fixture()
def world() -> World:
    return World([GPU_A, GPU_B, GPU_C])


@pytest.fixture()
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDeviceGetUuid unavailable: identities come from CuPy's properties (or the PCI bus id)."""
    monkeypatch.setattr(cuda, "driver_uuid", lambda ordinal: None)


def cupy_backend_on(monkeypatch: pytest.MonkeyPatch, cp: FakeCupy, device: int) -> cb.CupyBackend:
    monkeypatch.setattr(cb, "_import_cupy", lambda: cp)
    return cb.CupyBackend(device)


# ---------------------------------------------------------------------------
# Device identity.


def test_format_uuid_keeps_every_byte() -> None:
    assert cuda.format_uuid(GPU_A.uuid) == "GPU-5a1f00c2-0011-2233-4455-66778899aabb"
    assert cuda.format_uuid(bytearray(GPU_B.uuid)) == "GPU-0b7e3c41-9a2d-4c6f-8e1b-2f3a4b5c6d7e"
    assert cuda.format_uuid(GPU_A.props_uuid) == ""  # CuPy's cut-off C string is not a UUID
    assert cuda.format_uuid(b"") == "" and cuda.format_uuid(bytes(17)) == ""


@pytest.mark.parametrize(
    "spelling",
    [
        "GPU-5a1f00c2-0011-2233-4455-66778899aabb",
        "gpu-5A1F00C2-0011-2233-4455-66778899AABB",
        "5a1f00c2001122334455 66778899aabb".replace(" ", ""),
        "  GPU-5a1f00c2-0011-2233-4455-66778899aabb\n",
        "5a1f00c2-0011-2233-4455-66778899aabb",
    ],
)
def test_format_uuid_accepts_any_spelling(spelling: str) -> None:
    assert cuda.format_uuid(spelling) == cuda.format_uuid(GPU_A.uuid)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "GPU-",
        "GPU-5a1f00c2-0011-2233-4455-66778899aab",
        "GPU-5a1f00c2-0011-2233-4455-66778899aabbcc",
        "GPU-5a1f00c2-0011-2233-4455-66778899aabz",
        "MIG-5a1f00c2-0011-2233-4455-66778899aabb",
    ],
)
def test_format_uuid_rejects_what_is_not_a_uuid(bad: str) -> None:
    assert cuda.format_uuid(bad) == ""


def test_same_device() -> None:
    a = cuda.format_uuid(GPU_A.uuid)
    assert cuda.same_device(a, GPU_A.uuid.hex())
    assert cuda.same_device(a.lower(), a.upper())
    assert not cuda.same_device(a, cuda.format_uuid(GPU_B.uuid))
    assert cuda.same_device("PCI:0000:1B:00.0", "PCI:0000:1b:00.0")
    assert not cuda.same_device("PCI:0000:1B:00.0", "PCI:0000:3B:00.0")
    assert not cuda.same_device(a, "PCI:0000:1B:00.0")
    assert not cuda.same_device("", "") and not cuda.same_device("PCI:", "")


class FakeLibcuda:
    """libcuda.so.1 through ctypes: cuInit, cuDeviceGet, cuDeviceGetUuid(_v2) writing 16 raw bytes."""

    def __init__(self, uuids: list[bytes], init_status: int = 0, v2: bool = True) -> None:
        self.uuids, self.init_status = uuids, init_status
        if v2:
            self.cuDeviceGetUuid_v2 = self._get_uuid

    def cuInit(self, flags: int) -> int:
        return self.init_status

    def cuDeviceGet(self, ref: Any, ordinal: int) -> int:
        if not 0 <= ordinal < len(self.uuids):
            return 101  # CUDA_ERROR_INVALID_DEVICE
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = ordinal
        return 0

    def _get_uuid(self, buf: Any, dev: ctypes.c_int) -> int:
        ctypes.memmove(buf, self.uuids[dev.value], 16)
        return 0

    cuDeviceGetUuid = _get_uuid


@pytest.fixture()
def libcuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Any], None]]:
    def install(lib: Any) -> None:
        def cdll(name: str) -> Any:
            assert name == "libcuda.so.1"
            if lib is None:
                raise OSError("libcuda.so.1: cannot open shared object file")
            return lib

        monkeypatch.setattr(ctypes, "CDLL", cdll)
        cuda.driver_uuid.cache_clear()

    yield install
    cuda.driver_uuid.cache_clear()


def test_driver_uuid_reads_all_16_bytes(libcuda: Callable[[Any], None]) -> None:
    libcuda(FakeLibcuda([GPU_B.uuid, GPU_A.uuid]))
    assert cuda.driver_uuid(1) == GPU_A.uuid  # zero bytes inside, not cut off
    assert cuda.driver_uuid(0) == GPU_B.uuid
    assert cuda.driver_uuid(2) is None


def test_driver_uuid_without_v2_entry_point(libcuda: Callable[[Any], None]) -> None:
    libcuda(FakeLibcuda([GPU_C.uuid], v2=False))
    assert cuda.driver_uuid(0) == GPU_C.uuid


@pytest.mark.parametrize("lib", [None, FakeLibcuda([GPU_A.uuid], init_status=100)], ids=["no-libcuda", "cuInit-fails"])
def test_driver_uuid_is_none_without_a_driver(libcuda: Callable[[Any], None], lib: Any) -> None:
    libcuda(lib)
    assert cuda.driver_uuid(0) is None


def test_device_uuid_fallbacks(world: World) -> None:
    cp = FakeCupy(world, [0, 1, 2], "p")
    none: Callable[[int], bytes | None] = lambda i: None  # noqa: E731
    assert cuda.device_uuid(cp, 0, uuid_of=cp.uuid_of) == cuda.format_uuid(GPU_A.uuid)
    # no driver: CuPy's properties when they hold all 16 bytes, else the PCI bus id
    assert cuda.device_uuid(cp, 2, uuid_of=none) == cuda.format_uuid(GPU_C.uuid)
    assert cuda.device_uuid(cp, 1, uuid_of=none) == cuda.format_uuid(GPU_B.uuid)
    assert cuda.device_uuid(cp, 0, uuid_of=none) == "PCI:0000:1B:00.0"  # its properties lost the bytes after a zero


@pytest.mark.parametrize("driver", [True, False], ids=["cuDeviceGetUuid", "properties-or-pci"])
@pytest.mark.parametrize(
    "server_visible,client_visible", [([0, 1, 2], [2, 1, 0]), ([1, 2], [2, 0, 1]), ([2], [0, 1, 2]), ([0, 1, 2], [0, 1, 2])]
)
def test_local_ordinal_remaps_by_identity(world: World, driver: bool, server_visible: list[int], client_visible: list[int]) -> None:
    server, client = FakeCupy(world, server_visible, "server"), FakeCupy(world, client_visible, "client")
    for ordinal, physical in enumerate(server_visible):
        identity = cuda.device_uuid(server, ordinal, uuid_of=server.uuid_of if driver else (lambda i: None))
        mine = cuda.local_ordinal(client, identity, uuid_of=client.uuid_of if driver else (lambda i: None))
        assert client_visible[mine] == physical


def test_local_ordinal_of_an_invisible_device(world: World) -> None:
    client = FakeCupy(world, [0, 2], "client")
    with pytest.raises(LookupError, match="CUDA_VISIBLE_DEVICES"):
        cuda.local_ordinal(client, cuda.format_uuid(GPU_B.uuid), uuid_of=client.uuid_of)


def test_server_and_client_agree_on_the_device(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    server, client = FakeCupy(world, [0, 1, 2], "server"), FakeCupy(world, [1, 0], "client")
    monkeypatch.setattr(cuda, "driver_uuid", server.uuid_of)
    desc = cupy_backend_on(monkeypatch, server, 1).device()
    assert desc.uuid == cuda.format_uuid(GPU_B.uuid) and desc.ordinal == 1
    assert desc.name == "Fake H200" and (desc.memory_free, desc.memory_total) == (60 << 30, 80 << 30)
    assert [e[2] for e in world.events("memGetInfo")] == [1]
    assert cuda.local_ordinal(client, desc.uuid, uuid_of=client.uuid_of) == 0


# ---------------------------------------------------------------------------
# The CuPy backend's exports, contexts and errors (the real code, on the fake CuPy).


@pytest.mark.parametrize(
    "nbytes,alloc",
    [(0, 0), (1, 2 * MiB), (2 * MiB - 1, 2 * MiB), (2 * MiB, 2 * MiB), (2 * MiB + 1, 4 * MiB), (3 * MiB + 5, 4 * MiB), (1 << 30, 1 << 30)],
)
def test_ipc_size_is_whole_2mib_granules(nbytes: int, alloc: int) -> None:
    assert cb.ipc_size(nbytes) == alloc


def test_device_export_is_a_whole_rounded_allocation_with_a_zeroed_tail(
    monkeypatch: pytest.MonkeyPatch, world: World, no_driver: None
) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    gpu = cupy_backend_on(monkeypatch, cp, 1)
    nbytes = 3 * MiB + 5
    buf = gpu.export_buffer(nbytes)
    assert [(e[2], e[3]["size"]) for e in world.events("malloc")] == [(1, 4 * MiB)]
    assert buf.size == nbytes and buf.array.shape == (nbytes,)
    ptr = next(iter(world.allocs))
    host = world.allocs[ptr].host
    assert (host[nbytes:] == 0).all(), "the rounding's tail must not carry stale bytes to the peer"
    assert (host[:nbytes] == POISON).all()  # the data section is the fill's job
    assert not writes_outside_context(world)
    h = buf.handle()
    assert h.delivery == CUDA_IPC and h.size == nbytes and len(h.ipc_handle) == 64
    assert h.device is not None and h.device.uuid == cuda.format_uuid(GPU_B.uuid) and h.device.ordinal == 1
    assert [e[2] for e in world.events("ipcGetMemHandle")] == [1]
    assert buf.recycle() is False  # a handle cannot be revoked: never lent twice
    buf.close()
    assert [(e[2], e[3]["ptr"]) for e in world.events("free")] == [(1, ptr)]


def test_zero_byte_device_export_allocates_nothing(monkeypatch: pytest.MonkeyPatch, world: World, no_driver: None) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    buf = cupy_backend_on(monkeypatch, cp, 1).export_buffer(0)
    assert buf.array.shape == (0,) and buf.array.device_id == 1
    h = buf.handle()
    assert (h.size, h.ipc_handle) == (0, b"") and h.device is not None and h.device.ordinal == 1
    assert not world.events("malloc", "ipcGetMemHandle")
    buf.close()


def test_malloc_retries_once_after_freeing_the_pool(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    gpu = cupy_backend_on(monkeypatch, cp, 1)
    cp.malloc_failures = [2]
    buf = gpu.export_buffer(5 * MiB)
    assert [(e[1], e[2]) for e in world.events("malloc", "free_all_blocks")] == [("malloc", 1), ("free_all_blocks", 1), ("malloc", 1)]
    buf.close()


def test_malloc_out_of_memory_twice_is_resource_exhausted(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    gpu = cupy_backend_on(monkeypatch, cp, 1)
    cp.malloc_failures = [2, 2]
    with pytest.raises(errors.ResourceExhausted):
        gpu.export_buffer(5 * MiB)
    assert len(world.events("malloc")) == 2 and len(world.events("free_all_blocks")) == 1


def test_illegal_address_is_not_out_of_memory(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    gpu = cupy_backend_on(monkeypatch, cp, 1)
    cp.malloc_failures = [CUDA_ERROR_ILLEGAL_ADDRESS]
    with pytest.raises(CudaError) as info:
        gpu.export_buffer(5 * MiB)
    assert info.value.status == CUDA_ERROR_ILLEGAL_ADDRESS
    assert not world.events("free_all_blocks"), "a dead context is not retried as if memory were short"
    cp.empty_failures = [CudaError(CUDA_ERROR_ILLEGAL_ADDRESS), OutOfMemoryError("out of memory")]
    with pytest.raises(CudaError):
        gpu.scratch(MiB)
    with pytest.raises(errors.ResourceExhausted):
        gpu.scratch(MiB)


@pytest.mark.parametrize(
    "exc,oom",
    [
        (CudaError(2), True),
        (CudaError(CUDA_ERROR_ILLEGAL_ADDRESS), False),
        (OutOfMemoryError("x"), True),
        (RuntimeError("cudaErrorMemoryAllocation: out of memory"), False),
        (MemoryError("host memory"), False),
        (CudaError(999), False),
    ],
)
def test_is_out_of_memory_by_status_code(exc: BaseException, oom: bool) -> None:
    assert cb.is_out_of_memory(exc) is oom


def test_zero_synchronize_and_to_host_run_in_the_device_context(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    cp = FakeCupy(world, [0, 1, 2], "server")
    gpu = cupy_backend_on(monkeypatch, cp, 2)
    with cp.cuda.Device(2):
        buf = cp.empty(4096)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.empty(shape, dtype=dtype)))

    def on_a_new_thread() -> None:  # like an RPC worker: current device 0
        gpu.zero(buf, 100, 200)
        gpu.zero(buf, 300, 300)  # empty: nothing launched
        gpu.synchronize()

    t = threading.Thread(target=on_a_new_thread)
    t.start()
    t.join()
    host = gpu.to_host(buf)
    assert (host[100:200] == 0).all() and (host[:100] == POISON).all() and (host[200:] == POISON).all()
    assert [e[2] for e in world.events("write")] == [2]
    assert [e[2] for e in world.events("synchronize")] == [2]
    # the copy is queued without blocking, then waited for through an event, all on the buffer's device
    assert [(e[2], e[3]["blocking"], e[3]["array_device"]) for e in world.events("copy_to_host")] == [(2, False, 2)]
    assert [e[2] for e in world.events("event_record", "event_synchronize")] == [2, 2]
    world.log.clear()
    staged = gpu.host_staging(8192)
    wait = gpu.start_to_host(buf, staged[:4096])
    assert not world.events("event_synchronize")  # queued, not waited for
    assert wait() is not None and (staged[100:200] == 0).all() and (staged[:100] == POISON).all()
    assert [e[1] for e in world.log if e[1] in ("copy_to_host", "event_record", "event_synchronize")] == [
        "copy_to_host",
        "event_record",
        "event_synchronize",
    ]
    assert cp.current() == 0  # contexts are left as found


# ---------------------------------------------------------------------------
# The data plane on a device backend: contexts, order, empty exports.


class FakeDeviceBackend:
    """The Backend protocol on the fake CuPy (memory=DEVICE, delivery=CUDA_IPC), filled by the CPU backend,
    logging every call with the device current on the calling thread."""

    name = "fake-cuda"
    memory = DEVICE
    delivery = CUDA_IPC

    def __init__(self, cp: FakeCupy, ordinal: int) -> None:
        self.cp, self.ordinal, self.cpu = cp, ordinal, CpuBackend()

    @contextmanager
    def _call(self, what: str, **info: Any) -> Iterator[None]:
        with self.cp.cuda.Device(self.ordinal):
            self.cp.record(what, **info)
            yield

    def warm_up(self) -> None:
        with self._call("warm_up"):
            pass

    def prepare(self, params: Sequence[ResolvedParam]) -> None:
        pass  # the device kernels are ready once warm_up returns

    def scratch(self, nbytes: int) -> Any:
        with self._call("scratch"):
            return self.cp.empty(nbytes)

    def export_buffer(self, nbytes: int) -> Any:
        with self._call("export_buffer", size=nbytes):
            return FakeExport(self, nbytes)

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        with self._call("fill"):
            self.cpu.fill(p, np.asarray(out), l_begin)

    def fill_plan(
        self, params: Sequence[ResolvedParam], arena: Any, offsets: Sequence[int], should_stop: Callable[[], bool] | None = None
    ) -> None:
        with self._call("fill_plan", n=len(params)):
            host = np.asarray(arena)
            for p, off in zip(params, offsets, strict=True):
                self.cpu.fill(p, host[off : off + p.nbytes].view(p.dtype.storage))

    def zero(self, buf: Any, start: int, stop: int) -> None:
        if stop > start:
            with self._call("zero", start=start, stop=stop):
                buf[start:stop] = 0

    def synchronize(self) -> None:
        with self._call("synchronize"):
            pass

    def to_host(self, buf: Any) -> Any:
        with self._call("to_host"):
            return np.asarray(buf).copy()

    def host_staging(self, nbytes: int) -> Any:
        with self._call("host_staging", size=nbytes):
            return np.full(nbytes, POISON, dtype=np.uint8)

    def start_to_host(self, buf: Any, out: Any) -> Callable[[], Any]:
        """Like a device: the copy happens late (when waited for), so a slot the engine refilled or restaged
        before waiting would show up as another slab's bytes."""
        with self._call("start_to_host", size=int(buf.shape[0])):
            dest = np.empty(int(buf.shape[0]), dtype=np.uint8) if out is None else out

        def wait() -> Any:
            with self._call("wait_to_host"):
                dest[:] = np.asarray(buf)
            return dest

        return wait

    def device(self) -> DeviceInfo:
        return DeviceInfo("cuda", "Fake H200", cuda.device_uuid(self.cp, self.ordinal), self.ordinal, 80 << 30, 60 << 30)


class FakeExport:
    """A whole allocation of ipc_size bytes, or nothing for an empty export."""

    def __init__(self, backend: FakeDeviceBackend, nbytes: int) -> None:
        self.backend, self.size = backend, nbytes
        self.mem = FakeMemory(backend.cp, cb.ipc_size(nbytes)) if nbytes else None
        self.array = (
            backend.cp.ndarray((nbytes,), np.uint8, FakeMemoryPointer(self.mem, 0)) if self.mem is not None else backend.cp.empty(0)
        )

    def handle(self) -> ExportHandle:
        dev = self.backend.device()
        if self.mem is None:
            return ExportHandle(CUDA_IPC, 0, device=dev)
        with self.backend._call("handle"):
            raw = self.backend.cp.cuda.runtime.ipcGetMemHandle(self.mem.ptr)
        return ExportHandle(CUDA_IPC, self.size, ipc_handle=raw, device=dev)

    def recycle(self) -> bool:
        return False

    def close(self) -> None:
        with self.backend._call("close"):
            self.array = None
            self.mem = None


def small_plan() -> pb.Plan:  # type: ignore[name-defined]
    return plan_of(
        [
            param("w", [300, 70], {"kaimingUniformForShape": {"seed": 5}}),
            param("e", [33, 9], {"normal": {"std": 0.02, "seed": 6}}, "bfloat16"),
            param("h", [5], {"uniform": {"lo": -2, "hi": 2, "seed": 7}}, "float16"),
            param("z", [0, 4], {"ones": {}}),
            param("d", [3, 3], {"ones": {}}, "float64"),
        ]
    )


EMPTY_PLANS = {
    "no-params": plan_of([]),
    "zero-size-shapes": plan_of([param("a", [0], {"ones": {}}), param("b", [4, 0, 2], {"zeros": {}}, "bfloat16")]),
}


def plane_on(cp: FakeCupy, ordinal: int) -> Materializer:
    return Materializer(ServerConfig(backend="cpu", metrics_port=0), FakeDeviceBackend(cp, ordinal))


def want_arrays(plan: Any) -> dict[str, bytes]:
    """The bytes a CPU server streams for the plan."""
    with running_server() as cpu, Client(target_of(cpu)) as c:
        return {k: v.tobytes() for k, v in c.materialize(plan).items()}


def test_export_fills_in_the_device_context_and_synchronizes_before_the_handle(world: World, no_driver: None) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    plane = plane_on(cp, 1)
    try:
        export = plane.export(small_plan(), "cuda_ipc", Caller("alice"))
        names = [
            e[1]
            for e in world.log
            if e[0] == "server" and e[1] in ("zero", "fill_plan", "synchronize", "handle", "ipcGetMemHandle", "write")
        ]
        assert names.index("synchronize") > max(i for i, n in enumerate(names) if n in ("zero", "fill_plan", "write"))
        assert names.index("synchronize") < names.index("ipcGetMemHandle")
        assert world.events("zero"), "padding between tensors is zeroed"
        assert not writes_outside_context(world)
        assert {e[2] for e in world.log if e[0] == "server" and e[1] != "free"} == {1}
        assert export.size >= max(t.offset + t.nbytes for t in export.tensors) > 0 and export.device is not None
        # Apply re-fills the same memory and synchronizes before the caller hears back
        world.log.clear()
        plane.apply(export.lease.lease_id, small_plan(), Caller("alice"))
        names = [e[1] for e in world.log if e[1] in ("fill_plan", "synchronize")]
        assert names[-1] == "synchronize" and "fill_plan" in names
        assert not writes_outside_context(world)
        assert plane.release(export.lease.lease_id, Caller("alice"))
        assert world.events("free")
    finally:
        plane.close()


def test_device_streams_fill_the_next_slab_while_this_one_is_sent(world: World, no_driver: None) -> None:
    """The engine's ring on a device: slab k+1 is filled and its copy queued before slab k is waited for;
    the copies land late (the fake copies when waited for) and each slab is lent only until the consumer asks
    for the next, so reusing a slot too early would put another slab's bytes in the stream. PREFETCH + 2
    device slabs and as many staging slots serve all."""
    cp = FakeCupy(world, [0, 1], "server")
    config = ServerConfig(backend="cpu", metrics_port=0, slab_bytes=64 << 10, chunk_bytes=16 << 10)
    plane = Materializer(config, FakeDeviceBackend(cp, 1))
    plan = plan_of(
        [
            param("w", [200, 300], {"normal": {"std": 0.02, "seed": 8}}),
            param("b", [77], {"uniform": {"lo": -1, "hi": 1, "seed": 9}}, "bfloat16"),
        ]
    )
    try:
        items = plane.stream(plan, Caller("alice"), lend=True)
        start = next(items)
        assert isinstance(start, StreamStart)
        data = np.full(start.layout.data_bytes, POISON, dtype=np.uint8)
        for item in items:
            assert isinstance(item, tuple)
            offset, slab = item
            data[offset : offset + len(slab)] = slab  # copied out before the next is asked for, as a transport does
        want = want_arrays(plan)
        for pl in start.layout.placements:
            assert data[pl.offset : pl.offset + pl.param.nbytes].tobytes() == want[pl.param.name]
        names = [e[1] for e in world.log if e[0] == "server" and e[1] in ("fill", "start_to_host", "wait_to_host")]
        slabs = -(-start.layout.data_bytes // (64 << 10))
        assert slabs > 3 and names.count("start_to_host") == names.count("wait_to_host") == slabs
        starts = [i for i, n in enumerate(names) if n == "start_to_host"]
        waits = [i for i, n in enumerate(names) if n == "wait_to_host"]
        assert all(starts[k + 1] < waits[k] for k in range(slabs - 1))  # k+1 queued before k is waited for
        ring = materializer.PREFETCH + 2
        assert len(world.events("scratch")) == ring and len(world.events("host_staging")) == ring
        assert not writes_outside_context(world)
    finally:
        plane.close()


@pytest.mark.parametrize("which", EMPTY_PLANS)
def test_zero_byte_exports_through_the_data_plane(world: World, no_driver: None, which: str) -> None:
    cp = FakeCupy(world, [0, 1], "server")
    plane = plane_on(cp, 1)
    try:
        export = plane.export(EMPTY_PLANS[which], "cuda_ipc", Caller("alice"))
        assert not any(t.nbytes for t in export.tensors)
        assert (export.size, export.ipc_handle) == (0, b"")
        assert not world.events("malloc", "ipcGetMemHandle")
        assert plane.release(export.lease.lease_id, Caller("alice"))
    finally:
        plane.close()


@pytest.fixture()
def client_cupy(monkeypatch: pytest.MonkeyPatch, world: World) -> FakeCupy:
    """The client process's CuPy: the same host, its GPUs listed in another order."""
    cp = FakeCupy(world, [1, 0], "client")
    monkeypatch.setattr(client_exports, "_import_cupy", lambda: cp)
    return cp


def test_cuda_ipc_end_to_end_through_the_servicer(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    plan = small_plan()
    want = want_arrays(plan)
    backend = FakeDeviceBackend(FakeCupy(world, [0, 1, 2], "server"), 1)  # GPU_B: the client's ordinal 0
    with running_server(instance=backend) as srv, Client(target_of(srv)) as c:
        lease = c.export(plan, delivery="cuda_ipc")
        try:
            assert lease._cuda is not None and lease._cuda.ordinal == 0
            assert lease._renewer is not None, "CUDA_IPC leases renew themselves by default"
            for t in lease.info.tensors:
                assert t.offset % 256 == 0
                assert np.asarray(lease.arrays[t.name]).tobytes() == want[t.name], t.name
            assert [e[2] for e in world.events("ipcOpenMemHandle")] == [0]
        finally:
            assert lease.release()
        assert not c.leases()
    assert not writes_outside_context(world)
    client_events = [e for e in world.log if e[0] == "client" and e[1] in ("synchronize", "ipcCloseMemHandle")]
    assert [(e[1], e[2]) for e in client_events] == [("synchronize", 0), ("ipcCloseMemHandle", 0)]
    order = [e[1] for e in world.log if e[1] in ("ipcCloseMemHandle", "free")]
    assert order == ["ipcCloseMemHandle", "free"], "the server frees only after the client unmapped"


@pytest.mark.parametrize("which", EMPTY_PLANS)
def test_zero_byte_cuda_ipc_through_the_servicer_on_the_cupy_backend(
    monkeypatch: pytest.MonkeyPatch, world: World, no_driver: None, client_cupy: FakeCupy, which: str
) -> None:
    class NoKernels(cb.CupyBackend):
        def warm_up(self) -> None:
            """Nothing to compile on a fake device; an empty plan launches no kernel."""

    server_cp = FakeCupy(world, [0, 1, 2], "server")
    monkeypatch.setattr(cb, "_import_cupy", lambda: server_cp)
    with running_server(instance=NoKernels(1)) as srv, Client(target_of(srv)) as c:
        responses = list(c.stub.Materialize(pb.MaterializeRequest(plan=EMPTY_PLANS[which], delivery=pb.DELIVERY_CUDA_IPC)))
        info = responses[0].export
        assert info.WhichOneof("buffer") == "cuda_ipc"
        assert (info.cuda_ipc.size, info.cuda_ipc.ipc_handle) == (0, b"")
        assert info.cuda_ipc.device_uuid == cuda.format_uuid(GPU_B.uuid) and info.cuda_ipc.device == 1
        c.stub.Release(pb.ReleaseRequest(lease_id=info.lease.lease_id))
        with c.export(EMPTY_PLANS[which], delivery="cuda_ipc") as lease:
            assert lease._cuda is not None and lease._cuda.ordinal == 0  # GPU_B is the client's ordinal 0
            for t in lease.info.tensors:
                assert lease.arrays[t.name].shape == tuple(t.shape) and lease.arrays[t.name].size == 0
            assert set(lease.arrays) == {p.name for p in EMPTY_PLANS[which].params}
        assert not c.leases()
    assert not world.events("malloc", "ipcGetMemHandle", "ipcOpenMemHandle", "ipcCloseMemHandle")


@pytest.mark.parametrize(
    "statuses,code", [([2, 2], grpc.StatusCode.RESOURCE_EXHAUSTED), ([CUDA_ERROR_ILLEGAL_ADDRESS], grpc.StatusCode.INTERNAL)]
)
def test_device_errors_map_by_status_code(
    monkeypatch: pytest.MonkeyPatch, world: World, no_driver: None, client_cupy: FakeCupy, statuses: list[int], code: grpc.StatusCode
) -> None:
    class NoKernels(cb.CupyBackend):
        def warm_up(self) -> None:
            """Nothing to compile: the export fails at its allocation."""

    server_cp = FakeCupy(world, [0, 1], "server")
    monkeypatch.setattr(cb, "_import_cupy", lambda: server_cp)
    with running_server(instance=NoKernels(0)) as srv, Client(target_of(srv)) as c:
        server_cp.malloc_failures = list(statuses)
        with pytest.raises(ParaminitError) as info:
            c.export(small_plan(), delivery="cuda_ipc")
        assert info.value.code == code
        assert not c.leases()


# ---------------------------------------------------------------------------
# The client's lease: open, close, release.


class RecordingClient:
    """What Lease needs from a Client's transport, logging RPCs into the world's log."""

    releases_at_exit = False

    def __init__(self, world: World) -> None:
        self.world = world

    def release(self, lease_id: str, timeout: float | None = None) -> bool:
        self.world.log.append(("client", "rpc:Release", -1, {}))
        return True

    def renew(self, lease_id: str, ttl_seconds: float = 0.0) -> float:
        self.world.log.append(("client", "rpc:Renew", -1, {}))
        return 0.0

    def apply(self, lease_id: str, plan: Any) -> str:
        self.world.log.append(("client", "rpc:Apply", -1, {}))
        return "d"


def exported_info(world: World, gpu_index: int, nbytes: int, tensors: list[tuple[str, list[int], int]]) -> Any:
    """An ExportInfo of float32 tensors in random bytes, allocated by a 'server' process that sees every GPU
    in World order; the allocation stays alive in world.keep."""
    server = FakeCupy(world, list(range(len(world.gpus))), "server")
    with server.cuda.Device(gpu_index):
        mem = FakeMemory(server, cb.ipc_size(nbytes))
        mem.host[:nbytes] = np.random.default_rng(gpu_index).integers(0, 256, nbytes, dtype=np.uint8)
        handle = server.cuda.runtime.ipcGetMemHandle(mem.ptr)
    world.keep.append(mem)
    info = pb.ExportInfo(plan_digest="d")
    info.lease.lease_id = "L1"
    info.cuda_ipc.ipc_handle, info.cuda_ipc.size = handle, nbytes
    info.cuda_ipc.device_uuid, info.cuda_ipc.device = cuda.device_uuid(server, gpu_index), gpu_index
    for name, shape, offset in tensors:
        info.tensors.add(name=name, dtype=plan_pb2.DTYPE_FLOAT32, shape=shape, offset=offset, nbytes=4 * int(np.prod(shape)))
    return info


def test_release_closes_the_mapping_before_sending_release(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    info = exported_info(world, 0, 4096, [("w", [16, 4], 256)])
    lease = client_exports.Lease(RecordingClient(world), info)
    assert lease._cuda is not None and lease._cuda.ordinal == 1  # GPU_A is the client's ordinal 1
    assert np.asarray(lease.arrays["w"]).tobytes() == world.keep[0].host[256:512].tobytes()
    assert lease.release() is True
    assert lease.release() is False  # once
    tail = [(e[1], e[2]) for e in world.log if e[0] == "client"]
    assert tail[-3:] == [("synchronize", 1), ("ipcCloseMemHandle", 1), ("rpc:Release", -1)]
    assert [e for e in tail if e[0] == "rpc:Release"] == [("rpc:Release", -1)]


def test_a_mapping_stays_open_while_a_view_is_alive(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    """close() under a live view defers the unmap to the view's end: a use after unmapping would be an
    illegal address that poisons the whole CUDA context."""
    info = exported_info(world, 0, 4096, [])
    mapping = client_exports.CudaMapping(info.cuda_ipc, client_cupy)
    view = mapping.array[256:512].view(np.float32)
    ran: list[str] = []
    assert mapping.close(then=lambda: ran.append("then")) is False
    assert mapping.ptr is None and mapping.array is None
    assert "ipcCloseMemHandle" not in [e[1] for e in world.log if e[0] == "client"] and world.mapped
    assert np.asarray(view).tobytes() == world.keep[0].host[256:512].tobytes()  # still readable
    assert ran == []
    del view
    assert [e[1] for e in world.log if e[0] == "client"][-2:] == ["synchronize", "ipcCloseMemHandle"]
    assert ran == ["then"] and not world.mapped
    assert mapping.close() is True  # once


def test_release_with_a_live_view_waits_for_it(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    info = exported_info(world, 0, 4096, [("w", [16, 4], 256)])
    lease = client_exports.Lease(RecordingClient(world), info)
    lease._release_in_background = lease._send_release  # type: ignore[method-assign]  # synchronous here
    kept = lease.arrays["w"]  # e.g. a model parameter aliasing the lease
    assert lease.release() is False  # Release waits for the view
    events = [e[1] for e in world.log if e[0] == "client"]
    assert "ipcCloseMemHandle" not in events and "rpc:Release" not in events
    assert not lease._stop.is_set()  # still renewing while the memory is in use
    del kept
    tail = [e[1] for e in world.log if e[0] == "client"][-3:]
    assert tail == ["synchronize", "ipcCloseMemHandle", "rpc:Release"]
    assert lease._stop.is_set() and lease.release() is False


def test_a_failed_lease_closes_its_mapping(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    info = exported_info(world, 1, 4096, [("w", [16, 5], 0)])
    info.tensors[0].nbytes = 64  # does not match its shape: building the arrays fails after the handle opened
    with pytest.raises(ValueError):
        client_exports.Lease(RecordingClient(world), info)
    assert [e[1] for e in world.log if e[0] == "client"] == ["ipcOpenMemHandle", "synchronize", "ipcCloseMemHandle"]
    assert not world.mapped


def test_a_gpu_not_visible_here_is_failed_precondition(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    info = exported_info(world, 2, 4096, [])  # GPU_C: the client sees only A and B
    with pytest.raises(ParaminitError) as err:
        client_exports.Lease(RecordingClient(world), info)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "CUDA_VISIBLE_DEVICES" in str(err.value)
    assert not world.events("ipcOpenMemHandle")


def test_a_malformed_handle_is_refused_before_opening(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    info = exported_info(world, 0, 4096, [])
    info.cuda_ipc.ipc_handle = info.cuda_ipc.ipc_handle[:40]
    with pytest.raises(ParaminitError) as err:
        client_exports.Lease(RecordingClient(world), info)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert not world.events("ipcOpenMemHandle")


# ---------------------------------------------------------------------------
# torch: a copy off the leased GPU memory finishes before the lease is released.


class FakeTensor:
    """A tensor on a CUDA device (torch here has none): only where it is, and copies that log themselves."""

    def __init__(self, device: Any, log: list[str]) -> None:
        self.device, self.log = device, log

    def to(self, device: Any, copy: bool = False) -> FakeTensor:
        self.log.append(f"copy {self.device}->{device}")
        return FakeTensor(device, self.log)


def test_gpu_to_gpu_copy_is_synchronized_before_release(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from paraminit_client import torch as client_torch

    log: list[str] = []
    src = torch.device("cuda", 0)

    class FakeLease:
        def release(self) -> bool:
            log.append("release")
            return True

    client = types.SimpleNamespace(export=lambda *a, **k: FakeLease())
    monkeypatch.setattr(client_torch, "_lease_tensors", lambda lease: {"w": FakeTensor(src, log), "b": FakeTensor(src, log)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(f"synchronize {device}"))
    tensors, lease = client_torch._fetch(client, plan_of([]), torch.device("cuda", 1), "cuda_ipc", 0.0, None)
    assert lease is None and {t.device for t in tensors.values()} == {torch.device("cuda", 1)}
    assert log[:2] == ["copy cuda:0->cuda:1"] * 2
    assert sorted(log[2:4]) == ["synchronize cuda:0", "synchronize cuda:1"]
    assert log[4:] == ["release"]


def test_grids_are_sized_from_four_attributes_read_in_the_device_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the four occupancy attributes are read, each on its own (never `Device.attributes`, which fails as a
    whole on one attribute a driver does not know); one that fails keeps its default; the kernel's register count
    is read while its device is current."""
    current: list[int] = []
    asked: list[tuple[int, int]] = []

    class Function:
        kernel = object()

        @property
        def num_regs(self) -> int:
            assert current and current[-1] == 5, "num_regs read outside the device's context"
            return 40

    class Module:
        def __init__(self, code: str, options: Sequence[str]) -> None:
            assert "pi_fill_plan" in code and tuple(options) == cb.NVRTC_OPTIONS

        def get_function(self, name: str) -> Function:
            return Function()

    class Device:
        def __init__(self, device: int) -> None:
            self.id = device

        def __enter__(self) -> Device:
            current.append(self.id)
            return self

        def __exit__(self, *exc: object) -> None:
            current.pop()

        @property
        def attributes(self) -> dict[str, int]:
            raise AssertionError("every attribute read")

        compute_capability = "90"

    values = {16: 132, 39: 2048, 82: 65536}

    def get_attribute(code: int, device: int) -> int:
        asked.append((code, device))
        if code not in values:
            raise CudaError(CUDA_ERROR_ILLEGAL_ADDRESS)  # e.g. MaxBlocksPerMultiprocessor on an old driver
        return values[code]

    fake = types.SimpleNamespace(
        RawModule=Module, cuda=types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(deviceGetAttribute=get_attribute))
    )
    monkeypatch.setattr(cb, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cb, "_KERNELS", {})
    k = cb.kernels(5)
    assert sorted(set(asked)) == [(16, 5), (39, 5), (82, 5), (106, 5)]
    # 40 registers: 40 * 32 per warp, 8 warps a block -> 65536 // 10240 = 6 blocks; 2048 // 256 = 8; default 32
    assert k.fill_grid == k.fill_plan_grid == 132 * 6 * cb.WAVES
    assert cb.kernels(5) is k and len(asked) == 4  # sized once per device


def test_kernels_built_ahead_of_time_are_loaded_not_compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With PARAMINIT_CUBIN_DIR holding the cubin of these sources for the device's architecture (what the GPU
    image builds), the module is loaded from that file; a device of another architecture, or no directory,
    compiles from the source as before."""
    made: list[dict[str, Any]] = []

    class Function:
        kernel = object()
        num_regs = 40

    class Module:
        def __init__(self, **kw: Any) -> None:
            made.append(kw)

        def get_function(self, name: str) -> Function:
            return Function()

    class Device:
        def __init__(self, device: int) -> None:
            self.compute_capability = {0: "90", 1: "80"}[device]

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    fake = types.SimpleNamespace(
        RawModule=Module, cuda=types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(deviceGetAttribute=lambda c, d: 64))
    )
    monkeypatch.setattr(cb, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cb, "_KERNELS", {})
    built = tmp_path / cubins.file_name(cb.kernel_source(), cb.NVRTC_OPTIONS, "90")
    built.write_bytes(cubins.ELF_MAGIC + b"\0" * 60)
    (tmp_path / cubins.file_name(cb.kernel_source() + "// older", cb.NVRTC_OPTIONS, "80")).write_bytes(cubins.ELF_MAGIC)
    monkeypatch.setenv(cubins.DIR_ENV, str(tmp_path))
    cb.kernels(0)
    cb.kernels(1)  # sm_80: only a cubin of other sources is there
    assert made == [{"path": str(built)}, {"code": cb.kernel_source(), "options": cb.NVRTC_OPTIONS}]
    monkeypatch.delenv(cubins.DIR_ENV)
    monkeypatch.setattr(cb, "_KERNELS", {})
    cb.kernels(0)
    assert made[-1] == {"code": cb.kernel_source(), "options": cb.NVRTC_OPTIONS}


def test_a_fill_is_prepared_on_the_host_and_launched_apart(monkeypatch: pytest.MonkeyPatch, world: World) -> None:
    """prepare_fill packs and uploads; the launch it returns is the kernel call alone, which the GPU bench times
    (timing both made a 1 GiB fill read about 15% slow)."""
    cp = FakeCupy(world, [0], "server")
    launched: list[tuple[Any, ...]] = []
    kernels = cb.Kernels(
        lambda grid, block, args: launched.append(("fill", grid, args[1])),
        lambda grid, block, args: launched.append(("fill_plan", grid, args[2])),
        64,
        64,
    )
    monkeypatch.setattr(cb, "kernels", lambda device_id: kernels)
    backend = cupy_backend_on(monkeypatch, cp, 0)
    p = ResolvedParam(0, "w", (4, 6), ((0, 4), (1, 5)), dtypes.FLOAT32, "flat", Formula.FLAT, values=np.arange(24, dtype=np.float64))
    out = cp.empty(p.numel, np.float32)
    launch = backend.prepare_fill(p, out)
    uploads = [e for e in world.log if e[1] == "upload"]
    assert [e[3]["nbytes"] for e in uploads] == [16 * 8] and not launched  # the shard's own values; no launch yet
    launch()
    launch()
    assert launched == [("fill", (1,), np.int64(16))] * 2 and len([e for e in world.log if e[1] == "upload"]) == 1
    jobs = [cb.Job(p, 0)]
    arena = cp.empty(p.nbytes)
    go = cb.prepare_jobs(jobs, arena)
    assert launched[-1][0] == "fill" and len([e for e in world.log if e[1] == "upload"]) == 3  # meta and values
    go()
    assert launched[-1] == ("fill_plan", (1,), np.int32(1))


def test_a_lease_released_under_live_views_is_released_at_exit(world: World, no_driver: None, client_cupy: FakeCupy) -> None:
    """Release deferred to the last view's end never came when the views outlived the interpreter (the
    mapping's finalizer does not run at exit): the exit hook now sends it, once, and a view that goes later
    sends nothing more."""

    class Tracked(RecordingClient):
        releases_at_exit = True

    info = exported_info(world, 0, 4096, [("w", [16, 4], 256)])
    lease = client_exports.Lease(Tracked(world), info)
    lease._release_in_background = lease._send_release  # type: ignore[method-assign]  # synchronous here
    kept = lease.arrays["w"]  # a trainer's parameter, alive at exit
    assert lease.release() is False
    assert "rpc:Release" not in [e[1] for e in world.log if e[0] == "client"]
    assert lease in set(client_exports._live)  # still known to the exit hook
    client_exports._release_at_exit()
    assert [e[1] for e in world.log if e[0] == "client"].count("rpc:Release") == 1
    del kept  # the view goes after all: the mapping closes, and no second Release is sent
    events = [e[1] for e in world.log if e[0] == "client"]
    assert events.count("rpc:Release") == 1 and "ipcCloseMemHandle" in events
    assert lease not in set(client_exports._live)
