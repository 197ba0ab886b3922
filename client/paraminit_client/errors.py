"""The client's one exception type."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class Violation:
    """One problem in a plan, as the server reported it."""

    field: str
    description: str


class ParaminitError(Exception):
    """Every failure the client reports: a gRPC status code, a message and, for plans, the violations."""

    def __init__(self, code: grpc.StatusCode, message: str, violations: tuple[Violation, ...] = (),
                 omitted: int = 0) -> None:
        """`omitted`: violations the server left out of the status details to keep its trailers within the
        default 8 KiB metadata limit (google.rpc.ErrorInfo VIOLATIONS_TRUNCATED); Validate returns every one."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = violations
        self.omitted = omitted

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> ParaminitError:
        """Build from a failed call, unpacking google.rpc.BadRequest details when present."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        violations: list[Violation] = []
        omitted = 0
        try:
            status = rpc_status.from_call(err)
        except ValueError:
            status = None
        if status is not None:
            for any_detail in status.details:
                if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    br = error_details_pb2.BadRequest()
                    any_detail.Unpack(br)
                    violations += [Violation(v.field, v.description) for v in br.field_violations]
                elif any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    any_detail.Unpack(info)
                    if info.reason == "VIOLATIONS_TRUNCATED":
                        omitted = int(info.metadata.get("omitted_violations", "0") or 0)
        return cls(code, details or code.name, tuple(violations), omitted)
