"""The CUDA backend: CuPy launches the kernels of cuda/paraminit_kernels.cu on device memory.

CuPy is imported only inside functions of this module, so importing
paraminit_server (or this module, e.g. to pack plans in tests) never needs it.
The kernels are loaded from a cubin built ahead of time (backends/cubins.py),
or compiled once per device with NVRTC (CuPy also caches the binary on disk),
and kept in `_KERNELS`; their arithmetic lives in
paraminit_kernels.cuh, which a host-only harness checks without a GPU
(tests/test_cuda_harness.py).

Plans are packed on the host into one int64 `meta` array (job descriptors, tile
starts, region dims: the layout of the PI_W_* words in the header) plus one
float64 array of flat payloads, so a whole plan is one upload and one launch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit.cuda import IPC_HANDLE_BYTES, device_uuid
from paraminit_server.backends import CUDA_IPC, DEVICE, DeviceInfo, ExportBuffer, ExportHandle, cubins
from paraminit_server.errors import BackendUnavailable, Cancelled, ResourceExhausted
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Formula, Offsets, ResolvedParam, Runs, warm_up_params

log = logging.getLogger("paraminit.cupy")
KERNEL_DIR = Path(__file__).parent / "cuda"
KERNEL_SOURCE = KERNEL_DIR / "paraminit_kernels.cu"
KERNEL_HEADER = KERNEL_DIR / "paraminit_kernels.cuh"
# --fmad=false on top of the header's explicit __dadd_rn/__dmul_rn: nothing may contract into an FMA.
# CuPy appends -ftz=true after these (it cannot be overridden), so the header never computes or converts
# a float32 value; tests/test_nvrtc_ptx.py compiles with CuPy's option set and checks the PTX.
NVRTC_OPTIONS = ("--fmad=false",)
FILL_KERNEL = "pi_fill"
FILL_PLAN_KERNEL = "pi_fill_plan"

# Mirrors of the header's constants (tests/test_cuda_harness.py checks they agree).
BLOCK = 256
EPT = 8
TILE = BLOCK * EPT
WAVES = 4  # grid = whole waves of resident blocks, each striding over many tiles
DESC_WORDS = 16
(W_OUT, W_N, W_LBEGIN, W_KIND, W_OTYPE, W_KEY, W_P0, W_P1, W_VSHIFT, W_BASE, W_RUNLEN, W_NOUTER, W_DIMS, W_LO, W_HI, W_SEED) = range(16)
OTYPE_F32, OTYPE_F64, OTYPE_F16, OTYPE_BF16, OTYPE_F8E4M3, OTYPE_F8E5M2 = range(6)

_INCLUDE = '#include "paraminit_kernels.cuh"'
# CUDA's programming guide: share only allocations sized in 2 MiB multiples, since a smaller
# cudaMalloc may be carved from a larger block that IPC would map whole (someone else's data).
IPC_GRANULE = 2 << 20
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


def otype(dt: dtypes.DTypeInfo) -> int:
    """Kernel output type of a dtype (float, double, or the bit patterns of float16 / bfloat16 / 8-bit floats)."""
    return _OTYPES.get(dt.fmt, OTYPE_F64 if dt.itemsize == 8 else OTYPE_F32)


_OTYPES = {dtypes.FMT_FLOAT16: OTYPE_F16, dtypes.FMT_BFLOAT16: OTYPE_BF16, dtypes.FMT_F8E4M3: OTYPE_F8E4M3, dtypes.FMT_F8E5M2: OTYPE_F8E5M2}


def kernel_source() -> str:
    """The .cu with its header inlined, so CuPy's cache key covers both files and NVRTC needs no include path."""
    source = KERNEL_SOURCE.read_text()
    if _INCLUDE not in source:
        raise RuntimeError(f"{KERNEL_SOURCE} no longer includes the header as {_INCLUDE}")
    return source.replace(_INCLUDE, KERNEL_HEADER.read_text(), 1)


# ---------------------------------------------------------------------------
# Host-side packing (pure NumPy).


@dataclass(frozen=True)
class Job:
    """Local elements [l_begin, l_begin + n) of a parameter, written at byte `offset` of an arena."""

    param: ResolvedParam
    offset: int
    l_begin: int = 0
    n: int = -1  # -1: up to the end of the region


