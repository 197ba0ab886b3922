"""Byte sizes as people write them: `2GiB`, `512M`, `1.5G`, `4096` in; `1.5 GiB` out.

Server flags, PARAMINIT_* variables and the CLI share these rules, so a size that
`paraminit info` prints can be pasted back into any flag.

Units follow GNU coreutils: `K`, `M`, `G`, `T` and `KiB`, `MiB`, `GiB`, `TiB` (also `Ki`, `Mi`, ...) are
powers of 1024; `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` or no unit is bytes. Case does not matter.
"""

from __future__ import annotations

import argparse
import re

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)

UNITS_HELP = "sizes take K/M/G/T or KiB/MiB/GiB/TiB (powers of 1024) or KB/MB/GB/TB (powers of 1000)"


def parse_size(text: str | int) -> int:
    """Bytes for `text`; ValueError (naming the accepted forms) for anything else, negative sizes included."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a size; write bytes (4096) or a number with a unit (512M, 2GiB, 1.5GB); {UNITS_HELP}")
    number, prefix, binary, _ = m.groups()
    power = _POWERS[prefix.lower()]
    decimal = bool(prefix) and not binary and m.group(4) != ""  # "MB": 1000**2; "M", "Mi", "MiB": 1024**2
    if binary and not prefix:
        raise ValueError(f"{text!r} is not a size: 'i' needs a unit before it (KiB, MiB, ...)")
    base = 1000 if decimal else 1024
    factor: int = base**power
    value = float(number) * factor
    if value != value or value > 2**63:
        raise ValueError(f"{text!r} is too large")
    return round(value)


def format_size(n: float) -> str:
    """`1.5 GiB`, `512.0 MiB`, `37 B`: powers of 1024, one decimal; the inverse of parse_size up to rounding."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def exact_size(n: int) -> str:
    """`16GiB`, `4032KiB`, `1000`: the largest power-of-1024 unit that divides `n`, so parse_size gives `n` back."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def size_arg(raw: str) -> int:
    """An argparse `type` for size flags: a usage error, not a traceback, for a bad size."""
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


size_arg.__name__ = "size"  # argparse names the type in its error message
