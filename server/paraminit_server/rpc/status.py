"""The error boundary: every servicer method reports errors here, and only here.

Our errors become the status code they name (errors.*.code), invalid plans carry a
google.rpc.BadRequest with one FieldViolation per problem, and anything
unexpected becomes INTERNAL with an error id that is in the server log; a
traceback never reaches the client.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from paraminit.violations import NAME_ECHO, Violation, clip, describe
from paraminit_server import errors
from paraminit_server.plane.admission import DRAIN_RETRY_AFTER
from paraminit_server.rpc.edge import AbortCall

log = logging.getLogger("paraminit.server")
F = TypeVar("F", bound=Callable[..., Any])

# A status travels in trailers: grpc-message (percent-encoded, up to 3 bytes per byte) and
# grpc-status-details-bin (base64 of the google.rpc.Status: message + details). Stock clients (C-core, grpc-js,
# grpc-java) refuse trailers over 8 KiB by default, and then the caller gets RESOURCE_EXHAUSTED and none of the
# violations. The BadRequest therefore holds as many violations as keep every trailer within TRAILER_BUDGET
# (HPACK counts name + value + 32 bytes per entry); the rest are counted in a google.rpc.ErrorInfo.
MAX_MESSAGE_BYTES = 400
TRAILER_BUDGET = 8192 - 1024  # room for the transport's own entries and any a proxy adds
TRUNCATED_REASON = "VIOLATIONS_TRUNCATED"
ERROR_DOMAIN = "paraminit.v1"
MAX_FIELD_ECHO = 64
MAX_DESCRIPTION_ECHO = 200


def short(v: Violation) -> str:
    """A violation's text with every echoed user string bounded."""
    return describe(v.index, clip(v.name, NAME_ECHO), clip(v.field, MAX_FIELD_ECHO), clip(v.message, MAX_DESCRIPTION_ECHO))


def _percent_len(text: str) -> int:
    """Bytes of grpc-message on the wire: printable ASCII but '%' as is, every other byte as %XX."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8"))


def trailer_bytes(st: status_pb2.Status) -> int:
    """What the trailers of `st` count against a client's metadata limit (HPACK: name + value + 32 each)."""
    details = 4 * -(-int(st.ByteSize()) // 3)  # base64 without padding loss
    return (
        (32 + len("grpc-status") + 2)
        + (32 + len("grpc-message") + _percent_len(st.message))
        + (32 + len("grpc-status-details-bin") + details)
    )


def truncation_info(total: int, included: int) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo saying how many violations a BadRequest left out (reason VIOLATIONS_TRUNCATED)."""
    return error_details_pb2.ErrorInfo(
        reason=TRUNCATED_REASON,
        domain=ERROR_DOMAIN,
        metadata={
            "total_violations": str(total),
            "included_violations": str(included),
            "omitted_violations": str(total - included),
            "every_violation": "Validate finds every one and lists the first 1000",
        },
    )


def with_violations(
    st: status_pb2.Status, violations: Sequence[Violation], budget: int = TRAILER_BUDGET, omitted: int = 0
) -> status_pb2.Status:
    """`st` with a BadRequest of the first violations whose trailers fit `budget`, one FieldViolation per
    violation (never a made-up one), and, when some do not fit (or `omitted` more were found and not kept), an
    ErrorInfo counting them."""
    fvs = [error_details_pb2.BadRequest.FieldViolation(field=clip(v.field, MAX_FIELD_ECHO), description=short(v)) for v in violations]

    def build(n: int) -> status_pb2.Status:
        out = status_pb2.Status()
        out.CopyFrom(st)
        br = error_details_pb2.BadRequest(field_violations=fvs[:n])
        out.details.add().Pack(br)
        if n < len(fvs) or omitted:
            out.details.add().Pack(truncation_info(len(fvs) + omitted, n))
        return out

    lo, hi = 0, len(fvs)  # the largest n that fits: sizes grow with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if trailer_bytes(build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def bad_request(violations: Sequence[Violation], budget: int = TRAILER_BUDGET) -> error_details_pb2.BadRequest:
    """The BadRequest a status with these violations carries (see with_violations)."""
    st = with_violations(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT), violations, budget)
    br = error_details_pb2.BadRequest()
    st.details[0].Unpack(br)
    return br


def _message(err: errors.ParaminitServerError) -> str:
    violations = getattr(err, "violations", ())
    if not isinstance(err, errors.InvalidPlan) or not violations:
        return clip(str(err), MAX_MESSAGE_BYTES)
    total = len(violations) + getattr(err, "omitted", 0)
    lines = [f"invalid plan: {total} violation(s)"]
    size = len(lines[0])
    for k, v in enumerate(violations):
        line = f"  {short(v)}"
        if size + len(line.encode()) + 1 > MAX_MESSAGE_BYTES - 48:
            lines.append(f"  ... and {total - k} more")
            break
        lines.append(line)
        size += len(line.encode()) + 1
    return clip("\n".join(lines), MAX_MESSAGE_BYTES)


PUSHBACK = "grpc-retry-pushback-ms"  # gRPC's retry pushback trailer (gRFC A6): a delay, or negative for "don't"


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
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
    st = status_pb2.Status(code=getattr(code_pb2, err.code), message=_message(err))
    violations = err.violations if isinstance(err, (errors.InvalidPlan, errors.ResourceExhausted)) else ()
    if violations:
        st = with_violations(st, violations, omitted=getattr(err, "omitted", 0))
    status: grpc.Status = rpc_status.to_status(st)
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
    """The status a client gets for an exception (errors.classify): ours by the code they name, anything else
    INTERNAL with an error id that is in the server log (never the traceback, nor the exception's text)."""
    err = errors.classify(exc, method)
    if isinstance(err, errors.Internal):
        internal: grpc.Status = rpc_status.to_status(
            status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error (id {err.error_id}); see the server log")
        )
        return internal
    return to_status(err)


def _abort(owner: Servicer, context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    st = status_for(exc, method)
    owner.count(method, st.code)
    if st.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        refused = getattr(owner, "refused", None)
        if refused is not None:
            refused(method, getattr(exc, "reason", "memory" if isinstance(exc, MemoryError) else "limit"))
    context.abort_with_status(st)


def _is_abort(exc: BaseException) -> bool:
    # an abort (the edge's, or grpc's own bare Exception subclass) goes through untouched
    return isinstance(exc, AbortCall) or type(exc).__name__ == "_AbortException" or isinstance(exc, grpc.RpcError)


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
