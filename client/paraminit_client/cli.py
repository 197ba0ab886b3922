"""The `paraminit` command: materialize, validate, inspect, plan, info, health, serve.

Exit codes (also in every --help and the README): see EXIT_CODES_HELP.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc

import paraminit_client
from paraminit import dtypes, exitcodes, sizes
from paraminit_client import checkpoints, filesink
from paraminit_client.checkpoints import progress_bar, write_stream
from paraminit_client.client import Client
from paraminit_client.errors import CheckpointFormatError, InvalidArgument, MissingPackage, ParaminitError, require
from paraminit_client.plans import PlanFileError, field_lines, load_plan, plan_from_safetensors, plan_to_json

EXIT_OK, EXIT_ERROR, EXIT_INVALID, EXIT_FLAGGED, EXIT_USAGE, EXIT_INTERRUPTED = (
    exitcodes.OK,
    exitcodes.ERROR,
    exitcodes.INVALID,
    exitcodes.FLAGGED,
    exitcodes.USAGE,
    exitcodes.INTERRUPTED,
)
DEFAULT_HEALTH_TARGET = "127.0.0.1:50051"
EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK:<4} success
  {EXIT_ERROR:<4} error: server unreachable or failing, a file that cannot be read or written, a missing optional
       package (the line names it and the command that installs it), a limit (RESOURCE_EXHAUSTED)
  {EXIT_INVALID:<4} invalid plan: every violation is on stderr and no output file is written
  {EXIT_FLAGGED:<4} inspect --plan: a tensor does not match the plan (FLAG lines say why)
  {EXIT_USAGE:<4} usage error: unknown command or flag, a missing or malformed argument
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C); 128+N for signal N (SIGTERM 143, SIGHUP 129); no output is left
{sizes.UNITS_HELP}."""

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


# paraminit_client.torch.POLICIES, written here so that the CLI starts without importing torch (a test holds
# the two equal)
POLICIES = ("own", "torch", "torchlean", "hf", "torchtitan", "megatron", "neox", "olmo")


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


def _client(args: argparse.Namespace, default_target: str | None = None) -> Client:
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


def _write(text: str, output: str | None) -> None:
    """`text` to the file `output`, or to stdout when there is none (or it is '-')."""
    if output and output != "-":
        Path(output).write_text(text + "\n")
    else:
        print(text)


