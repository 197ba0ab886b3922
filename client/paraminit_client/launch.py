"""The `paraminit` command's entry point: `paraminit --version` answers before the CLI (grpc, numpy, protobuf) loads."""

from __future__ import annotations

import sys


def main() -> int:
    """Run the `paraminit` command (paraminit_client.cli.main).

    Returns:
        The exit code.
    """
    if sys.argv[1:] == ["--version"]:
        import paraminit_client

        print(f"paraminit {paraminit_client.__version__}")
        return 0
    from paraminit_client.cli import main as cli_main

    return cli_main()
