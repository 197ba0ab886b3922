"""One plan violation and its text, the same on the server, in status details and in the client."""

from __future__ import annotations

import re
from dataclasses import dataclass

INVALID = "invalid"
LIMIT = "limit"
NAME_ECHO = 48  # UTF-8 bytes of a parameter name a violation repeats; a longer one is clipped (clip)
MAX_ANSWER_VIOLATIONS = 1000  # violations a Validate answer lists (the rest are counted): about 1.2 MB at most


@dataclass(frozen=True)
class Violation:
    """One problem in a plan. `index` is -1 for plan-wide problems."""

    index: int
    name: str
    field: str
    message: str
    category: str = INVALID

    @property
    def is_limit(self) -> bool:
        return self.category == LIMIT

    @property
    def description(self) -> str:
        """The violation in one line: what a google.rpc.BadRequest FieldViolation carries as its description."""
        return str(self)

    def __str__(self) -> str:
        return describe(self.index, self.name, self.field, self.message)


def describe(index: int, name: str, field: str, message: str) -> str:
    """`params[3].init.normal ('fc.weight'): initialization: ...`; plan-wide problems name no parameter."""
    who = "" if index < 0 else f" ({name!r})"
    return f"{field}{who}: {message}"


def clip(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes of text: whole when it fits, else its longest prefix of whole characters within
    limit - 24 bytes and "... (N bytes)", N its full UTF-8 length (init_service.proto states this rule)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: max(0, limit - 24)].decode("utf-8", "ignore") + f"... ({len(raw)} bytes)"


def camel_path(path: str) -> str:
    """A field path with each segment in its JSON (lowerCamelCase) name, as plan files spell it:
    `init.kaiming_uniform_for_shape` -> `init.kaimingUniformForShape`; indices are kept."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), path)


@dataclass(frozen=True)
class ValidationReport:
    """What Validate found: every violation (limits included), the bytes per parameter and the plan's digest;
    the same value from the data plane in process and from a server's ValidateResponse."""

    valid: bool
    fits_limits: bool
    violations: tuple[Violation, ...]
    param_bytes: tuple[int, ...]
    total_bytes: int
    plan_digest: str
    omitted: int = 0  # violations found beyond those listed (at most MAX_ANSWER_VIOLATIONS are)

    @property
    def ok(self) -> bool:
        """Valid and within the limits: a materialization would be admitted."""
        return self.valid and self.fits_limits

    def lines(self) -> list[str]:
        """One line per violation: `FIELD ('NAME'): MESSAGE`."""
        return [str(v) for v in self.violations]


def listed(violations: tuple[Violation, ...] | list[Violation]) -> tuple[tuple[Violation, ...], int]:
    """The violations an answer lists (the first MAX_ANSWER_VIOLATIONS, in plan order) and how many it omits."""
    return tuple(violations[:MAX_ANSWER_VIOLATIONS]), max(0, len(violations) - MAX_ANSWER_VIOLATIONS)
