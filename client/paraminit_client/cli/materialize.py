"""`paraminit materialize`: a plan into a checkpoint (one safetensors file, shards, DCP) or onto standard output,
with a progress bar and a one-line summary that tells compiling and starting apart from the data's own time."""

from __future__ import annotations

import argparse
import errno
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paraminit import sizes
from paraminit.v1 import plan_pb2
from paraminit_client import checkpoints
from paraminit_client.checkpoints import progress_bar, write_stream
from paraminit_client.cli.common import (
    EXIT_OK,
    IncompleteOutput,
    Subcommands,
    UsageError,
    add_command,
    check_output,
    client_for,
    plural,
    print_json,
    with_target,
)
from paraminit_client.client import Client
from paraminit_client.errors import InvalidArgument
from paraminit_client.plans import load_plan


def add_parser(sub: Subcommands) -> None:
    """Add `materialize` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    m = add_command(
        sub,
        "materialize",
        "materialize a plan into a checkpoint: safetensors (one file or shards) or DCP",
        "Materialize a plan into a safetensors file, written atomically (a temporary file renamed into place "
        "when complete); with --max-shard-size into a directory of shards and model.safetensors.index.json, "
        "as transformers' save_pretrained writes them; with --format dcp into a torch.distributed.checkpoint "
        "directory (under torchrun each rank writes its part). On a terminal a progress bar shows on stderr; on "
        "success one line on stdout says what was written: parameters, bytes, time, throughput and the plan digest.",
    )
    m.add_argument("plan", help="plan file: JSON or YAML form of paraminit.v1.Plan")
    m.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="safetensors file to write (a directory with --max-shard-size or --format dcp); - writes the file to "
        "standard output (the summary then goes to stderr)",
    )
    m.add_argument(
        "--format",
        default="safetensors",
        metavar="FORMAT",
        help=f"checkpoint format: {' or '.join(checkpoints.FORMATS)} (default: safetensors)",
    )
    m.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write safetensors shards of at most SIZE (5GB, 500MB, 2GiB; a larger tensor alone in its shard) "
        "and their index into the -o directory",
    )
    m.add_argument(
        "--chunk-bytes",
        type=sizes.size_arg,
        default=0,
        metavar="SIZE",
        help="largest stream chunk to ask the server for, e.g. 2MiB (default: 0, the server's choice)",
    )
    m.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar, even on a terminal")
    m.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors: no bar, no summary line")
    m.add_argument("--summary", action="store_true", help=argparse.SUPPRESS)  # the summary is always printed now
    m.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (not with -o -: the file goes there)")
    with_target(m)
    m.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Materialize a plan into a safetensors file, shards or a DCP directory, or to standard output.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.

    Raises:
        UsageError: flags that do not go together, an output onto the plan.
        IncompleteOutput: standard output closed before the whole file was written.
    """
    started = time.time()  # one clock (tqdm's) for the bar and the summary
    to_stdout = args.output == "-"  # the data to standard output, everything said to standard error
    writer = _checked_writer(args, to_stdout)
    plan = load_plan(args.plan)
    compiled, starting = _compile_seconds(), _start_seconds()
    show_bar = args.progress and not args.quiet and sys.stderr.isatty()
    bar: Any = None
    data_at: list[float] = []

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if not data_at:
            data_at.append(time.time())
            if show_bar:
                bar = progress_bar(total, "stdout" if to_stdout else Path(args.output).name)
                bar.start_t = started  # elapsed and rate from the command's start, as the summary
        if bar is not None:
            bar.update(done - bar.n)

    try:
        with client_for(args) as c:
            if to_stdout:
                header = _to_stdout(c, plan, args.chunk_bytes, progress)
            else:
                with checkpoints.process_group(writer):
                    header = c.materialize_to_file(
                        plan,
                        args.output,
                        progress=progress,
                        chunk_bytes=args.chunk_bytes,
                        format=args.format,
                        max_shard_size=args.max_shard_size,
                    )
    finally:
        if bar is not None:
            bar.close()
    compiled = _compile_seconds() - compiled
    # one-time kernel compiling is reported apart: the time and the rate are over the rest
    seconds = max(time.time() - started - compiled, 0.0)
    setup = min(max((data_at[0] - started if data_at else seconds) - compiled, 0.0), seconds)
    # before the first byte: starting the in-process data plane (numba, cached kernels), then the plan's checks
    starting = min(_start_seconds() - starting, setup)
    return _summary(args, header, to_stdout, seconds, compiled, setup, starting)


