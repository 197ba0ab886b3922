"""How a failed command ends: one exit code, words on stderr and, with --json, the same failure as a JSON object;
and what SIGTERM, SIGHUP and Ctrl-C leave (nothing) while a command runs."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from paraminit_client import filesink
from paraminit_client.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_USAGE,
    IncompleteOutput,
    UsageError,
    located,
    plural,
    print_json,
    violation_json,
)
from paraminit_client.errors import CheckpointFormatError, InvalidArgument, MissingPackage, ParaminitError
from paraminit_client.plans import PlanFileError, field_lines

# The failures a command ends with an exit code and a line (anything else is a bug, and shows its traceback).
HANDLED = (PlanFileError, UsageError, IncompleteOutput, OSError, InvalidArgument, CheckpointFormatError, MissingPackage, ParaminitError)
HANDLED_ALSO = (ValueError, RuntimeError)  # after the ones above: some of those are ValueErrors too

# gRPC status codes in words, for one clear line on stderr.
_CODE_WORDS = {
    "UNAVAILABLE": "server unavailable",
    "DEADLINE_EXCEEDED": "timed out",
    "RESOURCE_EXHAUSTED": "over a server limit",
    "NOT_FOUND": "not found",
    "FAILED_PRECONDITION": "not possible here",
    "UNAUTHENTICATED": "not authenticated",
    "PERMISSION_DENIED": "permission denied",
    "INVALID_ARGUMENT": "invalid request",
    "INTERNAL": "server error",
    "CANCELLED": "cancelled",
    "DATA_LOSS": "data corrupted in transit",
    "UNIMPLEMENTED": "not supported by the server",
    "UNKNOWN": "error",
}


@dataclass
class Failure:
    """What a failed command says: the first line (after "paraminit: "), the lines below it, the exit code, and
    the violations of its --json answer; `quiet` ends with the code and says nothing."""

    message: str
    code: int
    lines: list[str] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    quiet: bool = False


def _rpc_line(err: ParaminitError, target: str | None) -> str:
    """One line for a failed call: what happened in words, the server's message, the status code last."""
    first = err.message.splitlines()[0] if err.message else ""
    if err.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in first.lower():
        reason = re.search(r"Failed to connect to remote host: ([^;]+)", first) or re.search(r"([^:]+)$", first)
        why = f": {reason.group(1).strip()}" if reason else ""
        return f"cannot connect to {target or 'the server'}{why} (gRPC status {err.code.name})"
    if not target and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # in process: this process's own limits
        return f"over a limit of this process: {first} (the variable named raises it, e.g. PARAMINIT_MAX_PARAM_BYTES=64GiB)"
    return f"{_CODE_WORDS.get(err.code.name, err.code.name.lower())}: {first} (gRPC status {err.code.name})"


def _os_line(err: OSError) -> str:
    if err.strerror and err.filename:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def _invalid_plan(err: ParaminitError, args: argparse.Namespace) -> Failure:
    """A plan the server refused: every violation at its line of the plan file, when the command read one."""
    message = f"invalid plan: {plural(len(err.violations) + err.omitted, 'violation')}"
    plan_file = getattr(args, "plan", None)
    at = field_lines(plan_file, [v.field for v in err.violations]) if plan_file else [None] * len(err.violations)
    lines = located(plan_file, err.violations, at) if plan_file else [str(v) for v in err.violations]
    if err.omitted:
        lines.append(f"... and {err.omitted} more (`paraminit validate` lists every one)")
    violations = [
        violation_json(plan_file, line, v.field, v.message, v.index, v.name, v.is_limit) for v, line in zip(err.violations, at, strict=True)
    ]
    return Failure(message, EXIT_INVALID, lines, violations)


def failure_of(err: Exception, args: argparse.Namespace) -> Failure:
    """What a command that raised `err` says and exits with (the first matching kind wins, in this order).

    Args:
        err: one of HANDLED or HANDLED_ALSO.
        args: the command's parsed flags (the plan file and target name what failed).

    Returns:
        The Failure.
    """
    if isinstance(err, PlanFileError):  # before ParaminitError, which it is
        return Failure(
            str(err), EXIT_INVALID, violations=[violation_json(err.file, v["line"], v["field"], v["message"]) for v in err.to_json()]
        )
    if isinstance(err, UsageError):
        return Failure(str(err), EXIT_USAGE)
    if isinstance(err, IncompleteOutput):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more goes to the closed pipe
        return Failure(str(err), EXIT_ERROR)
    if isinstance(err, OSError):  # FileAccessError too: a file, not a status, is the news
        if err.errno == errno.EPIPE:  # `paraminit inspect f | head`: the reader has all it wants (a BrokenPipeError,
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or one wrapped on the way by a sink)
            return Failure("", EXIT_OK, quiet=True)
        return Failure(_os_line(err), EXIT_ERROR)
    if isinstance(err, InvalidArgument | CheckpointFormatError | MissingPackage):  # before any call: an argument, a file, a package
        return Failure(err.message, EXIT_ERROR)
    if isinstance(err, ParaminitError):
        if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.violations:
            return _invalid_plan(err, args)
        return Failure(_rpc_line(err, getattr(args, "target", None)), EXIT_ERROR)
    return Failure(str(err), EXIT_ERROR)


def report(failure: Failure, args: argparse.Namespace) -> int:
    """Say a failure on stderr (and, with --json, as a JSON object on stdout).

    Args:
        failure: what failed.
        args: the command's parsed flags (--json).

    Returns:
        The exit code.
    """
    if failure.quiet:
        return failure.code
    print(f"paraminit: {failure.message}", file=sys.stderr)
    for line in failure.lines:
        print(line, file=sys.stderr)
    if getattr(args, "json", False):
        print_json(
            failure.code,
            valid=False if failure.code == EXIT_INVALID else None,
            error=failure.message.splitlines()[0].rstrip(":"),
            violations=failure.violations,
        )
    return failure.code


def interrupted_exit(signum: int, output: str | None) -> int:
    """Say what an interrupt left (nothing) and the exit code it gives.

    Args:
        signum: the signal.
        output: the file the command was writing, if any.

    Returns:
        130 for Ctrl-C, 128+N for signal N.
    """
    left = f"; {output} was not written" if output else ""
    print(f"paraminit: interrupted by {signal.Signals(signum).name}{left}", file=sys.stderr)
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum


@contextlib.contextmanager
def interruptible(output: str | None) -> Iterator[None]:
    """While a command runs, SIGTERM, SIGHUP (how batch schedulers and closed terminals end a job) and Ctrl-C end
    the process at once: the files being written are removed, one line says so, and the exit code tells which
    signal. Ending from the handler, rather than raising where the main thread happens to be, cannot leave a lock
    held halfway through a `with` (which would hang the unwinding). Handlers someone else set, and those of callers
    on other threads, are left alone (there Ctrl-C raises KeyboardInterrupt, handled in main).

    Args:
        output: the file the command writes, named in the line an interrupt prints.

    Yields:
        Nothing: the command runs inside.
    """

    def end(signum: int, frame: Any) -> None:
        filesink.remove_partial()
        code = interrupted_exit(signum, output)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig, default in (
            (signal.SIGTERM, signal.SIG_DFL),
            (signal.SIGHUP, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
        ):
            if signal.getsignal(sig) == default:
                previous[sig] = signal.signal(sig, end)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
