"""`paraminit info`: a server's version, backend, device and limits."""

from __future__ import annotations

import argparse

from paraminit import sizes
from paraminit_client.cli.common import EXIT_OK, Subcommands, add_command, client_for, dtype_name, print_json, with_target


def add_parser(sub: Subcommands) -> None:
    """Add `info` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    i = add_command(
        sub,
        "info",
        "server version, backend, device and limits",
        "Ask a server (or, without --target, the in-process data plane) for its version, backend, device, memory and limits.",
    )
    i.add_argument("--json", action="store_true", help="print the answer as JSON on stdout")
    with_target(i, local="this process's own data plane answers")
    i.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """A server's (or this process's data plane's) version, backend, device, memory and limits.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.
    """
    with client_for(args) as c:
        info = c.info()
    if args.json:
        from paraminit.v1 import init_service_pb2 as pb

        d, lim = info.device, info.limits
        return print_json(
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
            dtypes=[dtype_name(e) for e in info.dtypes],
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
