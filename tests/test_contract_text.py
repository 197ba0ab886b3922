"""The contract as another language reads it from the .proto alone: a stock gRPC client with default options takes
a 60,000-parameter plan; a status with many violations carries them all or counts the rest (no made-up entry);
chunk_bytes rounds as written; plan_digest is reproduced by an encoder written here from plan.proto's text."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from paraminit.header_checksum import header_crc32c
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit_client import Client, param, plan_from_dict, plan_of
from paraminit_server.rpc.server import Running
from support import digest_of, running_server, target_of

ROOT = Path(__file__).resolve().parents[1]
PROTO = " ".join((ROOT / "proto/paraminit/v1/init_service.proto").read_text().replace("//", " ").split())
PLAN_PROTO = " ".join((ROOT / "proto/paraminit/v1/plan.proto").read_text().replace("//", " ").split())


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    with running_server() as r:
        yield r


@pytest.fixture(scope="module")
def stock(server: Running) -> Iterator[Any]:
    """A plain generated stub on a channel with every default (4 MiB receive limit, 8 KiB metadata)."""
    channel = grpc.insecure_channel(target_of(server))
    try:
        yield pb_grpc.InitServiceStub(channel)
    finally:
        channel.close()


# -- a large plan through a stock client ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stock_client_streams_a_60000_parameter_plan(stock: Any) -> None:
    n = 60_000
    plan = plan_of(
        param(f"model.layers.{i}.block.attention.output.dense.weight", [1], {"normal": {"std": 1.0, "seed": i}}) for i in range(n)
    )
    messages = list(stock.Materialize(pb.MaterializeRequest(plan=plan), timeout=600))
    first = messages[0]
    assert first.WhichOneof("msg") == "header"
    header = pb.StreamHeader()
    header.CopyFrom(first.header)
    count = header.header_parts
    parts = messages[1 : 1 + count]
    assert count >= 1 and all(m.WhichOneof("msg") == "header_part" for m in parts)
    assert all(m.ByteSize() <= 2 << 20 for m in messages[: 1 + count])  # as the proto promises
    for m in parts:
        header.tensors.extend(m.header_part.tensors)
        header.safetensors_prefix += m.header_part.safetensors_prefix
    assert header_crc32c(header) == header.header_crc32c
    assert len(header.tensors) == n and header.tensors[n - 1].name == f"model.layers.{n - 1}.block.attention.output.dense.weight"
    prefix = header.safetensors_prefix
    table = json.loads(prefix[8 : 8 + int.from_bytes(prefix[:8], "little")])
    assert len([k for k in table if k != "__metadata__"]) == n
    data = b""
    for m in messages[1 + count :]:
        assert m.WhichOneof("msg") == "chunk" and crc32c.crc32c(m.chunk.data) == m.chunk.crc32c
        assert m.chunk.offset == len(data)
        data += m.chunk.data
    assert len(data) == header.data_bytes == 4 * n
    with Client() as c:  # the same bytes as the in-process data plane gives
        want = c.materialize(plan)
    t = header.tensors[12345]
    assert data[t.offset : t.offset + t.nbytes] == want[t.name].tobytes()


def _packed_column_rules(packed: list[Any]) -> dict[str, bytes]:
    """The packed columns joined as init_service.proto says: each column concatenated over the messages."""
    names = ("name_lengths", "names", "dtypes", "ranks", "dims", "offsets", "nbytes")
    assert all(f"bytes {c} =" in PROTO for c in names)
    return {c: b"".join(getattr(p, c) for p in packed) for c in names}


@pytest.mark.slow
def test_a_stock_client_reads_a_100000_parameter_packed_table(stock: Any) -> None:
    """MaterializeRequest.packed_table: the table stated once, as columns, reassembled here from the .proto text
    alone (no project helper): little-endian integers, names by their lengths, shapes by their ranks, and the
    checksum over the prefix, digest, data size and each column. Stock limits (4 MiB) throughout."""
    n = 100_000
    shapes = [[16, 16], [3], [2, 2, 2], []]
    plan = plan_of(
        param(
            f"experts.{i}.w{'é' if i % 1000 == 7 else ''}",
            shapes[i % 4],
            {"normal": {"std": 0.02, "seed": i}},
            "bfloat16" if i % 3 else "float32",
        )
        for i in range(n)
    )
    messages = list(stock.Materialize(pb.MaterializeRequest(plan=plan, packed_table=True), timeout=600))
    header = messages[0].header
    count = header.header_parts
    parts = [m.header_part for m in messages[1 : 1 + count]]
    assert count >= 1 and all(m.WhichOneof("msg") == "header_part" for m in messages[1 : 1 + count])
    assert all(m.ByteSize() <= 2 << 20 for m in messages[: 1 + count])
    assert not header.tensors and not any(p.tensors for p in parts)  # stated once
    groups = [header.packed_tensors, *(p.packed_tensors for p in parts)]
    cols = _packed_column_rules(groups)
    assert sum(g.count for g in groups) == n
    prefix = header.safetensors_prefix + b"".join(p.safetensors_prefix for p in parts)

    def framed(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    covered = framed(prefix) + framed(header.plan_digest.encode()) + struct.pack("<Q", header.data_bytes)
    covered += b"".join(framed(cols[c]) for c in ("name_lengths", "names", "dtypes", "ranks", "dims", "offsets", "nbytes"))
    assert crc32c.crc32c(covered) == header.header_crc32c
    lengths = struct.unpack(f"<{n}I", cols["name_lengths"])
    ranks, enums = list(cols["ranks"]), list(cols["dtypes"])
    offsets = struct.unpack(f"<{n}Q", cols["offsets"])
    sizes = struct.unpack(f"<{n}Q", cols["nbytes"])
    dims = struct.unpack(f"<{len(cols['dims']) // 8}Q", cols["dims"])
    table, at, dim_at = {}, 0, 0
    for i in range(n):
        name = cols["names"][at : at + lengths[i]].decode()
        at += lengths[i]
        table[name] = (enums[i], tuple(dims[dim_at : dim_at + ranks[i]]), offsets[i], sizes[i])
        dim_at += ranks[i]
    data = b"".join(m.chunk.data for m in messages[1 + count :])
    assert len(data) == header.data_bytes
    with Client() as c:
        want = c.materialize(plan)
    assert list(table) == list(want)
    for i in (0, 1, 2, 3, 7, 1007, n - 1):
        name = plan.params[i].name
        enum, shape, offset, size = table[name]
        assert enum == plan.params[i].dtype or (enum == 1 and plan.params[i].dtype == 0)
        assert shape == want[name].shape and data[offset : offset + size] == want[name].tobytes(), name


def test_a_stream_without_the_safetensors_prefix(stock: Any) -> None:
    """omit_safetensors_prefix: no prefix in any header message, the checksum over an empty prefix, the same data."""
    plan = plan_of(param(f"p{i}", [3, 5], {"uniform": {"lo": -1, "hi": 1, "seed": i}}) for i in range(3000))
    full = list(stock.Materialize(pb.MaterializeRequest(plan=plan, packed_table=True), timeout=600))
    bare = list(stock.Materialize(pb.MaterializeRequest(plan=plan, packed_table=True, omit_safetensors_prefix=True), timeout=600))
    header = bare[0].header
    count = header.header_parts
    assert not header.safetensors_prefix and not any(m.header_part.safetensors_prefix for m in bare[1 : 1 + count])
    cols = _packed_column_rules([header.packed_tensors, *(m.header_part.packed_tensors for m in bare[1 : 1 + count])])
    covered = struct.pack("<Q", 0) + struct.pack("<Q", 64) + header.plan_digest.encode()
    covered += struct.pack("<Q", header.data_bytes) + b"".join(struct.pack("<Q", len(c)) + c for c in cols.values())
    assert crc32c.crc32c(covered) == header.header_crc32c
    assert full[0].header.safetensors_prefix and full[0].header.plan_digest == header.plan_digest

    def data(messages: list[Any]) -> bytes:
        return b"".join(m.chunk.data for m in messages if m.WhichOneof("msg") == "chunk")

    assert data(bare) == data(full) and len(data(bare)) == header.data_bytes


def test_the_proto_states_the_header_size_rule() -> None:
    assert "header_parts" in PROTO and "2 MiB" in PROTO and "4 MiB" in PROTO and "message HeaderPart" in PROTO


# -- violations -----------------------------------------------------------------------------------------------------


def _status(err: grpc.RpcError) -> status_pb2.Status:
    raw = dict(err.trailing_metadata() or ())["grpc-status-details-bin"]
    return status_pb2.Status.FromString(raw)


def _details(st: status_pb2.Status) -> tuple[error_details_pb2.BadRequest, error_details_pb2.ErrorInfo | None]:
    br, info = error_details_pb2.BadRequest(), None
    for d in st.details:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            d.Unpack(br)
        elif d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
    return br, info


@pytest.mark.parametrize(("count", "name_len"), [(60, 4), (60, 60), (400, 60)])
def test_every_violation_or_a_count_of_the_rest(stock: Any, count: int, name_len: int) -> None:
    plan = plan_of(param(f"p{i:03d}".ljust(name_len, "x"), [4], {"normal": {"std": -1.0}}) for i in range(count))
    with pytest.raises(grpc.RpcError) as caught:
        list(stock.Materialize(pb.MaterializeRequest(plan=plan), timeout=60))
    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # the trailers fit a stock client's default limit
    br, info = _details(_status(err))
    fields = [v.field for v in br.field_violations]
    assert fields == [f"params[{i}].init.normal" for i in range(len(fields))]  # one per problem, in plan order
    assert all("more" not in v.description for v in br.field_violations)
    if len(fields) == count:
        assert info is None
    else:
        assert info is not None and info.reason == "VIOLATIONS_TRUNCATED" and info.domain == "paraminit.v1"
        assert (
            int(info.metadata["total_violations"]),
            int(info.metadata["included_violations"]),
            int(info.metadata["omitted_violations"]),
        ) == (count, len(fields), count - len(fields))
    assert len(fields) >= 20  # as many as the default 8 KiB allow, not a fixed handful


def test_the_proto_field_path_example_is_what_the_server_sends() -> None:
    assert '"params[3].init.normal"' in PROTO and "params[3].init.normal.std" not in PROTO
    assert "VIOLATIONS_TRUNCATED" in PROTO and "omitted_violations" in PROTO


# -- chunk_bytes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "got"), [(1, 8), (3, 8), (7, 8), (8, 8), (12, 8), (20, 16), (1000, 1000)])
def test_chunk_bytes_rounds_as_the_proto_says(stock: Any, asked: int, got: int) -> None:
    plan = plan_of([param("w", [1000], {"uniform": {"lo": -1, "hi": 1, "seed": 3}})])
    messages = list(stock.Materialize(pb.MaterializeRequest(plan=plan, chunk_bytes=asked), timeout=60))
    sizes = [len(m.chunk.data) for m in messages if m.WhichOneof("msg") == "chunk"]
    assert sizes[:-1] == [got] * (len(sizes) - 1) and 0 < sizes[-1] <= got and sum(sizes) == 4000
    assert "rounded down to a multiple of 8 bytes, at least 8" in PROTO


def test_the_largest_chunk_a_server_allows_arrives_at_a_stock_client(stock: Any) -> None:
    """The size rule as the proto states it: header messages within 2 MiB, a DataChunk within the chunk size the
    server's Limits allow, the message under the 4 MiB a stock client receives."""
    limit = stock.GetInfo(pb.GetInfoRequest(), timeout=30).limits.max_chunk_bytes
    assert 2 << 20 < limit < 4 << 20
    plan = plan_of([param("w", [3, 1 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 4}})])  # 12 MiB
    messages = list(stock.Materialize(pb.MaterializeRequest(plan=plan, chunk_bytes=limit), timeout=120))
    chunks = [m for m in messages if m.WhichOneof("msg") == "chunk"]
    assert max(len(m.chunk.data) for m in chunks) == limit // 8 * 8
    assert all(m.ByteSize() < 4 << 20 for m in chunks)
    assert all(m.ByteSize() <= 2 << 20 for m in messages if m.WhichOneof("msg") != "chunk")
    assert "DataChunk carries at most the chunk size (Limits.max_chunk_bytes" in PROTO


