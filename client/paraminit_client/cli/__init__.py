"""The `paraminit` command: materialize, validate, inspect, plan, leases, info, health, serve.

One module per command (`add_parser` adds its flags, `run` runs it), the flags and helpers they share in `common`,
and how a failure or an interrupt ends in `failures`; this module composes the parser and runs a command.

Exit codes (also in every --help and the README): see EXIT_CODES_HELP.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Sequence

from paraminit_client.cli import failures, health, info, inspection, leases, materialize, plan, serve, validate
from paraminit_client.cli.common import (
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_FLAGGED,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_USAGE,
    IncompleteOutput,
    Parser,
    UsageError,
    check_output,
    check_target,
)
from paraminit_client.cli.health import DEFAULT_HEALTH_TARGET
from paraminit_client.cli.plan import POLICIES

__all__ = [
    "DEFAULT_HEALTH_TARGET",
    "EXIT_CODES_HELP",
    "EXIT_ERROR",
    "EXIT_FLAGGED",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "POLICIES",
    "IncompleteOutput",
    "Parser",
    "UsageError",
    "build_parser",
    "check_output",
    "check_target",
    "main",
]

COMMANDS = (serve, materialize, validate, inspection, plan, leases, info, health)  # in `paraminit --help` order


def build_parser() -> argparse.ArgumentParser:
    """The `paraminit` parser: each command's own, in COMMANDS order.

    Returns:
        The parser.
    """
    parser = Parser(
        prog="paraminit", description="Materialize parameter tensors from a declarative init plan, check plans, and look at the result."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do; `paraminit COMMAND --help` says more")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one exit code and words on stderr (and, with --json, a JSON object on
    stdout: {"ok": false, "exit_code", "error", "violations"}).

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit code.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    output = getattr(args, "output", None) if args.func is materialize.run else None
    try:
        with failures.interruptible(output):
            return int(args.func(args))
    except failures.HANDLED + failures.HANDLED_ALSO as err:
        failure = failures.failure_of(err, args)
    except KeyboardInterrupt:  # Ctrl-C where main() does not own the handlers (another thread, a caller's handler)
        return failures.interrupted_exit(int(signal.SIGINT), output)
    return failures.report(failure, args)
