"""What every command of `paraminit` shares: the exit codes, the parser class, the target flags and checks, the
client they make, and the one shape of --json answers.

Each command module imports this one and none imports another command, so a command is read (and changed) alone.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import paraminit_client
from paraminit import dtypes, exitcodes, sizes
from paraminit_client.client import Client

EXIT_OK, EXIT_ERROR, EXIT_INVALID, EXIT_FLAGGED, EXIT_USAGE, EXIT_INTERRUPTED = (
    exitcodes.OK,
    exitcodes.ERROR,
    exitcodes.INVALID,
    exitcodes.FLAGGED,
    exitcodes.USAGE,
    exitcodes.INTERRUPTED,
)
EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK:<4} success
  {EXIT_ERROR:<4} error: server unreachable or failing, a file that cannot be read or written, a missing optional
       package (the line names it and the command that installs it), a limit (RESOURCE_EXHAUSTED)
  {EXIT_INVALID:<4} invalid plan: every violation is on stderr and no output file is written
  {EXIT_FLAGGED:<4} inspect --plan: a tensor does not match the plan (FLAG lines say why)
  {EXIT_USAGE:<4} usage error: unknown command or flag, a missing or malformed argument
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C); 128+N for signal N (SIGTERM 143, SIGHUP 129); no output is left
{sizes.UNITS_HELP}."""

Subcommands = Any  # argparse's _SubParsersAction, which typeshed keeps private


class UsageError(Exception):
    """An argument argparse accepted but the command cannot use (exit code EXIT_USAGE)."""


class IncompleteOutput(Exception):
    """The reader of standard output closed it before the whole file was written (exit code EXIT_ERROR): a
    safetensors file cut short is no file, unlike the lines of a report cut by `| head`."""


class _Version(argparse.Action):
    """--version, looked up only when asked (reading the package's metadata would slow every start)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        print(f"paraminit {paraminit_client.__version__}")
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse with the exit-code table in every help and EXIT_USAGE (not 2, an invalid plan) for usage errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_Version, nargs=0, help="show program's version number and exit")

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_command(sub: Subcommands, name: str, help: str, description: str = "") -> argparse.ArgumentParser:
    """One command's parser under `paraminit`.

    Args:
        sub: the subparsers of the `paraminit` parser.
        name: the command's name.
        help: its line in `paraminit --help`.
        description: its `--help` description (default: `help`).

    Returns:
        The command's parser.
    """
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description or help)
    return p


def with_target(p: argparse.ArgumentParser, default: str | None = None, local: str = "the plan runs in this process on the CPU") -> None:
    """The flags of a command that talks to a server: --target, --timeout, --token and the TLS files.

    Args:
        p: the command's parser.
        default: the target without --target (None: in process, or none).
        local: what happens without --target when there is no default.
    """
    where = f"default: {default}" if default else f"default: none, {local}"
    p.add_argument("--target", default=None, metavar="HOST:PORT", help=f"server to use ({where})")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="deadline of each call (default: none" + (", 5 for health)" if default else ")"),
    )
    p.add_argument("--token", default="", help="bearer token (default: $PARAMINIT_TOKEN)")
    p.add_argument("--tls-ca", default="", metavar="PEM", help="CA that signed the server's certificate (enables TLS)")
    p.add_argument("--tls-cert", default="", metavar="PEM", help="client certificate, for mutual TLS")
    p.add_argument("--tls-key", default="", metavar="PEM", help="client private key, for mutual TLS")


def client_for(args: argparse.Namespace, default_target: str | None = None) -> Client:
    """The Client a command's target flags describe.

    Args:
        args: the parsed flags (with_target's).
        default_target: the target to use without --target (set on `args`, so errors name the target tried).

    Returns:
        The client (in process without a target).

    Raises:
        UsageError: a malformed --target.
    """
    if args.target is None and default_target is not None:
        args.target = default_target  # errors name the target tried
    return Client(
        check_target(args.target),
        timeout=getattr(args, "timeout", None),
        token=args.token or None,
        tls_ca=args.tls_ca or None,
        tls_cert=args.tls_cert or None,
        tls_key=args.tls_key or None,
    )


def write_text(text: str, output: str | None) -> None:
    """`text` to the file `output`, or to stdout when there is none (or it is '-').

    Args:
        text: what to write (a newline is added).
        output: the -o value.
    """
    if output and output != "-":
        Path(output).write_text(text + "\n")
    else:
        print(text)


def plural(n: int, word: str) -> str:
    """Returns: "1 word" or "n words"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_target(target: str | None) -> str | None:
    """`target` if a channel could use it: host:port with a port in 1-65535, [v6]:port, unix:PATH, dns:...; a
    UsageError that says what is wrong otherwise, before anything connects.

    Args:
        target: the --target value (None: no server, the plan runs in process).

    Returns:
        The target unchanged.

    Raises:
        UsageError: a URL scheme, a missing or malformed port, an empty host.
    """
    if target is None or target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return target
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", target)
    if scheme:
        rest = target[scheme.end() :].rstrip("/")
        raise UsageError(
            f"--target {target!r}: gRPC targets take no {scheme.group(1)}:// scheme; "
            f"write HOST:PORT ({rest or 'localhost:50051'}) or unix:PATH"
        )
    host, sep, port = target.rpartition(":")
    if not sep or (":" in host and not host.startswith("[")):  # no port, or a bare IPv6 address
        example = f"[{target}]:50051" if ":" in target else f"{target}:50051"
        raise UsageError(f"--target {target!r} has no port: write HOST:PORT, e.g. {example}")
    if not host or host in ("[]",):
        raise UsageError(f"--target {target!r} has no host: write HOST:PORT, e.g. localhost{target}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--target {target!r}: port {port!r} is not a number from 1 to 65535")
    return target


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def check_output(output: str, inputs: Sequence[str | None], directory: bool = False) -> Path:
    """The -o file, refused before any work when it is one of the inputs, a directory (a file, for a format
    that writes a directory), or in a missing directory.

    Args:
        output: the path given to -o.
        inputs: the files the command reads (None entries are ignored).
        directory: the output is a directory (sharded safetensors, DCP): made if missing.

    Returns:
        The output path.

    Raises:
        UsageError: `output` names an input file.
        OSError: a directory, or a parent directory that does not exist (naming `output`).
    """
    dest = Path(output)
    for given in inputs:
        if given is not None and _same_file(given, dest):
            raise UsageError(f"-o {output} is the input file {given}: writing it would replace the input")
    if directory:
        if dest.exists() and not dest.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "is not a directory; sharded and DCP checkpoints are directories", output)
    elif dest.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; -o takes a file name (or give --max-shard-size or --format dcp)", output)
    if not dest.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"directory {str(dest.parent)!r} does not exist", output)
    return dest


