"""The compiled passes of plans/scanner.py over a serialized plan (protobuf's wire format, plan.proto's numbers).

`count` sizes the columns, `fill` writes them, `canonical` writes the digest's canonical bytes. A parameter
whose encoding is anything but the plain form (see scanner.py) is flagged irregular and left to the message.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from paraminit.v1 import plan_pb2

# numba's own on-disk cache keyed on this file: every compiled function these passes call lives here
jit = numba.njit(cache=True, nogil=True)

_IRREGULAR = np.int8(1)
_NO_DTYPE = np.int8(2)
_KINDS = max(f.number for f in plan_pb2.Init.DESCRIPTOR.fields)  # Init's oneof fields are 1.._KINDS
_FIELDS = 5


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
    if wire == 0:
        _, pos = varint(buf, pos, end)
        return pos
    if wire == 1:
        return pos + 8 if pos + 8 <= end else -1
    if wire == 5:
        return pos + 4 if pos + 4 <= end else -1
    if wire == 2:
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
        if tag >> np.uint64(3) == np.uint64(1) and wire == 2:
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
    """Read one Init message body: its one kind and that message's numeric fields 1.._FIELDS, in order, once."""
    seen = False
    while pos < end:
        tag, pos = varint(buf, pos, end)
        if pos < 0 or seen:
            return False
        f = int(tag >> np.uint64(3))
        if int(tag & np.uint64(7)) != 2 or f < 1 or f > _KINDS:
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
            if g <= last or g > _FIELDS:
                return False
            last = g
            if w == 0:
                v, pos = varint(buf, pos, stop)
                if pos < 0:
                    return False
                raw[i, g - 1] = v
            elif w == 1:
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
    buf: Any,
    pos: int,
    end: int,
    i: int,
    flags: Any,
    name_at: Any,
    dtype: Any,
    dims: Any,
    nd: int,
    kind: Any,
    wire: Any,
    raw: Any,
    param_at: Any,
) -> tuple[bool, int]:
    """Read one Param body in the plain form; (regular, dims written)."""
    last = 0
    written = 0
    param_at[i, 2] = end
    has_dtype = False
    while pos < end:
        at = pos
        tag, pos = varint(buf, pos, end)
        if pos < 0:
            return False, written
        f = int(tag >> np.uint64(3))
        w = int(tag & np.uint64(7))
        if f <= last or f > 4:  # out of order, repeated, a region (5), patches (6) or unknown
            return False, written
        if f == 4 and last < 4:
            param_at[i, 2] = at  # where an omitted dtype (3) goes
        last = f
        if f == 1:
            if w != 2:
                return False, written
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return False, written
            name_at[i, 0] = pos
            pos += int(size)
            name_at[i, 1] = pos
        elif f == 2:
            if w != 2:  # unpacked dims: legal, but not the canonical encoding
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
        elif f == 3:
            if w != 0:
                return False, written
            v, pos = varint(buf, pos, end)
            if pos < 0 or v == np.uint64(0) or v > np.uint64(1 << 31):  # an explicit 0 is not canonical
                return False, written
            dtype[i] = int(v)
            has_dtype = True
        else:
            if w != 2:
                return False, written
            size, pos = varint(buf, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return False, written
            if not _init(buf, pos, pos + int(size), i, kind, wire, raw):
                return False, written
            pos += int(size)
    if not has_dtype:
        flags[i] |= _NO_DTYPE
    return True, written


@jit
def fill(buf: Any, flags: Any, name_at: Any, dtype: Any, dims: Any, dims_at: Any, kind: Any, wire: Any, raw: Any, param_at: Any) -> None:
    """Write every parameter's columns (sized by `count`); irregular parameters keep only their body span."""
    pos, end = 0, buf.shape[0]
    i = 0
    nd = 0
    while pos < end and i < flags.shape[0]:
        tag, pos = varint(buf, pos, end)
        wire_type = int(tag & np.uint64(7))
        if tag >> np.uint64(3) != np.uint64(1) or wire_type != 2:
            pos = skip(buf, pos, end, wire_type)
            if pos < 0:
                return
            continue
        size, pos = varint(buf, pos, end)
        stop = pos + int(size)
        param_at[i, 0] = pos
        param_at[i, 1] = stop
        dims_at[i] = nd
        regular, written = _param(buf, pos, stop, i, flags, name_at, dtype, dims, nd, kind, wire, raw, param_at)
        if regular:
            nd += written
        else:
            flags[i] = _IRREGULAR
            name_at[i, 0] = name_at[i, 1] = 0
            kind[i] = 0
            dtype[i] = 0
            for f in range(_FIELDS):
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
def canonical(buf: Any, flags: Any, param_at: Any, out: Any) -> int:
    """Every parameter again in order, float32 (3: 1) written where the dtype is omitted; returns the size."""
    pos = 0
    for i in range(flags.shape[0]):
        a, b, at = param_at[i, 0], param_at[i, 1], param_at[i, 2]
        extra = 2 if flags[i] & _NO_DTYPE else 0
        out[pos] = 0x0A
        pos = _put_varint(out, pos + 1, b - a + extra)
        if extra:
            out[pos : pos + at - a] = buf[a:at]
            pos += at - a
            out[pos] = 0x18
            out[pos + 1] = 1
            pos += 2
            out[pos : pos + b - at] = buf[at:b]
            pos += b - at
        else:
            out[pos : pos + b - a] = buf[a:b]
            pos += b - a
    return pos


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
