"""Fast codec for MaterializeResponse data chunks, wire-compatible with init_service.proto.

A 1 MiB chunk built and parsed through generated messages is copied four times
or more; here the server joins header, payload and checksum into the bytes gRPC
sends with one copy of the payload, and the client reads the payload as a
memoryview of the received bytes. Anything that is not a chunk goes through the
generated message class, so any conforming peer interoperates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from paraminit.v1 import init_service_pb2 as pb


def _number(message: Any, field: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[field].number)


# Field numbers come from the generated descriptors, so the codec cannot drift from the .proto
# (tests/test_wire.py also round-trips it through the generated classes).
_LEN, _VARINT, _FIXED32 = 2, 0, 5
_CHUNK = _number(pb.MaterializeResponse, "chunk")
_OFFSET = _number(pb.DataChunk, "offset")
_DATA = _number(pb.DataChunk, "data")
_CRC = _number(pb.DataChunk, "crc32c")
_P_DTYPE = _number(pb.PayloadChunk, "dtype")
_P_COUNT = _number(pb.PayloadChunk, "count")
_P_DATA = _number(pb.PayloadChunk, "data")
_CHUNK_FIELD_TAG = _CHUNK << 3 | _LEN
_OFFSET_TAG = _OFFSET << 3 | _VARINT
_DATA_TAG = _DATA << 3 | _LEN
_CRC_TAG = _CRC << 3 | _FIXED32


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_CRC_TAG_BYTES = _varint(_CRC_TAG)
_CRC_TRAILER_BYTES = len(_CRC_TAG_BYTES) + 4


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def encode_chunk(offset: int, data: npt.NDArray[np.uint8]) -> bytes:
    """Serialized MaterializeResponse{chunk: DataChunk{offset, data, crc32c(data)}}: a new bytes object
    holding one copy of `data` (1-D uint8), for gRPC to send; `data` may be reused once this returns."""
    n = int(data.shape[0])
    inner_head = _varint(_OFFSET_TAG) + _varint(offset) + _varint(_DATA_TAG) + _varint(n)
    head = _varint(_CHUNK_FIELD_TAG) + _varint(len(inner_head) + n + _CRC_TRAILER_BYTES) + inner_head
    body = data.data
    return b"".join((head, body, _CRC_TAG_BYTES, crc32c.crc32c(body).to_bytes(4, "little")))


def serialize_response(msg: pb.MaterializeResponse | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


@dataclass(frozen=True)
class Chunk:
    """A decoded data chunk; `data` is a view into the received message bytes."""

    offset: int
    data: memoryview
    crc32c: int


def decode_response(raw: bytes) -> Chunk | pb.MaterializeResponse:
    """A Chunk for data-chunk messages, the generated message for everything else."""
    buf = memoryview(raw)
    try:
        if len(buf) and buf[0] == _CHUNK_FIELD_TAG:
            length, pos = _read_varint(buf, 1)
            if pos + length == len(buf):
                return _decode_chunk(buf[pos:])
    except ValueError:
        pass
    return pb.MaterializeResponse.FromString(raw)


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each field of a message: varints as ints, fixed32 as ints, length-delimited
    fields as views of buf; ValueError for bytes that are not a well-formed message."""
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            yield field, value
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated message")
            yield field, buf[pos : pos + length]
            pos += length
        elif wire_type == _FIXED32:
            if pos + 4 > len(buf):
                raise ValueError("truncated message")
            yield field, int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        elif wire_type == 1:
            pos += 8
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
    if pos != len(buf):
        raise ValueError("truncated message")


def _decode_chunk(buf: memoryview) -> Chunk:
    offset = crc = 0
    data = memoryview(b"")
    for field, value in _fields(buf):
        if field == _OFFSET and isinstance(value, int):
            offset = value
        elif field == _DATA and isinstance(value, memoryview):
            data = value
        elif field == _CRC and isinstance(value, int):
            crc = value
    return Chunk(offset, data, crc)


@dataclass(frozen=True)
class Piece:
    """A decoded PayloadChunk; `data` is a view into the received message bytes."""

    dtype: int
    count: int
    data: memoryview


def encode_payload_chunk(data: memoryview | bytes, dtype: int = 0, count: int = 0) -> bytes:
    """Serialized PayloadChunk{dtype, count, data} with one copy of data (zero fields omitted, as proto3 does)."""
    head = b""
    if dtype:
        head += _varint(_P_DTYPE << 3 | _VARINT) + _varint(dtype)
    if count:
        head += _varint(_P_COUNT << 3 | _VARINT) + _varint(count)
    return b"".join((head, _varint(_P_DATA << 3 | _LEN), _varint(len(data)), data))


def decode_payload_chunk(raw: bytes) -> Piece:
    """A PayloadChunk without copying its data; ValueError for bytes that are not one."""
    dtype = count = 0
    data = memoryview(b"")
    for field, value in _fields(memoryview(raw)):
        if field == _P_DTYPE and isinstance(value, int):
            dtype = value
        elif field == _P_COUNT and isinstance(value, int):
            count = value
        elif field == _P_DATA and isinstance(value, memoryview):
            data = value
    return Piece(dtype, count, data)
