"""Plan files and plan builders.

A plan file is the proto3 JSON form of paraminit.v1.Plan (YAML with the same
structure works too); parsing goes through protobuf's json_format only.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import descriptor, json_format

from paraminit import dtypes
from paraminit import safetensors_header as st_header
from paraminit.v1 import plan_pb2
from paraminit.violations import Violation
from paraminit_client.errors import FileAccessError, InvalidArgument, ParaminitError, file_errors


def load_plan(path: str | os.PathLike[str]) -> plan_pb2.Plan:
    """Read a JSON or YAML plan file into a Plan, reporting every mistake in the file at once.

    Args:
        path: a `.json` file (proto3 JSON form of paraminit.v1.Plan) or a `.yaml`/`.yml` file of the same structure;
            `-` (standard input) or any other name is JSON when it opens with `{`, else YAML.

    Returns:
        The plan.

    Raises:
        FileAccessError: (an OSError) the file cannot be read.
        PlanFileError: (a ValueError) a syntax error (with its line and column), or every unknown field, initializer and dtype,
            every value of the wrong type and every duplicate key, each with its camelCase path and line.
    """
    p = Path(path)
    try:
        text = read_input(p).decode()
    except OSError as exc:
        raise FileAccessError(exc) from None
    except UnicodeDecodeError as exc:
        raise PlanFileError(str(p), [PlanProblem((), f"not UTF-8 text ({exc.reason} at byte {exc.start})")]) from None
    # by its name; without a .json/.yaml name (standard input, a pipe) by its first character: JSON opens with {
    suffix = p.suffix.lower()
    is_yaml = suffix in (".yaml", ".yml") or (suffix != ".json" and not text.lstrip().startswith(("{", "[")))
    try:
        data = yaml.load(text, Loader=_NoAliases) if is_yaml else json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise PlanFileError(str(p), [_json_syntax(text, exc)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else None
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        raise PlanFileError(str(p), [PlanProblem((), f"YAML syntax: {what}", line)]) from None
    except yaml.YAMLError as exc:
        raise PlanFileError(str(p), [PlanProblem((), f"YAML: {exc}")]) from None
    except _DuplicateKey as exc:
        raise PlanFileError(str(p), [PlanProblem((), str(exc))]) from None
    try:
        return plan_from_dict(data)
    except PlanFileError as exc:
        lines = _key_lines(text)
        raise PlanFileError(str(p), [q.at_line(lines.get(q.anchor)) for q in exc.problems]) from None


def read_input(path: str | os.PathLike[str]) -> bytes:
    """The bytes of an input file; `-` is standard input. A FIFO or other special file is opened without waiting
    for a writer: with none, it reads as empty instead of hanging (a pipe with a writer, such as a shell's
    process substitution, reads as usual).

    Raises:
        OSError: it cannot be opened or read (IsADirectoryError for a directory).
    """
    if str(path) == "-":
        return sys.stdin.buffer.read()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        os.set_blocking(fd, True)
        parts = []
        while part := os.read(fd, 1 << 20):
            parts.append(part)
        return b"".join(parts)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PlanProblem:
    """One mistake in a plan file: where (path as written, camelCase), what, and the line when the format gives it."""

    path: tuple[str | int, ...]
    message: str
    line: str | None = None  # "LINE" or "LINE:COLUMN"
    anchor: tuple[str | int, ...] = ()  # the node the line is that of

    @property
    def where(self) -> str:
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        return out

    def at_line(self, line: int | None) -> PlanProblem:
        return PlanProblem(self.path, self.message, str(line) if line else self.line, self.anchor)

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.path else self.message


class PlanFileError(ParaminitError, ValueError):
    """A plan (file) that does not parse as paraminit.v1.Plan: every problem found, in file order.

    A ParaminitError (INVALID_ARGUMENT, one Violation per problem, `index` -1) and, as before, a ValueError."""

    def __init__(self, file: str | None, problems: Sequence[PlanProblem]) -> None:
        self.file = file
        self.problems = list(problems)
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, self.text(), tuple(Violation(-1, "", q.where, q.message) for q in self.problems))

    def __str__(self) -> str:
        return self.message

    def text(self) -> str:
        """One line per problem, each led by `FILE:LINE:` (or `FILE:` where the format gives no line)."""
        if self.file is None:
            return "; ".join(str(q) for q in self.problems)
        body = [f"  {self.file}:{q.line}: {q}" if q.line else f"  {self.file}: {q}" for q in self.problems]
        return f"{self.file}: not a valid plan ({_plural(len(self.problems), 'problem')}):\n" + "\n".join(body)

    def to_json(self) -> list[dict[str, Any]]:
        """The problems as JSON objects: field (path), line (or null), message."""
        return [{"field": q.where, "line": int(q.line.split(":")[0]) if q.line else None, "message": q.message} for q in self.problems]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {key!r} in one object (JSON keeps only the last; remove one)")
        out[key] = value
    return out


def _json_syntax(text: str, exc: json.JSONDecodeError) -> PlanProblem:
    """A JSON syntax error at the place to fix: a trailing comma is reported where the comma is, not at the
    next line's closing bracket."""
    before = text[: exc.pos].rstrip()
    if before.endswith(",") and exc.msg.startswith(("Expecting property name", "Expecting value")):
        pos = len(before) - 1
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        return PlanProblem((), "JSON syntax: a trailing comma (JSON allows none after the last item)", f"{line}:{column}")
    return PlanProblem((), f"JSON syntax: {exc.msg}", f"{exc.lineno}:{exc.colno}")


def field_lines(path: str | os.PathLike[str], fields: Sequence[str]) -> list[int | None]:
    """The line of a plan file each violation's field names (`params[3].init.kaimingUniformForShape`), so that a
    plan's violations read as `FILE:LINE:` like the file's own mistakes: the deepest part of the path the file
    writes (keys in either spelling, camelCase or snake_case). None where the file is standard input, cannot be
    read again, or does not write the field (a plan-wide violation gives the line of `params`).

    Args:
        path: the plan file as given.
        fields: each violation's field path.

    Returns:
        One line number (or None) per field.
    """
    if str(path) == "-":
        return [None] * len(fields)
    try:
        lines = _key_lines(read_input(path).decode())
    except (OSError, UnicodeDecodeError):
        return [None] * len(fields)
    folded = {tuple(_fold(k) for k in key): line for key, line in lines.items()}
    out: list[int | None] = []
    for field in fields:
        parts: list[str | int] = []
        for piece in field.split("."):
            name, *indices = piece.replace("]", "").split("[")
            parts.append(_fold(name))
            parts.extend(int(i) for i in indices if i.isdigit())
        found = None
        for n in range(len(parts), 0, -1):
            found = folded.get(tuple(parts[:n]))
            if found is not None:
                break
        out.append(found)
    return out


def _fold(key: str | int) -> str | int:
    """A key in one spelling: `kaiming_uniform_for_shape` and `kaimingUniformForShape` read alike."""
    return key.replace("_", "").lower() if isinstance(key, str) else key


