"""A plan's wire bytes read in one compiled pass into columns: what large plans are checked and resolved from.

Reading a protobuf message field by field costs a fraction of a microsecond per field in Python, and a plan of
100,000s of parameters has millions of them. `scan` walks the serialized plan once (one numba call) and gives
each parameter's name span, dtype, shape, initializer kind and its message's numeric fields as columns. Only
parameters of the plain form are described: a whole tensor (no region, no patches), fields in order, each once,
nothing unknown. Any other parameter is marked `IRREGULAR` and is read from the message as before, so the
columns never have to say what protobuf would make of an unusual encoding.

The canonical bytes of the plan digest (plan.proto) are the plan's own deterministic encoding with an omitted
dtype written as float32: `canonical` writes them for every plan, from the scan's bytes when the scan shows
nothing unknown in them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf import message_factory

from paraminit import packed_table
from paraminit.v1 import plan_pb2
from paraminit_server.plans.wire_format import ABSENT, FIELDS, FIXED64, IRREGULAR, VARINT


@dataclass(frozen=True)
class Scan:
    """Columns of a serialized plan, one row per parameter (see the module doc)."""

    data: bytes  # the serialized plan
    flags: npt.NDArray[np.int8]
    name_at: npt.NDArray[np.int64]  # [n, 2] byte span of the name
    dtype: npt.NDArray[np.int64]  # enum value as sent (0 when omitted)
    dims: npt.NDArray[np.uint64]  # every shape, concatenated
    dims_at: npt.NDArray[np.int64]  # [n + 1] where each parameter's dims start
    kind: npt.NDArray[np.int64]  # Init oneof field number (0: none)
    wire: npt.NDArray[np.int8]  # [n, FIELDS] wire type of the kind message's fields 1..FIELDS (ABSENT)
    raw: npt.NDArray[np.uint64]  # [n, FIELDS] their values: varints as they are, doubles as their bits
    plan_ok: bool  # nothing but parameters at the top level

    def __len__(self) -> int:
        return int(self.flags.shape[0])

    @property
    def regular(self) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = (self.flags & IRREGULAR) == 0
        return out

    def names(self) -> list[str]:
        """Every regular parameter's name ("" for irregular ones: read those from the message)."""
        n = len(self)
        out = np.empty(int(self.name_at[:, 1].sum() - self.name_at[:, 0].sum()) + n, dtype=np.uint8)
        size = _kernels().join_names(np.frombuffer(self.data, dtype=np.uint8), self.name_at, out)
        if size >= 0:  # one decode and one split instead of 100,000s of each
            return out[: size - 1].tobytes().decode().split("\0") if n else []
        data = self.data  # some name holds a NUL
        return [data[a:b].decode() for a, b in self.name_at.tolist()]

    def shapes(self) -> list[tuple[int, ...]]:
        """Every regular parameter's shape (() for irregular ones), one tuple per distinct shape."""
        return packed_table.shapes_of(self.dims[: int(self.dims_at[-1])], np.diff(self.dims_at))

    def field(self, message: Any, name: str) -> npt.NDArray[Any]:
        """A numeric field of every row's initializer message, as protobuf reads it (0 when absent): float64 for
        doubles, uint64 for varints. Only meaningful on rows whose kind has that message and whose `wire_ok`."""
        fd = message.DESCRIPTOR.fields_by_name[name]
        col = self.raw[:, fd.number - 1]
        return col.view(np.float64) if fd.type == fd.TYPE_DOUBLE else col

    def wire_ok(self, message: Any) -> npt.NDArray[np.bool_]:
        """Rows whose initializer message's fields all have the wire type `message` declares (or are absent)."""
        ok = np.ones(len(self), dtype=bool)
        seen = set()
        for fd in message.DESCRIPTOR.fields:
            if fd.number > FIELDS or fd.type not in _NUMERIC:  # (a packed repeated field is LEN: irregular)
                return np.zeros(len(self), dtype=bool)
            col = self.wire[:, fd.number - 1]
            ok &= (col == ABSENT) | (col == _NUMERIC[fd.type])
            seen.add(fd.number - 1)
        for f in range(FIELDS):
            if f not in seen:
                ok &= self.wire[:, f] == ABSENT
        return ok

    @functools.cached_property
    def declared(self) -> npt.NDArray[np.bool_]:
        """Rows whose initializer message holds only fields its kind declares, each with its declared wire type: a
        field protobuf would keep as unknown (another number, another wire type) makes the row's bytes not
        canonical, and the row is read from the message. Computed once a scan: the columns and the digest ask."""
        ok = np.ones(len(self), dtype=bool)
        for number in np.unique(self.kind).tolist():
            rows = np.flatnonzero(self.kind == number)
            field = plan_pb2.Init.DESCRIPTOR.fields_by_number.get(number)
            if field is None or field.message_type is None:
                ok[rows] = False
                continue
            ok[rows] = self.wire_ok(message_factory.GetMessageClass(field.message_type))[rows]
        return ok