# -- commands -------------------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """`paraminit serve ...` is `paraminit-server ...`: the same flags, variables and exit codes."""
    if args.server_missing:
        print(f"paraminit: the server is not installed ({args.server_missing})", file=sys.stderr)
        return EXIT_ERROR
    from paraminit_server.config import from_args
    from paraminit_server.rpc.server import serve

    try:
        config = from_args(args)
    except ValueError as exc:
        raise UsageError(" ".join(str(exc).split())) from None
    try:
        return serve(config)
    except Exception as exc:  # port in use, a backend that cannot run here, unreadable TLS files: one line
        print(f"paraminit serve: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr, flush=True)
        return EXIT_ERROR


def _plural(n: int, word: str) -> str:
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


def cmd_materialize(args: argparse.Namespace) -> int:
    started = time.time()  # one clock (tqdm's) for the bar and the summary
    to_stdout = args.output == "-"  # the data to standard output, everything said to standard error
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
        with _client(args) as c:
            if to_stdout:
                header, chunks = c.stream(plan, chunk_bytes=args.chunk_bytes, check_crc=False)
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
    total = header.data_bytes
    setup = min(max((data_at[0] - started if data_at else seconds) - compiled, 0.0), seconds)
    # before the first byte: starting the in-process data plane (numba, cached kernels), then the plan's checks
    starting = min(_start_seconds() - starting, setup)
    if args.json:
        return _print_json(
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
            f"wrote {'stdout' if to_stdout else args.output}: {_plural(len(header.tensors), 'parameter')}, "
            f"{sizes.format_size(total)} in {seconds:.2f} s{extra} ({sizes.format_size(total / max(seconds, 1e-9))}"
            f"/s; {setup:.2f} s of it before the first byte: {before}), plan digest {header.plan_digest}",
            file=sys.stderr if to_stdout else sys.stdout,
            flush=True,
        )
    return EXIT_OK


def _start_seconds() -> float:
    """Seconds this process has waited for its in-process data plane to start (numba and the plan scanner) and
    to load the cached kernels its calls fill with (0 with a server)."""
    embedded, cpu = sys.modules.get("paraminit_server.embedded"), sys.modules.get("paraminit_server.backends.cpu")
    waited = float(embedded.start_wait_seconds()) if embedded is not None else 0.0
    return waited + (float(cpu.load_seconds()) if cpu is not None else 0.0)


def _compile_seconds() -> float:
    """Seconds this process has spent compiling CPU kernels and the plan scanner (an in-process server's; 0 when
    none runs here)."""
    cpu, scanner = sys.modules.get("paraminit_server.backends.cpu"), sys.modules.get("paraminit_server.plans.scanner")
    compiled = float(cpu.compile_seconds()) if cpu is not None else 0.0
    return compiled + (float(scanner.ready_seconds()[1]) if scanner is not None else 0.0)


def cmd_validate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    with _client(args) as c:
        report = c.validate(plan)
    code = EXIT_OK if not report.violations else EXIT_INVALID if not report.valid else EXIT_ERROR
    where = "the server's limits" if getattr(args, "target", None) else "the limits of this process (PARAMINIT_* variables raise them)"
    kind = "invalid plan" if not report.valid else f"plan over {where}"
    at = field_lines(args.plan, [v.field for v in report.violations]) if report.violations else []
    if args.json:
        return _print_json(
            code,
            valid=report.valid,
            fits_limits=report.fits_limits,
            plan_digest=report.plan_digest,
            total_bytes=report.total_bytes,
            params=[
                {"name": p.name, "dtype": _dtype_name(p.dtype), "shape": list(p.shape), "bytes": n}
                for p, n in zip(plan.params, report.param_bytes, strict=False)
            ],
            violations=[
                _violation_json(args.plan, line, v.field, v.message, v.index, v.name, v.is_limit)
                for v, line in zip(report.violations, at, strict=True)
            ],
            omitted_violations=report.omitted,
            **({"error": f"{kind}: {_plural(len(report.violations) + report.omitted, 'violation')}"} if code else {}),
        )
    if report.violations:
        print(f"paraminit: {kind}: {_plural(len(report.violations) + report.omitted, 'violation')}", file=sys.stderr)
        for line in _located(args.plan, report.violations, at):
            print(line, file=sys.stderr)
        if report.omitted:
            print(f"  ... and {report.omitted} more (an answer lists the first {len(report.violations)})", file=sys.stderr)
        return code
    by_dtype: dict[str, list[int]] = {}
    for p, nbytes in zip(plan.params, report.param_bytes, strict=True):
        entry = by_dtype.setdefault(_dtype_name(p.dtype), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    print(f"valid plan {report.plan_digest[:16]}: {_plural(len(plan.params), 'parameter')}, {sizes.format_size(report.total_bytes)}")
    print(f"  {'dtype':<10} {'params':>7} {'bytes':>12}")
    for name, (count, nbytes) in sorted(by_dtype.items()):
        print(f"  {name:<10} {count:>7} {sizes.format_size(nbytes):>12}")
    return EXIT_OK


def _located(file: str, violations: Sequence[Any], at: Sequence[int | None]) -> list[str]:
    """Violations as a plan file's own mistakes read: `  FILE:LINE: FIELD ('NAME'): MESSAGE` (no line where the
    file does not write the field)."""
    shown = "<stdin>" if file == "-" else file
    return [f"  {shown}:{line}: {v}" if line else f"  {shown}: {v}" for v, line in zip(violations, at, strict=True)]


def _violation_json(
    file: str | None, line: int | None, field: str, message: str, index: int | None = None, name: str | None = None, limit: bool = False
) -> dict[str, Any]:
    """One violation in every --json answer's one shape: file and line (null where unknown), the parameter's
    index and name (null for a plan file's syntax, -1 and "" for plan-wide problems), field path, message,
    and whether it is a limit rather than a mistake."""
    return {"file": file, "line": line, "index": index, "name": name, "field": field, "message": message, "limit": limit}


def _print_json(code: int, **fields: Any) -> int:
    """Every --json answer: one object on stdout with "ok" and "exit_code", then the command's own fields (a
    failure's are "error" and "violations", written by main); returns `code`."""
    out: dict[str, Any] = {"ok": code == EXIT_OK, "exit_code": code}
    out.update((k, v) for k, v in fields.items() if k not in out)
    print(json.dumps(out, indent=1))
    return code


def _dtype_name(value: int) -> str:
    dt = dtypes.by_enum(value)
    return dt.name if dt else str(value)


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


def cmd_inspect(args: argparse.Namespace) -> int:
    from paraminit_client import inspect  # statistics and plots: only this command needs them

    if args.plot:
        inspect.check_plot(args.plot)  # before any work: matplotlib and a writable directory
    plan = load_plan(args.plan) if args.plan else None
    with _readable(args.file) as path:
        report = inspect.inspect_file(path, plan)
        shown = dataclasses.replace(report, path="<stdin>") if args.file == "-" else report
        code = EXIT_FLAGGED if plan is not None and not report.ok else EXIT_OK
        if args.json:
            _print_json(code, **inspect.to_json(shown))
        else:
            # names are cut (in the middle) only to fit a terminal, at its own width
            width = shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else None
            print(inspect.format_table(shown, wide=args.wide, columns=width))
        if args.plot:
            written = inspect.plot(report, args.plot, log=args.plot_log)  # reads the tensors again
            print(f"wrote {len(written)} histograms to {args.plot}", file=sys.stderr)
    return code


def cmd_plan_from_safetensors(args: argparse.Namespace) -> int:
    if args.file == "-":
        raise UsageError("a plan from a checkpoint reads its tensors from the file's path: give the path, not - (standard input)")
    if args.output and args.output != "-":
        check_output(args.output, [args.file, args.fallback])
    fallback = load_plan(args.fallback) if args.fallback else None
    _write(plan_to_json(plan_from_safetensors(args.file, fallback)), args.output)
    return EXIT_OK


def _factory(spec: str) -> Any:
    """The callable `package.module:name` names (the current directory is importable, as for `python -m`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected package.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"{module_name} has no attribute {attr!r}; callables there: {', '.join(public) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj


def _factory_argument(text: str) -> tuple[str, Any]:
    """--arg NAME=VALUE: the value as JSON where it parses (10, 0.5, true, [1, 2], "x"), else as the string."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise UsageError(f"--arg takes NAME=VALUE (a keyword argument of the factory), got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def cmd_plan_from_module(args: argparse.Namespace) -> int:
    require("torch", "plan from-module")  # before the factory's module, which imports it too
    factory = _factory(args.factory)
    import torch

    from paraminit_client.torch import meta_parameters, plan_from_module

    kwargs = dict(_factory_argument(a) for a in args.arg or [])
    with meta_parameters():  # the constructor's own initialization is recorded as it runs
        try:
            module = factory(**kwargs)
        except TypeError as exc:
            raise ValueError(f"{args.factory}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{args.factory} returned {type(module).__name__}, not a torch.nn.Module")
    overrides = _factory(args.overrides) if args.overrides else None
    policy: Any = args.policy
    settings = {"num_layers": args.num_layers, "d_model": args.d_model, "sigma": args.sigma}
    given = {k: v for k, v in settings.items() if v is not None}
    if given:
        from paraminit_client import recipes

        allowed = {"megatron": ("num_layers", "sigma"), "neox": ("num_layers", "d_model")}.get(policy, ())
        extra = [k for k in given if k not in allowed]
        if extra:
            flags = ", ".join("--" + k.replace("_", "-") for k in extra)
            raise UsageError(
                f"{flags}: not a setting of policy {policy!r} (megatron takes --num-layers and --sigma, neox --num-layers and --d-model)"
            )
        policy = getattr(recipes, policy)(**given)
    _write(plan_to_json(plan_from_module(module, seed=args.seed, policy=policy, overrides=overrides)), args.output)
    return EXIT_OK


def _lease_rows(leases: Sequence[Any], now: float) -> list[dict[str, Any]]:
    from paraminit import times
    from paraminit.v1 import init_service_pb2 as pb

    return [
        {
            "lease_id": s.lease.lease_id,
            "delivery": pb.Delivery.Name(s.lease.delivery).removeprefix("DELIVERY_").lower(),
            "nbytes": s.lease.nbytes,
            "expires_in_s": round(times.epoch(s.lease.expires_at) - now, 1),
            "age_s": round(times.seconds(s.age), 1),
            "owner": s.owner,
            "plan_digest": s.plan_digest,
        }
        for s in leases
    ]


def cmd_leases(args: argparse.Namespace) -> int:
    """List, release or renew this identity's leases on a server."""
    if args.target is None:
        raise UsageError("leases live on a server: give --target HOST:PORT (an in-process client's leases end with its process)")
    action = args.action
    if action != "list" and not args.lease_ids:
        raise UsageError(f"leases {action} needs at least one LEASE_ID (see `paraminit leases`)")
    with _client(args) as c:
        if action == "list":
            rows = _lease_rows(c.leases(), time.time())
            if args.json:
                _print_json(EXIT_OK, leases=rows)
            elif not rows:
                print(f"no live leases for this identity on {args.target}")
            else:
                head = ("lease id", "delivery", "size", "expires in", "age", "plan digest")
                table = [head] + [
                    (
                        r["lease_id"],
                        r["delivery"],
                        sizes.format_size(r["nbytes"]),
                        f"{r['expires_in_s']:.0f} s",
                        f"{r['age_s']:.0f} s",
                        r["plan_digest"][:16],
                    )
                    for r in rows
                ]
                widths = [max(len(row[i]) for row in table) for i in range(len(head))]
                for row in table:
                    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
                total = sum(r["nbytes"] for r in rows)
                print(f"{_plural(len(rows), 'lease')}, {sizes.format_size(total)}, owner {rows[0]['owner']}")
            return EXIT_OK
        done: list[dict[str, Any]] = []
        if action == "release":
            for lease_id in args.lease_ids:
                released = c.release(lease_id)
                done.append({"lease_id": lease_id, "released": released})
                if not args.json:
                    print(f"{lease_id}: {'released' if released else 'already released'}")
        else:
            for lease_id in args.lease_ids:
                expires = c.renew(lease_id, args.ttl)
                done.append({"lease_id": lease_id, "expires_in_s": round(expires - time.time(), 1)})
                if not args.json:
                    print(
                        f"{lease_id}: renewed, expires in {expires - time.time():.0f} s "
                        f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(expires))})"
                    )
        return _print_json(EXIT_OK, leases=done) if args.json else EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.info()
    if args.json:
        from paraminit.v1 import init_service_pb2 as pb

        d, lim = info.device, info.limits
        return _print_json(
            EXIT_OK,
            version=info.version,
            backend=info.backend,
            device={
                "kind": d.kind,
                "name": d.name,
                "uuid": d.uuid,
                "ordinal": d.ordinal,
                "memory_total": d.memory_total,
                "memory_free": d.memory_free,
            },
            limits={f.name: getattr(lim, f.name) for f in lim.DESCRIPTOR.fields},
            dtypes=[_dtype_name(e) for e in info.dtypes],
            deliveries=[pb.Delivery.Name(e).removeprefix("DELIVERY_").lower() for e in info.deliveries],
        )
    fmt = sizes.format_size
    print(
        f"paraminit {info.version} backend={info.backend} device={info.device.kind}:{info.device.name}"
        f"{' ' + info.device.uuid if info.device.uuid else ''}"
    )
    print(f"  memory free/total: {fmt(info.device.memory_free)} / {fmt(info.device.memory_total)}")
    print(f"  max plan bytes: {fmt(info.limits.max_plan_bytes)}, concurrent: {info.limits.max_concurrent_requests}")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    if args.timeout is None:
        args.timeout = 5.0
    with _client(args, DEFAULT_HEALTH_TARGET) as c:
        status = c.health()
    code = EXIT_OK if status == "SERVING" else EXIT_ERROR
    if args.json:
        return _print_json(code, status=status)
    print(status)
    return code


