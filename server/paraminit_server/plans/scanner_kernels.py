"""The compiled passes of plans/scanner.py over a serialized plan (protobuf's wire format, plan.proto's numbers).

`count` sizes the columns, `fill` writes them, `canonical` writes the digest's canonical bytes. A parameter
whose encoding is anything but the plain form (see scanner.py) is flagged irregular and left to the message.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from paraminit.v1 import plan_pb2
from paraminit_server.plans.wire_format import FIELDS, FIXED32, FIXED64, IRREGULAR, LEN, VARINT

# numba's own on-disk cache keyed on this file: every compiled function these passes call lives here
jit = numba.njit(cache=True, nogil=True)

_IRREGULAR = np.int8(IRREGULAR)
_KINDS = max(f.number for f in plan_pb2.Init.DESCRIPTOR.fields)  # Init's oneof fields are 1.._KINDS
# plan.proto's numbers, read from the generated descriptors (module constants: numba compiles them in)
_PARAMS = plan_pb2.Plan.DESCRIPTOR.fields_by_name["params"].number
_NAME, _SHAPE, _DTYPE, _INIT = (plan_pb2.Param.DESCRIPTOR.fields_by_name[f].number for f in ("name", "shape", "dtype", "init"))
_FLOAT32 = plan_pb2.DTYPE_FLOAT32


@jit
def varint(buf: Any, pos: int, end: int) -> tuple[Any, int]:
    """(value, position after it); position -1 when the varint is cut off or longer than ten bytes."""
    value = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if pos >= end:
            return value, -1
        b = buf[pos]
        pos += 1
        value |= np.uint64(b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += np.uint64(7)
    return value, -1


@jit
def skip(buf: Any, pos: int, end: int, wire: int) -> int:
    """The position after a field's value of this wire type; -1 when it does not fit or the type is unknown."""
    if wire == VARINT:
        _, pos = varint(buf, pos, end)
        return pos
    if wire == FIXED64:
        return pos + 8 if pos + 8 <= end else -1
    if wire == FIXED32:
        return pos + 4 if pos + 4 <= end else -1
    if wire == LEN:
        n, pos = varint(buf, pos, end)
        if pos < 0 or n > np.uint64(end - pos):
            return -1
        return pos + int(n)
    return -1


@jit
def count(buf: Any) -> tuple[int, int, bool]:
    """(parameters, an upper bound of all their dims, whether the plan holds nothing but parameters)."""
    pos, end = 0, buf.shape[0]
    n = 0
    dims = 0
    ok = True
    while pos < end:
        tag, pos = varint(buf, pos, end)
        if pos < 0:
            return n, dims, False
        wire = int(tag & np.uint64(7))
        if tag >> np.uint64(3) == np.uint64(_PARAMS) and wire == LEN:
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return n, dims, False
            n += 1
            dims += int(size)  # a dim takes at least one byte
            pos += int(size)
        else:
            ok = False
            pos = skip(buf, pos, end, wire)
            if pos < 0:
                return n, dims, False
    return n, dims, ok


@jit
def _init(buf: Any, pos: int, end: int, i: int, kind: Any, wire: Any, raw: Any) -> bool:
    """Read one Init message body: its one kind and that message's numeric fields 1..FIELDS, in order, once."""
    seen = False
    while pos < end:
        tag, pos = varint(buf, pos, end)
        if pos < 0 or seen:
            return False
        f = int(tag >> np.uint64(3))
        if int(tag & np.uint64(7)) != LEN or f < 1 or f > _KINDS:
            return False
        size, pos = varint(buf, pos, end)
        if pos < 0 or size > np.uint64(end - pos):
            return False
        stop = pos + int(size)
        kind[i] = f
        seen = True
        last = 0
        while pos < stop:
            tag, pos = varint(buf, pos, stop)
            if pos < 0:
                return False
            g = int(tag >> np.uint64(3))
            w = int(tag & np.uint64(7))
            if g <= last or g > FIELDS:
                return False
            last = g
            if w == VARINT:
                v, pos = varint(buf, pos, stop)
                if pos < 0:
                    return False
                raw[i, g - 1] = v
            elif w == FIXED64:
                if pos + 8 > stop:
                    return False
                v = np.uint64(0)
                for k in range(8):
                    v |= np.uint64(buf[pos + k]) << np.uint64(8 * k)
                raw[i, g - 1] = v
                pos += 8
            else:
                return False
            wire[i, g - 1] = w
    return seen