_NUMERIC = {1: FIXED64, 4: VARINT, 3: VARINT, 13: VARINT, 5: VARINT}  # double, uint64, int64, uint32, int32


def scan(plan: plan_pb2.Plan) -> Scan:
    """The plan's columns (one serialization and one compiled pass; see the module doc)."""
    data = plan.SerializeToString(deterministic=True)
    buf = np.frombuffer(data, dtype=np.uint8)
    n, ndims, plan_ok = _kernels().count(buf)
    flags = np.zeros(n, dtype=np.int8)
    name_at = np.zeros((n, 2), dtype=np.int64)
    dtype = np.zeros(n, dtype=np.int64)
    dims = np.zeros(ndims, dtype=np.uint64)
    dims_at = np.zeros(n + 1, dtype=np.int64)
    kind = np.zeros(n, dtype=np.int64)
    wire = np.full((n, FIELDS), ABSENT, dtype=np.int8)
    raw = np.zeros((n, FIELDS), dtype=np.uint64)
    if n:
        _kernels().fill(buf, flags, name_at, dtype, dims, dims_at, kind, wire, raw)
    return Scan(data, flags, name_at, dtype, dims, dims_at, kind, wire, raw, bool(plan_ok))


def canonical(plan: plan_pb2.Plan, s: Scan | None = None) -> bytes:
    """The plan's canonical bytes (plan.proto, above `message Plan`): aliases resolved (an unspecified Param.dtype
    is float32), unknown fields dropped, then proto3's binary encoding in field-number order with every field at
    its default omitted. Python protobuf's deterministic serialization is that encoding for a message without
    unknown fields; one compiled pass writes float32 where a dtype is omitted.

    Args:
        plan: the plan.
        s: its scan, if there is one: when it shows that nothing in the plan is unknown to plan.proto, its bytes
            are used as they are instead of serializing a cleaned copy.

    Returns:
        The canonical bytes."""
    if s is not None and s.plan_ok and bool(s.regular.all()) and bool(s.declared.all()):
        data = s.data
    else:  # something protobuf keeps as unknown may be in it: the canonical form drops it
        clean = plan_pb2.Plan()
        clean.CopyFrom(plan)
        clean.DiscardUnknownFields()
        data = clean.SerializeToString(deterministic=True)
    out = np.empty(len(data) + 3 * len(plan.params), dtype=np.uint8)  # two bytes and a longer length a param
    size = _kernels().canonical(np.frombuffer(data, dtype=np.uint8), out)
    assert size >= 0, "a deterministic encoding without unknown fields"
    return out[:size].tobytes()


def warm_up() -> None:
    """Load (or compile) the scanner's kernels, once per process (ready_seconds counts it)."""
    _kernels()


def _exercise() -> None:
    """Every compiled pass once: a plan of two parameters (one without its dtype) scanned, named and written in
    canonical form."""
    two = plan_pb2.Plan(params=[plan_pb2.Param(name="a", shape=[1], dtype=plan_pb2.DTYPE_FLOAT32), plan_pb2.Param(name="b", shape=[1])])
    for param in two.params:
        param.init.zeros.SetInParent()
    s = scan(two)
    s.names()
    canonical(two, s)


class _Compiled:
    """The compiled scanner (numba is imported, and the kernels loaded or compiled, on first use)."""

    def __init__(self) -> None:
        from paraminit_server.plans.scanner_kernels import canonical, count, fill, join_names

        self.count, self.fill, self.canonical, self.join_names = count, fill, canonical, join_names


_COMPILED: list[_Compiled] = []
_READIED: dict[str, float] = {"loading": 0.0, "compiling": 0.0}  # the first use's seconds, by what it did


def _kernels() -> _Compiled:
    if not _COMPILED:
        started = time.perf_counter()
        compiled = _Compiled()
        _COMPILED.append(compiled)
        _exercise()  # loads (or compiles) every pass now, so that the seconds below hold all of it
        passes = (compiled.count, compiled.fill, compiled.join_names, compiled.canonical)
        missed = any(sum(f.stats.cache_misses.values()) for f in passes)
        _READIED["compiling" if missed else "loading"] += time.perf_counter() - started
    return _COMPILED[0]


def ready_seconds() -> tuple[float, float]:
    """Seconds this process spent readying the scanner's kernels: (loading them from the disk cache, importing
    numba and its first load being most of it; compiling them, on a cold cache). A summary counts the first with
    the data plane's start and the second with the kernels' compiling, not with the plan's checks."""
    return _READIED["loading"], _READIED["compiling"]
