"""paraminit client: plans in, parameter tensors out.

The names below load with the module that defines them, on first use (PEP 562): importing the package (or
`paraminit --version`) costs no grpc, numpy or protobuf until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paraminit_client.client import Client, ValidationReport
    from paraminit_client.errors import (
        CheckpointFormatError,
        ClientClosed,
        FileAccessError,
        InvalidArgument,
        ParaminitError,
        Violation,
    )
    from paraminit_client.plans import (
        PlanFileError,
        load_plan,
        param,
        plan_from_dict,
        plan_from_safetensors,
        plan_of,
        plan_to_json,
        zip_plan,
    )

    __version__: str

# name -> the module that defines it
_HOMES = {
    **dict.fromkeys(("Client", "ValidationReport"), "client"),
    **dict.fromkeys(
        ("CheckpointFormatError", "ClientClosed", "FileAccessError", "InvalidArgument", "ParaminitError", "Violation"), "errors"
    ),
    **dict.fromkeys(
        ("PlanFileError", "load_plan", "param", "plan_from_dict", "plan_from_safetensors", "plan_of", "plan_to_json", "zip_plan"),
        "plans",
    ),
}

__all__ = [
    "CheckpointFormatError",
    "Client",
    "ClientClosed",
    "FileAccessError",
    "InvalidArgument",
    "ParaminitError",
    "PlanFileError",
    "ValidationReport",
    "Violation",
    "__version__",
    "load_plan",
    "param",
    "plan_from_dict",
    "plan_from_safetensors",
    "plan_of",
    "plan_to_json",
    "zip_plan",
]


def __getattr__(name: str) -> Any:
    """A public name, from its module on first use; `__version__` from the installed package's metadata."""
    if name == "__version__":
        from importlib import metadata

        try:
            value: Any = metadata.version("paraminit")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            value = "0+unknown"
    elif name in _HOMES:
        value = getattr(importlib.import_module(f"paraminit_client.{_HOMES[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