# -- parser ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="paraminit", description="Materialize parameter tensors from a declarative init plan, check plans, and look at the result."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do; `paraminit COMMAND --help` says more")

    def add(name: str, help: str, description: str = "", **kwargs: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description or help, **kwargs)
        return p

    serve = add(
        "serve",
        "run the gRPC server (the same as paraminit-server; `paraminit serve --help` lists its "
        "flags, each with its PARAMINIT_* variable and default)",
        "Run the paraminit gRPC server: the same flags, variables and exit codes as paraminit-server.",
    )
    try:
        from paraminit_server.config import add_arguments  # optional: the client can be installed alone
    except ImportError as exc:
        serve.set_defaults(func=cmd_serve, server_missing=str(exc))
    else:
        add_arguments(serve, version=False)
        serve.set_defaults(func=cmd_serve, server_missing="")

    def with_target(
        p: argparse.ArgumentParser, default: str | None = None, local: str = "the plan runs in this process on the CPU"
    ) -> None:
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

    m = add(
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
    m.set_defaults(func=cmd_materialize)

    v = add(
        "validate",
        "check a plan: every violation, or a summary by dtype",
        "Check a plan without materializing it: every violation (parameter, field, message) on stderr, or parameters and bytes by dtype.",
    )
    v.add_argument("plan", help="plan file: JSON or YAML form of paraminit.v1.Plan")
    v.add_argument(
        "--json", action="store_true", help="print the report as JSON on stdout (valid, violations, bytes per parameter, digest)"
    )
    with_target(v)
    v.set_defaults(func=cmd_validate)

    ins = add(
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
    ins.set_defaults(func=cmd_inspect)

    plan = add("plan", "build a plan from a checkpoint or a PyTorch module", "Build a plan and print its JSON (or write it with -o).")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True, metavar="SOURCE", help="where the plan comes from")
    fs = plan_sub.add_parser(
        "from-safetensors",
        help="a plan that loads every tensor of a checkpoint",
        description="A plan that takes every tensor of the checkpoint (as safetensors "
        "references, which the server must be allowed to read: --safetensors-dirs) and "
        "initializes the other parameters of --fallback as that plan says.",
    )
    fs.add_argument("file", help="safetensors checkpoint (a path: the plan refers to it, so not -)")
    fs.add_argument(
        "--fallback",
        metavar="PLAN",
        help="plan for the parameters the checkpoint lacks; its shapes and dtypes must agree with the checkpoint's",
    )
    fs.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fs.set_defaults(func=cmd_plan_from_safetensors)
    fm = plan_sub.add_parser(
        "from-module",
        help="the plan of a PyTorch module, built on the meta device",
        description="Import package.module, call factory(**args) with its parameters on the meta device (no "
        "parameter memory is allocated; its own initialization code is recorded as it runs) and print the plan of "
        "the module it returns: one parameter per distinct floating-point tensor of its state_dict, each with the "
        "initialization the model's own code gives it (policy own), e.g. `plan from-module "
        "torchvision.models:resnet50 --arg num_classes=10`. Needs PyTorch.",
    )
    fm.add_argument(
        "factory", metavar="package.module:factory", help="callable returning a torch.nn.Module; the current directory is importable"
    )
    fm.add_argument(
        "--arg",
        action="append",
        metavar="NAME=VALUE",
        help="a keyword argument of the factory (repeatable); VALUE is read as JSON where it parses (10, 0.5, true), else as a string",
    )
    fm.add_argument(
        "--seed", type=int, default=0, help="plan seed; each parameter's seed derives from it and the parameter name (default: 0)"
    )
    fm.add_argument(
        "--policy",
        choices=POLICIES,
        default="own",
        help="own: the model's own initialization code, replayed (its constructor, each layer's reset_parameters, "
        "transformers' _init_weights, timm's init_weights); torch: PyTorch's own default distributions per layer; "
        "torchlean: kaiming/xavier uniform, as TorchLean (the Lean runtime whose sampler paraminit reproduces) "
        "initializes; hf: Hugging Face "
        "transformers' own _init_weights (make extra-hf); torchtitan: torchtitan's own "
        "init_weights, read from the module (make extra-torchtitan); megatron: Megatron-LM's "
        "normal(0, sigma) with sigma / sqrt(2 L) on output projections; neox: GPT-NeoX's small_init with wang_init on "
        "output projections (both read depth and width from the model's config, or take --num-layers, --d-model, "
        "--sigma); olmo: OLMo-core's own init_weights, replayed (make extra-recipes) (default: own)",
    )
    fm.add_argument("--num-layers", type=int, metavar="L", help="megatron, neox: the model's depth, where its config does not say")
    fm.add_argument("--d-model", type=int, metavar="D", help="neox: the model's width, where its config does not say")
    fm.add_argument("--sigma", type=float, metavar="S", help="megatron: the standard deviation (default: the config's, else 0.02)")
    fm.add_argument(
        "--overrides",
        metavar="package.module:callable",
        help="asked first for every tensor: "
        "callable(name, tensor) or callable(name, tensor, module, module_name) returning an "
        "initializer as JSON ({'normal': {'std': 0.02}}) or an Init, or None to leave it to the policy",
    )
    fm.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fm.set_defaults(func=cmd_plan_from_module)

    ls = add(
        "leases",
        "list, release or renew your shared-memory / CUDA IPC leases on a server",
        "Leases hold exported buffers (SHM, CUDA IPC) until released or expired. Without an action: list "
        "this identity's live leases (id, delivery, size, time to expiry, age, plan digest).",
    )
    ls.add_argument(
        "action",
        nargs="?",
        choices=("list", "release", "renew"),
        default="list",
        help="list (the default): this identity's live leases; release: free them at once; renew: extend them",
    )
    ls.add_argument("lease_ids", nargs="*", metavar="LEASE_ID", help="the leases to release or renew")
    ls.add_argument(
        "--ttl",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="renew: new time to live from now (default: 0, the server's --lease-ttl, capped by its --max-lease-ttl)",
    )
    ls.add_argument("--json", action="store_true", help="print the leases listed, released or renewed as JSON")
    with_target(ls, local="required: leases live on a server")
    ls.set_defaults(func=cmd_leases)

    i = add(
        "info",
        "server version, backend, device and limits",
        "Ask a server (or, without --target, the in-process data plane) for its version, backend, device, memory and limits.",
    )
    i.add_argument("--json", action="store_true", help="print the answer as JSON on stdout")
    with_target(i, local="this process's own data plane answers")
    i.set_defaults(func=cmd_info)

    h = add(
        "health",
        "print the server's health status; exit 0 when it is SERVING",
        f"Ask a server's gRPC health service; exit 0 when it answers SERVING, 1 otherwise (default target {DEFAULT_HEALTH_TARGET}).",
    )
    h.add_argument("--json", action="store_true", help="print the status as JSON on stdout")
    with_target(h, DEFAULT_HEALTH_TARGET)
    h.set_defaults(func=cmd_health)
    return parser


# -- errors ---------------------------------------------------------------------------------------------------------


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


def _interrupted_exit(signum: int, output: str | None) -> int:
    """Say what an interrupt left (nothing) and the exit code it gives: 130 for Ctrl-C, 128+N for signal N."""
    left = f"; {output} was not written" if output else ""
    print(f"paraminit: interrupted by {signal.Signals(signum).name}{left}", file=sys.stderr)
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum


@contextlib.contextmanager
def _interruptible(output: str | None) -> Iterator[None]:
    """While a command runs, SIGTERM, SIGHUP (how batch schedulers and closed terminals end a job) and Ctrl-C end
    the process at once: the files being written are removed, one line says so, and the exit code tells which
    signal. Ending from the handler, rather than raising where the main thread happens to be, cannot leave a lock
    held halfway through a `with` (which would hang the unwinding). Handlers someone else set, and those of callers
    on other threads, are left alone (there Ctrl-C raises KeyboardInterrupt, handled in main)."""

    def end(signum: int, frame: Any) -> None:
        filesink.remove_partial()
        code = _interrupted_exit(signum, output)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one exit code and words on stderr (and, with --json, a JSON object on
    stdout: {"ok": false, "exit_code", "error", "violations"})."""
    parser = build_parser()
    args = parser.parse_args(argv)
    violations: list[dict[str, Any]] = []
    lines: list[str] = []
    output = getattr(args, "output", None) if args.func is cmd_materialize else None
    try:
        with _interruptible(output):
            return int(args.func(args))
    except PlanFileError as err:  # before ParaminitError, which it is
        message, lines, code = str(err), [], EXIT_INVALID
        violations = [_violation_json(err.file, v["line"], v["field"], v["message"]) for v in err.to_json()]
    except UsageError as err:
        message, lines, code = str(err), [], EXIT_USAGE
    except IncompleteOutput as err:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more goes to the closed pipe
        message, lines, code = str(err), [], EXIT_ERROR
    except OSError as err:  # FileAccessError too: a file, not a status, is the news
        if err.errno == errno.EPIPE:  # `paraminit inspect f | head`: the reader has all it wants (a BrokenPipeError,
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or one wrapped on the way by a sink)
            return EXIT_OK
        message, lines, code = _os_line(err), [], EXIT_ERROR
    except (InvalidArgument, CheckpointFormatError, MissingPackage) as err:  # before any call: an argument, a file, a package
        message, lines, code = err.message, [], EXIT_ERROR
    except ParaminitError as err:
        if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.violations:
            message = f"invalid plan: {_plural(len(err.violations) + err.omitted, 'violation')}"
            plan_file = getattr(args, "plan", None)
            at = field_lines(plan_file, [v.field for v in err.violations]) if plan_file else [None] * len(err.violations)
            lines = _located(plan_file, err.violations, at) if plan_file else [str(v) for v in err.violations]
            if err.omitted:
                lines.append(f"... and {err.omitted} more (`paraminit validate` lists every one)")
            violations = [
                _violation_json(plan_file, line, v.field, v.message, v.index, v.name, v.is_limit)
                for v, line in zip(err.violations, at, strict=True)
            ]
            code = EXIT_INVALID
        else:
            message, lines, code = _rpc_line(err, getattr(args, "target", None)), [], EXIT_ERROR
    except (ValueError, RuntimeError) as err:
        message, lines, code = str(err), [], EXIT_ERROR
    except KeyboardInterrupt:  # Ctrl-C where main() does not own the handlers (another thread, a caller's handler)
        return _interrupted_exit(int(signal.SIGINT), output)
    print(f"paraminit: {message}", file=sys.stderr)
    for line in lines:
        print(line, file=sys.stderr)
    if getattr(args, "json", False):
        _print_json(code, valid=False if code == EXIT_INVALID else None, error=message.splitlines()[0].rstrip(":"), violations=violations)
    return code


if __name__ == "__main__":
    sys.exit(main())
