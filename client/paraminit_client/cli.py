"""The `paraminit` command: serve, materialize, validate, info, health.

Exit codes: 0 success, 2 invalid plan (every violation on stderr, no output
file), 1 any other error (one clear line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import grpc

from paraminit import dtypes
from paraminit_client.client import Client
from paraminit_client.errors import ParaminitError
from paraminit_client.plans import PlanFileError, load_plan

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _client(args: argparse.Namespace, default_target: str | None = None) -> Client:
    return Client(args.target or default_target, timeout=getattr(args, "timeout", None), token=args.token or None,
                  tls_ca=args.tls_ca or None, tls_cert=args.tls_cert or None, tls_key=args.tls_key or None)


def cmd_serve(args: argparse.Namespace) -> int:
    """`paraminit serve ...` is `paraminit-server ...`."""
    try:
        from paraminit_server import embedded  # optional: the client can be installed alone
    except ImportError as exc:
        print(f"paraminit: the server is not installed ({exc})", file=sys.stderr)
        return EXIT_ERROR
    return embedded.serve_main(args.server_args)


def cmd_materialize(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    started = time.perf_counter()
    with _client(args) as c:
        header = c.materialize_to_file(plan, args.output, progress=args.progress and sys.stderr.isatty(),
                                       chunk_bytes=args.chunk_bytes)
    seconds = time.perf_counter() - started
    total = header.data_bytes
    if args.summary:
        print(f"wrote {args.output}: {len(header.tensors)} parameters, {_human(total)} in {seconds:.2f} s "
              f"({_human(total / max(seconds, 1e-9))}/s), plan {header.plan_digest[:16]}")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    with _client(args) as c:
        report = c.validate(plan)
    if report.violations:
        for line in report.lines():
            print(line, file=sys.stderr)
        return EXIT_INVALID if not report.valid else EXIT_ERROR
    by_dtype: dict[str, int] = {}
    for p, nbytes in zip(plan.params, report.param_bytes, strict=True):
        dt = dtypes.by_enum(p.dtype)
        name = dt.name if dt else str(p.dtype)
        by_dtype[name] = by_dtype.get(name, 0) + nbytes
    print(f"valid plan {report.plan_digest[:16]}: {len(plan.params)} parameters, {_human(report.total_bytes)}")
    print(f"  {'dtype':<10} {'params':>7} {'bytes':>12}")
    for name, nbytes in sorted(by_dtype.items()):
        count = sum(1 for p in plan.params if (d := dtypes.by_enum(p.dtype)) is not None and d.name == name)
        print(f"  {name:<10} {count:>7} {_human(nbytes):>12}")
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.info()
    print(f"paraminit {info.version} backend={info.backend} device={info.device.kind}:{info.device.name}"
          f"{' ' + info.device.uuid if info.device.uuid else ''}")
    print(f"  memory free/total: {_human(info.device.memory_free)} / {_human(info.device.memory_total)}")
    print(f"  max plan bytes: {_human(info.limits.max_plan_bytes)}, concurrent: {info.limits.max_concurrent_requests}")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    if args.timeout is None:
        args.timeout = 5.0
    with _client(args, "127.0.0.1:50051") as c:
        status = c.health()
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paraminit", description="Materialize parameter tensors from a plan.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC server (the same as paraminit-server; --help lists its flags)",
                           add_help=False)
    serve.add_argument("server_args", nargs=argparse.REMAINDER)
    serve.set_defaults(func=cmd_serve)

    def with_target(p: argparse.ArgumentParser, embedded: bool = True) -> None:
        p.add_argument("--target", default=None,
                       help="HOST:PORT of a server" + (" (default: embedded CPU server)" if embedded else ""))
        p.add_argument("--timeout", type=float, default=None, help="per-call deadline in seconds")
        p.add_argument("--token", default="", help="bearer token (default: $PARAMINIT_TOKEN)")
        p.add_argument("--tls-ca", default="", help="CA that signed the server's certificate (enables TLS)")
        p.add_argument("--tls-cert", default="", help="client certificate for mutual TLS")
        p.add_argument("--tls-key", default="", help="client key for mutual TLS")

    m = sub.add_parser("materialize", help="materialize a plan into a safetensors file")
    m.add_argument("plan")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--chunk-bytes", type=int, default=0)
    m.add_argument("--no-progress", dest="progress", action="store_false")
    m.add_argument("--summary", action="store_true", help="print parameters, bytes, time and throughput")
    with_target(m)
    m.set_defaults(func=cmd_materialize)

    v = sub.add_parser("validate", help="check a plan and print its violations or a summary")
    v.add_argument("plan")
    with_target(v)
    v.set_defaults(func=cmd_validate)

    i = sub.add_parser("info", help="server version, backend, device and limits")
    with_target(i)
    i.set_defaults(func=cmd_info)

    h = sub.add_parser("health", help="exit 0 when the server reports SERVING")
    with_target(h, embedded=False)
    h.set_defaults(func=cmd_health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ParaminitError as err:
        if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.violations:
            print(f"paraminit: invalid plan: {len(err.violations)} violation(s)", file=sys.stderr)
            for v in err.violations:
                print(v.description, file=sys.stderr)
            return EXIT_INVALID
        print(f"paraminit: {err.code.name}: {err.message.splitlines()[0]}", file=sys.stderr)
        return EXIT_ERROR
    except PlanFileError as err:
        print(f"paraminit: {err}", file=sys.stderr)
        return EXIT_INVALID
    except (OSError, ValueError) as err:
        print(f"paraminit: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
