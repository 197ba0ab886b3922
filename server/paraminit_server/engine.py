"""Filling bytes: any byte window of a layout, so streams need only a few slabs of memory.

Because every element depends only on (key, global index), a window is filled
without touching the rest of the plan; STREAM generates slab k+1 on a
background thread while slab k is being sent.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from paraminit_server.backends import HOST, Backend
from paraminit_server.layout import SLAB_QUANTUM, Layout
from paraminit_server.plan import ResolvedParam


def fill_window(backend: Backend, layout: Layout, buf: Any, start: int) -> None:
    """Fill buf (1-D uint8, backend memory) with layout bytes [start, start + len(buf))."""
    stop = start + int(buf.shape[0])
    for pl in layout.placements:
        p = pl.param
        lo, hi = max(start, pl.offset), min(stop, pl.offset + p.nbytes)
        if lo >= hi:
            continue
        isz = p.dtype.itemsize
        out = buf[lo - start:hi - start].view(p.dtype.storage)
        fill_param(backend, p, out, (lo - pl.offset) // isz)


def fill_param(backend: Backend, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
    """Local elements [l_begin, l_begin + len(out)) of p, patches included: every fill of part of a parameter goes here."""
    backend.fill(p, out, l_begin)
    apply_patches(backend, p, out, l_begin)


def apply_patches(backend: Backend, p: ResolvedParam, out: Any, l_begin: int = 0) -> None:
    """Overwrite the patched elements of a filled window, each from its own initializer at its global index.

    Backend-neutral (only backend.fill on sub-windows), so every backend applies patches the same way
    and a patch is exact at any window, chunk, region or export.
    """
    end = l_begin + int(out.shape[0])
    for patch in p.patches:
        for lo, hi in patch.runs_in(l_begin, end):
            backend.fill(patch.param, out[lo - l_begin:hi - l_begin], lo)


def fill_params(backend: Backend, params: Sequence[ResolvedParam], arena: Any, offsets: Sequence[int],
                should_stop: Callable[[], bool] | None = None) -> None:
    """backend.fill_plan, patches included: whole parameters into one arena, parameter i at byte offsets[i]."""
    backend.fill_plan(params, arena, offsets, should_stop)
    for p, off in zip(params, offsets, strict=True):
        if p.patches:
            apply_patches(backend, p, arena[off:off + p.nbytes].view(p.dtype.storage), 0)


def fill_all(backend: Backend, layout: Layout, buf: Any, should_stop: Callable[[], bool] | None = None) -> None:
    """Fill a whole arena (exports), then wait for the backend: padding between tensors is zeroed so no
    stale bytes leak, and the arena is complete before anyone else can see it."""
    prev = 0
    for pl in layout.in_offset_order():
        backend.zero(buf, prev, pl.offset)
        prev = max(prev, pl.offset + pl.param.nbytes)
    backend.zero(buf, prev, layout.data_bytes)
    fill_params(backend, [pl.param for pl in layout.placements], buf, [pl.offset for pl in layout.placements],
                should_stop)
    backend.synchronize()


def iter_slabs(backend: Backend, layout: Layout, slab_bytes: int, should_stop: Callable[[], bool],
               prefetch: int = 2, transform: Callable[[int, Any], Any] | None = None) -> Iterator[Any]:
    """Yield (offset, host uint8 array) slabs of the data section, generated ahead on a thread.

    `transform(offset, host)`, when given, also runs on that thread (e.g. checksums and message
    encoding) and its result is yielded instead, so the sending thread only sends.
    Stops early (and frees its slabs) when should_stop() turns true or the consumer closes the iterator.
    """
    slab = max(SLAB_QUANTUM, slab_bytes // SLAB_QUANTUM * SLAB_QUANTUM)
    total = layout.data_bytes
    q: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
    cancel = threading.Event()
    alloc = backend.scratch

    def produce() -> None:
        # With a transform each slab is consumed before it is queued, so a ring of buffers serves every slab:
        # fresh memory costs a page fault per 4 KiB, about as much as generating into it. On a device the
        # ring has two slots: slab k+1 is filled and copied to host (asynchronously) while slab k is encoded
        # on this thread and earlier ones are sent; the copy of k+1 lands in the other staging slot, and
        # the fill of k+2 is queued behind the copy of k on the device, so no slot is reused too early.
        depth = 2 if transform is not None and backend.memory != HOST else 1
        try:
            first = min(slab, total)
            ring = [alloc(first) for _ in range(depth)] if transform is not None and total else []
            staging = [backend.host_staging(first) for _ in ring]
            pending: collections.deque[tuple[int, Callable[[], Any]]] = collections.deque()

            def emit(start: int, ready: Callable[[], Any]) -> bool:
                host = ready()
                item = transform(start, host) if transform is not None else (start, host)
                while not cancel.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        return True
                    except queue.Full:
                        if should_stop():
                            cancel.set()
                return False

            for k, start in enumerate(range(0, total, slab)):
                if cancel.is_set() or should_stop():
                    break
                size = min(slab, total - start)
                buf = ring[k % depth][:size] if ring else alloc(size)
                fill_window(backend, layout, buf, start)
                out = staging[k % depth][:size] if staging and staging[k % depth] is not None else None
                pending.append((start, backend.start_to_host(buf, out)))
                if len(pending) == depth and not emit(*pending.popleft()):
                    break
            while pending and not cancel.is_set() and not should_stop():
                emit(*pending.popleft())
            q.put(None) if not cancel.is_set() else None
        except BaseException as exc:  # surfaced to the consumer, which owns error reporting
            if not cancel.is_set():
                q.put(exc)

    worker = threading.Thread(target=produce, name="paraminit-fill", daemon=True)
    worker.start()
    try:
        while True:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                if not worker.is_alive() and q.empty():  # never wait on a producer that is gone
                    raise RuntimeError("slab producer stopped without a result") from None
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()
        while True:  # drop queued slabs so their memory goes now, not at thread exit
            try:
                q.get_nowait()
            except queue.Empty:
                break
        worker.join(timeout=5)
