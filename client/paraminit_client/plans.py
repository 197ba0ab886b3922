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

import yaml
from google.protobuf import json_format

from paraminit import dtypes
from paraminit.v1 import plan_pb2


def load_plan(path: str | os.PathLike[str]) -> plan_pb2.Plan:
    """Read a JSON or YAML plan file into a Plan; unknown fields are errors, not silently dropped."""
    p = Path(path)
    text = p.read_text()
    try:
        data = yaml.safe_load(text) if p.suffix.lower() in (".yaml", ".yml") else json.loads(text)
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
    if isinstance(params, list):  # accept "bfloat16", "bf16", ... as well as the enum name "DTYPE_BFLOAT16"
        data = {**data, "params": [_short_dtype(p) for p in params]}
    plan = plan_pb2.Plan()
    json_format.ParseDict(dict(data), plan)
    return plan


def _short_dtype(p: Any) -> Any:
    if isinstance(p, dict) and isinstance(p.get("dtype"), str):
        return {**p, "dtype": plan_pb2.DType.Name(dtypes.by_name(p["dtype"]).enum)}  # type: ignore[arg-type]
    return p


def plan_to_json(plan: plan_pb2.Plan) -> str:
    return json_format.MessageToJson(plan, indent=1)


def param(name: str, shape: Sequence[int], init: plan_pb2.Init | Mapping[str, Any], dtype: str = "float32",
          region: Sequence[tuple[int, int]] | None = None) -> plan_pb2.Param:
    """Build one Param; `init` may be an Init message or its JSON form, e.g. {"normal": {"std": 0.02, "seed": 1}}."""
    p = plan_pb2.Param(name=name, shape=list(shape), dtype=dtypes.by_name(dtype).enum)  # type: ignore[arg-type]
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


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def plan_from_safetensors(path: str | os.PathLike[str], fallback_plan: plan_pb2.Plan) -> plan_pb2.Plan:
    """The fine-tuning plan: every parameter the checkpoint holds comes from it, the rest from the fallback.

    Checkpoint tensors are named by path (the server must be able to read it, under its
    --safetensors-dirs). A tensor whose shape or dtype differs from the fallback's parameter is an error.
    """
    header = safetensors_header(path)
    out = plan_pb2.Plan()
    problems = []
    for p in fallback_plan.params:
        q = out.params.add()
        q.CopyFrom(p)
        entry = header.get(p.name)
        if entry is None:
            continue
        dtype = dtypes.by_safetensors(entry["dtype"])
        want = dtypes.by_enum(p.dtype)
        if list(entry["shape"]) != list(p.shape):
            problems.append(f"{p.name}: checkpoint shape {entry['shape']} != plan shape {list(p.shape)}")
        if dtype is None or want is None or dtype.enum != want.enum:
            problems.append(f"{p.name}: checkpoint dtype {entry['dtype']} != plan dtype {want.name if want else p.dtype}")
        q.init.Clear()
        q.init.safetensors.path = str(Path(path).resolve())
        q.init.safetensors.tensor = p.name
        q.init.safetensors.dtype = dtype.enum if dtype else plan_pb2.DTYPE_UNSPECIFIED  # type: ignore[assignment]
    if problems:
        raise ValueError("checkpoint does not fit the plan: " + "; ".join(problems))
    return out