def test_validate_and_materialize_answer_both_kinds_of_violation_as_the_proto_says(stock: Any) -> None:
    """An invalid parameter and one too large for this server: Validate lists both (limit marked), a digest and
    the sizes; Materialize answers INVALID_ARGUMENT, and RESOURCE_EXHAUSTED once only the limits remain."""
    bad = param("bad", [4], {"uniform": {"lo": 1, "hi": 0}})
    huge = param("huge", [1 << 33], {"zeros": {}})  # 32 GiB of float32: over the default 16 GiB limits
    both = plan_of([bad, huge])
    r = stock.Validate(pb.ValidateRequest(plan=both), timeout=30)
    assert not r.valid and not r.fits_limits and len(r.plan_digest) == 64
    assert [(v.index, v.limit) for v in r.violations] == [(0, False), (1, True), (-1, True)]  # plan-wide last
    assert list(r.param_bytes) == [16, 4 << 33] and r.total_bytes == 16 + (4 << 33)
    with pytest.raises(grpc.RpcError) as invalid:
        list(stock.Materialize(pb.MaterializeRequest(plan=both), timeout=30))
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    only = stock.Validate(pb.ValidateRequest(plan=plan_of([huge])), timeout=30)
    assert only.valid and not only.fits_limits
    with pytest.raises(grpc.RpcError) as limited:
        list(stock.Materialize(pb.MaterializeRequest(plan=plan_of([huge])), timeout=30))
    assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the invalid plan wins" in PROTO and "plan-wide ones last" in PROTO


