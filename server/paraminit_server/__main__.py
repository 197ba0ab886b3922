"""`paraminit-server` / `python -m paraminit_server`: the server's own entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paraminit_server.config import add_arguments, from_args
from paraminit_server.server import serve


def build_parser(prog: str = "paraminit-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run the paraminit gRPC server.")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(from_args(args))


if __name__ == "__main__":
    sys.exit(main())
