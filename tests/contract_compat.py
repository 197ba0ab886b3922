"""The wire contract against the released one: what a client built from the released .proto files relies on.

`proto/released/paraminit-v1.binpb` holds the released descriptors (a FileDescriptorSet). A change breaks such a
client when it deletes or renames a message, enum or service it uses, changes a method's types or streaming,
deletes a field without reserving its number and name, changes a field's number, type, cardinality, oneof or JSON
name, or deletes an enum value without reserving it. Adding is always allowed. This is the WIRE and WIRE_JSON
subset of `buf breaking` (`make contract` runs buf itself where npm is reachable); `make lint` runs this module, and
tests/test_contract_text.py shows it catches each kind of break.

Run: python tests/contract_compat.py [RELEASED CURRENT]; after a deliberate, announced break, copy the current
contract.binpb over the released file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
RELEASED = ROOT / "proto" / "released" / "paraminit-v1.binpb"
CURRENT = ROOT / "proto" / "paraminit" / "v1" / "contract.binpb"

_F = descriptor_pb2.FieldDescriptorProto
_Messages = dict[str, descriptor_pb2.DescriptorProto]
_Enums = dict[str, descriptor_pb2.EnumDescriptorProto]
_Services = dict[str, descriptor_pb2.ServiceDescriptorProto]
_Ranges = list[descriptor_pb2.DescriptorProto.ReservedRange] | list[descriptor_pb2.EnumDescriptorProto.EnumReservedRange]


def load(path: Path) -> descriptor_pb2.FileDescriptorSet:
    """A FileDescriptorSet from its binary file."""
    return descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())


def _index(fds: descriptor_pb2.FileDescriptorSet) -> tuple[_Messages, _Enums, _Services]:
    """Messages, enums and services of the paraminit files by full name (nested ones included)."""
    messages: _Messages = {}
    enums: _Enums = {}
    services: _Services = {}

    def walk(prefix: str, ms: list[descriptor_pb2.DescriptorProto], es: list[descriptor_pb2.EnumDescriptorProto]) -> None:
        for e in es:
            enums[f"{prefix}.{e.name}"] = e
        for m in ms:
            messages[f"{prefix}.{m.name}"] = m
            walk(f"{prefix}.{m.name}", list(m.nested_type), list(m.enum_type))

    for f in fds.file:
        if not f.package.startswith("paraminit."):
            continue  # google/protobuf and other imports are not ours to break
        walk(f".{f.package}", list(f.message_type), list(f.enum_type))
        for s in f.service:
            services[f".{f.package}.{s.name}"] = s
    return messages, enums, services


def _reserved(numbers: _Ranges, n: int, end_inclusive: bool) -> bool:
    return any(r.start <= n < r.end + (1 if end_inclusive else 0) for r in numbers)


def _field(f: descriptor_pb2.FieldDescriptorProto, m: descriptor_pb2.DescriptorProto) -> tuple[object, ...]:
    """What a client's encoding of the field depends on."""
    oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") and not f.proto3_optional else ""
    return (f.name, f.json_name, _F.Type.Name(f.type), f.type_name, _F.Label.Name(f.label), oneof)


def breaks(released: descriptor_pb2.FileDescriptorSet, current: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Every change from `released` to `current` that breaks a client of the released contract.

    Args:
        released: the released descriptors.
        current: the contract as it is now.

    Returns:
        One line per break (empty: compatible).
    """
    old_m, old_e, old_s = _index(released)
    new_m, new_e, new_s = _index(current)
    out: list[str] = []
    for name, m in old_m.items():
        now = new_m.get(name)
        if now is None:
            out.append(f"message {name} deleted")
            continue
        fields = {f.number: f for f in now.field}
        for f in m.field:
            g = fields.get(f.number)
            if g is None:
                if not (_reserved(list(now.reserved_range), f.number, False) and f.name in now.reserved_name):
                    out.append(f"{name}.{f.name} (field {f.number}) deleted without reserving its number and name")
            elif _field(f, m) != _field(g, now):
                out.append(f"{name} field {f.number}: {_field(f, m)} became {_field(g, now)}")
    for name, e in old_e.items():
        now_e = new_e.get(name)
        if now_e is None:
            out.append(f"enum {name} deleted")
            continue
        values = {v.number: v.name for v in now_e.value}
        for v in e.value:
            if v.number not in values:
                if not (_reserved(list(now_e.reserved_range), v.number, True) and v.name in now_e.reserved_name):
                    out.append(f"{name}.{v.name} (value {v.number}) deleted without reserving it")
            elif values[v.number] != v.name:
                out.append(f"{name} value {v.number}: {v.name} renamed {values[v.number]} (JSON spells the name)")
    for name, s in old_s.items():
        now_s = new_s.get(name)
        if now_s is None:
            out.append(f"service {name} deleted")
            continue
        methods = {r.name: r for r in now_s.method}
        for r in s.method:
            q = methods.get(r.name)
            shape = (r.input_type, r.output_type, r.client_streaming, r.server_streaming)
            if q is None:
                out.append(f"{name}/{r.name} deleted")
            elif (q.input_type, q.output_type, q.client_streaming, q.server_streaming) != shape:
                out.append(f"{name}/{r.name}: types or streaming changed")
    return out


def main(argv: list[str]) -> int:
    released, current = (Path(argv[0]), Path(argv[1])) if len(argv) == 2 else (RELEASED, CURRENT)
    found = breaks(load(released), load(current))
    for line in found:
        print(f"breaking: {line}", file=sys.stderr)
    if not found:
        print(f"contract: compatible with {released.relative_to(ROOT) if released.is_relative_to(ROOT) else released}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
