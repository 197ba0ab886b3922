"""The error boundary: every servicer method reports errors here, and only here.

Our errors become their status code from errors.STATUS, invalid plans carry a
google.rpc.BadRequest with one FieldViolation per problem, and anything
unexpected becomes INTERNAL with an error id that is in the server log; a
traceback never reaches the client.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from paraminit.violations import Violation, describe
from paraminit_server import errors
from paraminit_server.admission import DRAIN_RETRY_AFTER, MEMORY_RETRY_AFTER

log = logging.getLogger("paraminit.server")
F = TypeVar("F", bound=Callable[..., Any])

# A status travels in trailers: grpc-message (percent-encoded, up to 3 bytes per byte) and
# grpc-status-details-bin (base64 of message + details). Clients refuse trailers over 8 KiB, and then the
# caller gets RESOURCE_EXHAUSTED and none of the violations; these bounds keep the whole status near 4 KiB.
MAX_MESSAGE_BYTES = 400
MAX_DETAIL_BYTES = 2000
MAX_NAME_ECHO = 48
MAX_FIELD_ECHO = 64
MAX_DESCRIPTION_ECHO = 200


def clip(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes of text, marked when cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[:max(0, limit - 24)].decode("utf-8", "ignore") + f"... ({len(raw)} bytes)"


def short(v: Violation) -> str:
    """A violation's text with every echoed user string bounded."""
    return describe(v.index, clip(v.name, MAX_NAME_ECHO), clip(v.field, MAX_FIELD_ECHO),
                    clip(v.message, MAX_DESCRIPTION_ECHO))


def bad_request(violations: Sequence[Violation], limit: int = MAX_DETAIL_BYTES) -> error_details_pb2.BadRequest:
    """The first violations that fit in `limit` bytes, then one entry counting the rest."""
    br = error_details_pb2.BadRequest()
    size = 0
    for k, v in enumerate(violations):
        fv = error_details_pb2.BadRequest.FieldViolation(field=clip(v.field, MAX_FIELD_ECHO), description=short(v))
        if size + fv.ByteSize() + 4 > limit - 96:  # room for the count of the rest
            br.field_violations.add(field="params", description=f"... and {len(violations) - k} more violations; "
                                                                "Validate returns every one")
            break
        br.field_violations.append(fv)
        size += fv.ByteSize() + 4
    return br


def _message(err: errors.ParaminitServerError) -> str:
    violations = getattr(err, "violations", ())
    if not isinstance(err, errors.InvalidPlan) or not violations:
        return clip(str(err), MAX_MESSAGE_BYTES)
    lines = [f"invalid plan: {len(violations)} violation(s)"]
    size = len(lines[0])
    for k, v in enumerate(violations):
        line = f"  {short(v)}"
        if size + len(line.encode()) + 1 > MAX_MESSAGE_BYTES - 48:
            lines.append(f"  ... and {len(violations) - k} more")
            break
        lines.append(line)
        size += len(line.encode()) + 1
    return clip("\n".join(lines), MAX_MESSAGE_BYTES)


PUSHBACK = "grpc-retry-pushback-ms"  # gRPC's retry pushback trailer (gRFC A6): a delay, or negative for "don't"


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):  # type: ignore[misc]
    pass


def pushback_ms(err: errors.ParaminitServerError) -> int | None:
    """The retry pushback for a refusal: milliseconds until a retry makes sense, -1 for a RESOURCE_EXHAUSTED
    that no retry can fix (clients retry RESOURCE_EXHAUSTED by policy), None to leave the client's backoff."""
    if isinstance(err, errors.ResourceExhausted):
        return -1 if err.retry_after is None else max(0, round(err.retry_after * 1000))
    if isinstance(err, errors.Unavailable) and err.retry_after is not None:
        return max(0, round(err.retry_after * 1000))
    return None


def to_status(err: errors.ParaminitServerError) -> grpc.Status:
    code = errors.status_of(err)
    st = status_pb2.Status(code=getattr(code_pb2, code.name), message=_message(err))
    violations = err.violations if isinstance(err, (errors.InvalidPlan, errors.ResourceExhausted)) else ()
    if violations:
        detail = any_pb2.Any()
        detail.Pack(bad_request(violations))
        st.details.append(detail)
    status = rpc_status.to_status(st)
    pushback = pushback_ms(err)
    if pushback is None:
        return status
    return _Status(status.code, status.details, (*status.trailing_metadata, (PUSHBACK, str(pushback))))


class Servicer(Protocol):
    """What the boundary needs from the servicer it wraps."""

    def draining(self) -> bool: ...

    def count(self, method: str, code: grpc.StatusCode) -> None: ...


class MalformedRequest:
    """Stands in for a request whose bytes did not parse; see server._lenient_parser."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _precheck(owner: Servicer, request: Any = None) -> None:
    if isinstance(request, MalformedRequest):
        raise errors.InvalidRequest(request.reason)
    if owner.draining():
        raise errors.Unavailable("server is shutting down; retry on another worker", retry_after=DRAIN_RETRY_AFTER)


def status_for(exc: BaseException, method: str) -> grpc.Status:
    """The status a client gets for an exception: ours by the STATUS table, anything else INTERNAL with an
    error id that is in the server log (never the traceback)."""
    if isinstance(exc, MemoryError):  # allocation failed: everything of the request is already unwound
        exc = errors.ResourceExhausted(f"out of memory while materializing ({exc or 'allocation failed'}); retry later",
                                       retry_after=MEMORY_RETRY_AFTER, reason="memory")
    if isinstance(exc, errors.ParaminitServerError):
        return to_status(exc)
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", error_id, method, exc_info=exc, extra={"error_id": error_id})
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.INTERNAL,
                                                  message=f"internal error (id {error_id}); see the server log"))


def _abort(owner: Servicer, context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    st = status_for(exc, method)
    owner.count(method, st.code)
    if st.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        refused = getattr(owner, "refused", None)
        if refused is not None:
            refused(method, getattr(exc, "reason", "memory" if isinstance(exc, MemoryError) else "limit"))
    context.abort_with_status(st)


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises a bare Exception subclass that grpc recognises; let it through untouched.
    return type(exc).__name__ == "_AbortException" or isinstance(exc, grpc.RpcError)


def boundary(fn: F) -> F:
    """Wrap a unary or server-streaming servicer method with the error mapping."""
    name = fn.__name__
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(self: Servicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                _precheck(self, request)
                yield from fn(self, request, context)
                self.count(name, grpc.StatusCode.OK if context.is_active() else grpc.StatusCode.CANCELLED)
            except GeneratorExit:
                self.count(name, grpc.StatusCode.CANCELLED)
                raise
            except Exception as exc:
                if _is_abort(exc):
                    raise
                _abort(self, context, exc, name)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    def unary(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _precheck(self, request)
            result = fn(self, request, context)
            self.count(name, grpc.StatusCode.OK)
            return result
        except Exception as exc:
            if _is_abort(exc):
                raise
            _abort(self, context, exc, name)

    return unary  # type: ignore[return-value]
