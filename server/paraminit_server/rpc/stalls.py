"""Calls whose peer stopped reading (a stream) or sending (an upload) are cancelled after --max-stall seconds.

A stream's generator is suspended while gRPC sends its last message; a client that stops reading leaves it
there (flow control), holding its concurrency slot, memory and a worker thread for as long as the deadline
allows, or forever without one. An upload whose client stops sending waits in the same way for its next message.
The watch times how long each call has been waiting on its peer, not how long the server takes to produce: a
slow fill is not a stall. One thread looks at every watched call a few times per limit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("paraminit.server")


class Watched:
    """One call's clock: `waiting()` before handing a message to gRPC (or asking it for one), `progress()` once
    it returns. `stalled` tells the call's own code why it ended."""

    __slots__ = ("cancel", "since", "stalled", "what")

    def __init__(self, what: str, cancel: Callable[[], object]) -> None:
        self.what = what
        self.cancel = cancel
        self.since: float | None = None
        self.stalled = False

    def waiting(self) -> None:
        self.since = time.monotonic()

    def progress(self) -> None:
        self.since = None


class StallWatch:
    """Cancels calls that have waited on their peer longer than `limit` seconds (0: never)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._calls: set[Watched] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def watch(self, what: str, cancel: Callable[[], object]) -> Iterator[Watched]:
        """Watch a call for the block; `cancel` ends it (gRPC's context.cancel: the peer sees CANCELLED and the
        handler's generator or iterator is closed, so its slot and memory go back)."""
        w = Watched(what, cancel)
        if self.limit <= 0:
            yield w
            return
        with self._lock:
            self._calls.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="paraminit-stalls", daemon=True)
                self._thread.start()
        try:
            yield w
        finally:
            with self._lock:
                self._calls.discard(w)

    def iterate(self, items: Iterator[Any], w: Watched) -> Iterator[Any]:
        """`items` (a request stream) with the time spent waiting for each next item on the clock."""
        while True:
            w.waiting()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                w.progress()
            yield item

    def _loop(self) -> None:
        while not self._stop.wait(max(0.05, self.limit / 4)):
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._calls if w.since is not None and now - w.since > self.limit and not w.stalled]
            for w in late:
                w.stalled = True
                log.warning("cancelled a %s whose client made no progress for %.0f s (--max-stall)", w.what, self.limit)
                with contextlib.suppress(Exception):
                    w.cancel()

    def close(self) -> None:
        self._stop.set()
