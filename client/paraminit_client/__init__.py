"""paraminit client: plans in, parameter tensors out."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    __version__: str

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


def __getattr__(name: str) -> str:
    """`__version__`, read from the installed package's metadata when first asked: importlib.metadata costs every
    CLI start about 50 ms, and only `--version` needs it."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import metadata

    try:
        version = metadata.version("paraminit")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version