def _checked_writer(args: argparse.Namespace, to_stdout: bool) -> checkpoints.Format:
    """The checkpoint format's writer, once the flags are known to go together and the output can be written."""
    if to_stdout and args.json:
        raise UsageError("--json prints the summary on standard output, where -o - writes the file: use one of them")
    if to_stdout and sys.stdout.isatty():
        raise UsageError("-o - writes a binary file to standard output, which is a terminal here: redirect it (> file, | cmd)")
    try:
        writer = checkpoints.format_for(args.format, args.max_shard_size)
    except InvalidArgument as exc:
        raise UsageError(exc.message) from None
    multi_file = not isinstance(writer, checkpoints.SafetensorsFile)
    if to_stdout and multi_file:
        raise UsageError("-o - writes one safetensors file: sharded and DCP checkpoints are directories")
    if not to_stdout:
        check_output(args.output, [args.plan], directory=multi_file)
    return writer


def _to_stdout(c: Client, plan: plan_pb2.Plan, chunk_bytes: int, progress: Callable[[int, int], None]) -> Any:
    """One stream of the plan written to standard output as a safetensors file; its header."""
    header, chunks = c.stream(plan, chunk_bytes=chunk_bytes, check_crc=False)
    progress(0, header.data_bytes)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        progress(done[0], header.data_bytes)

    sys.stdout.flush()
    try:
        write_stream(sys.stdout.fileno(), header.safetensors_prefix, chunks, advance)
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        total = len(header.safetensors_prefix) + header.data_bytes
        written = len(header.safetensors_prefix) + done[0] if done[0] else 0
        raise IncompleteOutput(
            f"standard output was closed when at least {written} of the file's {total} bytes were written: "
            "the safetensors file written there is incomplete"
        ) from None
    return header


def _summary(args: argparse.Namespace, header: Any, to_stdout: bool, seconds: float, compiled: float, setup: float, starting: float) -> int:
    """The summary: JSON on stdout with --json, else one line (on stderr when the file went to stdout)."""
    total = header.data_bytes
    if args.json:
        return print_json(
            EXIT_OK,
            output=args.output,
            parameters=len(header.tensors),
            bytes=total,
            seconds=round(seconds, 3),
            compile_seconds=round(compiled, 3),
            first_byte_seconds=round(setup, 3),
            start_seconds=round(starting, 3),
            plan_digest=header.plan_digest,
        )
    if not args.quiet:
        extra = f" plus {compiled:.1f} s compiling CPU kernels" if compiled > 0 else ""
        before = f"{setup - starting:.2f} s plan checks"
        if starting >= 0.005:
            before = f"{starting:.2f} s starting the data plane (numba, cached CPU kernels), {before}"
        print(
            f"wrote {'stdout' if to_stdout else args.output}: {plural(len(header.tensors), 'parameter')}, "
            f"{sizes.format_size(total)} in {seconds:.2f} s{extra} ({sizes.format_size(total / max(seconds, 1e-9))}"
            f"/s; {setup:.2f} s of it before the first byte: {before}), plan digest {header.plan_digest}",
            file=sys.stderr if to_stdout else sys.stdout,
            flush=True,
        )
    return EXIT_OK


def _start_seconds() -> float:
    """Seconds this process has waited for its in-process data plane to start (numba and the plan scanner) and
    to load the cached kernels its calls fill with (0 with a server)."""
    embedded = sys.modules.get("paraminit_server.embedded")  # imported only by an in-process client
    return float(embedded.start_seconds()) if embedded is not None else 0.0


def _compile_seconds() -> float:
    """Seconds this process has spent compiling CPU kernels and the plan scanner (an in-process server's; 0 when
    none runs here)."""
    embedded = sys.modules.get("paraminit_server.embedded")
    return float(embedded.compile_seconds()) if embedded is not None else 0.0
