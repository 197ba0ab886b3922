"""The server's one error vocabulary, with no transport in sight: a floor that plans, backends and the data plane
all raise from.

Each error names its canonical status code (google.rpc.Code's names, which gRPC,
HTTP gateways and the in-process client all understand); the gRPC edge
(`rpc/status.py`) and the in-process transport translate that name, nothing else.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import ClassVar

from paraminit.violations import Violation

log = logging.getLogger("paraminit.server")


class ParaminitServerError(Exception):
    """Base of every error the service reports to a client on purpose."""

    code: ClassVar[str] = "INTERNAL"


class InvalidPlan(ParaminitServerError):
    """The plan has violations: those validation kept (the first MAX_ANSWER_VIOLATIONS), and how many more it
    found (`omitted`)."""

    code: ClassVar[str] = "INVALID_ARGUMENT"

    def __init__(self, violations: Sequence[Violation], omitted: int = 0) -> None:
        self.violations = tuple(violations)
        self.omitted = omitted
        lines = "\n".join(f"  {v}" for v in self.violations)
        super().__init__(f"invalid plan: {len(self.violations) + omitted} violation(s)\n{lines}")


class InvalidRequest(ParaminitServerError):
    """A request field other than the plan is wrong."""

    code: ClassVar[str] = "INVALID_ARGUMENT"


class ResourceExhausted(ParaminitServerError):
    """Over a byte, concurrency or lease limit, or out of memory.

    `retry_after`: seconds after which the same call may succeed (a busy server, memory in use); None when a
    retry cannot help (the plan is over a limit), which clients' retry policies are told (pushback -1).
    `reason`: a short label for the refusals metric."""

    code: ClassVar[str] = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, violations: Sequence[Violation] = (), retry_after: float | None = None, reason: str = "limit") -> None:
        self.violations = tuple(violations)
        self.retry_after = retry_after
        self.reason = reason
        super().__init__(message)


class NotFound(ParaminitServerError):
    """An unknown lease (or one that belongs to someone else)."""

    code: ClassVar[str] = "NOT_FOUND"


class FailedPrecondition(ParaminitServerError):
    """The request cannot be served in this situation (e.g. zero-copy to a remote peer)."""

    code: ClassVar[str] = "FAILED_PRECONDITION"


class Unavailable(ParaminitServerError):
    """The server is shutting down or not ready; `retry_after` seconds, when set, is sent as retry pushback."""

    code: ClassVar[str] = "UNAVAILABLE"

    def __init__(self, message: str, retry_after: float | None = None, reason: str = "draining") -> None:
        self.retry_after = retry_after
        self.reason = reason
        super().__init__(message)


class Unauthenticated(ParaminitServerError):
    """Missing or wrong credentials."""

    code: ClassVar[str] = "UNAUTHENTICATED"


class BackendUnavailable(ParaminitServerError):
    """A backend that cannot run here (no CuPy, no driver, no device)."""

    code: ClassVar[str] = "FAILED_PRECONDITION"


class Cancelled(ParaminitServerError):
    """The client went away or the deadline passed."""

    code: ClassVar[str] = "CANCELLED"


class Internal(ParaminitServerError):
    """An exception no layer raised on purpose (a bug): its id is in the log, with the traceback."""

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, error_id: str, detail: str) -> None:
        self.error_id = error_id
        self.detail = detail  # the exception's type and text: for a caller in this process only
        super().__init__(f"internal error (id {error_id})")


MEMORY_RETRY_AFTER = 1.0  # seconds a client refused for memory waits before its retry: streams end, leases go


def classify(exc: BaseException, where: str) -> ParaminitServerError:
    """Any exception a call raised, in this vocabulary, for both doors (the gRPC edge and the in-process one):
    ours as they are, MemoryError as ResourceExhausted (reason "memory"), anything else Internal, logged once
    with its traceback under the error id the caller sees.

    Args:
        exc: what the call raised.
        where: the method or door, for the log line.

    Returns:
        The error to report.
    """
    if isinstance(exc, ParaminitServerError):
        return exc
    if isinstance(exc, MemoryError):  # allocation failed: everything of the request is already unwound
        return ResourceExhausted(
            f"out of memory while materializing ({exc or 'allocation failed'}); retry in {MEMORY_RETRY_AFTER:g} s or free memory",
            retry_after=MEMORY_RETRY_AFTER,
            reason="memory",
        )
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", error_id, where, exc_info=exc, extra={"error_id": error_id})
    return Internal(error_id, f"{type(exc).__name__}: {exc}")
