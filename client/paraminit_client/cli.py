"""The `paraminit` command: materialize, validate, inspect, plan, info, health, serve.

Exit codes (also in every --help and the README): see EXIT_CODES_HELP.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc

from paraminit import dtypes, sizes
from paraminit_client import __version__, inspect
from paraminit_client.client import Client
from paraminit_client.errors import ParaminitError
from paraminit_client.plans import PlanFileError, load_plan, plan_from_safetensors, plan_to_json

EXIT_OK, EXIT_ERROR, EXIT_INVALID, EXIT_FLAGGED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 3, 64, 130
DEFAULT_HEALTH_TARGET = "127.0.0.1:50051"
EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK:<4} success
  {EXIT_ERROR:<4} error: server unreachable or failing, a file that cannot be read or written
  {EXIT_INVALID:<4} invalid plan: every violation is on stderr and no output file is written
  {EXIT_FLAGGED:<4} inspect --plan: a tensor does not match the plan (FLAG lines say why)
  {EXIT_USAGE:<4} usage error: unknown command or flag, a missing or malformed argument
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C)
{sizes.UNITS_HELP}."""

# gRPC status codes in words, for one clear line on stderr.
_CODE_WORDS = {
    "UNAVAILABLE": "server unavailable", "DEADLINE_EXCEEDED": "timed out", "RESOURCE_EXHAUSTED": "over a server limit",
    "NOT_FOUND": "not found", "FAILED_PRECONDITION": "not possible here", "UNAUTHENTICATED": "not authenticated",
    "PERMISSION_DENIED": "permission denied", "INVALID_ARGUMENT": "invalid request", "INTERNAL": "server error",
    "CANCELLED": "cancelled", "DATA_LOSS": "data corrupted in transit", "UNIMPLEMENTED": "not supported by the server",
    "UNKNOWN": "error",
}


class UsageError(Exception):
    """An argument argparse accepted but the command cannot use (exit code EXIT_USAGE)."""


