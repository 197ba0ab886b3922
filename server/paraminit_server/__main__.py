"""`paraminit-server` / `python -m paraminit_server`: the server's own entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from paraminit import exitcodes
from paraminit_server.config import add_arguments, from_args
from paraminit_server.rpc.server import serve


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the whole usage block: a startup error should be readable in any log."""
        self.exit(exitcodes.USAGE, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def build_parser(prog: str = "paraminit-server") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Run the paraminit gRPC server.", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes (paraminit.exitcodes): 0 after a clean drain, 1 when the server fails (one line on stderr), 64 for
    bad flags or variables, as for `paraminit`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(args)
    except ValueError as exc:
        parser.error(" ".join(str(exc).split()))
    try:
        return serve(config)
    except Exception as exc:  # port in use, a backend that cannot run here, unreadable TLS files: one line
        print(f"{parser.prog}: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr, flush=True)
        return exitcodes.ERROR


if __name__ == "__main__":
    sys.exit(main())
