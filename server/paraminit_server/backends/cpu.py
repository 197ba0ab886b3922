"""The embedded CPU backend: numba kernels (the cpu_kernels package) over NumPy buffers, exports in shared memory."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from paraminit import dtypes
from paraminit.hostmem import host_buffer
from paraminit_server.backends import HOST, SHM, DeviceInfo, ExportBuffer, cpu_kernels
from paraminit_server.backends.cpu_kernels import jit
from paraminit_server.backends.shm import ShmSegment
from paraminit_server.errors import Cancelled
from paraminit_server.host_limits import host_memory
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Formula, Offsets, ResolvedParam, Runs, warm_up_params

_NO_VALUES = np.zeros(0, dtype=np.float64)
_NO_INDEX = np.zeros(0, dtype=np.int64)
FILL_WINDOW = 64 << 20
CONVERT_PIECE = 1 << 20  # payload elements converted to binary64 at a time (8 MiB)
SPANS_PER_THREAD = 8  # a large output is cut into about this many spans per thread, each a whole number of PIECEs
log = logging.getLogger("paraminit.server")
COMPILE_LINE = "compiling CPU kernels, once per machine"
QUIET_SECONDS = 1.0  # a background compile waits until no fill has asked for a kernel for this long


class _Compiles:
    """Which kernel specializations (cpu_kernels.KERNELS) this process has loaded, and the time spent compiling.

    A specialization missing from numba's on-disk cache is compiled before its first fill, under a lock, with
    one line on stderr (the first time in the process) so that a cold start is not silent; its seconds are
    counted so that reported throughput can leave them out.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready: set[tuple[Any, ...]] = set()
        self.seconds = 0.0
        self.load_seconds = 0.0  # readying kernels without compiling them, that calls waited for (CpuBackend.prepare)
        self.announced = False
        self.turn = threading.Condition()
        self.waiting = 0  # callers that are not background ones, waiting for the lock or holding it
        self.last = -QUIET_SECONDS  # when the last of them finished (time.monotonic)

    def ensure(self, disp: Any, args: tuple[Any, ...], compile: bool = True, background: bool = False) -> bool:
        """Load or compile the specialization of kernel `disp` (one of a kind's cpu_kernels.Kernels) for `args`.

        A `background` caller (a server's warm-up after SERVING) lets every other caller go first, and waits
        until none has asked for QUIET_SECONDS: a request that needs kernels then waits for at most the one
        compile already under way, not for the warm-up's whole list between its own.

        Returns:
            Whether it is ready: False only when `compile` is False and it would have to be compiled.
        """
        key = _key(disp, args)
        if key in self.ready:
            return True
        if background:
            with self.turn:
                while self.waiting or time.monotonic() - self.last < QUIET_SECONDS:
                    self.turn.wait(QUIET_SECONDS / 4)
            return self._ensure(key, disp, args, compile)
        with self.turn:
            self.waiting += 1
        try:
            return self._ensure(key, disp, args, compile)
        finally:
            with self.turn:
                self.waiting -= 1
                self.last = time.monotonic()

    def _ensure(self, key: tuple[Any, ...], disp: Any, args: tuple[Any, ...], compile: bool) -> bool:
        with self.lock:
            if key in self.ready:
                return True
            sig = tuple(disp.typeof_pyval(a) for a in args)
            if sig not in disp.overloads and not _cached(disp, sig):
                if not compile:
                    return False
                if not self.announced:
                    self.announced = True
                    # says what it compiles: a later run that meets a new kind or dtype compiles that one too
                    line = (
                        f"{COMPILE_LINE} for each kind of value and dtype, then loaded from the cache; now: "
                        f"{_kernel_words(disp.__name__, args)}"
                    )
                    if logging.getLogger("paraminit").handlers:  # a server: its log format (JSON lines, ...)
                        log.info("%s", line)
                    else:
                        print(line, file=sys.stderr, flush=True)
                started = time.perf_counter()
                jit.quiet_inliner_warnings()
                disp.compile(sig)
                self.seconds += time.perf_counter() - started
            else:
                disp.compile(sig)  # loads it from the cache (nothing when already loaded)
            self.ready.add(key)
            return True


