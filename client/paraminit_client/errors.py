"""The client's one error vocabulary: `ParaminitError` (and its subclasses) and one `Violation` type.

Every exception the client raises on purpose is a `ParaminitError`, whichever transport served the call and
whether the mistake was in a plan file, an argument or the plan itself; `except ParaminitError` catches them all.
Subclasses keep the built-in type a caller may already catch (`PlanFileError` and `InvalidArgument` are also
`ValueError`s, `FileAccessError` an `OSError`).
"""

from __future__ import annotations

import ast
import contextlib
import errno
import importlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from paraminit.safetensors_header import HeaderError
from paraminit.violations import INVALID, LIMIT, Violation

__all__ = [
    "ClientClosed",
    "FileAccessError",
    "InvalidArgument",
    "MissingPackage",
    "ParaminitError",
    "Violation",
    "require",
    "violation_from_text",
]

_PARAM_FIELD = re.compile(r"params\[(\d+)\]")
_FILE_CODES = {
    errno.ENOENT: grpc.StatusCode.NOT_FOUND,
    errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
    errno.EPERM: grpc.StatusCode.PERMISSION_DENIED,
    errno.ENOSPC: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class ParaminitError(Exception):
    """Every failure the client reports: a gRPC status code, a message and, for plans, the violations."""

    def __init__(self, code: grpc.StatusCode, message: str, violations: Sequence[Violation] = (), omitted: int = 0) -> None:
        """Args:
        code: the status code (the same names in process and from a server).
        message: what happened, in words.
        violations: every problem of an invalid plan (or those that fit a server's trailers).
        omitted: violations a server left out of the status details to keep its trailers within the default
            8 KiB metadata limit (google.rpc.ErrorInfo VIOLATIONS_TRUNCATED); `validate` finds every one and lists the first 1000.
        """
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = tuple(violations)
        self.omitted = omitted

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def named(cls, code: str, message: str, violations: Sequence[Violation] = ()) -> ParaminitError:
        """The error for a canonical status name (google.rpc.Code, e.g. "INVALID_ARGUMENT"): what the in-process
        door's failures carry, so that no gRPC type crosses it.

        Args:
            code: the status name.
            message: what happened.
            violations: an invalid plan's problems.

        Returns:
            The error, its code the status of that name (UNKNOWN for a name gRPC does not have).
        """
        return cls(grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN), message, violations)

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> ParaminitError:
        """The error a failed gRPC call stands for, its google.rpc.BadRequest unpacked into Violations.

        Args:
            err: the failed call.

        Returns:
            A ParaminitError with the call's code and details; a RESOURCE_EXHAUSTED's violations are limits.
        """
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        category = LIMIT if code == grpc.StatusCode.RESOURCE_EXHAUSTED else INVALID
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
                    violations += [violation_from_text(v.field, v.description, category) for v in br.field_violations]
                elif any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    any_detail.Unpack(info)
                    if info.reason == "VIOLATIONS_TRUNCATED":
                        omitted = int(info.metadata.get("omitted_violations", "0") or 0)
        return cls(code, details or code.name, tuple(violations), omitted)


class InvalidArgument(ParaminitError, ValueError):
    """An argument the client refuses before any call (a delivery name, a payload dtype, a list of targets)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)

    def __str__(self) -> str:
        return self.message  # a ValueError's text, as callers that catch ValueError expect


# The extra (pyproject.toml, and its `make extra-NAME` target) that installs each optional package.
EXTRA_OF = {
    "torch": "torch",
    "transformers": "hf",
    "torchtitan": "torchtitan",
    "megatron": "recipes",
    "olmo_core": "recipes",
    "jax": "jax",
    "flax": "jax",
    "matplotlib": "plot",
    "torchvision": "vision",
    "timm": "vision",
}


class MissingPackage(ParaminitError, ImportError):
    """An optional package a feature needs is not installed: FAILED_PRECONDITION, and still an ImportError.
    The message names the package and the command that installs it."""

    def __init__(self, package: str, feature: str) -> None:
        top = package.split(".")[0]
        extra = EXTRA_OF.get(top)
        how = f"make extra-{extra} in a checkout, or pip install 'paraminit[{extra}]'" if extra else f"pip install {top}"
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, f"{feature} needs {top}, which is not installed: {how}")
        self.package = top

    def __str__(self) -> str:
        return self.message


def require(module: str, feature: str) -> Any:
    """The module, imported; MissingPackage naming its package and how to install it when it is not there.

    Args:
        module: the dotted module name.
        feature: what needs it, for the message ("policy 'torchtitan'").

    Raises:
        MissingPackage: the module's package is not installed (or cannot be imported).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if isinstance(exc, MissingPackage):
            raise
        raise MissingPackage(module, feature) from exc


class ClientClosed(ParaminitError):
    """A call on a Client after close(), or on an in-process Client inherited across fork()."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


class CheckpointFormatError(ParaminitError, ValueError):
    """A file that is not a readable safetensors file (paraminit.safetensors_header.HeaderError) as a ParaminitError:
    INVALID_ARGUMENT, and still a ValueError. `reason`, `tensor`, `position` and `path` are the header error's."""

    def __init__(self, err: HeaderError) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        self.reason, self.tensor, self.position, self.path = err.reason, err.tensor, err.position, err.path

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def file_errors() -> Iterator[None]:
    """Raise what reading a local file fails with as ParaminitErrors: an OSError as FileAccessError (still an
    OSError), a safetensors format error as CheckpointFormatError (still a ValueError)."""
    try:
        yield
    except HeaderError as exc:
        raise CheckpointFormatError(exc) from None
    except ParaminitError:
        raise
    except OSError as exc:
        raise FileAccessError(exc) from None


class FileAccessError(ParaminitError, OSError):
    """A file the client cannot read or write (a plan file, an output file): the OSError, as a ParaminitError."""

    def __init__(self, err: OSError) -> None:
        OSError.__init__(self, err.errno, err.strerror, err.filename)
        self.code = _FILE_CODES.get(err.errno or 0, grpc.StatusCode.FAILED_PRECONDITION)
        self.message = OSError.__str__(self) if err.strerror else str(err)
        self.violations = ()
        self.omitted = 0

    def __str__(self) -> str:
        return self.message


def violation_from_text(field: str, description: str, category: str = INVALID) -> Violation:
    """A Violation back from a google.rpc.BadRequest FieldViolation, whose description is the violation's text
    (`paraminit.violations.describe`: `FIELD ('NAME'): MESSAGE`, or `FIELD: MESSAGE` for plan-wide problems).

    Args:
        field: the FieldViolation's field (`params[3].init.normal`, or `params` for the whole plan).
        description: its description.
        category: INVALID or LIMIT (a BadRequest does not say; the status code does).

    Returns:
        The Violation; its `str()` is `description` again. A description in another form is kept whole as the
        message.
    """
    m = _PARAM_FIELD.match(field)
    index = int(m.group(1)) if m else -1
    if not description.startswith(field):
        return Violation(index, "", field, description, category)
    rest = description[len(field) :]
    if index >= 0 and rest.startswith(" ("):
        at = rest.find("): ")
        while at >= 0:  # the name is a Python repr: the first cut that parses as a string is it
            try:
                name = ast.literal_eval(rest[2:at])
            except (ValueError, SyntaxError):
                name = None
            if isinstance(name, str):
                return Violation(index, name, field, rest[at + 3 :], category)
            at = rest.find("): ", at + 1)
    if rest.startswith(": "):
        return Violation(index, "", field, rest[2:], category)
    return Violation(index, "", field, description, category)
