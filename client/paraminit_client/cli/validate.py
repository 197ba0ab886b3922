"""`paraminit validate`: a plan checked without materializing it, every violation at its file:line."""

from __future__ import annotations

import argparse
import sys

from paraminit import sizes
from paraminit_client.cli.common import (
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_OK,
    Subcommands,
    add_command,
    client_for,
    dtype_name,
    located,
    plural,
    print_json,
    violation_json,
    with_target,
)
from paraminit_client.plans import field_lines, load_plan


def add_parser(sub: Subcommands) -> None:
    """Add `validate` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    v = add_command(
        sub,
        "validate",
        "check a plan: every violation, or a summary by dtype",
        "Check a plan without materializing it: every violation (parameter, field, message) on stderr, or parameters and bytes by dtype.",
    )
    v.add_argument("plan", help="plan file: JSON or YAML form of paraminit.v1.Plan")
    v.add_argument(
        "--json", action="store_true", help="print the report as JSON on stdout (valid, violations, bytes per parameter, digest)"
    )
    with_target(v)
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check a plan: every violation on stderr (or in --json), else its parameters and bytes by dtype.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.
    """
    plan = load_plan(args.plan)
    with client_for(args) as c:
        report = c.validate(plan)
    code = EXIT_OK if not report.violations else EXIT_INVALID if not report.valid else EXIT_ERROR
    where = "the server's limits" if getattr(args, "target", None) else "the limits of this process (PARAMINIT_* variables raise them)"
    kind = "invalid plan" if not report.valid else f"plan over {where}"
    at = field_lines(args.plan, [v.field for v in report.violations]) if report.violations else []
    if args.json:
        return print_json(
            code,
            valid=report.valid,
            fits_limits=report.fits_limits,
            plan_digest=report.plan_digest,
            total_bytes=report.total_bytes,
            params=[
                {"name": p.name, "dtype": dtype_name(p.dtype), "shape": list(p.shape), "bytes": n}
                for p, n in zip(plan.params, report.param_bytes, strict=False)
            ],
            violations=[
                violation_json(args.plan, line, v.field, v.message, v.index, v.name, v.is_limit)
                for v, line in zip(report.violations, at, strict=True)
            ],
            omitted_violations=report.omitted,
            **({"error": f"{kind}: {plural(len(report.violations) + report.omitted, 'violation')}"} if code else {}),
        )
    if report.violations:
        print(f"paraminit: {kind}: {plural(len(report.violations) + report.omitted, 'violation')}", file=sys.stderr)
        for line in located(args.plan, report.violations, at):
            print(line, file=sys.stderr)
        if report.omitted:
            print(f"  ... and {report.omitted} more (an answer lists the first {len(report.violations)})", file=sys.stderr)
        return code
    by_dtype: dict[str, list[int]] = {}
    for p, nbytes in zip(plan.params, report.param_bytes, strict=True):
        entry = by_dtype.setdefault(dtype_name(p.dtype), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    print(f"valid plan {report.plan_digest[:16]}: {plural(len(plan.params), 'parameter')}, {sizes.format_size(report.total_bytes)}")
    print(f"  {'dtype':<10} {'params':>7} {'bytes':>12}")
    for name, (count, nbytes) in sorted(by_dtype.items()):
        print(f"  {name:<10} {count:>7} {sizes.format_size(nbytes):>12}")
    return EXIT_OK