# -- plan_digest from the text --------------------------------------------------------------------------------------

# plan.proto's fields by JSON name: (field number, kind, repeated). Written by hand from the .proto text.
SCHEMA: dict[str, dict[str, tuple[int, str, bool]]] = {
    "Plan": {"params": (1, "Param", True)},
    "Param": {
        "name": (1, "string", False),
        "shape": (2, "uint64", True),
        "dtype": (3, "dtype", False),
        "init": (4, "Init", False),
        "region": (5, "Range", True),
        "patches": (6, "Patch", True),
    },
    "Patch": {"box": (1, "Range", True), "init": (2, "Init", False)},
    "Range": {"start": (1, "uint64", False), "stop": (2, "uint64", False)},
    "Init": {
        "zeros": (1, "Empty", False),
        "ones": (2, "Empty", False),
        "uniform": (3, "Uniform", False),
        "normal": (4, "Normal", False),
        "xavierUniform": (5, "XavierUniform", False),
        "kaimingUniform": (6, "KaimingUniform", False),
        "flat": (7, "Flat", False),
        "xavierUniformForShape": (8, "Seeded", False),
        "kaimingUniformForShape": (9, "Seeded", False),
        "flatRef": (10, "FlatRef", False),
        "safetensors": (11, "SafetensorsRef", False),
    },
    "Empty": {},
    "Uniform": {"lo": (1, "double", False), "hi": (2, "double", False), "seed": (3, "uint64", False)},
    "Normal": {"mean": (1, "double", False), "std": (2, "double", False), "seed": (3, "uint64", False)},
    "XavierUniform": {"fanIn": (1, "uint64", False), "fanOut": (2, "uint64", False), "seed": (3, "uint64", False)},
    "KaimingUniform": {"fanIn": (1, "uint64", False), "seed": (2, "uint64", False)},
    "Seeded": {"seed": (1, "uint64", False)},
    "Flat": {"values": (1, "double", True)},
    "FlatRef": {"payloadId": (1, "string", False)},
    "SafetensorsRef": {"path": (1, "string", False), "tensor": (2, "string", False), "dtype": (3, "dtype", False)},
}
DTYPES = {"float32": 1, "DTYPE_FLOAT32": 1, "float64": 2, "DTYPE_FLOAT64": 2, "float16": 3, "bfloat16": 4, "DTYPE_UNSPECIFIED": 0}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode(message: str, data: dict[str, Any]) -> bytes:
    """The canonical bytes of plan.proto's text: ascending field numbers, defaults omitted, set messages written
    even when empty, packed repeated numbers, unspecified dtypes as float32."""
    fields = SCHEMA[message]
    if message == "Param":  # an unspecified dtype is float32 (a SafetensorsRef's stays: there 0 means "any")
        data = {**data, "dtype": DTYPES[data.get("dtype", "DTYPE_UNSPECIFIED")] or 1}
    elif message == "SafetensorsRef":
        data = {**data, "dtype": DTYPES[data.get("dtype", "DTYPE_UNSPECIFIED")]}
    out = b""
    for key, (number, kind, repeated) in sorted(fields.items(), key=lambda kv: kv[1][0]):
        if key not in data:
            continue
        value = data[key]
        if kind in SCHEMA:
            for item in value if repeated else [value]:
                body = encode(kind, item)
                out += varint(number << 3 | 2) + varint(len(body)) + body
        elif repeated:  # packed
            body = b"".join(varint(v) if kind == "uint64" else struct.pack("<d", v) for v in value)
            if body:
                out += varint(number << 3 | 2) + varint(len(body)) + body
        elif kind == "string":
            if value:
                raw = value.encode()
                out += varint(number << 3 | 2) + varint(len(raw)) + raw
        elif kind in ("uint64", "dtype"):
            if value:
                out += varint(number << 3) + varint(value)
        elif kind == "double" and (value != 0 or math.copysign(1.0, value) < 0):  # +0.0 omitted, -0.0 written
            out += varint(number << 3 | 1) + struct.pack("<d", value)
    return out


