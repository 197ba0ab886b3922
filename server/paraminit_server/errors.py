"""The server's one error vocabulary and the one table that maps it to gRPC status codes."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from paraminit.violations import Violation


class ParaminitServerError(Exception):
    """Base of every error the service reports to a client on purpose."""


class InvalidPlan(ParaminitServerError):
    """The plan has violations; all of them are attached."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  {v}" for v in self.violations)
        super().__init__(f"invalid plan: {len(self.violations)} violation(s)\n{lines}")


class InvalidRequest(ParaminitServerError):
    """A request field other than the plan is wrong."""


class ResourceExhausted(ParaminitServerError):
    """Over a byte, concurrency or lease limit, or out of memory.

    `retry_after`: seconds after which the same call may succeed (a busy server, memory in use); None when a
    retry cannot help (the plan is over a limit), which clients' retry policies are told (pushback -1).
    `reason`: a short label for the refusals metric."""

    def __init__(self, message: str, violations: Sequence[Violation] = (), retry_after: float | None = None,
                 reason: str = "limit") -> None:
        self.violations = tuple(violations)
        self.retry_after = retry_after
        self.reason = reason
        super().__init__(message)


class NotFound(ParaminitServerError):
    """An unknown lease (or one that belongs to someone else)."""


class FailedPrecondition(ParaminitServerError):
    """The request cannot be served in this situation (e.g. zero-copy to a remote peer)."""


class Unavailable(ParaminitServerError):
    """The server is shutting down or not ready; `retry_after` seconds, when set, is sent as retry pushback."""

    def __init__(self, message: str, retry_after: float | None = None, reason: str = "draining") -> None:
        self.retry_after = retry_after
        self.reason = reason
        super().__init__(message)


class Unauthenticated(ParaminitServerError):
    """Missing or wrong credentials."""


class BackendUnavailable(ParaminitServerError):
    """A backend that cannot run here (no CuPy, no driver, no device)."""


class Cancelled(ParaminitServerError):
    """The client went away or the deadline passed."""


STATUS: dict[type[ParaminitServerError], grpc.StatusCode] = {
    InvalidPlan: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    BackendUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    Cancelled: grpc.StatusCode.CANCELLED,
}


def status_of(err: ParaminitServerError) -> grpc.StatusCode:
    """The status code for an error, by its most specific class in STATUS."""
    for cls in type(err).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL
