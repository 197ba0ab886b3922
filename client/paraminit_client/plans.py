"""Plan files and plan builders.

A plan file is the proto3 JSON form of paraminit.v1.Plan (YAML with the same
structure works too); parsing goes through protobuf's json_format only.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import descriptor, json_format

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
        raise PlanFileError(f"{p}: not a valid plan: {_clean(str(exc))}") from None
    except Exception as exc:  # yaml.YAMLError and friends: still a bad file, not a crash
        raise PlanFileError(f"{p}: not a valid plan: {exc}") from None


class PlanFileError(ValueError):
    """A plan file that does not parse as paraminit.v1.Plan."""


def plan_from_dict(data: Mapping[str, Any]) -> plan_pb2.Plan:
    """A Plan from its JSON form. Dtypes may be written "bfloat16", "bf16", ... as well as "DTYPE_BFLOAT16"; an
    unknown field, initializer or dtype is a ValueError that names its path, the nearest valid name and all of them."""
    if not isinstance(data, Mapping):
        raise ValueError("the top level must be an object with a 'params' list")
    plan = plan_pb2.Plan()
    json_format.ParseDict(_checked(data, plan_pb2.Plan.DESCRIPTOR, ""), plan)
    return plan


def dtype_of(name: str, where: str = "dtype") -> dtypes.DTypeInfo:
    """The dtype for a name or alias; the error names the nearest valid name and every valid one."""
    try:
        return dtypes.by_name(name)
    except ValueError:
        pass
    choices = [*dtypes.NAMES, *(a for d in dtypes.SUPPORTED for a in d.aliases)]
    raise ValueError(f"{where}: unknown dtype {name!r}{_nearest(name.lower().removeprefix('dtype_'), choices)}; "
                     f"valid: {', '.join(dtypes.NAMES)} (aliases: {', '.join(choices[len(dtypes.NAMES):])}, "
                     f"or DTYPE_FLOAT32 ...)")


def _nearest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    if not close:  # case and separators: "KaimingUniform", "kaiming_uniform_for_shape"
        folded = {c.replace("_", "").lower(): c for c in choices}
        close = difflib.get_close_matches(word.replace("_", "").lower(), list(folded), n=1, cutoff=0.5)
        close = [folded[c] for c in close]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _checked(data: Mapping[str, Any], desc: descriptor.Descriptor, path: str) -> dict[str, Any]:
    """`data` with dtype names as enum names, after checking every key against the message (recursively), so
    mistakes read as "params[0].init: unknown initializer 'normall'; did you mean 'normal'?" rather than as
    protobuf's parser text."""
    by_key = {k: f for f in desc.fields for k in (f.json_name, f.name)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = by_key.get(key) if isinstance(key, str) else None
        where = f"{path}.{key}" if path else str(key)
        if field is None:
            names = [f.json_name for f in desc.fields]
            what = "initializer" if desc is plan_pb2.Init.DESCRIPTOR else "field"
            at = path or "the plan"
            raise ValueError(f"{at}: unknown {what} {key!r}{_nearest(str(key), names)}; valid: {', '.join(names)}")
        out[key] = _checked_value(value, field, where)
    return out


def _checked_value(value: Any, field: descriptor.FieldDescriptor, where: str) -> Any:
    if field.is_repeated and isinstance(value, list):
        return [_checked_one(v, field, f"{where}[{i}]") for i, v in enumerate(value)]
    return _checked_one(value, field, where)


_UNSIGNED = (descriptor.FieldDescriptor.TYPE_UINT64, descriptor.FieldDescriptor.TYPE_UINT32,
             descriptor.FieldDescriptor.TYPE_FIXED64, descriptor.FieldDescriptor.TYPE_FIXED32)


def _checked_one(value: Any, field: descriptor.FieldDescriptor, where: str) -> Any:
    if field.message_type is not None and isinstance(value, Mapping):
        return _checked(value, field.message_type, where)
    if field.enum_type is plan_pb2.DType.DESCRIPTOR and isinstance(value, str):
        return plan_pb2.DType.Name(dtype_of(value, where).enum)  # type: ignore[arg-type]
    if field.type in _UNSIGNED and isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"{where}: must not be negative, got {value}")
    return value


def _clean(message: str) -> str:
    """protobuf's parser text without its nesting chatter ("Failed to parse params field: ...")."""
    return re.sub(r"(Failed to parse \w+ field: )+", "", message).strip().rstrip(".") or message


def plan_to_json(plan: plan_pb2.Plan) -> str:
    return json_format.MessageToJson(plan, indent=1)


def param(name: str, shape: Sequence[int], init: plan_pb2.Init | Mapping[str, Any], dtype: str = "float32",
          region: Sequence[tuple[int, int]] | None = None) -> plan_pb2.Param:
    """Build one Param; `init` may be an Init message or its JSON form, e.g. {"normal": {"std": 0.02, "seed": 1}}."""
    p = plan_pb2.Param(name=name, shape=list(shape), dtype=dtype_of(dtype).enum)  # type: ignore[arg-type]
    if isinstance(init, plan_pb2.Init):
        p.init.CopyFrom(init)
    else:
        json_format.ParseDict(_checked(init, plan_pb2.Init.DESCRIPTOR, "init"), p.init)
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


def plan_from_safetensors(path: str | os.PathLike[str], fallback_plan: plan_pb2.Plan | None = None) -> plan_pb2.Plan:
    """The fine-tuning plan: every tensor the checkpoint holds comes from it, the rest of the fallback plan is
    initialized as that plan says.

    The fallback's parameters come first, in its order (those the checkpoint holds become
    `{"safetensors": ...}` references); then every checkpoint tensor the fallback does not name, in file order,
    with the checkpoint's shape and dtype. Without a fallback the plan is the whole checkpoint. Tensors are named
    by the file's absolute path (the server must be able to read it, under its --safetensors-dirs). A tensor whose
    shape or dtype differs from the fallback's parameter, or whose dtype no plan can hold (integers, booleans), is
    an error.
    """
    header = safetensors_header(path)
    source = str(Path(path).resolve())
    out = plan_pb2.Plan()
    problems = []
    named = set()

    def reference(q: plan_pb2.Param, tensor: str, dtype: dtypes.DTypeInfo) -> None:
        q.init.Clear()
        q.init.safetensors.path = source
        q.init.safetensors.tensor = tensor
        q.init.safetensors.dtype = dtype.enum  # type: ignore[assignment]

    for p in (fallback_plan.params if fallback_plan is not None else ()):
        named.add(p.name)
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
        else:
            reference(q, p.name, dtype)
    rest = sorted((k for k in header if k not in named), key=lambda k: tuple(header[k].get("data_offsets", (0, 0))))
    for name in rest:
        entry = header[name]
        dtype = dtypes.by_safetensors(entry.get("dtype"))
        if dtype is None:
            problems.append(f"{name}: checkpoint dtype {entry.get('dtype')} is not one a plan can hold "
                            f"({', '.join(d.safetensors for d in dtypes.SUPPORTED)})")
            continue
        q = out.params.add(name=name, shape=list(entry["shape"]), dtype=dtype.enum)
        reference(q, name, dtype)
    if problems:
        raise ValueError("checkpoint does not fit the plan: " + "; ".join(problems))
    return out