PLANS: list[dict[str, Any]] = [
    {"params": [{"name": "w", "shape": [2], "init": {"zeros": {}}}]},
    {"params": [{"name": "w", "shape": [2], "dtype": "DTYPE_FLOAT32", "init": {"zeros": {}}}]},
    {
        "params": [
            {
                "name": "h.0.attn.c_attn.weight",
                "shape": [768, 2304],
                "dtype": "bfloat16",
                "init": {"normal": {"mean": -0.0, "std": 0.02, "seed": 2**64 - 1}},
                "region": [{"start": 0, "stop": 384}, {"start": 5, "stop": 2304}],
                "patches": [{"box": [{"start": 0, "stop": 1}, {"start": 0, "stop": 2304}], "init": {"ones": {}}}],
            },
            {"name": "b", "shape": [3], "dtype": "float64", "init": {"flat": {"values": [0.0, -1.5, 1e300]}}},
            {"name": "k", "shape": [4, 8], "init": {"kaimingUniformForShape": {}}},
            {"name": "x", "shape": [4, 8], "dtype": "float16", "init": {"xavierUniform": {"fanIn": 3, "fanOut": 0}}},
            {"name": "u", "shape": [], "init": {"uniform": {"lo": 0.0, "hi": 1.0, "seed": 0}}},
        ]
    },
]


