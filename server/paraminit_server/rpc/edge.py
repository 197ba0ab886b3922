"""The gRPC edge: calls are received on one asyncio loop and take a worker thread only once their request is in.

grpc's thread-pool server waits for a unary request on a pool worker before any handler runs, so calls that
sent their headers and never their body could hold every worker, health included. Here the server is grpc.aio:
every InitService method is registered request-streaming and its request is read on the loop (at most
--max-stall seconds); only then does the call take one of --workers threads, where the servicer's synchronous
code runs as it always has, through `CallContext` (the part of grpc.ServicerContext it uses). Responses are
serialized on the worker and written by the loop, at most OUTGOING_DEPTH messages ahead of the client's
pace. Health and reflection answer on the loop itself, so no number of slow calls delays them.

Calls in flight (waiting for their request, queued for a worker, or running) are bounded by --max-rpcs; one
caller (its token, else its peer's host) may hold at most three quarters of them, so a pile of calls from
one caller never refuses the others. Beyond it: RESOURCE_EXHAUSTED on the headers, before any body is read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

T = TypeVar("T")
OUTGOING_DEPTH = 2  # serialized messages a stream may have queued for the loop: each is a copy of a chunk outside the budget
CALLER_SHARE = 0.75  # of --max-rpcs, what one caller may hold


class AbortCall(Exception):
    """Raised on a worker by `CallContext.abort*`; the loop ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing_metadata or ())


class CallEnded(Exception):
    """The call is over (the client left, its deadline passed, or the server cancelled it) while its worker
    still wanted to send or receive."""