def _key(disp: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A specialization is told apart by its arrays' dtypes and layouts (the scalars' types never vary)."""
    return (disp.__name__, *((a.dtype.str, a.flags.c_contiguous) for a in args if isinstance(a, np.ndarray)))


def _kernel_words(name: str, args: tuple[Any, ...]) -> str:
    """A kernel specialization in words: `normal values into uint16 storage` from `fill_k2` and its arrays."""
    from paraminit_server.plans.plan import Formula

    _, _, code = name.rpartition("_k")
    kind = Formula(int(code)).name.lower() if code.isdigit() and int(code) in Formula._value2member_map_ else name
    stores = sorted(
        {
            a.dtype.name
            for a in args
            if isinstance(a, np.ndarray)
            and a.dtype.kind in "fu"
            and a.ndim == 1
            and a.dtype.itemsize in (1, 2, 4, 8)
            and a.dtype.name != "uint64"
        }
    )
    return f"{kind} values" + (f" ({', '.join(stores)} arrays)" if stores else "")


def _cached(disp: Any, sig: tuple[Any, ...]) -> bool:
    """Whether numba's on-disk cache holds this specialization (False when that cannot be told)."""
    try:
        cache = disp._cache
        return cache._index_key(sig, disp.targetctx.codegen()) in cache._cache_file._load_index()
    except Exception:  # pragma: no cover - numba internals moved: count it as compiling
        return False


COMPILES = _Compiles()


class _Pool:
    """The threads of large fills: one fill at a time (each already uses every thread), its spans taken from a shared
    counter by the calling thread and threads-1 helpers.

    Not a static split: on a shared machine a thread slowed by other work would hold up the whole fill. Python
    threads rather than a parallel numba kernel: the kernels release the GIL, and a parallel kernel compiled per
    kind cost a second compile, about a third of the whole, plus a threading layer that could fail to load.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._owner = (0, 0)  # (pid, helpers) the executor was made for: a forked child makes its own

    def _helpers(self, n: int) -> ThreadPoolExecutor:
        if self._executor is None or self._owner[0] != os.getpid() or self._owner[1] < n:
            if self._executor is not None and self._owner[0] == os.getpid():
                self._executor.shutdown(wait=False)
            self._executor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="paraminit-fill")
            self._owner = (os.getpid(), n)
        return self._executor

    def run(self, threads: int, spans: int, work: Callable[[int], None]) -> None:
        """Call work(0), ..., work(spans - 1), each once, on up to `threads` threads; returns when all are done.

        Raises:
            Whatever a call of `work` raised (the first), after every thread has stopped.
        """
        with self.lock:
            counter = itertools.count()  # next() is atomic under the GIL

            def worker() -> None:
                for t in counter:
                    if t >= spans:
                        return
                    work(t)

            n = min(threads, spans) - 1
            helpers = []
            try:
                for _ in range(max(0, n)):
                    helpers.append(self._helpers(n).submit(worker))
            except RuntimeError:  # the interpreter is exiting (no new threads): the calling thread does the rest
                pass
            try:
                worker()
            finally:
                for f in helpers:
                    f.result()


POOL = _Pool()


def _reset_after_fork() -> None:
    """In a forked child only the forking thread exists: a lock another thread held at the fork would stay held
    forever, and the parent's helper threads are not there. The child starts with fresh locks and no pool."""
    POOL.lock = threading.Lock()
    POOL._executor = None
    POOL._owner = (0, 0)
    COMPILES.lock = threading.Lock()
    COMPILES.turn = threading.Condition()
    COMPILES.waiting = 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _flat_values(p: ResolvedParam) -> Any:
    return p.values if p.formula == Formula.FLAT and p.values is not None else _NO_VALUES