class _NoAliases(yaml.SafeLoader):
    """YAML's safe loader without aliases: a plan never needs one, and nested aliases make a few hundred bytes
    expand to gigabytes (a "billion laughs")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in plan files", mark)
        return super().compose_node(parent, index)


def _key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """Line of every key and list item of a JSON or YAML document, by path (empty when it does not compose)."""
    try:
        root = yaml.compose(text, Loader=_NoAliases)
    except Exception:  # JSON that PyYAML reads differently: no lines, the paths still say where
        return {}
    out: dict[tuple[str | int, ...], int] = {}

    def walk(node: Any, path: tuple[str | int, ...]) -> None:
        out.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                out[(*path, key.value)] = key.start_mark.line + 1
                walk(value, (*path, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, i))

    if root is not None:
        walk(root, ())
    return out


def plan_from_dict(data: Mapping[str, Any]) -> plan_pb2.Plan:
    """A Plan from its JSON form. Dtypes may be written "bfloat16", "bf16", ... as well as "DTYPE_BFLOAT16".

    Args:
        data: the parsed JSON (or YAML) document.

    Returns:
        The plan.

    Raises:
        PlanFileError: (a ValueError) naming every unknown field, initializer or dtype (with the nearest valid name
            and all of them), every value of the wrong type or sign, and initializers given twice.
    """
    if not isinstance(data, Mapping):
        raise PlanFileError(None, [PlanProblem((), f"the top level must be an object with a 'params' list, not {_kind(data)}")])
    plan = plan_pb2.Plan()
    _parsed(data, plan)
    return plan


def _parsed(data: Mapping[str, Any], message: Any, path: tuple[str | int, ...] = ()) -> Any:
    problems: list[PlanProblem] = []
    cleaned = _walk(data, message.DESCRIPTOR, path, problems)
    if problems:
        raise PlanFileError(None, problems)
    try:
        json_format.ParseDict(cleaned, message)
    except json_format.ParseError as exc:  # a case the walk does not know: protobuf's words, without its chatter
        raise PlanFileError(None, [PlanProblem(path, _clean(str(exc)))]) from None
    return message


def dtype_of(name: str, where: str = "dtype") -> dtypes.DTypeInfo:
    """The dtype for a name or alias; the error names the nearest valid name and every valid one."""
    try:
        return dtypes.by_name(name)
    except ValueError:
        pass
    raise InvalidArgument(f"{where}: {_unknown_dtype(name)}")


def _unknown_dtype(name: str) -> str:
    choices = [*dtypes.NAMES, *(a for d in dtypes.SUPPORTED for a in d.aliases)]
    word = name.lower().removeprefix("dtype_")
    # a suggestion keeps the digits (bit widths) the user wrote: 'bf61' -> 'bf16', but 'float8' is no 'float'
    digits = sorted(c for c in word if c.isdigit())
    same_width = [c for c in choices if sorted(ch for ch in c if ch.isdigit()) == digits]
    return (
        f"unknown dtype {name!r}{_nearest(word, same_width)}; valid: {', '.join(dtypes.NAMES)} "
        f"(aliases: {', '.join(choices[len(dtypes.NAMES) :])}, or DTYPE_FLOAT32 ...)"
    )


def _nearest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    if not close:  # case and separators: "KaimingUniform", "kaiming_uniform_for_shape"
        folded = {c.replace("_", "").lower(): c for c in choices}
        close = difflib.get_close_matches(word.replace("_", "").lower(), list(folded), n=1, cutoff=0.5)
        close = [folded[c] for c in close]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _walk(data: Any, desc: descriptor.Descriptor, path: tuple[str | int, ...], problems: list[PlanProblem]) -> dict[str, Any]:
    """Check `data` against the message `desc` recursively, appending every problem; returns what protobuf's
    parser should get (dtype names as enum names)."""
    if not isinstance(data, Mapping):
        problems.append(PlanProblem(path, f"expected an object, got {_kind(data)}", anchor=path))
        return {}
    by_key = {k: f for f in desc.fields for k in (f.json_name, f.name)}
    is_init = desc is plan_pb2.Init.DESCRIPTOR
    out: dict[str, Any] = {}
    oneofs: dict[str, list[str]] = {}
    for key, value in data.items():
        field = by_key.get(key) if isinstance(key, str) else None
        here = (*path, str(key))
        if field is None:
            names = [f.json_name for f in desc.fields]
            what = "initializer" if is_init else "field"
            problems.append(
                PlanProblem(path, f"unknown {what} {str(key)!r}{_nearest(str(key), names)}; valid: {', '.join(names)}", anchor=here)
            )
            continue
        if field.containing_oneof is not None and value is not None:
            oneofs.setdefault(field.containing_oneof.name, []).append(str(key))
        out[key] = _walk_value(value, field, here, problems)
    for group, keys in oneofs.items():
        if len(keys) > 1:
            what = "initializer" if is_init else f"member of {group}"
            problems.append(PlanProblem(path, f"more than one {what}: {', '.join(map(repr, keys))}; give one", anchor=(*path, keys[1])))
    return out


def _walk_value(value: Any, field: descriptor.FieldDescriptor, path: tuple[str | int, ...], problems: list[PlanProblem]) -> Any:
    if value is None:
        return None  # JSON null: the field's default
    if field.is_repeated:
        if not isinstance(value, list):
            problems.append(PlanProblem(path, f"expected a list, got {_kind(value)} ({_short(value)})", anchor=path))
            return []
        return [_walk_one(v, field, (*path, i), problems) for i, v in enumerate(value)]
    return _walk_one(value, field, path, problems)


_FD = descriptor.FieldDescriptor
_UNSIGNED = (_FD.TYPE_UINT64, _FD.TYPE_UINT32, _FD.TYPE_FIXED64, _FD.TYPE_FIXED32)
_INTS = {
    _FD.TYPE_INT32: (-(1 << 31), 1 << 31),
    _FD.TYPE_SINT32: (-(1 << 31), 1 << 31),
    _FD.TYPE_SFIXED32: (-(1 << 31), 1 << 31),
    _FD.TYPE_INT64: (-(1 << 63), 1 << 63),
    _FD.TYPE_SINT64: (-(1 << 63), 1 << 63),
    _FD.TYPE_SFIXED64: (-(1 << 63), 1 << 63),
    _FD.TYPE_UINT32: (0, 1 << 32),
    _FD.TYPE_FIXED32: (0, 1 << 32),
    _FD.TYPE_UINT64: (0, 1 << 64),
    _FD.TYPE_FIXED64: (0, 1 << 64),
}
_FLOAT_WORDS = ("NaN", "Infinity", "-Infinity")


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, str, int, float, bool)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _walk_one(value: Any, field: descriptor.FieldDescriptor, path: tuple[str | int, ...], problems: list[PlanProblem]) -> Any:
    def wrong(expected: str) -> None:
        problems.append(PlanProblem(path, f"expected {expected}, got {_kind(value)} ({_short(value)})", anchor=path))

    if field.message_type is not None:
        return _walk(value, field.message_type, path, problems) if isinstance(value, Mapping) else wrong("an object")
    if field.enum_type is not None:
        if isinstance(value, str):
            if field.enum_type is plan_pb2.DType.DESCRIPTOR:
                try:
                    return plan_pb2.DType.Name(dtypes.by_name(value).enum)  # type: ignore[arg-type]
                except ValueError:
                    problems.append(PlanProblem(path, _unknown_dtype(value), anchor=path))
                    return None
            if value not in field.enum_type.values_by_name:
                names = list(field.enum_type.values_by_name)
                problems.append(
                    PlanProblem(path, f"unknown value {value!r}{_nearest(value, names)}; valid: {', '.join(names)}", anchor=path)
                )
            return value
        return value if isinstance(value, int) and not isinstance(value, bool) else wrong("a name")
    if field.type in _INTS:
        number: Any = value
        if (isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip())) or (isinstance(value, float) and value.is_integer()):
            number = int(value)
        if not isinstance(number, int) or isinstance(number, bool):
            wrong("a whole number")
            return None
        lo, hi = _INTS[field.type]
        if number < 0 and field.type in _UNSIGNED:
            problems.append(PlanProblem(path, f"must not be negative, got {number}", anchor=path))
        elif not lo <= number < hi:
            problems.append(PlanProblem(path, f"{number} is out of range [{lo}, {hi - 1}]", anchor=path))
        return number
    if field.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                float(value)
                return value if value in _FLOAT_WORDS else float(value)
            except ValueError:
                pass
        wrong('a number (or "NaN", "Infinity", "-Infinity")')
        return None
    if field.type == _FD.TYPE_BOOL:
        return value if isinstance(value, bool) else wrong("true or false")
    if field.type == _FD.TYPE_STRING:
        return value if isinstance(value, str) else wrong("a string")
    return value


def _clean(message: str) -> str:
    """protobuf's parser text without its nesting chatter ("Failed to parse params field: ...")."""
    return re.sub(r"(Failed to parse \w+ field: )+", "", message).strip().rstrip(".") or message


