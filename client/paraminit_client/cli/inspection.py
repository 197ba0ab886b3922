"""`paraminit inspect`: a safetensors file's tensors with their statistics, checked against a plan when one is
given, as a table, JSON or histograms."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator

from paraminit_client.cli.common import EXIT_FLAGGED, EXIT_OK, Subcommands, add_command, print_json
from paraminit_client.plans import load_plan


def add_parser(sub: Subcommands) -> None:
    """Add `inspect` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    ins = add_command(
        sub,
        "inspect",
        "list a safetensors file's tensors with their statistics, and check them against a plan",
        "One line per tensor: name, dtype, shape, bytes, mean, std (over the finite values), and a "
        "non-finite count when any value is NaN or infinite; --wide adds min and max. With --plan also the "
        "initializer (--wide: the mean, standard deviation and bounds it promises), and a check column: "
        "FLAG when the sample "
        "mean or std is more than 5 standard errors (plus the dtype's rounding) from the expected one, or a "
        "value lies outside the bounds; the FLAG lines below the table say why.",
    )
    ins.add_argument("file", help="safetensors file, or a directory of shards and their index (- reads standard input)")
    ins.add_argument("--plan", metavar="PLAN", help="plan whose initializers the tensors should follow")
    ins.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ins.add_argument(
        "--wide",
        action="store_true",
        help="every column (min, max, the expected mean, std and "
        "bounds); the default table fits 100 columns, long names cut in the middle with '~'",
    )
    ins.add_argument(
        "--plot-log",
        action="store_true",
        help="with --plot: the whole range of values on a "
        "logarithmic density axis, so the tails show (default: the bulk, mean +- 4 std, linear)",
    )
    ins.add_argument(
        "--plot",
        metavar="DIR",
        help="write one PNG histogram per tensor into DIR, the plan's "
        "expected density drawn over it (needs matplotlib: pip install 'paraminit[plot]')",
    )
    ins.set_defaults(func=run)


@contextlib.contextmanager
def _readable(file: str) -> Iterator[str]:
    """A safetensors file given on the command line as a path readers can pread at any offset: `-` is standard
    input, itself when it is a regular file (`< f`), else copied into an unnamed temporary file (a pipe)."""
    if file != "-":
        yield file
        return
    fd = sys.stdin.fileno()
    if stat.S_ISREG(os.fstat(fd).st_mode):
        yield f"/proc/self/fd/{fd}"
        return
    with tempfile.TemporaryFile() as copy:
        shutil.copyfileobj(sys.stdin.buffer, copy, 1 << 20)
        copy.flush()
        yield f"/proc/self/fd/{copy.fileno()}"


def run(args: argparse.Namespace) -> int:
    """List a safetensors file's tensors with their statistics, and check them against --plan.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.
    """
    from paraminit_client import inspect  # statistics and plots: only this command needs them

    if args.plot:
        inspect.check_plot(args.plot)  # before any work: matplotlib and a writable directory
    plan = load_plan(args.plan) if args.plan else None
    with _readable(args.file) as path:
        report = inspect.inspect_file(path, plan)
        shown = dataclasses.replace(report, path="<stdin>") if args.file == "-" else report
        code = EXIT_FLAGGED if plan is not None and not report.ok else EXIT_OK
        if args.json:
            print_json(code, **inspect.to_json(shown))
        else:
            # names are cut (in the middle) only to fit a terminal, at its own width
            width = shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else None
            print(inspect.format_table(shown, wide=args.wide, columns=width))
        if args.plot:
            written = inspect.plot(report, args.plot, log=args.plot_log)  # reads the tensors again
            print(f"wrote {len(written)} histograms to {args.plot}", file=sys.stderr)
    return code
