"""Fast codec for MaterializeResponse data chunks, wire-compatible with init_service.proto.

A 1 MiB chunk built and parsed through generated messages is copied four times
or more; here the server joins header and payload once and the client reads the
payload as a memoryview of the received bytes. Anything that is not a chunk goes
through the generated message class, so any conforming peer interoperates.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraminit.v1 import init_service_pb2 as pb

_CHUNK_FIELD_TAG = 0x12  # MaterializeResponse.chunk = 2, length-delimited


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


def encode_chunk(offset: int, data: memoryview | bytes, crc32c: int) -> bytes:
    """Serialized MaterializeResponse{chunk: DataChunk{offset, data, crc32c}} with one copy of data."""
    inner_head = b"\x08" + _varint(offset) + b"\x12" + _varint(len(data))
    inner_tail = b"\x1d" + crc32c.to_bytes(4, "little")
    inner_len = len(inner_head) + len(data) + len(inner_tail)
    return b"".join((bytes([_CHUNK_FIELD_TAG]), _varint(inner_len), inner_head, data, inner_tail))


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


def _decode_chunk(buf: memoryview) -> Chunk:
    offset = crc = 0
    data = memoryview(b"")
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated chunk")
            if field == 2:
                data = buf[pos:pos + length]
            pos += length
        elif wire_type == 5:
            if field == 3:
                crc = int.from_bytes(buf[pos:pos + 4], "little")
            pos += 4
        elif wire_type == 1:
            pos += 8
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
    if pos != len(buf):
        raise ValueError("truncated chunk")
    return Chunk(offset, data, crc)
