"""The packed tensor table (init_service.proto, PackedTensors): columns that round-trip whatever the names, ranks
and split, a checksum that catches a flipped byte, and the client's arrays equal to the message form's."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from paraminit import packed_table
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.rpc import service
from support import server_fixture

server = server_fixture()


def _rows(n: int) -> tuple[list[str], list[int], list[tuple[int, ...]], list[int], list[int]]:
    rng = np.random.default_rng(5)
    names = [f"layer.{i}" + ("ü✓" if i % 7 == 0 else "") + "x" * int(rng.integers(0, 40)) for i in range(n)]
    shapes = [tuple(int(d) for d in rng.integers(0, 9, int(rng.integers(0, 6)))) for _ in range(n)]
    enums = [int(e) for e in rng.integers(1, 5, n)]
    offsets = [int(o) for o in rng.integers(0, 1 << 40, n)]
    sizes = [int(o) for o in rng.integers(0, 1 << 40, n)]
    return names, enums, shapes, offsets, sizes


@pytest.mark.parametrize("n", [0, 1, 5000])
@pytest.mark.parametrize("budget", [64, 4096, 1 << 20])
def test_columns_round_trip_at_any_split(n: int, budget: int) -> None:
    rows = _rows(n)
    packed = packed_table.pack(*rows)
    groups = packed_table.split(packed, budget)
    assert sum(g.count for g in groups) == n and all(g.count for g in groups if n)
    if n > 1 and budget == 64:
        assert len(groups) > 1
    for g in groups:  # each group is within the budget, unless one tensor alone is larger
        size = sum(len(getattr(g, c)) for c in packed_table.COLUMNS)
        assert size <= budget or g.count == 1
    joined = packed_table.join([pb.PackedTensors(**g.fields()) for g in groups])
    assert joined == packed
    assert packed_table.Table(joined).columns() == rows


def test_columns_that_disagree_are_refused() -> None:
    packed = packed_table.pack(*_rows(10))
    short = packed_table.Packed(**{**packed.fields(), "offsets": packed.offsets[:-8]})
    with pytest.raises(ValueError, match="do not agree"):
        packed_table.Table(short)


def test_the_checksum_covers_every_column() -> None:
    packed = packed_table.pack(*_rows(50))
    base = packed_table.checksum(b"prefix", "digest", 123, packed)
    for c in packed_table.COLUMNS:
        col = bytearray(getattr(packed, c))
        col[len(col) // 2] ^= 1
        flipped = packed_table.Packed(**{**packed.fields(), c: bytes(col)})
        assert packed_table.checksum(b"prefix", "digest", 123, flipped) != base, c
    assert packed_table.checksum(b"prefix", "digest", 124, packed) != base


def test_a_client_gets_the_same_arrays_packed_or_not(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_of(
        [
            param(f"e{i}.w", [4, 4] if i % 2 else [3], {"normal": {"std": 1.0, "seed": i}}, "float16" if i % 3 == 0 else "float32")
            for i in range(3000)
        ]
        + [param("big", [64, 64], {"uniform": {"lo": -1, "hi": 1}}, "float64")]
    )
    packed = client.materialize(plan)
    assert list(packed) == [p.name for p in plan.params]
    with Client() as local:
        want = local.materialize(plan)
    assert all(packed[k].dtype == want[k].dtype and packed[k].tobytes() == want[k].tobytes() for k in want)
    outs = {k: np.full_like(v, 7) for k, v in want.items()}
    client.materialize_into(plan, outs)
    assert all(outs[k].tobytes() == want[k].tobytes() for k in want)
    header, _chunks = client.stream(plan)  # the public stream keeps the TensorInfo table and the file's prefix
    assert len(header.tensors) == len(plan.params) and not header.HasField("packed_tensors")
    assert header.safetensors_prefix.startswith(len(header.safetensors_prefix[8:]).to_bytes(8, "little"))


def test_a_corrupted_packed_header_is_data_loss(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    real = service._header

    def corrupt(start: Any, packed: bool = False, omit_prefix: bool = False) -> Any:
        header, groups = real(start, packed, omit_prefix)
        if groups:
            g = groups[0]
            groups[0] = packed_table.Packed(**{**g.fields(), "dtypes": bytes([3]) + g.dtypes[1:]})
        return header, groups

    monkeypatch.setattr(service, "_header", corrupt)
    with pytest.raises(ParaminitError) as err:
        client.materialize(plan_of([param("w", [8], {"ones": {}})]))
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.message


def test_runs_are_the_row_by_row_runs() -> None:
    """Runs by shape ids (a packed Table) and by comparing shapes (plain columns) agree, on random tables and on
    one built to have long runs broken by every kind of change (gap, size, dtype, shape)."""

    def by_rows(enums: list[int], shapes: list[Any], offsets: list[int], sizes: list[int]) -> list[Any]:
        out, i = [], 0
        while i < len(enums):
            j = i + 1
            while (
                j < len(enums)
                and (enums[j], shapes[j], sizes[j]) == (enums[i], shapes[i], sizes[i])
                and offsets[j] == offsets[j - 1] + sizes[j - 1]
            ):
                j += 1
            out.append(packed_table.Run(i, j, enums[i], shapes[i], offsets[i], sizes[i]))
            i = j
        return out

    rows = _rows(3000)
    assert packed_table.Table(packed_table.pack(*rows)).runs() == packed_table.runs(*rows[1:]) == by_rows(*rows[1:])
    n = 400
    shapes = [(4, 4) if i < 150 or i >= 170 else (16,) for i in range(n)]
    enums = [1 if i != 300 else 2 for i in range(n)]
    sizes = [64] * n
    offsets = [64 * i + (8 if i >= 250 else 0) for i in range(n)]
    table = packed_table.Table(packed_table.pack([f"t{i}" for i in range(n)], enums, shapes, offsets, sizes))
    runs = table.runs()
    assert runs == packed_table.runs(enums, shapes, offsets, sizes) == by_rows(enums, shapes, offsets, sizes)
    assert [(r.first, r.stop) for r in runs] == [(0, 150), (150, 170), (170, 250), (250, 300), (300, 301), (301, 400)]


def test_scalars_are_zero_dimensional_views(client: Client) -> None:
    """Runs of scalar parameters come back as 0-d arrays viewing the delivered buffer, like every other tensor,
    in process and through a server (packed table): not numpy scalars, which are copies of another type."""
    plan = plan_of([param(f"s{i}", [], {"normal": {"std": 1.0, "seed": i}}) for i in range(1500)] + [param("v", [3], {"ones": {}})])
    with Client() as local:
        for got in (local.materialize(plan), client.materialize(plan)):
            scalars = [got[f"s{i}"] for i in range(1500)]
            assert all(type(a) is np.ndarray and a.shape == () for a in scalars)
            assert len({float(a) for a in scalars}) > 1000  # real values, not one repeated
            base = scalars[0].base
            assert base is not None and all(a.base is base for a in scalars[1:])  # views of one run
            scalars[1][()] = 42.0
            assert float(got["s1"]) == 42.0
