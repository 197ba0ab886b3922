"""paraminit client: plans in, parameter tensors out."""

from importlib import metadata as _metadata

try:
    __version__: str = _metadata.version("paraminit")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

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
