"""Filling bytes: any byte window of a layout, so streams need only a few slabs of memory.

Because every element depends only on (key, global index), a window is filled
without touching the rest of the plan; STREAM generates slab k+1 on a
background thread while slab k is being sent. The engine yields host slabs;
what a transport makes of them (messages, checksums) is the transport's.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit_server import errors
from paraminit_server.backends import HOST, Backend
from paraminit_server.plane.layout import SLAB_QUANTUM, Layout
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Offsets, Patch, ResolvedParam

HostSlab = npt.NDArray[np.uint8]  # bytes of the data section in host memory, as slabs and buffers hand them out


def fill_window(backend: Backend, layout: Layout, buf: Any, start: int, should_stop: Callable[[], bool] | None = None) -> None:
    """Fill buf (1-D uint8, backend memory) with layout bytes [start, start + len(buf))."""
    stop = start + int(buf.shape[0])
    params = layout.params
    rows = layout.overlapping(start, stop)
    # whole plain tensors of the window in one fill from the columns; the other rows, and parts, below
    offsets = np.asarray(layout.offsets, dtype=np.int64)[rows]
    inside = params.plain[rows] & (offsets >= start) & (offsets + params.nbytes[rows] <= stop)
    if inside.any():
        backend.fill_plan(params.take(rows[inside]), buf, offsets[inside] - start)
    rows = rows[~inside]
    for i in rows.tolist():
        _fill_part(backend, params[i], int(layout.offsets[i]), buf, start, stop, should_stop)


def _fill_part(
    backend: Backend, p: ResolvedParam, offset: int, buf: Any, start: int, stop: int, should_stop: Callable[[], bool] | None = None
) -> None:
    """The bytes of p (at `offset` of the layout) that fall in the window buf = layout bytes [start, stop)."""
    lo, hi = max(start, offset), min(stop, offset + p.nbytes)
    if lo < hi:
        isz = p.dtype.itemsize
        out = buf[lo - start : hi - start].view(p.dtype.storage)
        fill_param(backend, p, out, (lo - offset) // isz, should_stop)


def fill_param(backend: Backend, p: ResolvedParam, out: Any, l_begin: int = 0, should_stop: Callable[[], bool] | None = None) -> None:
    """Local elements [l_begin, l_begin + len(out)) of p, patches included: every fill of part of a parameter goes here."""
    backend.fill(p, out, l_begin)
    apply_patches(backend, p, out, l_begin, should_stop)


PATCH_PIECE = 1 << 20  # elements of a patch's span generated at a time when its runs are short and many
SPAN_PER_RUN = 4096  # a span up to this many elements per run costs less to generate whole than run by run
CHECK_RUNS = 256  # runs filled one by one between two looks at should_stop
# covered elements a box fill makes at a time: its index arithmetic holds about 40 bytes an element (2.5 MiB), outside
# the memory budget like the rest of a fill's scratch
BOX_PIECE = 1 << 16


def apply_patches(backend: Backend, p: ResolvedParam, out: Any, l_begin: int = 0, should_stop: Callable[[], bool] | None = None) -> None:
    """Overwrite the patched elements of a filled window, each from its own initializer at its global index (or,
    for a patch holding a part, at its index in the part).

    Backend-neutral (only backend.fill on sub-windows), so every backend applies patches the same way and a
    patch is exact at any window, chunk, region or export. Many short runs (a column patch) are not filled one
    call each: on a host backend their span is generated a piece at a time and the covered elements taken from
    it in one array operation. `should_stop` is looked at between pieces and every CHECK_RUNS runs.

    Raises:
        Cancelled: should_stop() turned true.
    """
    end = l_begin + int(out.shape[0])
    for patch in p.patches:
        _stop_if(should_stop)
        starts, values = patch.runs_in(l_begin, end)
        count = int(starts.shape[0])
        if not count:
            continue
        lo, hi = max(int(starts[0]), l_begin), min(int(starts[-1]) + patch.run_len, end)
        # a part's runs may lie farther apart in their own tensor than here: whole spans only where they do not
        span = int(values[-1]) - int(values[0])
        if backend.memory == HOST and count >= 16 and hi - lo <= count * SPAN_PER_RUN and span <= 2 * (hi - lo + patch.run_len):
            _patch_span(backend, patch, out, l_begin, lo, hi, should_stop)
            continue
        if backend.memory == HOST and count >= 16 and _box_fillable(p, patch):
            _patch_box(backend, p, patch, out, l_begin, should_stop)
            continue
        for k, (a, v) in enumerate(zip(starts.tolist(), values.tolist(), strict=True)):
            if k % CHECK_RUNS == CHECK_RUNS - 1:
                _stop_if(should_stop)
            a_lo, a_hi = max(a, l_begin), min(a + patch.run_len, end)
            if a_lo < a_hi:
                backend.fill(patch.param, out[a_lo - l_begin : a_hi - l_begin], v + a_lo - a)


def _patch_span(backend: Backend, patch: Patch, out: Any, l_begin: int, lo: int, hi: int, should_stop: Callable[[], bool] | None) -> None:
    """The covered elements of local [lo, hi), from the patch's values over their span of value indices, made
    PATCH_PIECE local elements at a time."""
    offsets = np.arange(patch.run_len, dtype=np.int64)
    scratch = np.empty(min(PATCH_PIECE, hi - lo), dtype=out.dtype)
    for a in range(lo, hi, PATCH_PIECE):
        _stop_if(should_stop)
        b = min(a + PATCH_PIECE, hi)
        starts, values = patch.runs_in(a, b)
        idx = (starts[:, None] + offsets).reshape(-1)
        keep = (idx >= a) & (idx < b)
        idx, at = idx[keep], (values[:, None] + offsets).reshape(-1)[keep]
        if not idx.shape[0]:
            continue
        first, stop = int(at[0]), int(at[-1]) + 1  # generate only from the first to the last covered element
        if scratch.shape[0] < stop - first:
            scratch = np.empty(stop - first, dtype=out.dtype)
        made = scratch[: stop - first]
        backend.fill(patch.param, made, first)
        out[idx - l_begin] = made[at - first]


def _box_fillable(p: ResolvedParam, patch: Patch) -> bool:
    """A patch whose initializer is resolved over the parameter's own shape and region (no part, values indexed
    by global index): its box, as a region of its own, gives the covered elements in their local order."""
    q = patch.param
    return q.shape == p.shape and q.region == p.region and not q.compact and len(patch.box) == len(p.shape)


def _patch_box(backend: Backend, p: ResolvedParam, patch: Patch, out: Any, l_begin: int, should_stop: Callable[[], bool] | None) -> None:
    """Many runs far apart (a column patch of a wide tensor): the covered elements of the window made by one
    fill of the patch's initializer over its box (a region: the kernel walks its runs), BOX_PIECE at a time,
    and put in place in one array operation, instead of one fill call per run.

    The k-th element of the box in row-major order is the k-th covered element in local order (both ascend),
    so piece [k, k + n) of the box is local elements starts[k // run_len] + k % run_len."""
    box = tuple((max(a, ra), min(b, rb)) for (a, b), (ra, rb) in zip(patch.box, p.region, strict=True))
    if any(a >= b for a, b in box):
        return
    over_box = dataclasses.replace(patch.param, region=box, patches=())
    end = l_begin + int(out.shape[0])
    starts, run_len = patch.starts, patch.run_len
    covered = int(starts.shape[0]) * run_len
    # box elements whose local place falls in [l_begin, end): one contiguous range of k
    first = int(np.searchsorted(starts, l_begin - run_len, side="right"))
    last = int(np.searchsorted(starts, end, side="left"))
    k_lo = min(first * run_len + max(0, l_begin - int(starts[first])), covered) if first < starts.shape[0] else covered
    k_hi = max((last - 1) * run_len + min(run_len, end - int(starts[last - 1])), k_lo) if last > 0 else k_lo
    scratch = np.empty(min(BOX_PIECE, max(k_hi - k_lo, 0)), dtype=out.dtype)
    for k in range(k_lo, k_hi, BOX_PIECE):
        _stop_if(should_stop)
        n = min(BOX_PIECE, k_hi - k)
        made = scratch[:n]
        backend.fill(over_box, made, k)
        idx = np.arange(k, k + n, dtype=np.int64)
        out[starts[idx // run_len] + idx % run_len - l_begin] = made


def _stop_if(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise errors.Cancelled("client cancelled or deadline passed")


def fill_params(backend: Backend, params: ParamTable, arena: Any, offsets: Offsets, should_stop: Callable[[], bool] | None = None) -> None:
    """backend.fill_plan, patches included: whole parameters into one arena, parameter i at byte offsets[i]."""
    backend.fill_plan(params, arena, offsets, should_stop)
    for i, p in params.special.items():  # plain rows have no patches
        if p.patches:
            off = int(offsets[i])
            apply_patches(backend, p, arena[off : off + p.nbytes].view(p.dtype.storage), 0, should_stop)


def fill_all(backend: Backend, layout: Layout, buf: Any, should_stop: Callable[[], bool] | None = None) -> None:
    """Fill a whole arena (exports), then wait for the backend: padding between tensors is zeroed so no
    stale bytes leak, and the arena is complete before anyone else can see it."""
    for start, stop in layout.gaps():
        backend.zero(buf, start, stop)
    fill_params(backend, layout.params, buf, layout.offsets, should_stop)
    backend.synchronize()


class Slabs(Iterator[tuple[int, HostSlab]]):
    """(offset, host uint8 array) slabs of the data section, generated ahead on a thread (iter_slabs).

    The producer starts when this is made, not at the first `next`: a stream's first slabs are filled while its
    header is built and sent. `close()` (or the end of a `with`) stops it and frees its slabs, whether or not
    anything was read; a Slabs dropped unclosed stops its producer when collected."""

    def __init__(
        self, backend: Backend, layout: Layout, slab_bytes: int, should_stop: Callable[[], bool], prefetch: int, lend: bool
    ) -> None:
        slab = max(SLAB_QUANTUM, slab_bytes // SLAB_QUANTUM * SLAB_QUANTUM)
        total = layout.data_bytes
        q: queue.Queue[tuple[int, Any, int] | BaseException | None] = queue.Queue(maxsize=prefetch)
        ring_size = prefetch + 2 if lend and total else 0  # one lent, `prefetch` queued, one being filled
        free: queue.Queue[int] = queue.Queue()  # ring slots the consumer has handed back
        for i in range(ring_size):
            free.put(i)
        cancel = threading.Event()
        final: list[BaseException | None] = []  # the producer's outcome, set once before it exits
        alloc = backend.scratch

        def stopped() -> bool:
            return cancel.is_set() or should_stop()

        def produce() -> None:
            # On a device two slabs are in the pipeline: slab k+1 is filled and copied to host (asynchronously,
            # into its own page-locked staging slot) while slab k's copy is awaited and queued.
            depth = 2 if ring_size and backend.memory != HOST else 1
            try:
                first = min(slab, total)
                ring = [alloc(first) for _ in range(ring_size)]
                staging = [backend.host_staging(first) for _ in ring]
                pending: collections.deque[tuple[int, Callable[[], Any], int]] = collections.deque()

                def emit(start: int, ready: Callable[[], Any], slot: int) -> bool:
                    item = (start, ready(), slot)
                    while not stopped():
                        try:
                            q.put(item, timeout=0.1)
                            return True
                        except queue.Full:
                            pass
                    return False

                def take_slot() -> int | None:
                    while not stopped():
                        try:
                            return free.get(timeout=0.1)
                        except queue.Empty:
                            pass
                    return None

                for start in range(0, total, slab):
                    if stopped():
                        break
                    size = min(slab, total - start)
                    slot = -1
                    if ring:
                        got = take_slot()
                        if got is None:
                            break
                        slot = got
                    buf = ring[slot][:size] if ring else alloc(size)
                    fill_window(backend, layout, buf, start, stopped)
                    out = staging[slot][:size] if ring and staging[slot] is not None else None
                    pending.append((start, backend.start_to_host(buf, out), slot))
                    if len(pending) == depth and not emit(*pending.popleft()):
                        break
                while pending and not stopped():
                    emit(*pending.popleft())
                finish(errors.Cancelled("client cancelled or deadline passed") if should_stop() else None)
            except BaseException as exc:  # surfaced to the consumer, which owns error reporting
                finish(exc)

        def finish(outcome: BaseException | None) -> None:
            # The end (or the error) is never dropped: it waits behind the slabs however slowly they are read,
            # and is also kept aside, so a consumer that finds the producer gone still sees it. Only the
            # consumer's own close (cancel) ends the wait.
            final.append(outcome)
            while not cancel.is_set():
                try:
                    q.put(outcome, timeout=0.1)
                    return
                except queue.Full:
                    pass

        def consume() -> Generator[tuple[int, Any], None, None]:
            while True:
                try:
                    item = q.get(timeout=0.5)
                except queue.Empty:
                    if not worker.is_alive() and q.empty():  # never wait on a producer that is gone
                        if final:
                            item = final[0]
                        elif should_stop():
                            raise errors.Cancelled("client cancelled or deadline passed") from None
                        else:
                            raise RuntimeError("slab producer stopped without a result") from None
                    else:
                        continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                start, host, slot = item
                yield start, host
                if slot >= 0:
                    free.put(slot)  # the consumer asked for more: it is done with this slab

        worker = threading.Thread(target=produce, name="paraminit-fill", daemon=True)
        self._items = consume()
        # the producer holds no reference to self: collecting an unclosed Slabs cancels it
        self._stop = weakref.finalize(self, _stop_producer, cancel, q, worker)
        worker.start()

    def __next__(self) -> tuple[int, HostSlab]:
        try:
            return next(self._items)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the producer and drop the queued slabs, so their memory goes now, not at thread exit."""
        self._items.close()
        self._stop()

    def __enter__(self) -> Slabs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_producer(cancel: threading.Event, q: queue.Queue[Any], worker: threading.Thread) -> None:
    cancel.set()
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            break
    if worker is not threading.current_thread():
        worker.join(timeout=5)


def iter_slabs(
    backend: Backend, layout: Layout, slab_bytes: int, should_stop: Callable[[], bool], prefetch: int = 2, lend: bool = False
) -> Slabs:
    """(offset, host uint8 array) slabs of the data section, generated ahead on a thread started now.

    With `lend`, slabs come from a ring of `prefetch + 2` buffers and each one is lent: it is the consumer's
    until the consumer asks for the next item (or closes the iterator), and is refilled after that. Fresh
    memory costs a page fault per 4 KiB, about as much as generating into it, so a consumer that copies each
    slab out (an encoder) should borrow. Without `lend` every slab is new memory the consumer may keep.
    Stops early (and frees its slabs) when should_stop() turns true or the consumer closes the iterator.
    """
    return Slabs(backend, layout, slab_bytes, should_stop, prefetch, lend)