@pytest.mark.parametrize("index", range(len(PLANS)))
def test_plan_digest_is_reproduced_from_the_proto_text(index: int) -> None:
    data = PLANS[index]
    with Client() as c:
        served = c.validate(plan_from_dict(data)).plan_digest
    assert served == hashlib.sha256(encode("Plan", data)).hexdigest()


def test_an_omitted_dtype_and_float32_have_one_digest() -> None:
    with Client() as c:
        digests = {c.validate(plan_from_dict(p)).plan_digest for p in PLANS[:2]}
    assert len(digests) == 1
    assert re.search(r"canonical bytes", PLAN_PROTO) and "DTYPE_UNSPECIFIED becomes DTYPE_FLOAT32" in PLAN_PROTO


def test_a_safetensors_reference_digest_is_reproduced_and_any_dtype_kept(tmp_path: Path) -> None:

    ref = {"path": str(tmp_path / "a.safetensors"), "tensor": "w"}
    refs = [{"params": [{"name": "w", "shape": [2], "init": {"safetensors": r}}]} for r in (ref, {**ref, "dtype": "float32"})]
    got = [digest_of(plan_from_dict(r)) for r in refs]  # without sources: the canonical bytes alone
    assert got == [hashlib.sha256(encode("Plan", r)).hexdigest() for r in refs] and got[0] != got[1]


# -- reflection carries the comments --------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_serves_the_contract_with_its_comments(server: Running, service: str) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r

    with grpc.insecure_channel(target_of(server)) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        (resp,) = list(call(iter([r.ServerReflectionRequest(file_containing_symbol="paraminit.v1.InitService")]), timeout=10))
    files = {f.name: f for f in map(descriptor_pb2.FileDescriptorProto.FromString, resp.file_descriptor_response.file_descriptor_proto)}
    comments = {
        name: " ".join(
            loc.leading_comments + loc.trailing_comments + " ".join(loc.leading_detached_comments) for loc in f.source_code_info.location
        )
        for name, f in files.items()
    }
    service_text = " ".join(comments["paraminit/v1/init_service.proto"].split())
    plan_text = " ".join(comments["paraminit/v1/plan.proto"].split())
    assert "Castagnoli" in service_text and "0xE3069283" in service_text and "header_parts" in service_text
    assert "VIOLATIONS_TRUNCATED" in service_text and "rounded down to a multiple of 8 bytes" in service_text
    assert "canonical bytes" in plan_text and "SplitMix64" in plan_text
    # the same descriptors as the generated code, plus the comments
    from paraminit.v1 import init_service_pb2 as generated

    bare = descriptor_pb2.FileDescriptorProto()
    generated.DESCRIPTOR.CopyToProto(bare)
    served = files["paraminit/v1/init_service.proto"]
    served.ClearField("source_code_info")
    for message in served.message_type:  # protoc also writes each field's JSON name, which the pool derives
        for f in message.field:
            f.ClearField("json_name")
    assert served == bare


# -- long names in violations ---------------------------------------------------------------------------------------


def _echoed(name: str) -> str:
    """A parameter name as init_service.proto says violations show it: whole up to 48 UTF-8 bytes, else its longest
    prefix of whole UTF-8 characters within 24 bytes and "... (N bytes)", N the name's UTF-8 length."""
    raw = name.encode()
    if len(raw) <= 48:
        return name
    keep = 24
    while True:
        try:
            head = raw[:keep].decode()
            break
        except UnicodeDecodeError:  # the cut fell inside a character: keep fewer bytes
            keep -= 1
    return f"{head}... ({len(raw)} bytes)"


@pytest.mark.parametrize(
    "name", ["x" * 48, "n" * 100, "a" + "€" * 40, "é" * 300], ids=["48-ascii", "100-ascii", "121-three-byte", "600-two-byte"]
)
def test_a_long_name_is_echoed_as_the_proto_says(stock: Any, name: str) -> None:
    plan = plan_of([param(name, [4], {"normal": {"std": -1.0}})])
    with pytest.raises(grpc.RpcError) as caught:
        list(stock.Materialize(pb.MaterializeRequest(plan=plan), timeout=60))
    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    br, _ = _details(_status(err))
    shown = _echoed(name)
    assert len(shown.encode()) <= 48 and (shown == name) == (len(name.encode()) <= 48)
    want = f"params[0].init.normal ({shown!r}): "  # the name quoted as Python's repr() quotes it
    assert br.field_violations[0].description.startswith(want)
    assert want in err.details()  # the status message shows it the same way
    assert "A name over 48 UTF-8 bytes" in PROTO and "longest prefix of whole UTF-8 characters within 24 bytes" in PROTO
    assert '"... (N bytes)", N being the name\'s UTF-8 length' in PROTO


