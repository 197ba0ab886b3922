"""One plan violation and its text, the same on the server, in status details and in the client."""

from __future__ import annotations

import re
from dataclasses import dataclass

INVALID = "invalid"
LIMIT = "limit"


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


def camel_path(path: str) -> str:
    """A field path with each segment in its JSON (lowerCamelCase) name, as plan files spell it:
    `init.kaiming_uniform_for_shape` -> `init.kaimingUniformForShape`; indices are kept."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), path)