@dataclass(frozen=True)
class Packed:
    """A plan ready for pi_fill_plan: meta = descriptors | tile starts | dims, values = flat payloads."""

    meta: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]
    njobs: int
    total_tiles: int
    end_bytes: int  # one past the last byte any job writes

    @property
    def dims_at(self) -> int:
        return self.njobs * DESC_WORDS + self.njobs + 1


def pack(jobs: Sequence[Job]) -> Packed:
    """Pack jobs into the kernel's meta layout; empty jobs are dropped, bad windows raise ValueError."""
    rows: list[npt.NDArray[np.int64]] = []
    tile_start = [0]
    dims: list[int] = []
    values: list[npt.NDArray[np.float64]] = []
    vpos = 0
    end = 0
    for job in jobs:
        p = job.param
        n = p.numel - job.l_begin if job.n < 0 else job.n
        if job.l_begin < 0 or n < 0 or job.l_begin + n > p.numel:
            raise ValueError(f"{p.name}: window [{job.l_begin}, {job.l_begin + n}) outside its {p.numel} elements")
        if job.offset < 0 or job.offset % p.dtype.itemsize:
            raise ValueError(f"{p.name}: byte offset {job.offset} is not a multiple of its item size {p.dtype.itemsize}")
        if n == 0:
            continue
        runs = p.runs()
        sparse = None  # a data window whose elements lie apart in the tensor (a column shard): only they travel
        g_lo = g_hi = 0
        if p.formula == Formula.FLAT:
            g_lo, g_hi = runs.global_index(job.l_begin), runs.global_index(job.l_begin + n - 1)
            if g_hi + 1 - g_lo > n:
                sparse = runs.global_indices(job.l_begin, n)
                runs = Runs.single(job.l_begin + n)  # the gathered values, read by local index
        row = np.zeros(DESC_WORDS, dtype=np.int64)
        row[W_OUT] = job.offset
        row[W_N] = n
        row[W_LBEGIN] = job.l_begin
        row[W_KIND] = int(p.formula)
        row[W_OTYPE] = otype(p.dtype)
        row.view(np.uint64)[W_KEY] = p.key
        row.view(np.float64)[W_P0] = p.p0
        row.view(np.float64)[W_P1] = p.p1
        row.view(np.float64)[W_LO] = p.lo
        row.view(np.float64)[W_HI] = p.hi
        row.view(np.uint64)[W_SEED] = p.seed
        row[W_BASE] = runs.base
        row[W_RUNLEN] = runs.run_len
        row[W_NOUTER] = len(runs.outer_ext)
        row[W_DIMS] = len(dims)
        for d in range(len(runs.outer_ext)):
            dims += [int(runs.outer_start[d]), int(runs.outer_ext[d]), int(runs.outer_stride[d])]
        if p.formula == Formula.FLAT:
            # Only the window's values travel; the kernel reads values[g - vshift], g its global index (the local
            # one for a gathered window).
            assert p.values is not None
            if sparse is not None:
                values.append(np.asarray(p.values[sparse], dtype=np.float64))
                row[W_VSHIFT] = job.l_begin - vpos
                vpos += n
            else:
                values.append(np.ascontiguousarray(p.values[g_lo : g_hi + 1], dtype=np.float64))
                row[W_VSHIFT] = g_lo - vpos
                vpos += g_hi + 1 - g_lo
        rows.append(row)
        tile_start.append(tile_start[-1] + -(-n // TILE))
        end = max(end, job.offset + n * p.dtype.itemsize)
    meta = np.concatenate([*rows, np.asarray(tile_start, dtype=np.int64), np.asarray(dims, dtype=np.int64)])
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.float64)
    return Packed(meta.astype(np.int64, copy=False), flat, len(rows), tile_start[-1], end)


def pack_table(table: ParamTable, offsets: Offsets) -> Packed:
    """pack() of a whole large plan (parameter i at byte offsets[i]) without a Python object per plain parameter:
    the plain rows' descriptors are written as columns, the others (regions, patches) go through pack(). Flat rows
    are left out: plan_launches packs their values a window at a time.

    The plain rows come first and hold no dims and no values, so the other rows' dims and value offsets are those
    pack() gives them; which job comes first never changes a byte (every job writes only its own window).

    Raises:
        ValueError: offsets and parameters disagree in number, or an offset is not a multiple of its item size.
    """
    offs = np.asarray(offsets, dtype=np.int64)
    if offs.shape[0] != len(table):
        raise ValueError(f"{len(table)} parameters but {offs.shape[0]} offsets")
    live = table.numel > 0
    plain = np.flatnonzero(table.plain & live)
    if ((offs[plain] < 0) | (offs[plain] % np.maximum(table.itemsize[plain], 1) != 0)).any():
        raise ValueError("a byte offset is not a multiple of its parameter's item size")
    others = [i for i in np.flatnonzero(~table.plain & live).tolist() if table.special[i].formula != Formula.FLAT]
    rest = pack([Job(table[i], int(offs[i])) for i in others])
    n = table.numel[plain]
    desc = np.zeros((plain.shape[0], DESC_WORDS), dtype=np.int64)
    desc[:, W_OUT] = offs[plain]
    desc[:, W_N] = n
    desc[:, W_KIND] = table.kernel[plain]
    desc[:, W_OTYPE] = _OTYPE_BY_ENUM[table.dtype[plain]]
    desc.view(np.uint64)[:, W_KEY] = table.key[plain]
    desc.view(np.float64)[:, W_P0] = table.p0[plain]
    desc.view(np.float64)[:, W_P1] = table.p1[plain]
    desc.view(np.float64)[:, W_LO] = table.lo[plain]
    desc.view(np.float64)[:, W_HI] = table.hi[plain]
    desc.view(np.uint64)[:, W_SEED] = table.seed[plain]
    desc[:, W_RUNLEN] = n  # one run from element 0 (base 0, no outer dims)
    tiles = -(-n // TILE)
    head = int(tiles.sum())
    rest_desc = rest.meta[: rest.njobs * DESC_WORDS]
    rest_tiles = rest.meta[rest.njobs * DESC_WORDS : rest.dims_at]
    tile_start = np.concatenate([[0], np.cumsum(tiles), head + rest_tiles[1:]]).astype(np.int64)
    meta = np.concatenate([desc.reshape(-1), rest_desc, tile_start, rest.meta[rest.dims_at :]])
    end = max(int((offs[plain] + n * table.itemsize[plain]).max()) if plain.size else 0, rest.end_bytes)
    return Packed(meta, rest.values, plain.shape[0] + rest.njobs, head + rest.total_tiles, end)


_OTYPE_BY_ENUM = np.zeros(max(d.enum for d in dtypes.SUPPORTED) + 1, dtype=np.int64)
for _d in dtypes.SUPPORTED:
    _OTYPE_BY_ENUM[_d.enum] = otype(_d)


# ---------------------------------------------------------------------------
# CuPy side.


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(
            f"cupy backend unavailable: CuPy is not installed ({_one_line(exc)}); "
            "install paraminit[gpu-cuda13] (CUDA 13) or paraminit[gpu] (CUDA 12) to use the GPU"
        ) from None
    except Exception as exc:  # a broken CUDA install can fail the import in many ways
        raise BackendUnavailable(f"cupy backend unavailable: importing CuPy failed ({_one_line(exc)})") from None
    return cupy


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels of one device, with the grid that fills it with whole waves."""

    fill: Any
    fill_plan: Any
    fill_grid: int
    fill_plan_grid: int


_KERNELS: dict[int, Kernels] = {}
_KERNELS_LOCK = threading.Lock()


def kernels(device_id: int) -> Kernels:
    """The kernels for a device, loaded (a cubin built ahead of time) or compiled on first use."""
    k = _KERNELS.get(device_id)
    if k is not None:
        return k
    cp = _import_cupy()
    with _KERNELS_LOCK:
        k = _KERNELS.get(device_id)
        if k is None:
            device = cp.cuda.Device(device_id)
            with device:
                try:
                    module = _module(cp, str(device.compute_capability))
                    fill = module.get_function(FILL_KERNEL)
                    fill_plan = module.get_function(FILL_PLAN_KERNEL)
                    _ = fill.kernel, fill_plan.kernel  # compile and load now, not at the first launch
                except Exception as exc:
                    raise BackendUnavailable(f"cupy backend: compiling the CUDA kernels failed ({_one_line(exc)})") from exc
                # sized in the device's context: num_regs is read from the kernel loaded on this device
                attrs = _occupancy_attributes(cp, device_id)
                k = Kernels(fill, fill_plan, _wave_grid(fill, attrs), _wave_grid(fill_plan, attrs))
            _KERNELS[device_id] = k
    return k


def _module(cp: Any, arch: str) -> Any:
    """The kernels' module for a device of compute capability `arch` ("90"): the cubin built ahead of time for it
    and these sources (backends/cubins.py) when there is one, else compiled now by NVRTC (or CuPy's disk cache)."""
    source = kernel_source()
    prebuilt = cubins.find(source, NVRTC_OPTIONS, arch)
    if prebuilt is not None:
        log.info("cupy backend: loading the kernels built ahead of time for sm_%s (%s)", arch, prebuilt.name)
        return cp.RawModule(path=str(prebuilt))
    log.info("cupy backend: compiling the kernels for sm_%s (no cubin built ahead of time for it)", arch)
    return cp.RawModule(code=source, options=NVRTC_OPTIONS)


# The device attributes a grid is sized with: cudaDeviceAttr codes (stable in the CUDA runtime API) and the value
# taken when one cannot be read (a partial wave costs a little speed, never a failure).
OCCUPANCY_ATTRIBUTES: dict[str, tuple[int, int]] = {
    "MultiProcessorCount": (16, 1),  # cudaDevAttrMultiProcessorCount
    "MaxThreadsPerMultiProcessor": (39, 2048),  # cudaDevAttrMaxThreadsPerMultiProcessor
    "MaxRegistersPerMultiprocessor": (82, 65536),  # cudaDevAttrMaxRegistersPerMultiprocessor
    "MaxBlocksPerMultiprocessor": (106, 32),  # cudaDevAttrMaxBlocksPerMultiprocessor
}


def _occupancy_attributes(cp: Any, device_id: int) -> dict[str, int]:
    """The four attributes _wave_grid needs, each read on its own (cudaDeviceGetAttribute): reading every
    attribute (`Device.attributes`) fails as a whole on the first one a driver or CuPy build does not know."""
    out: dict[str, int] = {}
    for name, (code, default) in OCCUPANCY_ATTRIBUTES.items():
        try:
            out[name] = int(cp.cuda.runtime.deviceGetAttribute(code, device_id))
        except Exception as exc:
            log.warning("device %d: attribute %s unreadable (%s); sizing grids with %d", device_id, name, _one_line(exc), default)
            out[name] = default
    return out


def _wave_grid(kernel: Any, attrs: dict[str, int]) -> int:
    """WAVES times the blocks of PI_BLOCK threads the device holds at once (by register use)."""
    sm = attrs["MultiProcessorCount"]
    resident = 4  # what 64 registers a thread allows
    try:
        regs = max(1, int(kernel.num_regs))
    except Exception:  # an attribute of the loaded kernel CuPy could not read: assume 64 registers a thread
        regs = 64
    per_warp = -(-regs // 8) * 8 * 32
    by_regs = attrs["MaxRegistersPerMultiprocessor"] // (per_warp * (BLOCK // 32))
    by_threads = attrs["MaxThreadsPerMultiProcessor"] // BLOCK
    resident = max(1, min(by_regs, by_threads, attrs["MaxBlocksPerMultiprocessor"]))
    return sm * resident * WAVES


def _grid(tiles: int, wave_grid: int) -> int:
    return max(1, min(tiles, wave_grid))


def _null() -> np.uint64:
    return np.uint64(0)


def prepare_jobs(jobs: Sequence[Job] | Packed, arena: Any) -> Callable[[], None]:
    """Everything one fill_plan launch does before it runs (packing, uploading the descriptors and values), and the launch
    to call: what a benchmark times apart from the host work. `jobs` may come packed already (pack_table)."""
    cp = _import_cupy()
    if not isinstance(arena, cp.ndarray) or not arena.flags.c_contiguous:
        raise ValueError("arena must be a C-contiguous cupy.ndarray")
    packed = jobs if isinstance(jobs, Packed) else pack(jobs)
    if packed.njobs == 0:
        return _nothing
    if packed.end_bytes > arena.nbytes:
        raise ValueError(f"jobs write up to byte {packed.end_bytes} but the arena has {arena.nbytes}")
    with arena.device:
        k = kernels(arena.device.id)
        meta = cp.asarray(packed.meta)
        values = cp.asarray(packed.values) if packed.values.size else _null()

    def launch() -> None:
        with arena.device:
            k.fill_plan(
                (_grid(packed.total_tiles, k.fill_plan_grid),),
                (BLOCK,),
                (arena, meta, np.int32(packed.njobs), np.int64(packed.total_tiles), values),
            )

    return launch


def _nothing() -> None:
    return None


FLAT_WINDOW = 1 << 23  # flat values one launch of fill_plan carries at most (64 MiB as binary64)


def plan_launches(params: ParamTable, offsets: Offsets) -> Iterator[Packed]:
    """fill_plan's launches, packed one at a time: every parameter but the flat ones in one (the plain rows as
    columns), then the flat values in windows of at most FLAT_WINDOW elements. A window's values become
    binary64 only when it is packed, so a payload in its own dtype (a bfloat16 one is a quarter of its binary64
    form) costs one window on the host and the device at a time, not 8 bytes an element of the whole plan.

    Raises:
        ValueError: offsets and parameters disagree in number, or an offset is not a multiple of its item size.
    """
    if len(params) != len(offsets):
        raise ValueError(f"{len(params)} parameters but {len(offsets)} offsets")
    offs = np.asarray(offsets, dtype=np.int64)
    flat = [(rp, int(offs[i])) for i, rp in sorted(params.special.items()) if rp.formula == Formula.FLAT]  # flat rows are special
    yield pack_table(params, offsets)
    jobs: list[Job] = []
    held = 0
    for p, off in flat:
        for lo in range(0, p.numel, FLAT_WINDOW):
            n = min(FLAT_WINDOW, p.numel - lo)
            if jobs and held + n > FLAT_WINDOW:
                yield pack(jobs)
                jobs, held = [], 0
            jobs.append(Job(p, off + lo * p.dtype.itemsize, lo, n))
            held += n  # a window's values are at most its elements (pack gathers a sparse one)
    if jobs:
        yield pack(jobs)


def fill_plan(params: ParamTable, arena: Any, offsets: Offsets) -> None:
    """Fill whole parameters into one device arena, parameter i at byte offsets[i]: one launch, and one more per
    FLAT_WINDOW of flat values (plan_launches), all on the current stream, in order.

    Bytes between parameters are left as they are; the caller zeroes padding it exports.
    """
    for packed in plan_launches(params, offsets):
        prepare_jobs(packed, arena)()


def is_out_of_memory(exc: BaseException) -> bool:
    """cudaErrorMemoryAllocation or CuPy's pool OutOfMemoryError; by status code, never by message text
    (a dead context's cudaErrorIllegalAddress must surface as INTERNAL, not as a retryable limit)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return getattr(exc, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION


def ipc_size(nbytes: int) -> int:
    """Allocation size for an exported buffer: whole 2 MiB granules."""
    return -(-nbytes // IPC_GRANULE) * IPC_GRANULE


class DeviceExport:
    """A whole cudaMalloc allocation lent by CUDA IPC; an empty export allocates nothing.

    The peer maps the whole allocation, so the bytes past `size` (the rounding to 2 MiB) are
    zeroed here: cudaMalloc may hand back memory this server freed, holding an earlier export."""

    def __init__(self, backend: CupyBackend, nbytes: int) -> None:
        self.size = nbytes
        self._backend = backend
        self._mem: Any = None
        cp = backend._cp
        with backend._device:
            if nbytes == 0:
                self.array: Any = cp.empty(0, dtype=cp.uint8)
                return
            alloc = ipc_size(nbytes)
            self._mem = backend._malloc(alloc)
            whole = cp.ndarray((alloc,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(self._mem, 0))
            if alloc > nbytes:
                whole[nbytes:].fill(0)  # ordered before the handle leaves by fill_all's synchronize
            self.array = whole[:nbytes]

    def handle(self) -> ExportHandle:
        dev = self._backend.device()
        if self._mem is None:
            return ExportHandle(CUDA_IPC, 0, device=dev)
        with self._backend._device:
            raw = bytes(self._backend._cp.cuda.runtime.ipcGetMemHandle(self._mem.ptr))
        if len(raw) != IPC_HANDLE_BYTES:
            raise RuntimeError(f"ipcGetMemHandle returned {len(raw)} bytes, expected {IPC_HANDLE_BYTES}")
        return ExportHandle(CUDA_IPC, self.size, ipc_handle=raw, device=dev)

    def recycle(self) -> bool:
        return False  # an IPC handle cannot be revoked: released device memory is never lent again

    def close(self) -> None:
        with self._backend._device:  # cudaFree (when CuPy drops the last reference) in the allocation's context
            self.array = None
            self._mem = None


class CupyBackend:
    """Backend on one CUDA device; construction fails with BackendUnavailable when none is usable."""

    name = "cupy"
    memory = DEVICE
    delivery = CUDA_IPC

    def __init__(self, device: int = 0) -> None:
        cp = _import_cupy()
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as exc:
            raise BackendUnavailable(f"cupy backend unavailable: no usable CUDA driver ({_one_line(exc)})") from None
        if count == 0:
            raise BackendUnavailable("cupy backend unavailable: no CUDA device found")
        if not 0 <= device < count:
            raise BackendUnavailable(f"cupy backend unavailable: device {device} requested but {count} present")
        self._cp = cp
        self._ordinal = device

    @property
    def _device(self) -> Any:
        """A new cupy.cuda.Device each time: a `with` block on one shared object from several threads
        (RPC workers, the slab producer, lease expiry) could restore another thread's previous device."""
        return self._cp.cuda.Device(self._ordinal)

    def warm_up(self) -> None:
        """Compile (or load) the kernels and run each kind once, so the first request pays nothing."""
        cp = self._cp
        with self._device:
            kernels(self._ordinal)
            params = warm_up_params()
            for rp in params:
                self.fill(rp, cp.empty(rp.numel, dtype=rp.dtype.storage))
            fill_plan(ParamTable.of(params), cp.empty(len(params) * 48, dtype=cp.uint8), [48 * i for i in range(len(params))])
            cp.cuda.Device().synchronize()

    def prepare(self, params: ParamTable) -> None:
        """Nothing: the device kernels are one module, compiled by warm_up before the server says SERVING."""

    def _malloc(self, nbytes: int) -> Any:
        """A plain cudaMalloc (not CuPy's pool, whose blocks are carved from larger allocations);
        on OOM the pool's cached free blocks are returned to the driver once and the call retried."""
        cp = self._cp
        with self._device:
            for attempt in range(2):
                try:
                    return cp.cuda.memory.Memory(int(nbytes))
                except Exception as exc:
                    if not is_out_of_memory(exc):
                        raise
                    if attempt == 0:
                        cp.get_default_memory_pool().free_all_blocks()
                        continue
                    raise ResourceExhausted(f"device {self._ordinal} out of memory allocating {nbytes} bytes") from None
        raise AssertionError("unreachable")

    def export_buffer(self, nbytes: int) -> ExportBuffer:
        return DeviceExport(self, nbytes)

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        """One launch of pi_fill; only regions (dims) and flat payloads need an upload first."""
        self.prepare_fill(p, out, l_begin)()

    def prepare_fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> Callable[[], None]:
        """Everything fill does before its launch (packing, uploads), and the launch to call: a benchmark times
        the kernel alone, without the host work in front of it."""
        cp = self._cp
        if not isinstance(out, cp.ndarray) or out.ndim != 1 or not out.flags.c_contiguous:
            raise ValueError("out must be a 1-D C-contiguous cupy.ndarray")
        if out.dtype != p.dtype.storage:
            raise ValueError(f"{p.name}: out has dtype {out.dtype}, expected {p.dtype.storage}")
        n = int(out.shape[0])
        if n == 0:
            return _nothing
        packed = pack([Job(p, 0, l_begin, n)])
        row = packed.meta[:DESC_WORDS]
        n_outer = int(row[W_NOUTER])
        with self._device:
            k = kernels(self._ordinal)
            dims = cp.asarray(packed.meta[packed.dims_at :]) if n_outer else _null()
            values = cp.asarray(packed.values) if packed.values.size else _null()
        args = (
            out,
            np.int64(n),
            np.int64(l_begin),
            np.int32(row[W_KIND]),
            np.int32(row[W_OTYPE]),
            row.view(np.uint64)[W_KEY],
            row.view(np.float64)[W_P0],
            row.view(np.float64)[W_P1],
            values,
            np.int64(row[W_VSHIFT]),
            dims,
            np.int32(n_outer),
            np.int64(row[W_BASE]),
            np.int64(row[W_RUNLEN]),
            row.view(np.float64)[W_LO],
            row.view(np.float64)[W_HI],
            row.view(np.uint64)[W_SEED],
        )

        def launch() -> None:
            with self._device:
                k.fill((_grid(packed.total_tiles, k.fill_grid),), (BLOCK,), args)

        return launch

    def fill_plan(self, params: ParamTable, arena: Any, offsets: Offsets, should_stop: Callable[[], bool] | None = None) -> None:
        """Whole parameters into one arena in one launch (see the module-level fill_plan)."""
        if should_stop is not None and should_stop():
            raise Cancelled("client cancelled or deadline passed")
        with self._device:
            fill_plan(params, arena, offsets)

    def scratch(self, nbytes: int) -> Any:
        """A pooled device buffer for stream slabs: no cudaMalloc/cudaFree (which synchronizes) per slab."""
        with self._device:
            try:
                return self._cp.empty(int(nbytes), dtype=self._cp.uint8)
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise ResourceExhausted(f"device {self._ordinal} out of memory allocating {nbytes} bytes") from None
                raise

    def zero(self, buf: Any, start: int, stop: int) -> None:
        """In this backend's device context: CuPy's current device is per thread, and RPC threads start on 0."""
        if stop > start:
            with self._device:
                buf[start:stop].fill(0)

    def synchronize(self) -> None:
        """IPC gives no cross-process ordering: a peer must not see the buffer before its fill has finished."""
        with self._device:
            self._device.synchronize()

    def to_host(self, buf: Any) -> Any:
        """Copy into pinned host memory (CuPy's pinned pool), the fast path for device-to-host copies."""
        return self.start_to_host(buf, None)()

    def host_staging(self, nbytes: int) -> Any:
        """Page-locked host memory from CuPy's pinned pool: device-to-host copies into it are DMA, and
        asynchronous, so the device fills and copies the next slab while the host sends this one."""
        import cupyx  # with CuPy, which this module imports only when the backend is chosen

        with self._device:
            return cupyx.empty_pinned((int(nbytes),), dtype=np.uint8)

    def start_to_host(self, buf: Any, out: Any) -> Callable[[], Any]:
        """The copy goes on this thread's current stream, the one the fills went on, so it follows them;
        an event recorded after it is what the returned function waits for."""
        cp = self._cp
        host = self.host_staging(buf.nbytes).view(buf.dtype).reshape(buf.shape) if out is None else out
        with self._device:
            try:
                cp.asnumpy(buf, out=host, blocking=False)
            except TypeError:  # a CuPy without `blocking`: the copy is synchronous, the event passes at once
                buf.get(out=host)
            done = cp.cuda.Event()
            done.record()

        def wait() -> Any:
            with self._device:
                done.synchronize()
            return host

        return wait

    def device(self) -> DeviceInfo:
        cp = self._cp
        props = cp.cuda.runtime.getDeviceProperties(self._ordinal)
        name = props.get("name", b"")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        with self._device:
            free, total = cp.cuda.runtime.memGetInfo()
        return DeviceInfo("cuda", name, device_uuid(cp, self._ordinal, props), self._ordinal, int(total), int(free))
