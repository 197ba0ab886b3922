"""Plan files and plan builders.

A plan file is the proto3 JSON form of paraminit.v1.Plan (YAML with the same
structure works too); parsing goes through protobuf's json_format only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from paraminit.v1 import plan_pb2

DTYPES = {"float32": plan_pb2.DTYPE_FLOAT32, "float64": plan_pb2.DTYPE_FLOAT64,
          "float16": plan_pb2.DTYPE_FLOAT16, "bfloat16": plan_pb2.DTYPE_BFLOAT16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()} | {plan_pb2.DTYPE_UNSPECIFIED: "float32"}


def load_plan(path: str | os.PathLike[str]) -> plan_pb2.Plan:
    """Read a JSON or YAML plan file into a Plan; unknown fields are errors, not silently dropped."""
    p = Path(path)
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return plan_from_dict(data)
    except (ValueError, json_format.ParseError) as exc:
        raise PlanFileError(f"{p}: not a valid plan: {exc}") from None
    except Exception as exc:  # yaml.YAMLError and friends: still a bad file, not a crash
        raise PlanFileError(f"{p}: not a valid plan: {exc}") from None


class PlanFileError(ValueError):
    """A plan file that does not parse as paraminit.v1.Plan."""


def plan_from_dict(data: Mapping[str, Any]) -> plan_pb2.Plan:
    if not isinstance(data, Mapping):
        raise ValueError("the top level must be an object with a 'params' list")
    params = data.get("params", [])
    if isinstance(params, list):  # accept "bfloat16" as well as the enum name "DTYPE_BFLOAT16"
        data = {**data, "params": [_short_dtype(p) for p in params]}
    plan = plan_pb2.Plan()
    json_format.ParseDict(dict(data), plan)
    return plan


def _short_dtype(p: Any) -> Any:
    if isinstance(p, dict) and isinstance(p.get("dtype"), str) and p["dtype"].lower() in DTYPES:
        return {**p, "dtype": plan_pb2.DType.Name(DTYPES[p["dtype"].lower()])}
    return p


def plan_to_json(plan: plan_pb2.Plan) -> str:
    return json_format.MessageToJson(plan, indent=1)


def param(name: str, shape: Sequence[int], init: plan_pb2.Init | Mapping[str, Any], dtype: str = "float32",
          region: Sequence[tuple[int, int]] | None = None) -> plan_pb2.Param:
    """Build one Param; `init` may be an Init message or its JSON form, e.g. {"normal": {"std": 0.02, "seed": 1}}."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    p = plan_pb2.Param(name=name, shape=list(shape), dtype=DTYPES[dtype])
    if isinstance(init, plan_pb2.Init):
        p.init.CopyFrom(init)
    else:
        json_format.ParseDict(dict(init), p.init)
    for start, stop in region or ():
        p.region.add(start=start, stop=stop)
    return p


def plan_of(params: Iterable[plan_pb2.Param]) -> plan_pb2.Plan:
    return plan_pb2.Plan(params=list(params))


def zip_plan(specs: Sequence[tuple[str, Sequence[int]]], inits: Sequence[plan_pb2.Init], dtype: str = "float32") -> plan_pb2.Plan:
    """Pair a parameter list with an initializer list, as TorchLean's plan recovery does."""
    if len(inits) < len(specs):
        raise ValueError("torch.runtimeInit: initializer array shorter than parameter list")
    if len(inits) > len(specs):
        raise ValueError("torch.runtimeInit: initializer array longer than parameter list")
    return plan_of(param(name, shape, init, dtype) for (name, shape), init in zip(specs, inits, strict=True))