def plan_to_json(plan: plan_pb2.Plan) -> str:
    """The plan's proto3 JSON form, with its 64-bit integers (shapes, ranges, seeds) as JSON numbers where a JSON
    number holds them exactly (up to 2^53 - 1, what JavaScript's numbers hold); a larger seed stays a string, as
    proto3 JSON writes every 64-bit integer. Both forms read back the same (load_plan, any proto3 JSON parser)."""
    return json.dumps(_numbers(json_format.MessageToDict(plan)), indent=1) + "\n"


_INTEGER_KEYS = frozenset({"shape", "start", "stop", "seed", "groups", "fanIn", "fanOut"})  # plan.proto's 64-bit fields


def _numbers(node: Any, integer: bool = False) -> Any:
    """MessageToDict's 64-bit integer strings (the values of _INTEGER_KEYS) as numbers where exact."""
    if isinstance(node, dict):
        return {k: _numbers(v, k in _INTEGER_KEYS) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers(v, integer) for v in node]
    if integer and isinstance(node, str) and node.isdigit() and int(node) < 1 << 53:
        return int(node)
    return node


def param(
    name: str,
    shape: Sequence[int],
    init: plan_pb2.Init | Mapping[str, Any],
    dtype: str = "float32",
    region: Sequence[tuple[int, int]] | None = None,
) -> plan_pb2.Param:
    """Build one Param; `init` may be an Init message or its JSON form, e.g. {"normal": {"std": 0.02, "seed": 1}}."""
    p = plan_pb2.Param(name=name, shape=list(shape), dtype=dtype_of(dtype).enum)  # type: ignore[arg-type]
    if isinstance(init, plan_pb2.Init):
        p.init.CopyFrom(init)
    else:
        _parsed(init, p.init, ("init",))
    for start, stop in region or ():
        p.region.add(start=start, stop=stop)
    return p


