"""`paraminit leases`: this identity's shared-memory and CUDA IPC leases on a server, listed, released or renewed."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from paraminit import sizes
from paraminit_client.cli.common import EXIT_OK, Subcommands, UsageError, add_command, client_for, plural, print_json, with_target


def add_parser(sub: Subcommands) -> None:
    """Add `leases` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    ls = add_command(
        sub,
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
    ls.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    """List, release or renew this identity's leases on a server.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.

    Raises:
        UsageError: no --target, or release and renew without a lease id.
    """
    if args.target is None:
        raise UsageError("leases live on a server: give --target HOST:PORT (an in-process client's leases end with its process)")
    action = args.action
    if action != "list" and not args.lease_ids:
        raise UsageError(f"leases {action} needs at least one LEASE_ID (see `paraminit leases`)")
    with client_for(args) as c:
        if action == "list":
            rows = _lease_rows(c.leases(), time.time())
            if args.json:
                print_json(EXIT_OK, leases=rows)
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
                print(f"{plural(len(rows), 'lease')}, {sizes.format_size(total)}, owner {rows[0]['owner']}")
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
        return print_json(EXIT_OK, leases=done) if args.json else EXIT_OK