def located(file: str, violations: Sequence[Any], at: Sequence[int | None]) -> list[str]:
    """Violations as a plan file's own mistakes read: `  FILE:LINE: FIELD ('NAME'): MESSAGE` (no line where the
    file does not write the field).

    Args:
        file: the plan file ('-': standard input).
        violations: the violations.
        at: the line of each in the file, or None.

    Returns:
        One line per violation.
    """
    shown = "<stdin>" if file == "-" else file
    return [f"  {shown}:{line}: {v}" if line else f"  {shown}: {v}" for v, line in zip(violations, at, strict=True)]


def violation_json(
    file: str | None, line: int | None, field: str, message: str, index: int | None = None, name: str | None = None, limit: bool = False
) -> dict[str, Any]:
    """One violation in every --json answer's one shape: file and line (null where unknown), the parameter's
    index and name (null for a plan file's syntax, -1 and "" for plan-wide problems), field path, message,
    and whether it is a limit rather than a mistake.

    Returns:
        The JSON object.
    """
    return {"file": file, "line": line, "index": index, "name": name, "field": field, "message": message, "limit": limit}


def print_json(code: int, **fields: Any) -> int:
    """Every --json answer: one object on stdout with "ok" and "exit_code", then the command's own fields (a
    failure's are "error" and "violations", written by main).

    Args:
        code: the exit code.
        fields: the command's fields.

    Returns:
        `code`.
    """
    out: dict[str, Any] = {"ok": code == EXIT_OK, "exit_code": code}
    out.update((k, v) for k, v in fields.items() if k not in out)
    print(json.dumps(out, indent=1))
    return code


def dtype_name(value: int) -> str:
    """Returns: the name of a plan dtype enum value (the number, for one this release does not know)."""
    dt = dtypes.by_enum(value)
    return dt.name if dt else str(value)