def set_region(p: plan_pb2.Param, region: Sequence[tuple[int, int]]) -> None:
    """Make `region` (one (start, stop) per dimension) p's region in place; the whole tensor is no region."""
    del p.region[:]
    if tuple(region) != tuple((0, int(d)) for d in p.shape):
        for a, b in region:
            p.region.add(start=a, stop=b)


def plan_of(params: Iterable[plan_pb2.Param]) -> plan_pb2.Plan:
    return plan_pb2.Plan(params=list(params))


def zip_plan(specs: Sequence[tuple[str, Sequence[int]]], inits: Sequence[plan_pb2.Init], dtype: str = "float32") -> plan_pb2.Plan:
    """Pair a parameter list with an initializer list, as TorchLean's plan recovery does."""
    if len(inits) < len(specs):
        raise InvalidArgument("torch.runtimeInit: initializer array shorter than parameter list")
    if len(inits) > len(specs):
        raise InvalidArgument("torch.runtimeInit: initializer array longer than parameter list")
    return plan_of(param(name, shape, init, dtype) for (name, shape), init in zip(specs, inits, strict=True))


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The tensors of a safetensors file's header, checked by the one strict reader (paraminit.safetensors_header).

    Args:
        path: the file.

    Returns:
        Tensor name -> {"dtype", "shape", "data_offsets"}, in the header's order, without `__metadata__`.

    Raises:
        FileAccessError: (an OSError) the file cannot be read.
        CheckpointFormatError: (a ValueError) the file breaks the format.
    """
    with file_errors():
        header = st_header.read_file(path)
    return {e.name: {"dtype": e.code, "shape": list(e.shape), "data_offsets": [e.begin, e.end]} for e in header.tensors.values()}


def plan_from_safetensors(path: str | os.PathLike[str], fallback_plan: plan_pb2.Plan | None = None) -> plan_pb2.Plan:
    """The fine-tuning plan: every tensor the checkpoint holds comes from it, the rest of the fallback plan is
    initialized as that plan says.

    The fallback's parameters come first, in its order (those the checkpoint holds become
    `{"safetensors": ...}` references); then every checkpoint tensor the fallback does not name, in file order,
    with the checkpoint's shape and dtype. Without a fallback the plan is the whole checkpoint. Tensors are named
    by the file's absolute path (the server must be able to read it, under its --safetensors-dirs). A tensor whose
    shape or dtype differs from the fallback's parameter, or whose dtype no plan can hold (integers, booleans), is
    an error.

    Raises:
        FileAccessError: (an OSError) the file cannot be read.
        CheckpointFormatError: (a ValueError) the file breaks the format (the one strict reader the server and
            `paraminit inspect` use, so no plan is made from a file they refuse).
        InvalidArgument: (a ValueError) the checkpoint does not fit the fallback plan.
    """
    with file_errors():
        header = st_header.read_file(path)
    source = str(Path(path).resolve())
    out = plan_pb2.Plan()
    problems = []
    named = set()

    def reference(q: plan_pb2.Param, tensor: str, dtype: dtypes.DTypeInfo) -> None:
        q.init.Clear()
        q.init.safetensors.path = source
        q.init.safetensors.tensor = tensor
        q.init.safetensors.dtype = dtype.enum  # type: ignore[assignment]

    for p in fallback_plan.params if fallback_plan is not None else ():
        named.add(p.name)
        q = out.params.add()
        q.CopyFrom(p)
        entry = header.tensors.get(p.name)
        if entry is None:
            continue
        dtype = entry.dtype
        want = dtypes.by_enum(p.dtype)
        if list(entry.shape) != list(p.shape):
            problems.append(f"{p.name}: checkpoint shape {list(entry.shape)} != plan shape {list(p.shape)}")
        if dtype is None or want is None or dtype.enum != want.enum:
            problems.append(f"{p.name}: checkpoint dtype {entry.code} != plan dtype {want.name if want else p.dtype}")
        else:
            reference(q, p.name, dtype)
    for entry in header.in_file_order():
        if entry.name in named:
            continue
        dtype = entry.dtype
        if dtype is None:
            problems.append(
                f"{entry.name}: checkpoint dtype {entry.code} is not one a plan can hold "
                f"({', '.join(d.safetensors for d in dtypes.SUPPORTED)})"
            )
            continue
        q = out.params.add(name=entry.name, shape=list(entry.shape), dtype=dtype.enum)
        reference(q, entry.name, dtype)
    if problems:
        raise InvalidArgument("checkpoint does not fit the plan: " + "; ".join(problems))
    return out