class Parser(argparse.ArgumentParser):
    """argparse with the exit-code table in every help and EXIT_USAGE (not 2, an invalid plan) for usage errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"paraminit {__version__}")

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")




def _client(args: argparse.Namespace, default_target: str | None = None) -> Client:
    return Client(args.target or default_target, timeout=getattr(args, "timeout", None), token=args.token or None,
                  tls_ca=args.tls_ca or None, tls_cert=args.tls_cert or None, tls_key=args.tls_key or None)


def _write(text: str, output: str | None) -> None:
    """`text` to the file `output`, or to stdout when there is none (or it is '-')."""
    if output and output != "-":
        Path(output).write_text(text + "\n")
    else:
        print(text)


# -- commands -------------------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """`paraminit serve ...` is `paraminit-server ...`."""
    try:
        from paraminit_server import embedded  # optional: the client can be installed alone
    except ImportError as exc:
        print(f"paraminit: the server is not installed ({exc})", file=sys.stderr)
        return EXIT_ERROR
    try:
        return embedded.serve_main(args.server_args)
    except SystemExit as done:  # argparse: --help/--version (0) or a usage error (2)
        code = done.code if isinstance(done.code, int) else EXIT_ERROR
        return EXIT_USAGE if code == 2 else code


def cmd_materialize(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    compiled = _compile_seconds()
    started = time.perf_counter()
    with _client(args) as c:
        header = c.materialize_to_file(plan, args.output, progress=args.progress and sys.stderr.isatty(),
                                       chunk_bytes=args.chunk_bytes)
    compiled = _compile_seconds() - compiled
    seconds = max(time.perf_counter() - started - compiled, 0.0)  # throughput leaves one-time compiling out
    total = header.data_bytes
    if not args.quiet:
        extra = f" plus {compiled:.1f} s compiling CPU kernels" if compiled > 0 else ""
        print(f"wrote {args.output}: {len(header.tensors)} parameters, {sizes.format_size(total)} in {seconds:.2f} s"
              f"{extra} ({total / max(seconds, 1e-9) / 1e9:.2f} GB/s), plan digest {header.plan_digest}", flush=True)
    return EXIT_OK


def _compile_seconds() -> float:
    """Seconds this process has spent compiling CPU kernels (an in-process server's; 0 when none runs here)."""
    cpu = sys.modules.get("paraminit_server.backends.cpu")
    return float(cpu.compile_seconds()) if cpu is not None else 0.0


def cmd_validate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    with _client(args) as c:
        report = c.validate(plan)
    code = EXIT_OK if not report.violations else EXIT_INVALID if not report.valid else EXIT_ERROR
    if args.json:
        out = {"valid": report.valid, "fits_limits": report.fits_limits, "plan_digest": report.plan_digest,
               "total_bytes": report.total_bytes,
               "params": [{"name": p.name, "dtype": _dtype_name(p.dtype), "shape": list(p.shape), "bytes": n}
                          for p, n in zip(plan.params, report.param_bytes, strict=False)],
               "violations": [{"index": v.index, "name": v.name, "field": v.field, "message": v.message,
                               "limit": v.limit} for v in report.violations]}
        print(json.dumps(out, indent=1))
        return code
    if report.violations:
        kind = "invalid plan" if not report.valid else "plan over the server's limits"
        print(f"paraminit: {kind}: {len(report.violations)} violation(s)", file=sys.stderr)
        for line in report.lines():
            print(line, file=sys.stderr)
        return code
    by_dtype: dict[str, list[int]] = {}
    for p, nbytes in zip(plan.params, report.param_bytes, strict=True):
        entry = by_dtype.setdefault(_dtype_name(p.dtype), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    print(f"valid plan {report.plan_digest[:16]}: {len(plan.params)} parameters, {sizes.format_size(report.total_bytes)}")
    print(f"  {'dtype':<10} {'params':>7} {'bytes':>12}")
    for name, (count, nbytes) in sorted(by_dtype.items()):
        print(f"  {name:<10} {count:>7} {sizes.format_size(nbytes):>12}")
    return EXIT_OK


def _dtype_name(value: int) -> str:
    dt = dtypes.by_enum(value)
    return dt.name if dt else str(value)


def cmd_inspect(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan) if args.plan else None
    report = inspect.inspect_file(args.file, plan)
    if args.json:
        print(json.dumps(inspect.to_json(report), indent=1))
    else:
        print(inspect.format_table(report))
    if args.plot:
        written = inspect.plot(report, args.plot)
        print(f"wrote {len(written)} histograms to {args.plot}", file=sys.stderr)
    return EXIT_FLAGGED if plan is not None and not report.ok else EXIT_OK


def cmd_plan_from_safetensors(args: argparse.Namespace) -> int:
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


def cmd_plan_from_module(args: argparse.Namespace) -> int:
    factory = _factory(args.factory)
    try:
        import torch

        from paraminit_client.torch import plan_from_module
    except ImportError:
        raise ValueError("plan from-module needs PyTorch: pip install 'paraminit[torch]'") from None
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{args.factory} returned {type(module).__name__}, not a torch.nn.Module")
    _write(plan_to_json(plan_from_module(module, seed=args.seed, policy=args.policy)), args.output)
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.info()
    fmt = sizes.format_size
    print(f"paraminit {info.version} backend={info.backend} device={info.device.kind}:{info.device.name}"
          f"{' ' + info.device.uuid if info.device.uuid else ''}")
    print(f"  memory free/total: {fmt(info.device.memory_free)} / {fmt(info.device.memory_total)}")
    print(f"  max plan bytes: {fmt(info.limits.max_plan_bytes)}, concurrent: {info.limits.max_concurrent_requests}")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    if args.timeout is None:
        args.timeout = 5.0
    with _client(args, DEFAULT_HEALTH_TARGET) as c:
        status = c.health()
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_ERROR


# -- parser ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="paraminit", description="Materialize parameter tensors from a declarative init plan, "
                    "check plans, and look at the result.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `paraminit COMMAND --help` says more")

    def add(name: str, help: str, description: str = "", **kwargs: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description or help, **kwargs)
        return p

    serve = add("serve", "run the gRPC server (the same as paraminit-server; `paraminit serve --help` lists its "
                "flags, each with its PARAMINIT_* variable and default)", add_help=False)
    serve.add_argument("server_args", nargs=argparse.REMAINDER, help="paraminit-server flags")
    serve.set_defaults(func=cmd_serve)

    def with_target(p: argparse.ArgumentParser, default: str | None = None) -> None:
        where = f"default: {default}" if default else "default: none, the plan runs in this process on the CPU"
        p.add_argument("--target", default=None, metavar="HOST:PORT", help=f"server to use ({where})")
        p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                       help="deadline of each call (default: none" + (", 5 for health)" if default else ")"))
        p.add_argument("--token", default="", help="bearer token (default: $PARAMINIT_TOKEN)")
        p.add_argument("--tls-ca", default="", metavar="PEM", help="CA that signed the server's certificate "
                       "(enables TLS)")
        p.add_argument("--tls-cert", default="", metavar="PEM", help="client certificate, for mutual TLS")
        p.add_argument("--tls-key", default="", metavar="PEM", help="client private key, for mutual TLS")

    m = add("materialize", "materialize a plan into a safetensors file",
            "Materialize a plan into a safetensors file, written atomically (a temporary file renamed into place "
            "when complete). On a terminal a progress bar shows on stderr; on success one line on stdout says what "
            "was written: parameters, bytes, time, throughput and the plan digest.")
    m.add_argument("plan", help="plan file: JSON or YAML form of paraminit.v1.Plan")
    m.add_argument("-o", "--output", required=True, metavar="FILE", help="safetensors file to write")
    m.add_argument("--chunk-bytes", type=sizes.size_arg, default=0, metavar="SIZE",
                   help="largest stream chunk to ask the server for, e.g. 2MiB (default: 0, the server's choice)")
    m.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar, even on a terminal")
    m.add_argument("-q", "--quiet", action="store_true", help="no summary line on success")
    m.add_argument("--summary", action="store_true", help=argparse.SUPPRESS)  # the summary is always printed now
    with_target(m)
    m.set_defaults(func=cmd_materialize)

    v = add("validate", "check a plan: every violation, or a summary by dtype",
            "Check a plan without materializing it: every violation (parameter, field, message) on stderr, or "
            "parameters and bytes by dtype.")
    v.add_argument("plan", help="plan file: JSON or YAML form of paraminit.v1.Plan")
    v.add_argument("--json", action="store_true",
                   help="print the report as JSON on stdout (valid, violations, bytes per parameter, digest)")
    with_target(v)
    v.set_defaults(func=cmd_validate)

    ins = add("inspect", "list a safetensors file's tensors with their statistics, and check them against a plan",
              "One line per tensor: name, dtype, shape, bytes, mean, std, min, max. With --plan also the mean, "
              "standard deviation and bounds each initializer promises, and a check column: FLAG when the sample "
              "mean or std is more than 5 standard errors (plus the dtype's rounding) from the expected one, or a "
              "value lies outside the bounds; the FLAG lines below the table say why.")
    ins.add_argument("file", help="safetensors file")
    ins.add_argument("--plan", metavar="PLAN", help="plan whose initializers the tensors should follow")
    ins.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ins.add_argument("--plot", metavar="DIR", help="write one PNG histogram per tensor into DIR, the plan's "
                     "expected density drawn over it (needs matplotlib: pip install 'paraminit[plot]')")
    ins.set_defaults(func=cmd_inspect)

    plan = add("plan", "build a plan from a checkpoint or a PyTorch module",
               "Build a plan and print its JSON (or write it with -o).")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True, metavar="SOURCE", help="where the plan comes from")
    fs = plan_sub.add_parser("from-safetensors", help="a plan that loads every tensor of a checkpoint",
                             description="A plan that takes every tensor of the checkpoint (as safetensors "
                             "references, which the server must be allowed to read: --safetensors-dirs) and "
                             "initializes the other parameters of --fallback as that plan says.")
    fs.add_argument("file", help="safetensors checkpoint")
    fs.add_argument("--fallback", metavar="PLAN", help="plan for the parameters the checkpoint lacks; its shapes "
                    "and dtypes must agree with the checkpoint's")
    fs.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fs.set_defaults(func=cmd_plan_from_safetensors)
    fm = plan_sub.add_parser("from-module", help="the plan of a PyTorch module, built on the meta device",
                             description="Import package.module, call factory() under torch.device('meta') (no "
                             "memory is allocated) and print the plan of the module it returns: one parameter per "
                             "distinct floating-point tensor of its state_dict. Needs PyTorch.")
    fm.add_argument("factory", metavar="package.module:factory", help="callable returning a torch.nn.Module; "
                    "the current directory is importable")
    fm.add_argument("--seed", type=int, default=0, help="plan seed; each parameter's seed derives from it and "
                    "the parameter name (default: 0)")
    fm.add_argument("--policy", choices=("torch", "torchlean"), default="torch",
                    help="torch: PyTorch's own default distributions; torchlean: kaiming/xavier uniform "
                    "(default: torch)")
    fm.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fm.set_defaults(func=cmd_plan_from_module)

    i = add("info", "server version, backend, device and limits")
    with_target(i)
    i.set_defaults(func=cmd_info)

    h = add("health", "print the server's health status; exit 0 when it is SERVING",
            f"Ask a server's gRPC health service; exit 0 when it answers SERVING, 1 otherwise (default target "
            f"{DEFAULT_HEALTH_TARGET}).")
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
    return f"{_CODE_WORDS.get(err.code.name, err.code.name.lower())}: {first} (gRPC status {err.code.name})"


def _os_line(err: OSError) -> str:
    if err.strerror and err.filename:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ParaminitError as err:
        if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.violations:
            print(f"paraminit: invalid plan: {len(err.violations)} violation(s)", file=sys.stderr)
            for v in err.violations:
                print(v.description, file=sys.stderr)
            return EXIT_INVALID
        print(f"paraminit: {_rpc_line(err, getattr(args, 'target', None))}", file=sys.stderr)
        return EXIT_ERROR
    except PlanFileError as err:
        print(f"paraminit: {err}", file=sys.stderr)
        return EXIT_INVALID
    except UsageError as err:
        print(f"paraminit: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"paraminit: {_os_line(err)}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, RuntimeError) as err:
        print(f"paraminit: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
