"""`paraminit health`: a server's gRPC health status, as an exit code."""

from __future__ import annotations

import argparse

from paraminit_client.cli.common import EXIT_ERROR, EXIT_OK, Subcommands, add_command, client_for, print_json, with_target

DEFAULT_HEALTH_TARGET = "127.0.0.1:50051"


def add_parser(sub: Subcommands) -> None:
    """Add `health` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    h = add_command(
        sub,
        "health",
        "print the server's health status; exit 0 when it is SERVING",
        f"Ask a server's gRPC health service; exit 0 when it answers SERVING, 1 otherwise (default target {DEFAULT_HEALTH_TARGET}).",
    )
    h.add_argument("--json", action="store_true", help="print the status as JSON on stdout")
    with_target(h, DEFAULT_HEALTH_TARGET)
    h.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """A server's gRPC health status; EXIT_OK when it is SERVING.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.
    """
    if args.timeout is None:
        args.timeout = 5.0
    with client_for(args, DEFAULT_HEALTH_TARGET) as c:
        status = c.health()
    code = EXIT_OK if status == "SERVING" else EXIT_ERROR
    if args.json:
        return print_json(code, status=status)
    print(status)
    return code
