"""`paraminit serve`: the gRPC server, with the same flags, variables and exit codes as paraminit-server."""

from __future__ import annotations

import argparse
import sys

from paraminit_client.cli.common import EXIT_ERROR, Subcommands, UsageError, add_command


def add_parser(sub: Subcommands) -> None:
    """Add `serve` (the server's own flags, where the server is installed) to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    serve = add_command(
        sub,
        "serve",
        "run the gRPC server (the same as paraminit-server; `paraminit serve --help` lists its "
        "flags, each with its PARAMINIT_* variable and default)",
        "Run the paraminit gRPC server: the same flags, variables and exit codes as paraminit-server.",
    )
    try:
        from paraminit_server import embedded  # optional: the client can be installed alone
    except ImportError as exc:
        serve.set_defaults(func=run, server_missing=str(exc))
    else:
        embedded.add_server_arguments(serve)
        serve.set_defaults(func=run, server_missing="")


def run(args: argparse.Namespace) -> int:
    """`paraminit serve ...` is `paraminit-server ...`: the same flags, variables and exit codes.

    Args:
        args: the parsed flags.

    Returns:
        The server's exit code.

    Raises:
        UsageError: a flag the server's configuration refuses.
    """
    if args.server_missing:
        print(f"paraminit: the server is not installed ({args.server_missing})", file=sys.stderr)
        return EXIT_ERROR
    from paraminit_server import embedded

    try:
        return embedded.serve(args)
    except ValueError as exc:  # a flag the configuration refuses
        raise UsageError(" ".join(str(exc).split())) from None
    except Exception as exc:  # port in use, a backend that cannot run here, unreadable TLS files: one line
        print(f"paraminit serve: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr, flush=True)
        return EXIT_ERROR