def compile_seconds() -> float:
    """Seconds this process has spent compiling CPU kernels (those loaded from the disk cache cost none)."""
    return COMPILES.seconds


def load_seconds() -> float:
    """Seconds calls in this process have waited for CPU kernels to be readied without compiling (importing the
    kernel modules and numba's first load from the disk cache are most of it): a summary counts them with the
    start of the data plane, not with the plan's checks."""
    return COMPILES.load_seconds


class _Batch:
    """Small whole tensors of the value kinds waiting for one batch call of `fill` per dtype and kind (fill_plan)."""

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.groups: dict[tuple[int, int], _Group] = {}
        self.piece: int = cpu_kernels.PIECE  # the largest tensor fill keeps on the calling thread

    def add(self, p: ResolvedParam, offset: int) -> bool:
        """Queue p (at byte `offset` of the arena) when a batch can fill it; False: fill it on its own."""
        dt, n, runs = p.dtype, p.numel, p.runs()
        if (
            not 0 < n <= self.piece
            or p.formula == Formula.FLAT
            or runs.run_len != n
            or runs.base
            or runs.outer_ext.shape[0]
            or offset % dt.itemsize
        ):
            return False
        group = self.groups.get((dt.enum, p.formula))
        if group is None:
            view = self.arena[: self.arena.shape[0] // dt.itemsize * dt.itemsize].view(dt.storage)
            group = self.groups[(dt.enum, p.formula)] = _Group(view, dt.fmt, p.formula)
        group.add(p, offset // dt.itemsize)
        return True

    def run(self) -> None:
        """Fill every queued tensor, then forget them."""
        for group in self.groups.values():
            group.run()
        self.groups.clear()


class _Group:
    """The queued tensors of one dtype and formula: the columns of a batch (driver.BATCH_COLUMNS)."""

    def __init__(self, out: Any, fmt: int, formula: int) -> None:
        self.out, self.fmt, self.formula = out, fmt, formula
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.keys: list[int] = []
        self.p0: list[float] = []
        self.p1: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.seeds: list[int] = []

    def add(self, p: ResolvedParam, start: int) -> None:
        self.starts.append(start)
        self.counts.append(p.numel)
        self.keys.append(p.key)
        self.p0.append(p.p0)
        self.p1.append(p.p1)
        self.lo.append(p.lo)
        self.hi.append(p.hi)
        self.seeds.append(p.seed)

    def args(self) -> tuple[Any, ...]:
        u64, f64 = np.uint64, np.float64
        floats = [np.array(c, f64) for c in (self.p0, self.p1, self.lo, self.hi)]
        batch = [np.array(self.starts, u64), np.array(self.counts, u64), np.array(self.keys, u64), *floats, np.array(self.seeds, u64)]
        return _batch_args(self.out, self.fmt, batch)

    def run(self) -> None:
        if not self.starts:
            return
        _fill_batch(self.formula, self.args())
        self.starts.clear()  # queued tensors are filled once
        for column in (self.counts, self.keys, self.p0, self.p1, self.lo, self.hi, self.seeds):
            column.clear()


def _batch_args(out: Any, fmt: int, columns: Sequence[Any]) -> tuple[Any, ...]:
    """`fill`'s arguments for a batch of whole tensors into `out` (a view of the arena in their storage dtype), from
    the batch's columns in driver.BATCH_COLUMNS order (p0, p1, lo and hi as binary64, the rest as integers)."""
    rows = np.empty((len(columns[0]), len(columns)), dtype=np.uint64)
    for j, column in enumerate(columns):
        rows[:, j] = column.view(np.uint64) if column.dtype == np.float64 else column
    return (out, 0, 0, 0, np.uint64(0), 0.0, 0.0, 0.0, 0.0, np.uint64(0), _NO_VALUES, fmt, _NO_INDEX, _NO_INDEX, _NO_INDEX, 0, 0, rows)


def _fill_batch(kind: int, args: tuple[Any, ...]) -> None:
    """One batch call of `kind`'s fill (_batch_args), on the calling thread."""
    kernel = cpu_kernels.KERNELS[kind].fill
    COMPILES.ensure(kernel, args)
    kernel(*args)


def _fill_rows(
    backend: CpuBackend, params: Sequence[ResolvedParam], arena: Any, offsets: Sequence[int], should_stop: Callable[[], bool] | None
) -> None:
    """fill_plan of the rows a table does not batch from its columns, one ResolvedParam each: small whole tensors
    still go through a _Batch, larger ones and regions a FILL_WINDOW at a time."""
    since_check = FILL_WINDOW  # ask before the first fill
    batch = _Batch(arena)
    for p, off in zip(params, offsets, strict=True):
        if since_check >= FILL_WINDOW:
            batch.run()
            if should_stop is not None and should_stop():
                raise Cancelled("client cancelled or deadline passed")
            since_check = 0
        if batch.add(p, off):
            since_check += p.nbytes
            continue
        out = arena[off : off + p.nbytes].view(p.dtype.storage)
        step = max(1, FILL_WINDOW // p.dtype.itemsize)
        for lo in range(0, p.numel, step):
            if since_check >= FILL_WINDOW:
                if should_stop is not None and should_stop():
                    raise Cancelled("client cancelled or deadline passed")
                since_check = 0
            piece = out[lo : lo + step]
            backend.fill(p, piece, lo)
            since_check += piece.nbytes
    batch.run()


def _fill_table(backend: CpuBackend, params: ParamTable, arena: Any, offsets: Offsets, should_stop: Callable[[], bool] | None) -> None:
    """fill_plan from a ParamTable's columns: its small plain tensors by one batch call per dtype and kind per
    FILL_WINDOW bytes, straight from the columns; the other rows one by one (_fill_rows)."""
    t = params
    if not t.plain.any():  # a table of rows resolved one by one (a small plan)
        _fill_rows(backend, t, arena, [int(o) for o in offsets], should_stop)
        return
    offs = np.asarray(offsets, dtype=np.int64)
    batched = t.plain & (t.numel > 0) & (t.numel <= cpu_kernels.PIECE) & (offs % np.maximum(t.itemsize, 1) == 0)
    rest = np.flatnonzero(~batched).tolist()
    if rest:
        _fill_rows(backend, [params[i] for i in rest], arena, [int(offs[i]) for i in rest], should_stop)
    # one batch call per task: tensors of one dtype and kind whose bytes end in one piece of about
    # `piece` bytes (FILL_WINDOW at most, so a cancelled request stops within one window's time)
    total = int(t.nbytes[batched].sum())
    threads = backend.threads if total > cpu_kernels.PIECE else 1
    piece = max(1 << 20, min(FILL_WINDOW, -(-total // (threads * SPANS_PER_THREAD))))
    tasks: list[tuple[int, tuple[Any, ...]]] = []
    # the (dtype, kind) pairs present, by a count of their codes: np.unique over pairs sorts, once per slab
    kinds = len(Formula)
    codes = t.dtype * kinds + t.kernel
    for code in np.flatnonzero(np.bincount(codes[batched])).tolist():
        enum, kind = divmod(code, kinds)
        dt = dtypes.by_enum(enum)
        assert dt is not None, "plain rows have a known dtype"
        rows = np.flatnonzero(batched & (codes == code))
        view = arena[: arena.shape[0] // dt.itemsize * dt.itemsize].view(dt.storage)
        window = np.cumsum(t.nbytes[rows]) // piece  # which piece each tensor's end falls in
        cuts = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), rows.shape[0]]
        for a, b in itertools.pairwise(cuts):
            r = rows[a:b]
            batch = [offs[r] // dt.itemsize, t.numel[r], t.key[r], t.p0[r], t.p1[r], t.lo[r], t.hi[r], t.seed[r]]
            tasks.append((kind, _batch_args(view, dt.fmt, batch)))

    def work(i: int) -> None:
        if should_stop is not None and should_stop():
            raise Cancelled("client cancelled or deadline passed")
        _fill_batch(*tasks[i])

    if threads == 1 or len(tasks) == 1:
        for i in range(len(tasks)):
            work(i)
    else:  # the kernels release the GIL: tasks run on the pool's threads too
        POOL.run(threads, len(tasks), work)


class CpuBackend:
    name = "cpu"
    memory = HOST
    delivery = SHM

    def __init__(self, threads: int | None = None) -> None:
        cores: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # the usable cores, or NUMBA_NUM_THREADS
        self._threads = max(1, min(threads, cores)) if threads else cores
        self._ready_all = False  # every kernel of every kind and dtype loaded or compiled (warm_up, preload)
        self._ready_kinds: set[tuple[int, Formula]] = set()  # (dtype enum, kind) pairs prepare has readied

    @property
    def threads(self) -> int:
        """Threads a large fill uses (the calling one included)."""
        return self._threads

    def warm_up(self) -> None:
        """Compile (or load) every kernel of every kind and dtype, letting fills' own compiles go first."""
        self._ready_all = self._ensure(warm_up_params(), compile=True, background=True)

    def preload(self) -> None:
        """Load the kernels already in the disk cache and compile nothing: a process then compiles only the kinds
        and dtypes it fills, on first use (a cold cache costs those specializations, not all of them)."""
        self._ready_all = self._ensure(warm_up_params(), compile=False, background=True)

    def prepare(self, params: ParamTable) -> None:
        """Compile (or load) the kernels of the kinds and dtypes these parameters use, as a fill would, but
        before the call is admitted: on a cold cache, calls wait for their compile without holding a
        concurrency slot or their place in line (each call queued behind one compiling would otherwise
        time out in line). Nothing to do once every kernel is ready."""
        if self._ready_all:
            return
        wanted = params.kinds() - self._ready_kinds
        if wanted:
            started, compiled = time.perf_counter(), COMPILES.seconds
            self._ensure([rp for rp in warm_up_params() if (rp.dtype.enum, rp.formula) in wanted], compile=True, background=False)
            self._ready_kinds |= wanted
            with COMPILES.turn:  # calls of several threads may prepare at once
                COMPILES.load_seconds += time.perf_counter() - started - (COMPILES.seconds - compiled)

    def compile_share(self, index: int, count: int) -> None:
        """Compile (or load) every `count`-th kernel specialization of the warm-up, from the `index`-th: `count`
        processes then fill a cold disk cache together, each compiling its own share once (numba compiles under
        one lock per process, so processes, not threads, use the cores; prebuild --cpu).

        Args:
            index: this process's share, 0 <= index < count.
            count: the number of processes sharing the work.
        """
        self._ensure(warm_up_params(), compile=True, background=False, share=slice(index, None, count))

    def _ensure(self, params: list[ResolvedParam], compile: bool, background: bool, share: slice = slice(None)) -> bool:
        """Load or compile the fill kernels of these (warm-up) parameters and the batched fill of their kinds;
        whether all are ready."""
        ready = True
        for disp, args, run in self._specializations(params)[share]:
            if COMPILES.ensure(disp, args, compile=compile, background=background):
                run()
            else:
                ready = False
        return ready

    def _specializations(self, params: list[ResolvedParam]) -> list[tuple[Any, tuple[Any, ...], Callable[[], object]]]:
        """Each kernel specialization filling these parameters takes, once: (dispatcher, arguments, a fill with them).
        A batch of small tensors calls the same specialization as a span of one."""
        out: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], Callable[[], object]]] = {}
        for rp in params:
            buffer = np.empty(rp.numel, dtype=rp.dtype.storage)
            kernel, args = self._entry(rp, buffer, 0, rp.runs(), _flat_values(rp))
            out.setdefault(_key(kernel, args), (kernel, args, functools.partial(kernel, *args)))
        return list(out.values())

    def scratch(self, nbytes: int) -> Any:
        return host_buffer(nbytes)

    def export_buffer(self, nbytes: int) -> ExportBuffer:
        return ShmSegment(nbytes)

    def fill(self, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
        n = out.shape[0]
        if n == 0:
            return
        runs = p.runs()
        values = _flat_values(p)
        if values.dtype != np.float64:  # a payload in its own dtype: convert only what this window reads
            for lo in range(0, n, CONVERT_PIECE):  # (exact: every float dtype embeds in binary64)
                hi = min(n, lo + CONVERT_PIECE)
                g_lo, g_hi = runs.global_index(l_begin + lo), runs.global_index(l_begin + hi - 1)
                if g_hi - g_lo < 2 * (hi - lo):  # mostly contiguous: one slice
                    part, at, piece_runs = values[g_lo : g_hi + 1].astype(np.float64), l_begin + lo, runs.shifted(g_lo)
                else:  # a sparse region (e.g. a column): gather just its elements, indexed 0..hi-lo
                    part = values[runs.global_indices(l_begin + lo, hi - lo)].astype(np.float64)
                    at, piece_runs = 0, Runs(_NO_INDEX, _NO_INDEX, _NO_INDEX, 0, hi - lo)
                self._launch(p, out[lo:hi], at, piece_runs, part)
            return
        self._launch(p, out, l_begin, runs, values)

    def _launch(self, p: ResolvedParam, out: Any, l_begin: int, runs: Runs, values: Any) -> None:
        kernel, args = self._entry(p, out, l_begin, runs, values)
        COMPILES.ensure(kernel, args)  # outside the pool's lock: fills of compiled kernels go on meanwhile
        n, piece = out.shape[0], cpu_kernels.PIECE
        if n <= piece or self._threads == 1:  # smaller outputs stay on this thread: waking others costs more
            kernel(*args)
            return
        span = -(-n // (self._threads * SPANS_PER_THREAD * piece)) * piece
        rest = args[4:]

        def work(t: int) -> None:
            kernel(out, l_begin + t * span, l_begin + min(n, (t + 1) * span), l_begin, *rest)

        POOL.run(self._threads, -(-n // span), work)

    @staticmethod
    def _entry(p: ResolvedParam, out: Any, l_begin: int, runs: Runs, values: Any) -> tuple[Any, tuple[Any, ...]]:
        """The kernel of p's kind and its arguments to fill all of `out` (local elements l_begin...)."""
        return cpu_kernels.KERNELS[p.formula].fill, (
            out,
            l_begin,
            l_begin + out.shape[0],
            l_begin,
            np.uint64(p.key),
            p.p0,
            p.p1,
            p.lo,
            p.hi,
            np.uint64(p.seed),
            values,
            p.dtype.fmt,
            runs.outer_start,
            runs.outer_ext,
            runs.outer_stride,
            runs.base,
            runs.run_len,
            cpu_kernels.NO_BATCH,
        )

    def fill_plan(self, params: ParamTable, arena: Any, offsets: Offsets, should_stop: Callable[[], bool] | None = None) -> None:
        """In windows of FILL_WINDOW bytes, so a cancelled request stops within one window's time.

        `should_stop` is asked before each window's worth of bytes, not before each parameter: a plan of
        many small tensors would otherwise pay for the check more than for the fill. Small whole tensors of
        the value kinds are gathered per dtype and kind and filled by one kernel call per window (a batch):
        one launch each would cost more than their values."""
        _fill_table(self, params, arena, offsets, should_stop)

    def zero(self, buf: Any, start: int, stop: int) -> None:
        buf[start:stop] = 0

    def synchronize(self) -> None:
        """Fills are synchronous on the CPU."""

    def to_host(self, buf: Any) -> Any:
        return buf

    def host_staging(self, nbytes: int) -> Any:
        return None

    def start_to_host(self, buf: Any, out: Any) -> Callable[[], Any]:
        return lambda: buf

    def device(self) -> DeviceInfo:
        total, free = host_memory()
        return DeviceInfo("cpu", platform.processor() or platform.machine(), "", -1, total, free)