@jit
def _param(
    buf: Any, pos: int, end: int, i: int, name_at: Any, dtype: Any, dims: Any, nd: int, kind: Any, wire: Any, raw: Any
) -> tuple[bool, int]:
    """Read one Param body in the plain form; (regular, dims written)."""
    last = 0
    written = 0
    while pos < end:
        tag, pos = varint(buf, pos, end)
        if pos < 0:
            return False, written
        f = int(tag >> np.uint64(3))
        w = int(tag & np.uint64(7))
        if f <= last or f > _INIT:  # out of order, repeated, a region, patches or unknown
            return False, written
        last = f
        if f == _NAME:
            if w != LEN:
                return False, written
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return False, written
            name_at[i, 0] = pos
            pos += int(size)
            name_at[i, 1] = pos
        elif f == _SHAPE:
            if w != LEN:  # unpacked dims: legal, but not the canonical encoding
                return False, written
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return False, written
            stop = pos + int(size)
            while pos < stop:
                v, pos = varint(buf, pos, stop)
                if pos < 0:
                    return False, written
                dims[nd + written] = v
                written += 1
        elif f == _DTYPE:
            if w != VARINT:
                return False, written
            v, pos = varint(buf, pos, end)
            if pos < 0 or v == np.uint64(0) or v > np.uint64(1 << 31):  # an explicit 0 is not canonical
                return False, written
            dtype[i] = int(v)
        else:
            if w != LEN:
                return False, written
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return False, written
            if not _init(buf, pos, pos + int(size), i, kind, wire, raw):
                return False, written
            pos += int(size)
    return True, written


@jit
def fill(buf: Any, flags: Any, name_at: Any, dtype: Any, dims: Any, dims_at: Any, kind: Any, wire: Any, raw: Any) -> None:
    """Write every parameter's columns (sized by `count`); irregular parameters are flagged and left empty."""
    pos, end = 0, buf.shape[0]
    i = 0
    nd = 0
    while pos < end and i < flags.shape[0]:
        tag, pos = varint(buf, pos, end)
        wire_type = int(tag & np.uint64(7))
        if tag >> np.uint64(3) != np.uint64(_PARAMS) or wire_type != LEN:
            pos = skip(buf, pos, end, wire_type)
            if pos < 0:
                return
            continue
        size, pos = varint(buf, pos, end)
        stop = pos + int(size)
        dims_at[i] = nd
        regular, written = _param(buf, pos, stop, i, name_at, dtype, dims, nd, kind, wire, raw)
        if regular:
            nd += written
        else:
            flags[i] = _IRREGULAR
            name_at[i, 0] = name_at[i, 1] = 0
            kind[i] = 0
            dtype[i] = 0
            for f in range(FIELDS):
                wire[i, f] = -1
                raw[i, f] = 0
        pos = stop
        i += 1
    dims_at[i] = nd


@jit
def _put_varint(out: Any, pos: int, v: int) -> int:
    while v >= 0x80:
        out[pos] = (v & 0x7F) | 0x80
        v >>= 7
        pos += 1
    out[pos] = v
    return pos + 1


@jit
def canonical(buf: Any, out: Any) -> int:
    """A plan's deterministic encoding (fields in number order, nothing unknown) with float32 written into every
    Param whose dtype is omitted, before its first field numbered above dtype; returns the size written to `out`
    (at least 3 bytes a parameter larger than `buf`), -1 when `buf` is not such an encoding."""
    pos, end = 0, buf.shape[0]
    o = 0
    while pos < end:
        tag, pos = varint(buf, pos, end)
        if pos < 0 or tag != np.uint64(_PARAMS << 3 | LEN):
            return -1
        size, pos = varint(buf, pos, end)
        if pos < 0 or size > np.uint64(end - pos):
            return -1
        a, b = pos, pos + int(size)
        at, has_dtype = b, False  # where the dtype goes: before the first field after it (fields are in order)
        p = a
        while p < b:
            t, q = varint(buf, p, b)
            if q < 0:
                return -1
            f = int(t >> np.uint64(3))
            if f >= _DTYPE:
                has_dtype = f == _DTYPE
                at = p
                break
            p = skip(buf, q, b, int(t & np.uint64(7)))
            if p < 0:
                return -1
        extra = 0 if has_dtype else 2
        o = _put_varint(out, o, _PARAMS << 3 | LEN)
        o = _put_varint(out, o, b - a + extra)
        out[o : o + at - a] = buf[a:at]
        o += at - a
        if extra:
            o = _put_varint(out, o, _DTYPE << 3 | VARINT)
            o = _put_varint(out, o, _FLOAT32)
        out[o : o + b - at] = buf[at:b]
        o += b - at
        pos = b
    return o


@jit
def join_names(buf: Any, name_at: Any, out: Any) -> int:
    """Every name, each followed by a NUL byte, into `out`; returns the size, or -1 when a name holds a NUL."""
    pos = 0
    for i in range(name_at.shape[0]):
        a, b = name_at[i, 0], name_at[i, 1]
        for k in range(a, b):
            c = buf[k]
            if c == 0:
                return -1
            out[pos] = c
            pos += 1
        out[pos] = 0
        pos += 1
    return pos