def test_a_name_over_the_length_limit_is_echoed_with_its_length(stock: Any) -> None:
    name = "n" * 1025
    with pytest.raises(grpc.RpcError) as caught:
        list(stock.Materialize(pb.MaterializeRequest(plan=plan_of([param(name, [4], {"zeros": {}})])), timeout=60))
    br, _ = _details(_status(caught.value))
    assert br.field_violations[0].description.startswith(f"params[0].name ({_echoed(name)!r}): ")


# -- known answers --------------------------------------------------------------------------------------------------

EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ONE_DIGEST = "12bfab35112c8b6bb0dd72c6982b58fc321bc8c73769d5c44aa9a29402dabecc"
ONE_CANONICAL = "0a 0c 0a 01 77 12 01 02 18 01 22 02 0a 00"
# (plan, digest, data_bytes, tensors as (name, dtype, shape, offset, nbytes), header_crc32c, packed header_crc32c)
HEADER_VECTORS: list[tuple[dict[str, Any], str, int, list[tuple[str, int, list[int], int, int]], int, int]] = [
    ({"params": []}, EMPTY_DIGEST, 0, [], 0x0176CB2C, 0xCFE2AF8D),
    ({"params": [{"name": "w", "shape": [2], "init": {"zeros": {}}}]}, ONE_DIGEST, 8, [("w", 1, [2], 0, 8)], 0x6E9337FD, 0x335047ED),
]


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _framed(b: bytes) -> bytes:
    return _u64(len(b)) + b


def _crc_of_table(digest: str, data_bytes: int, tensors: list[tuple[str, int, list[int], int, int]]) -> int:
    """header_crc32c with an empty prefix and TensorInfo messages, from init_service.proto's text alone."""
    covered = _framed(b"") + _framed(digest.encode()) + _u64(data_bytes)
    for name, dtype, shape, offset, nbytes in tensors:
        covered += _framed(name.encode()) + _u64(dtype) + _u64(len(shape)) + b"".join(map(_u64, shape))
        covered += _u64(offset) + _u64(nbytes)
    return int(crc32c.crc32c(covered))


def _crc_of_packed(digest: str, data_bytes: int, tensors: list[tuple[str, int, list[int], int, int]]) -> int:
    """header_crc32c with an empty prefix and a packed table, its columns built here as PackedTensors says."""
    columns = [
        b"".join(struct.pack("<I", len(t[0].encode())) for t in tensors),
        b"".join(t[0].encode() for t in tensors),
        bytes(t[1] for t in tensors),
        bytes(len(t[2]) for t in tensors),
        b"".join(_u64(d) for t in tensors for d in t[2]),
        b"".join(_u64(t[3]) for t in tensors),
        b"".join(_u64(t[4]) for t in tensors),
    ]
    covered = _framed(b"") + _framed(digest.encode()) + _u64(data_bytes) + b"".join(map(_framed, columns))
    return int(crc32c.crc32c(covered))


@pytest.mark.parametrize("vector", HEADER_VECTORS, ids=["empty-plan", "one-tensor"])
def test_the_header_checksum_known_answers(stock: Any, vector: Any) -> None:
    data, digest, data_bytes, tensors, crc, packed_crc = vector
    assert f"0x{crc:08X}" in PROTO and f"0x{packed_crc:08X}" in PROTO and f'"{digest}"' in PROTO
    assert hashlib.sha256(encode("Plan", data)).hexdigest() == digest  # the digest from plan.proto's text
    assert _crc_of_table(digest, data_bytes, tensors) == crc and _crc_of_packed(digest, data_bytes, tensors) == packed_crc
    plan = plan_from_dict(data)
    for packed, want in ((False, crc), (True, packed_crc)):
        messages = list(stock.Materialize(pb.MaterializeRequest(plan=plan, omit_safetensors_prefix=True, packed_table=packed), timeout=60))
        header = messages[0].header
        assert (header.plan_digest, header.data_bytes, header.header_crc32c) == (digest, data_bytes, want)
        assert not header.safetensors_prefix and header.header_parts == 0
        if not packed:
            assert [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in header.tensors] == tensors
    assert stock.Validate(pb.ValidateRequest(plan=plan), timeout=30).plan_digest == digest


def test_the_plan_digest_known_answers(stock: Any) -> None:
    one = {"params": [{"name": "w", "shape": [2], "init": {"zeros": {}}}]}
    canonical = bytes.fromhex(ONE_CANONICAL.replace(" ", ""))
    assert ONE_CANONICAL in PLAN_PROTO and ONE_DIGEST in PLAN_PROTO and EMPTY_DIGEST in PLAN_PROTO
    assert encode("Plan", one) == canonical and hashlib.sha256(canonical).hexdigest() == ONE_DIGEST
    assert hashlib.sha256(b"").hexdigest() == EMPTY_DIGEST
    for data, digest in ((one, ONE_DIGEST), ({"params": []}, EMPTY_DIGEST)):
        assert stock.Validate(pb.ValidateRequest(plan=plan_from_dict(data)), timeout=30).plan_digest == digest