class CallContext:
    """One call as its worker sees it: what the servicer reads of grpc.ServicerContext (deadline, peer,
    metadata, whether the call is still active), cancel and abort, and the send/receive of its messages.

    The call's facts are read on the loop before the worker starts, so nothing here touches gRPC from a
    worker thread except through the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._loop = loop
        self._context = context
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self._metadata = tuple(context.invocation_metadata() or ())
        self._peer = context.peer()
        self._auth = context.auth_context()
        self._active = True
        self._cancelled = asyncio.Event()  # set on the loop when the server cancels the call
        self._room = threading.Condition()
        self._queued = 0
        self._outgoing: collections.deque[bytes | None] = collections.deque()  # appends and pops are atomic
        self._idle = False  # the loop waits for the worker's next message (it must then be woken)
        self._wake: asyncio.Future[None] | None = None

    # -- the grpc.ServicerContext subset -------------------------------------------------------

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[Any, ...]:
        return self._metadata

    def auth_context(self) -> Any:
        return self._auth

    def is_active(self) -> bool:
        return self._active

    def cancel(self) -> None:
        """End the call with CANCELLED (the stall watch's way out); safe from any thread."""
        self.end()
        self._loop.call_soon_threadsafe(self._cancelled.set)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortCall(code, details)

    def abort_with_status(self, status: grpc.Status) -> None:
        raise AbortCall(status.code, status.details, status.trailing_metadata)

    # -- the edge's side -----------------------------------------------------------------------

    def end(self) -> None:
        """No longer active: a worker waiting to send wakes and stops."""
        self._active = False
        with self._room:
            self._room.notify_all()

    def send(self, raw: bytes) -> None:
        """Hand one serialized response to the loop; blocks while OUTGOING_DEPTH are queued (the client's pace).

        Raises:
            CallEnded: the call is over.
        """
        with self._room:
            while self._queued >= OUTGOING_DEPTH and self._active:
                self._room.wait()
            if not self._active:
                raise CallEnded
            self._queued += 1
        self._put(raw)

    def finish_sending(self) -> None:
        self._put(None)

    def _put(self, raw: bytes | None) -> None:
        # the loop is woken only when it waits: a stream whose client keeps up costs no wake-up per message
        self._outgoing.append(raw)
        if self._idle:
            self._loop.call_soon_threadsafe(self._kick)

    def _kick(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def drain(self) -> None:
        """Write what the worker sends, in order, until it finishes (loop side)."""
        while True:
            while self._outgoing:
                raw = self._outgoing.popleft()
                if raw is None:
                    return
                await self._context.write(raw)
                with self._room:
                    self._queued -= 1
                    self._room.notify()
            self._wake = self._loop.create_future()
            self._idle = True
            if not self._outgoing:  # (what the worker appended before it saw the flag)
                await self._wake
            self._idle = False

    def receive(self) -> bytes | None:
        """The next request message, None at the end of the stream (worker side).

        Raises:
            CallEnded: the call is over.
        """
        if not self._active:
            raise CallEnded
        try:
            return asyncio.run_coroutine_threadsafe(self._read(), self._loop).result()
        except (asyncio.CancelledError, futures.CancelledError):
            raise CallEnded from None

    async def _read(self) -> bytes | None:
        raw = await until_cancelled(self._context.read(), self._cancelled)
        return None if raw is grpc.aio.EOF else raw

    @property
    def cancelled_event(self) -> asyncio.Event:
        return self._cancelled


async def until_cancelled(work: Awaitable[T], cancelled: asyncio.Event) -> T:
    """`work`'s result, unless `cancelled` is set first.

    Raises:
        CallEnded: `cancelled` was set first (work is cancelled).
    """
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(cancelled.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not task.done():
        task.cancel()
        raise CallEnded
    return task.result()


Handler = Callable[[Any, Any], Any]  # the servicer's sync method: (request or request iterator, context)


class Edge:
    """The asyncio loop thread, the worker pool and the in-flight bound, shared by every method's handler.

    Args:
        workers: threads that run the servicer's code.
        max_rpcs: calls in flight at once (0 = no bound).
        stall: seconds a call may take to send its request (0 = no limit).
        caller_key: who a call is, from its metadata and peer, for the per-caller share (cheap: runs on the loop).
        refused: told (method, reason) of each call turned away here.
    """

    def __init__(
        self,
        workers: int,
        max_rpcs: int,
        stall: float,
        caller_key: Callable[[tuple[Any, ...], str], str],
        refused: Callable[[str, str], None] = lambda method, reason: None,
    ) -> None:
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="paraminit-rpc")
        self.max_rpcs = max_rpcs
        self.stall = stall
        self._caller_key = caller_key
        self._refused = refused
        self._in_flight: dict[str, int] = {}
        self._total = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="paraminit-grpc", daemon=True)
        self._thread.start()
        self.closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop from another thread and wait for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Edge.call from the loop thread would wait for itself")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and the workers (after the server stopped)."""
        if self.closed:
            return
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def in_flight(self) -> int:
        return self._total

    @contextlib.asynccontextmanager
    async def admitted(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """Count the call in flight for the block, or end it with RESOURCE_EXHAUSTED beyond --max-rpcs or its
        caller's share of it (loop side, so no lock)."""
        key = self._caller_key(tuple(context.invocation_metadata() or ()), context.peer())
        mine = self._in_flight.get(key, 0)
        if self.max_rpcs > 0 and (self._total >= self.max_rpcs or mine >= max(1, int(self.max_rpcs * CALLER_SHARE))):
            self._refused(method, "rpcs")
            share = "" if self._total >= self.max_rpcs else " for one caller"
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls in flight{share} (--max-rpcs {self.max_rpcs}); retry with backoff",
            )
        self._in_flight[key] = mine + 1
        self._total += 1
        try:
            yield
        finally:
            self._total -= 1
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]

    async def first_message(self, context: grpc.aio.ServicerContext[Any, Any]) -> bytes | None:
        """A call's first request message, None when its stream ended without one, waiting at most the stall
        limit: a call that sends headers and no body ends here, having held no worker."""
        try:
            raw = await asyncio.wait_for(context.read(), self.stall if self.stall > 0 else None)
        except TimeoutError:
            await context.abort(grpc.StatusCode.CANCELLED, f"no request arrived within {self.stall:.0f} s (--max-stall)")
        return None if raw is grpc.aio.EOF else raw

    def handler(
        self,
        method: str,
        fn: Handler,
        parse: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
        client_streaming: bool,
        server_streaming: bool,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """The method's async handler: request read on the loop, `fn` run on a worker with a CallContext."""

        def requests(first: bytes | None, call: CallContext) -> Iterator[Any]:
            if first is not None:
                yield parse(first)
                while (raw := call.receive()) is not None:
                    yield parse(raw)

        def run_unary(first: bytes | None, call: CallContext) -> bytes:
            if client_streaming:
                return serialize(fn(requests(first, call), call))
            if first is None:
                raise AbortCall(grpc.StatusCode.INVALID_ARGUMENT, f"{method} needs a request message")
            return serialize(fn(parse(first), call))

        def run_stream(first: bytes | None, call: CallContext) -> None:
            try:
                if first is None:
                    raise AbortCall(grpc.StatusCode.INVALID_ARGUMENT, f"{method} needs a request message")
                responses = fn(parse(first), call)
                try:
                    for message in responses:
                        call.send(serialize(message))
                except CallEnded:
                    pass
                finally:
                    responses.close()  # a call that ended mid-stream closes at its yield (GeneratorExit)
            finally:
                call.finish_sending()

        async def behaviour(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes | None:
            async with self.admitted(method, context):
                first = await self.first_message(context)
                call = CallContext(self.loop, context)
                try:
                    if not server_streaming:  # an upload's stall ends its receive(): the worker says why
                        return await self.loop.run_in_executor(self.pool, run_unary, first, call)
                    work = self.loop.run_in_executor(self.pool, run_stream, first, call)
                    await until_cancelled(call.drain(), call.cancelled_event)
                    await work
                    return None
                except AbortCall as abort:
                    call.end()
                    await context.abort(abort.code, abort.details, abort.trailing_metadata)
                except CallEnded:  # the server cancelled it (a stall)
                    call.end()
                    await context.abort(grpc.StatusCode.CANCELLED, "cancelled by the server: the client made no progress (--max-stall)")
                except BaseException:  # the client left or its deadline passed: the worker sees it and stops
                    call.end()
                    raise
                return None  # not reached: abort raises

        if server_streaming:
            return grpc.stream_stream_rpc_method_handler(behaviour)
        return grpc.stream_unary_rpc_method_handler(behaviour)
