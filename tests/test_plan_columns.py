"""Large plans read as columns (plans/scanner.py, plans/columns.py) give exactly what the per-parameter path gives:
the same violations, sizes, digest, layout, header and bytes, whatever mix of parameters the plan holds."""

from __future__ import annotations

import hashlib
import math
from typing import Any
from unittest import mock

import numpy as np
import pytest
import reference

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_client.arrays import arrays_from_buffer
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.plane import engine, layout
from paraminit_server.plans import columns, scanner, validation
from paraminit_server.plans import plan as planlib
from paraminit_server.plans.columns import ParamTable
from support import poisoned

BACKEND = CpuBackend()
N = max(columns.SCAN_MIN, 1024) + 200  # large enough that slabs cut many tensors
INITS = [
    "normal",
    "uniform",
    "zeros",
    "ones",
    "xavier_uniform",
    "kaiming_uniform",
    "truncated_normal",
    "xavier_uniform_for_shape",
    "kaiming_uniform_for_shape",
    "flat",
]


def _param(rng: np.random.Generator, i: int, valid: bool) -> plan_pb2.Param:
    """A random parameter: every kind, dtype (omitted too) and rank, some with regions or patches; when not
    `valid`, some break one rule each."""
    rank = int(rng.choice([0, 1, 2, 2, 2, 3]))
    shape = [int(rng.integers(0 if i % 97 == 5 else 1, 9)) for _ in range(rank)]
    p = plan_pb2.Param(name=f"layer{i // 7}.w{i % 7}", shape=shape)
    dt = int(rng.integers(0, 5))
    if dt:
        p.dtype = dt  # type: ignore[assignment]
    kind = INITS[int(rng.integers(0, len(INITS)))]
    if kind.endswith("for_shape") and rank < 2:
        kind = "normal"
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    init = getattr(p.init, kind)
    init.SetInParent()
    if kind == "normal":
        init.mean, init.std, init.seed = float(rng.normal()), float(rng.choice([0.02, 1.0, 0.0, 1e-310])), seed
    elif kind == "uniform":
        lo = float(rng.normal())
        init.lo, init.hi, init.seed = lo, lo + float(rng.choice([0.0, 0.5, 3.0])), seed
    elif kind == "truncated_normal":
        init.mean, init.std, init.lo, init.hi, init.seed = 0.0, 0.5, -1.0, 2.0, seed
    elif kind == "xavier_uniform":
        init.fan_in, init.fan_out, init.seed = int(rng.integers(0, 3)) * int(rng.integers(1, 2**60)), 7, seed
    elif kind == "kaiming_uniform":
        init.fan_in, init.seed = int(rng.integers(0, 2)) * int(rng.integers(1, 2**63)), seed
    elif kind == "flat":
        init.values.extend(rng.normal(size=math.prod(shape)).tolist())
    elif kind.endswith("for_shape"):
        init.seed = seed
    if rank and i % 13 == 0 and all(shape):
        p.region.add(start=0, stop=shape[0])
        for d in shape[1:]:
            p.region.add(start=d // 2, stop=d)
    if rank and i % 17 == 0 and all(shape):
        q = p.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
        for d in shape:
            q.box.add(start=0, stop=1 + d // 2)
        if i % 34 == 0:  # the box as part of a tensor of its own
            q.part.shape.append(math.prod(1 + d // 2 for d in shape) + 3)
            q.part.start = 2
    if not valid and i % 11 == 3:
        breakage = (i // 11) % 9
        if breakage == 0:
            p.name = ""
        elif breakage == 1:
            p.name = "layer0.w0"  # a repeated name
        elif breakage == 2:
            p.dtype = 9  # type: ignore[assignment]
        elif breakage == 3:
            p.init.normal.std = -1.0
        elif breakage == 4:
            p.init.uniform.lo, p.init.uniform.hi = 2.0, 1.0
        elif breakage == 5:
            p.init.truncated_normal.std, p.init.truncated_normal.lo = float("nan"), 0.0
        elif breakage == 6:
            p.ClearField("init")
        elif breakage == 7:
            p.name = "n" * 2000
        else:
            p.name = "__metadata__"  # reserved
    return p


def _row_by_row(plan: plan_pb2.Plan, limits: validation.Limits | None = None) -> validation.Checked:
    """The sweep with every row read from the message, as a plan too small to scan is."""
    with mock.patch.object(columns, "SCAN_MIN", 1 << 62):
        got = validation.check(plan, limits)
    assert got.params is None or not bool(got.params.plain.any())
    return got


def _table(got: validation.Checked) -> ParamTable:
    assert got.params is not None
    return got.params


def _plan(seed: int, valid: bool) -> plan_pb2.Plan:
    rng = np.random.default_rng(seed)
    return plan_pb2.Plan(params=[_param(rng, i, valid) for i in range(N)])


@pytest.mark.parametrize("seed", [1, 2])
def test_invalid_plans_report_the_same_violations(seed: int) -> None:
    plan = _plan(seed, valid=False)
    cols = columns.of(plan)
    assert cols is not None and 0 < int(cols.plain.sum()) < len(plan.params)
    limits = validation.Limits(max_param_bytes=600)
    got, want = validation.check(plan, limits, resolve=False).report, _row_by_row(plan, limits).report
    assert len(want.violations) > 20 and got == want
    assert validation.check(plan, resolve=False).digest == _row_by_row(plan).digest


def _stream(params: Any, digest: str) -> tuple[layout.Layout, np.ndarray[Any, Any]]:
    lay = layout.stream_layout(params, digest)
    buf = poisoned(lay.data_bytes, np.dtype(np.uint8))
    engine.fill_params(BACKEND, lay.params, buf, lay.offsets)
    return lay, buf


@pytest.mark.parametrize("seed", [3, 4])
def test_valid_plans_give_the_same_bytes_layout_and_tables(seed: int) -> None:
    plan = _plan(seed, valid=True)
    cols = columns.of(plan)
    assert cols is not None and validation.check(plan, resolve=False).report == _row_by_row(plan).report
    digest = validation.check(plan, resolve=False).digest
    assert digest == _row_by_row(plan).digest
    table, listed = _table(validation.check(plan)), _table(_row_by_row(plan))
    assert isinstance(table, ParamTable) and len(table.special) < len(plan.params) // 3
    assert [(p.name, p.out_shape, p.dtype, p.formula, p.p0, p.p1, p.key, p.lo, p.hi, p.seed) for p in table] == [
        (p.name, p.out_shape, p.dtype, p.formula, p.p0, p.p1, p.key, p.lo, p.hi, p.seed) for p in listed
    ]
    # the kernels a server readies before admitting the call: read from the columns, as row by row
    assert table.kinds() == planlib.kinds_of(listed) and len(table.kinds()) > 3
    (lay, got), (want_lay, want) = _stream(table, digest), _stream(listed, digest)
    assert lay.prefix == want_lay.prefix and list(np.asarray(lay.offsets)) == list(want_lay.offsets)
    assert lay.data_bytes == want_lay.data_bytes and np.array_equal(got, want)
    assert list(lay.spans()) == want_lay.spans()
    arrays, want_arrays = arrays_from_buffer(lay.spans(), got), arrays_from_buffer(want_lay.spans(), want)
    assert list(arrays) == list(want_arrays)
    for name, a in arrays.items():
        b = want_arrays[name]
        assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    # and against the spec's reference, for the plain parameters of a few shapes
    for rp in [table[i] for i in np.flatnonzero(table.plain)[:40].tolist()]:
        ref = reference.materialize(rp).reshape(-1)
        assert arrays[rp.name].reshape(-1).view(np.uint8).tobytes() == ref.view(np.uint8).tobytes(), rp.name


def test_unknown_fields_and_an_empty_plan() -> None:
    """A parameter or initializer carrying a field this server does not know is read from the message; the
    canonical bytes drop it, as the contract says."""
    plan = plan_pb2.Plan(params=[plan_pb2.Param(name=f"p{i}", shape=[3, 4]) for i in range(N)])
    for p in plan.params:
        p.init.normal.std = 0.5
    extra = plan_pb2.Param()
    extra.ParseFromString(plan.params[5].SerializeToString() + b"\x78\x01")  # field 15, varint 1
    plan.params[5].CopyFrom(extra)
    normal = plan_pb2.Normal()
    normal.ParseFromString(plan.params[9].init.normal.SerializeToString() + b"\x30\x07")  # field 6
    plan.params[9].init.normal.CopyFrom(normal)
    cols = columns.of(plan)
    assert cols is not None
    assert not cols.plain[5] and not cols.plain[9] and bool(cols.plain[10])
    assert scanner.canonical(plan, cols.scan) == reference.canonical(plan) != plan.SerializeToString(deterministic=True)
    assert validation.check(plan, resolve=False).digest == _row_by_row(plan).digest
    table = _table(validation.check(plan))
    assert isinstance(table, ParamTable) and sorted(table.special) == [5, 9]
    assert columns.of(plan_pb2.Plan()).scan is None


def test_scan_reads_names_with_nul_and_non_ascii() -> None:
    plan = plan_pb2.Plan(params=[plan_pb2.Param(name=f"é{i}\x00x" if i % 2 else f"名{i}", shape=[2]) for i in range(N)])
    for p in plan.params:
        p.init.zeros.SetInParent()
    s = scanner.scan(plan)
    assert s.names() == [p.name for p in plan.params]
    assert s.shapes() == [(2,)] * N


def test_dtype_sizes_match_the_dtype_table() -> None:
    plan = plan_pb2.Plan(
        params=[
            plan_pb2.Param(name=f"p{i}", shape=[5, 3], dtype=d.enum)  # type: ignore[arg-type]
            for i in range(N)
            for d in [dtypes.SUPPORTED[i % len(dtypes.SUPPORTED)]]
        ]
    )
    for p in plan.params:
        p.init.ones.SetInParent()
    cols = columns.of(plan)
    assert cols is not None and cols.nbytes.tolist() == [
        15 * dtypes.by_enum(p.dtype).itemsize  # type: ignore[union-attr]
        for p in plan.params
    ]


@pytest.mark.parametrize("count", [1, 3, N], ids=["one", "three", "scanned"])
def test_canonical_bytes_are_the_contracts(count: int) -> None:
    """Plans of plain parameters, some with their dtype omitted, small or scanned, and with regions and patches
    after the dtype: one compiled pass writes the canonical bytes plan.proto states, scan or no scan."""
    rng = np.random.default_rng(9)
    plan = plan_pb2.Plan(
        params=[
            plan_pb2.Param(name=f"p{i}", shape=[int(rng.integers(1, 300))] * (i % 3), dtype=int(rng.integers(0, 5)))  # type: ignore[arg-type]
            for i in range(count)
        ]
    )
    for i, p in enumerate(plan.params):
        p.init.normal.std, p.init.normal.seed = 0.02, i * 1000003
    plan.params[0].dtype = plan_pb2.DTYPE_UNSPECIFIED
    want = reference.canonical(plan)
    assert want != plan.SerializeToString(deterministic=True)
    assert scanner.canonical(plan) == want and scanner.canonical(plan, scanner.scan(plan)) == want
    cols = columns.of(plan)
    assert cols.scan is None or bool(cols.plain.all())
    assert validation.check(plan, resolve=False).digest == _row_by_row(plan).digest == hashlib.sha256(want).hexdigest()
    # a region and patches (fields after the dtype, and after init) and no init: the dtype goes before them
    plan.params[-1].region.add(start=0, stop=1)
    plan.params[0].ClearField("init")
    plan.params[0].patches.add().init.zeros.SetInParent()
    assert scanner.canonical(plan, scanner.scan(plan)) == reference.canonical(plan)
    assert scanner.canonical(plan_pb2.Plan()) == b""


@pytest.mark.parametrize("slab", [8 * 97, 8 * 997])
def test_streamed_slabs_match_the_per_parameter_path(slab: int) -> None:
    """Slabs cut tensors anywhere: the whole plain tensors of a slab come from the columns, the cut ones (and
    regions, patches, data) from their ResolvedParam; the bytes are the per-parameter path's."""
    plan = _plan(5, valid=True)
    digest = _row_by_row(plan).digest
    table, listed = _table(validation.check(plan)), _table(_row_by_row(plan))
    assert isinstance(table, ParamTable)

    def streamed(params: Any) -> bytes:
        lay = layout.stream_layout(params, digest)
        return b"".join(bytes(s) for _, s in engine.iter_slabs(BACKEND, lay, slab, lambda: False))

    got, want = streamed(table), streamed(listed)
    assert len(got) > 10 * slab and got == want
    assert got == _stream(listed, digest)[1].tobytes()


@pytest.mark.parametrize("extra", [b"\x20\x05", b"\x19" + bytes(8), b"\x08\x07"], ids=["number", "seed", "mean"])
def test_unknown_initializer_fields_leave_the_digest_alone(extra: bytes) -> None:
    """plan.proto: unknown fields are dropped from the canonical form. A field the kind does not declare (field 4
    of Normal), or a declared one with another wire type (seed as fixed64, mean as a varint), is kept by protobuf
    as unknown: the scan must not copy it into the digest's bytes."""
    plan = plan_pb2.Plan(
        params=[
            plan_pb2.Param(name=f"p{i}", shape=[4], init=plan_pb2.Init(normal=plan_pb2.Normal(std=1.0, seed=i)))
            for i in range(columns.SCAN_MIN + 8)
        ]
    )
    plain_digest = _row_by_row(plan).digest
    odd = plan.params[5].init.normal
    odd.MergeFromString(extra)
    assert extra in odd.SerializeToString()  # kept as an unknown field, and sent on
    cols = columns.of(plan)
    assert cols is not None
    assert validation.check(plan, resolve=False).digest == _row_by_row(plan).digest == plain_digest
