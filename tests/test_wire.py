"""The hand codec (paraminit.wire) against the generated classes: a tag drift must fail here, not in the field."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraminit import wire
from paraminit.v1 import init_service_pb2 as pb

FIELDS = pb.DataChunk.DESCRIPTOR.fields_by_name


def test_field_numbers_come_from_the_descriptors() -> None:
    assert pb.MaterializeResponse.DESCRIPTOR.fields_by_name["chunk"].number == wire._CHUNK
    assert (FIELDS["offset"].number, FIELDS["data"].number, FIELDS["crc32c"].number) == (wire._OFFSET, wire._DATA, wire._CRC)


def encode(offset: int, data: bytes) -> bytes:
    """A chunk message as the server's service layer encodes it, from a slab it then reuses (overwritten here)."""
    slab = np.frombuffer(bytearray(data), dtype=np.uint8)
    message = wire.encode_chunk(offset, slab)
    slab[:] = 0xA5  # the message holds its own copy
    return message


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000))
def test_encoded_chunks_parse_with_the_generated_classes(offset: int, data: bytes) -> None:
    msg = pb.MaterializeResponse.FromString(encode(offset, data))
    assert msg.WhichOneof("msg") == "chunk"
    assert (msg.chunk.offset, msg.chunk.data, msg.chunk.crc32c) == (offset, data, crc32c.crc32c(data))
    if offset and data and crc32c.crc32c(data):  # protobuf leaves zero fields out; with none, byte for byte the same
        assert msg.SerializeToString() == encode(offset, data)


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000), crc=st.integers(0, 2**32 - 1))
def test_generated_chunks_decode_with_the_codec(offset: int, data: bytes, crc: int) -> None:
    raw = pb.MaterializeResponse(chunk=pb.DataChunk(offset=offset, data=data, crc32c=crc)).SerializeToString()
    got = wire.decode_response(raw)
    assert isinstance(got, wire.Chunk)
    assert (got.offset, bytes(got.data), got.crc32c) == (offset, data, crc)


def test_other_messages_go_through_the_generated_class() -> None:
    header = pb.MaterializeResponse(header=pb.StreamHeader(plan_digest="ab" * 32, data_bytes=7))
    got = wire.decode_response(header.SerializeToString())
    assert isinstance(got, pb.MaterializeResponse) and got.header.plan_digest == "ab" * 32
    assert wire.serialize_response(header) == header.SerializeToString()
    encoded = encode(5, b"xyz")
    assert wire.serialize_response(encoded) is encoded  # pre-encoded bytes pass untouched


def test_truncated_chunk_is_an_error() -> None:
    raw = encode(1, b"abcdef")
    with pytest.raises(Exception):  # noqa: B017  (protobuf's DecodeError or the codec's ValueError)
        wire.decode_response(raw[:-3])


@settings(max_examples=200, deadline=None)
@given(dtype=st.integers(0, 4), count=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000))
def test_payload_chunks_round_trip_with_the_generated_classes(dtype: int, count: int, data: bytes) -> None:
    raw = wire.encode_payload_chunk(memoryview(data), dtype, count)
    msg = pb.PayloadChunk.FromString(raw)
    assert (msg.dtype, msg.count, msg.data) == (dtype, count, data)
    back = wire.decode_payload_chunk(pb.PayloadChunk(dtype=dtype, count=count, data=data).SerializeToString())  # type: ignore[arg-type]
    assert (back.dtype, back.count, bytes(back.data)) == (dtype, count, data)


def test_payload_chunk_fields_come_from_the_descriptors() -> None:
    fields = pb.PayloadChunk.DESCRIPTOR.fields_by_name
    assert (fields["dtype"].number, fields["count"].number, fields["data"].number) == (wire._P_DTYPE, wire._P_COUNT, wire._P_DATA)
    with pytest.raises(ValueError):
        wire.decode_payload_chunk(wire.encode_payload_chunk(b"abcdef", 1, 6)[:-2])