def test_a_payload_digest_line_uses_the_dtype_names_the_proto_lists() -> None:
    from paraminit import dtypes
    from paraminit_server.plans.payloads import payload_sha256

    names = [d.name for d in dtypes.SUPPORTED]
    assert sorted(names) == sorted(["float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
    assert "float32, float64, float16, bfloat16, float8_e4m3fn or float8_e5m2" in PLAN_PROTO
    data = struct.pack("<2f", 1.0, -2.0)
    assert payload_sha256(dtypes.FLOAT32, data) == hashlib.sha256(b"float32\0" + data).hexdigest()


# -- load and retries -----------------------------------------------------------------------------------------------


def test_the_proto_retry_policy_is_the_clients() -> None:
    from paraminit_client.client import SERVICE_CONFIG

    start = PROTO.index('{"methodConfig"')
    stated, _ = json.JSONDecoder().raw_decode(PROTO[start:])
    assert stated == SERVICE_CONFIG
    assert "grpc-retry-pushback-ms" in PROTO and "-1 where no retry can help" in PROTO
    assert "half its remaining deadline" in PROTO and "--max-queued (32)" in PROTO and "--max-queue-wait (60 s" in PROTO


def test_a_plan_over_the_limits_is_refused_with_pushback_minus_one(stock: Any) -> None:
    huge = plan_of([param("huge", [1 << 33], {"zeros": {}})])  # 32 GiB of float32: over the default limits
    with pytest.raises(grpc.RpcError) as caught:
        list(stock.Materialize(pb.MaterializeRequest(plan=huge), timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(caught.value.trailing_metadata() or ())["grpc-retry-pushback-ms"] == "-1"


# -- small facts ----------------------------------------------------------------------------------------------------


def test_deliveries_and_device_info_on_a_cpu_server(stock: Any) -> None:
    plan = plan_of([param("w", [4], {"zeros": {}})])
    for delivery, code in ((pb.DELIVERY_CUDA_IPC, grpc.StatusCode.FAILED_PRECONDITION), (9, grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as caught:
            list(stock.Materialize(pb.MaterializeRequest(plan=plan, delivery=delivery), timeout=30))
        assert caught.value.code() == code
        assert not _status(caught.value).details  # no BadRequest
    info = stock.GetInfo(pb.GetInfoRequest(), timeout=30)
    assert (info.device.kind, info.device.ordinal, info.device.uuid) == ("cpu", -1, "")
    assert list(info.deliveries) == [pb.DELIVERY_STREAM, pb.DELIVERY_SHM]
    assert "-1 on a CPU server" in PROTO and "is FAILED_PRECONDITION, before the plan is validated" in PROTO


def test_an_shm_export_aligns_every_tensor_to_64_bytes(stock: Any) -> None:
    plan = plan_of([param("a", [1], {"ones": {}}), param("b", [3], {"ones": {}}, "float16"), param("c", [17], {"ones": {}})])
    (message,) = list(stock.Materialize(pb.MaterializeRequest(plan=plan, delivery=pb.DELIVERY_SHM), timeout=60))
    export = message.export
    try:
        assert [(t.name, t.offset, t.nbytes) for t in export.tensors] == [("a", 0, 4), ("b", 64, 6), ("c", 128, 68)]
        assert export.shm.size == 256
    finally:
        stock.Release(pb.ReleaseRequest(lease_id=export.lease.lease_id), timeout=30)
    assert "a multiple of 64 bytes for SHM and 256 for CUDA_IPC" in PROTO


def test_an_upload_reads_dtype_and_count_from_its_first_chunk_only(stock: Any) -> None:
    data = struct.pack("<4f", 0.0, 1.0, 2.0, 3.0)
    ref = stock.UploadPayload(
        iter([pb.PayloadChunk(dtype=1, count=4, data=data[:8]), pb.PayloadChunk(dtype=2, count=99, data=data[8:])]), timeout=30
    )
    assert ref.count == 4
    with pytest.raises(grpc.RpcError) as caught:
        stock.UploadPayload(iter([pb.PayloadChunk(dtype=1, count=4, data=data[:8])]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "later chunks' dtype and count are ignored" in PROTO


def test_flat_values_must_be_finite(stock: Any) -> None:
    for bad in ("NaN", "Infinity", "-Infinity"):
        plan = plan_from_dict({"params": [{"name": "f", "shape": [2], "init": {"flat": {"values": [1.0, bad]}}}]})
        r = stock.Validate(pb.ValidateRequest(plan=plan), timeout=30)
        assert not r.valid and [v.field for v in r.violations] == ["params[0].init.flat.values"]
    assert "each finite (a NaN or an infinity is a violation at params[i].init.flat.values)" in PLAN_PROTO


def test_a_safetensors_path_is_read_as_the_proto_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Absolute, or relative to the server's working directory; '..' folded as text; strictly beneath an allowed
    directory; and nothing at all without one."""
    allowed = tmp_path / "ck"
    allowed.mkdir()
    header = json.dumps({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    (allowed / "a.safetensors").write_bytes(_u64(len(header)) + header + struct.pack("<2f", 1.0, 2.0))
    monkeypatch.chdir(tmp_path)

    def valid(path: str, **config: Any) -> bool:
        plan = plan_from_dict({"params": [{"name": "s", "shape": [2], "init": {"safetensors": {"path": path, "tensor": "t"}}}]})
        with running_server(**config) as r, grpc.insecure_channel(target_of(r)) as channel:
            resp = pb_grpc.InitServiceStub(channel).Validate(pb.ValidateRequest(plan=plan), timeout=30)
        assert resp.valid or [v.field for v in resp.violations] == ["params[0].init.safetensors"]
        return bool(resp.valid)

    dirs = {"safetensors_dirs": str(allowed)}
    assert valid(str(allowed / "a.safetensors"), **dirs) and valid("ck/a.safetensors", **dirs)
    assert valid("./ck/../ck/a.safetensors", **dirs)
    assert not valid("a.safetensors", **dirs) and not valid("ck", **dirs)
    assert not valid(str(allowed / "a.safetensors"))  # no --safetensors-dirs: no file
    assert "relative to the server process's working directory" in PLAN_PROTO


# -- compatibility with the released contract (tests/contract_compat.py, run by `make lint`) -----------------------


def test_the_contract_keeps_what_released_clients_rely_on() -> None:
    import contract_compat as cc

    assert cc.breaks(cc.load(cc.RELEASED), cc.load(cc.CURRENT)) == []


def test_the_compatibility_check_names_each_kind_of_break() -> None:
    """Each kind of break is found on an edited copy of the contract; additions and reserved deletions are not."""
    import contract_compat as cc
    from google.protobuf import descriptor_pb2

    base = cc.load(cc.CURRENT)
    plan_file, service_file = base.file[0], base.file[1]
    assert plan_file.name.endswith("plan.proto") and service_file.name.endswith("init_service.proto")

    def edited(edit: Any) -> list[str]:
        fds = descriptor_pb2.FileDescriptorSet()
        fds.CopyFrom(base)
        edit(fds.file[0], fds.file[1])
        return cc.breaks(base, fds)

    def message(f: Any, name: str) -> Any:
        return next(m for m in f.message_type if m.name == name)

    def field(m: Any, name: str) -> Any:
        return next(x for x in m.field if x.name == name)

    def delete_field(p: Any, s: Any, reserve: bool = False) -> None:
        m = message(p, "Param")
        f = field(m, "dtype")
        m.field.remove(f)
        if reserve:
            m.reserved_range.add(start=f.number, end=f.number + 1)
            m.reserved_name.append(f.name)

    def retype(p: Any, s: Any) -> None:
        field(message(p, "Param"), "name").type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES

    def rename(p: Any, s: Any) -> None:
        f = field(message(p, "Param"), "name")
        f.name, f.json_name = "label", "label"

    def drop_value(p: Any, s: Any) -> None:
        del p.enum_type[0].value[-1]

    def rename_value(p: Any, s: Any) -> None:
        p.enum_type[0].value[-1].name = "DTYPE_RENAMED"

    def unstream(p: Any, s: Any) -> None:
        next(r for r in s.service[0].method if r.name == "Materialize").server_streaming = False

    def drop_message(p: Any, s: Any) -> None:
        p.message_type.remove(message(p, "Range"))

    def add(p: Any, s: Any) -> None:
        message(p, "Param").field.add(name="added_later", json_name="addedLater", number=999, type=9, label=1)
        p.enum_type[0].value.add(name="DTYPE_ADDED_LATER", number=999)

    found = {
        "field": edited(delete_field),
        "type": edited(retype),
        "rename": edited(rename),
        "value": edited(drop_value),
        "value name": edited(rename_value),
        "streaming": edited(unstream),
        "message": edited(drop_message),
    }
    assert all(len(lines) == 1 for lines in found.values()), found
    assert "Param.dtype (field 3) deleted without reserving" in found["field"][0]
    assert "TYPE_STRING" in found["type"][0] and "TYPE_BYTES" in found["type"][0]
    assert "'name', 'name'" in found["rename"][0] and "'label', 'label'" in found["rename"][0]
    assert "deleted without reserving it" in found["value"][0] and "renamed DTYPE_RENAMED" in found["value name"][0]
    assert "InitService/Materialize: types or streaming changed" in found["streaming"][0]
    assert found["message"] == ["message .paraminit.v1.Range deleted"]
    assert edited(lambda p, s: delete_field(p, s, reserve=True)) == []
    assert edited(add) == []
