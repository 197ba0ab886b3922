"""Param.patches: fixed elements over a base initializer, exact at any window, chunk, region and export."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import reference

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_client import Client
from paraminit_server.plane import engine, layout
from paraminit_server.plans import plan as planlib
from paraminit_server.plans import validation
from paraminit_server.rpc.server import Running
from support import digest_of, poisoned, resolved, server_fixture, target_of

server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)

Box = list[tuple[int, int]]
Part = tuple[list[int], int]  # Patch.part: (shape, start)


def _base(p: plan_pb2.Param) -> Any:
    """A parameter resolved without its patches: the base values they patch."""
    q = plan_pb2.Param()
    q.CopyFrom(p)
    del q.patches[:]
    return planlib.resolve_unchecked(0, q)


def param(
    name: str,
    shape: list[int],
    init: dict[str, Any],
    patches: list[tuple[Box, dict[str, Any]] | tuple[Box, dict[str, Any], Part]],
    dtype: str = "float32",
    region: Box | None = None,
) -> plan_pb2.Param:
    from google.protobuf import json_format

    p = plan_pb2.Param(name=name, shape=shape, dtype=dtypes.by_name(dtype).enum)
    json_format.ParseDict(init, p.init)
    for lo, hi in region or []:
        p.region.add(start=lo, stop=hi)
    for box, pinit, *part in patches:
        q = p.patches.add()
        for lo, hi in box:
            q.box.add(start=lo, stop=hi)
        json_format.ParseDict(pinit, q.init)
        if part:
            q.part.shape.extend(part[0][0])
            q.part.start = part[0][1]
    return p


def patched_plan() -> plan_pb2.Plan:
    return plan_pb2.Plan(
        params=[
            # padding_idx rows 0 and 5 of an embedding
            param(
                "emb", [11, 7], {"normal": {"std": 0.02, "seed": 1}}, [([(0, 1), (0, 7)], {"zeros": {}}), ([(5, 6), (0, 7)], {"zeros": {}})]
            ),
            # a column (one element per run), then an overlapping seeded block that wins over it
            param(
                "col",
                [9, 13],
                {"uniform": {"lo": -1, "hi": 1, "seed": 2}},
                [([(0, 9), (4, 5)], {"ones": {}}), ([(2, 6), (3, 8)], {"normal": {"mean": 3, "std": 0.5, "seed": 9}})],
                dtype="bfloat16",
            ),
            # a region (row and column shard) the patches only partly overlap
            param(
                "shard",
                [6, 10, 4],
                {"kaimingUniformForShape": {"seed": 3}},
                [
                    ([(1, 3), (0, 10), (0, 4)], {"uniform": {"lo": 7, "hi": 7, "seed": 0}}),
                    ([(0, 6), (8, 10), (2, 3)], {"zeros": {}}),
                    ([(5, 6), (0, 1), (0, 1)], {"ones": {}}),
                ],
                dtype="float16",
                region=[(1, 6), (2, 10), (0, 4)],
            ),
            # a patch wholly outside the region changes nothing
            param(
                "outside",
                [8, 3],
                {"normal": {"std": 1, "seed": 4}},
                [([(0, 2), (0, 3)], {"ones": {}})],
                dtype="float64",
                region=[(4, 8), (0, 3)],
            ),
            param("plain", [5], {"normal": {"std": 1, "seed": 5}}, []),
            # many short runs (columns of a row shard): their span is generated at once and the columns taken from it
            param(
                "cols",
                [64, 33],
                {"uniform": {"lo": -1, "hi": 1, "seed": 8}},
                [
                    ([(0, 64), (5, 6)], {"ones": {}}),
                    ([(10, 50), (10, 13)], {"normal": {"std": 2, "seed": 11}}),
                    ([(0, 64), (32, 33)], {"truncatedNormal": {"std": 1, "lo": -1, "hi": 1, "seed": 12}}),
                ],
                region=[(3, 61), (0, 33)],
            ),
            # a truncated normal patch over a truncated normal base (the base of an embedding's rows 2..4)
            param(
                "trunc",
                [6, 9],
                {"truncatedNormal": {"std": 0.02, "lo": -0.04, "hi": 0.04, "seed": 6}},
                [([(2, 5), (1, 8)], {"truncatedNormal": {"mean": 1, "std": 0.5, "lo": 0.5, "hi": 1.6, "seed": 7}})],
                dtype="bfloat16",
            ),
            # a fused tensor, read as a row and column shard: two parts side by side along dimension 1 (a w13
            # holding w1 and w3), the second from an offset into its tensor, a for-shape initializer taking the
            # part's fans, and a plain patch over both
            param(
                "fused",
                [3, 8, 5],
                {"ones": {}},
                [
                    ([(0, 3), (0, 4), (0, 5)], {"normal": {"std": 1, "seed": 21}}, ([3, 4, 5], 0)),
                    ([(0, 3), (4, 8), (0, 5)], {"kaimingUniformForShape": {"seed": 22}}, ([7, 4, 5], 60)),
                    ([(2, 3), (6, 7), (0, 2)], {"zeros": {}}),
                ],
                dtype="bfloat16",
                region=[(1, 3), (1, 7), (1, 5)],
            ),
            # many short runs of a part (a column of a fused tensor): generated as one span of the part's values
            param(
                "fused_cols",
                [64, 33],
                {"zeros": {}},
                [
                    ([(0, 64), (5, 6)], {"uniform": {"lo": -1, "hi": 1, "seed": 23}}, ([80], 3)),
                    ([(0, 64), (7, 9)], {"normal": {"std": 1, "seed": 24}}, ([64, 2], 0)),
                ],
                region=[(3, 61), (0, 33)],
            ),
        ]
    )


def expected(p: plan_pb2.Param) -> np.ndarray[Any, Any]:
    """The oracle: base values, then each patch over the elements of its box (by global coordinates)."""
    base = _base(p)
    g = reference.global_indices(base)
    values = reference.values_f64(base, g)
    coords = np.unravel_index(g, base.shape)
    for q in p.patches:
        inside = np.ones(g.shape, dtype=bool)
        for c, r in zip(coords, q.box, strict=True):
            inside &= (c >= r.start) & (c < r.stop)
        if q.HasField("part"):  # element k of the box (row-major over the box) is element start + k of the part
            in_box = tuple(c[inside] - r.start for c, r in zip(coords, q.box, strict=True))
            k = np.ravel_multi_index(in_box, tuple(r.stop - r.start for r in q.box)) + q.part.start
            part = _base(plan_pb2.Param(name=p.name, shape=q.part.shape, dtype=p.dtype, init=q.init))
            values[inside] = reference.values_f64(part, k.astype(np.int64))
            continue
        own = plan_pb2.Param(name=p.name, shape=p.shape, dtype=p.dtype, init=q.init, region=p.region)
        values[inside] = reference.values_f64(_base(own), g)[inside]
    return reference.cast(values, base.dtype).reshape(base.out_shape)


def test_validation_reports_every_bad_patch() -> None:
    p = param(
        "w",
        [4, 5],
        {"zeros": {}},
        [
            ([(0, 1)], {"ones": {}}),  # wrong rank
            ([(2, 2), (0, 9)], {"ones": {}}),  # empty, out of bounds
            ([(0, 1), (0, 5)], {"flat": {"values": [0.0]}}),  # flat kinds are refused
            ([(0, 1), (0, 5)], {"normal": {"std": -1}}),  # the initializer's own rules
            ([(0, 1), (0, 5)], {}),  # unset
            ([(0, 1), (0, 5)], {"truncatedNormal": {"std": 1, "lo": -0.4, "hi": 1}}),  # bounds too tight
        ],
    )
    report = validation.check(plan_pb2.Plan(params=[p]), resolve=False).report
    fields = sorted(v.field for v in report.violations)
    assert fields == [
        "params[0].patches[0].box",
        "params[0].patches[1].box[0]",
        "params[0].patches[1].box[1]",
        "params[0].patches[2].init.flat",
        "params[0].patches[3].init.normal",
        "params[0].patches[4].init",
        "params[0].patches[5].init.truncatedNormal",
    ], fields
    assert validation.check(patched_plan(), resolve=False).report.ok


def test_digest_covers_patches() -> None:
    a = patched_plan()
    b = patched_plan()
    b.params[0].patches[1].box[0].start = 4
    assert digest_of(a) != digest_of(b)


@pytest.mark.parametrize("window", [8, 16, 24, 40, 1000, 1 << 20])
def test_every_window_is_exact(cpu_backend: Any, window: int) -> None:
    """Stream-style fills: windows of any multiple of 8 bytes, split inside runs and between patches."""
    plan = patched_plan()
    lay = layout.stream_layout(resolved(plan), digest_of(plan))
    got = filled_in_windows(cpu_backend, lay, plan, window)
    for p in plan.params:
        assert got[p.name] == expected(p).tobytes(), p.name


def filled_in_windows(backend: Any, lay: Any, plan: plan_pb2.Plan, window: int) -> dict[str, bytes]:
    """Each parameter's bytes from a poisoned stream buffer filled `window` bytes at a time."""
    buf = poisoned(lay.data_bytes, np.dtype(np.uint8))
    for start in range(0, lay.data_bytes, window):
        engine.fill_window(backend, lay, buf[start : start + window], start)
    out = {}
    for pl, p in zip(lay.placements, plan.params, strict=True):
        rp = pl.param
        out[p.name] = buf[pl.offset : pl.offset + rp.nbytes].view(rp.dtype.storage).reshape(rp.out_shape).tobytes()
    return out


def test_whole_arena_is_exact(cpu_backend: Any) -> None:
    plan = patched_plan()
    lay = layout.export_layout(resolved(plan))
    buf = poisoned(lay.data_bytes, np.dtype(np.uint8))
    engine.fill_all(cpu_backend, lay, buf)
    for pl, p in zip(lay.placements, plan.params, strict=True):
        rp = pl.param
        got = buf[pl.offset : pl.offset + rp.nbytes].view(rp.dtype.storage).reshape(rp.out_shape)
        assert got.tobytes() == expected(p).tobytes(), p.name


def test_long_patch_work_looks_at_cancellation(cpu_backend: Any) -> None:
    """Patches of many runs stop inside the work once the caller is gone (they kept their slot past the
    deadline before): span pieces and runs one by one both look at should_stop."""
    from paraminit_server import errors

    plan = plan_pb2.Plan(
        params=[
            param(
                "w",
                [4096, 512],
                {"zeros": {}},
                [([(0, 4096), (c, c + 1)], {"ones": {}}) for c in range(0, 512, 2)] + [([(0, 4096), (0, 300)], {"ones": {}})],
            )
        ]
    )
    rp = resolved(plan)[0]
    out = np.zeros(rp.numel, dtype=np.float32)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    with pytest.raises(errors.Cancelled):
        engine.apply_patches(cpu_backend, rp, out, 0, stop)
    assert len(calls) == 4
    engine.apply_patches(cpu_backend, rp, out, 0, lambda: False)  # and done whole, every column is set
    grid = out.reshape(4096, 512)
    assert (grid[:, 0:512:2] == 1).all() and (grid[:, :300] == 1).all() and (grid[:, 301:512:2] == 0).all()


def test_patches_change_what_they_cover_only(cpu_backend: Any) -> None:
    """The oracle is not vacuous: the padding rows differ from the unpatched parameter, the rest does not."""
    p = patched_plan().params[0]
    bare = plan_pb2.Param()
    bare.CopyFrom(p)
    del bare.patches[:]
    with_rows, without = expected(p), expected(bare)
    assert not with_rows[[0, 5]].any() and without[[0, 5]].all()
    np.testing.assert_array_equal(np.delete(with_rows, [0, 5], axis=0), np.delete(without, [0, 5], axis=0))


def _check(arrays: dict[str, Any], plan: plan_pb2.Plan) -> None:
    for p in plan.params:
        want = expected(p)
        assert np.asarray(arrays[p.name]).view(want.dtype).tobytes() == want.tobytes(), p.name


def test_server_stream_and_export(server: Running) -> None:
    plan = patched_plan()
    with Client(target_of(server)) as c:
        _check(c.materialize(plan, chunk_bytes=64), plan)
        lease = c.export(plan, "shm")
        try:
            _check(lease.arrays, plan)
        finally:
            lease.release()


def test_embedded_client() -> None:
    plan = patched_plan()
    with Client() as c:
        _check(c.materialize(plan), plan)


def test_a_part_has_the_values_of_its_unfused_tensor() -> None:
    """The law parts exist for: a fused w13 as [E, 2F, D] (w1 and w3 side by side), [E, 2, F, D] or [E, F, 2, D]
    (gate and up interleaved row by row), and a wqkv stored group by group
    as torchtitan's fused attention stores it ([n_kv, heads_per_kv + 2, head_dim, dim] flattened to rows) give
    each logical tensor the bytes the same initializer gives it unfused, whole and as a shard of the fused one."""
    e, f, d = 4, 6, 10
    w1 = {"normal": {"std": 0.02, "seed": 31}}
    w3 = {"truncatedNormal": {"std": 0.02, "lo": -0.04, "hi": 0.04, "seed": 32}}
    n_kv, per_kv, hd = 2, 2, 3  # two groups of two query heads, one key head and one value head
    r = per_kv + 2
    qkv = {
        "wq": ([n_kv * per_kv * hd, d], {"kaimingUniformForShape": {"seed": 33}}),
        "wk": ([n_kv * hd, d], {"normal": {"std": 1, "seed": 34}}),
        "wv": ([n_kv * hd, d], {"uniform": {"lo": -2, "hi": 3, "seed": 35}}),
    }
    parts: list[tuple[Box, dict[str, Any], Part]] = []
    for g in range(n_kv):
        row = g * r * hd
        for name, first, rows in (("wq", row, per_kv * hd), ("wk", row + per_kv * hd, hd), ("wv", row + (per_kv + 1) * hd, hd)):
            shape, init = qkv[name]
            parts.append(([(first, first + rows), (0, d)], init, (shape, g * rows * d)))
    for dtype in ("float32", "bfloat16"):
        fused = [
            param(
                "w13",
                [e, 2 * f, d],
                {"ones": {}},
                [([(0, e), (0, f), (0, d)], w1, ([e, f, d], 0)), ([(0, e), (f, 2 * f), (0, d)], w3, ([e, f, d], 0))],
                dtype,
            ),
            param("wqkv", [n_kv * r * hd, d], {"ones": {}}, parts, dtype),
            param(
                "w13_shard",
                [e, 2 * f, d],
                {"ones": {}},
                [([(0, e), (0, f), (0, d)], w1, ([e, f, d], 0))],
                dtype,
                region=[(1, 3), (2, 9), (3, 10)],
            ),
        ]
        # the two fused grouped-expert layouts: gate and up as an axis of their own, [E, 2, F, D], or interleaved
        # row by row, [E, F, 2, D]; either half is one box holding all of w1 (or w3) in its order
        for name, shape, half in (("w13_e2fd", [e, 2, f, d], 1), ("w13_ef2d", [e, f, 2, d], 2)):
            boxes = [[(0, n) if k != half else (h, h + 1) for k, n in enumerate(shape)] for h in (0, 1)]
            fused.append(param(name, shape, {"ones": {}}, [(boxes[0], w1, ([e, f, d], 0)), (boxes[1], w3, ([e, f, d], 0))], dtype))
        unfused = [param("w1", [e, f, d], w1, [], dtype), param("w3", [e, f, d], w3, [], dtype)]
        unfused += [param(n, shape, init, [], dtype) for n, (shape, init) in qkv.items()]
        with Client() as c:
            got = {k: np.asarray(v) for k, v in c.materialize(plan_pb2.Plan(params=fused)).items()}
            want = {k: np.asarray(v) for k, v in c.materialize(plan_pb2.Plan(params=unfused)).items()}
        assert np.unique(want["w1"]).size > 100 and np.unique(want["w3"]).size > 100  # not constant data
        assert got["w13"][:, :f].tobytes() == want["w1"].tobytes() and got["w13"][:, f:].tobytes() == want["w3"].tobytes()
        assert got["w13_e2fd"][:, 0].tobytes() == want["w1"].tobytes() and got["w13_e2fd"][:, 1].tobytes() == want["w3"].tobytes()
        assert got["w13_ef2d"][:, :, 0].tobytes() == want["w1"].tobytes() and got["w13_ef2d"][:, :, 1].tobytes() == want["w3"].tobytes()
        assert got["w13_shard"][:, :4].tobytes() == want["w1"][1:3, 2:6, 3:10].tobytes()
        assert (got["w13_shard"][:, 4:] == 1).all()  # rows 6..8 of the shard are w3's, which it does not patch
        split = got["wqkv"].reshape(n_kv, r, hd, d)
        assert split[:, :per_kv].tobytes() == want["wq"].tobytes()
        assert split[:, per_kv].tobytes() == want["wk"].tobytes() and split[:, per_kv + 1].tobytes() == want["wv"].tobytes()


def test_validation_reports_bad_parts() -> None:
    """A part that cannot hold its box, or of an impossible shape, is named with every other violation, and the
    initializer is checked over the part's shape (a for-shape one needs rank 2 there, whatever the parameter's)."""
    p = param(
        "w",
        [4, 6],
        {"zeros": {}},
        [
            ([(0, 2), (0, 6)], {"ones": {}}, ([11], 0)),  # 12 elements do not fit in 11
            ([(0, 2), (0, 6)], {"ones": {}}, ([4, 6], 13)),  # nor from index 13 of 24
            ([(0, 1), (0, 6)], {"ones": {}}, ([1] * 33, 0)),  # rank 33
            ([(0, 2), (0, 6)], {"xavierUniformForShape": {"seed": 1}}, ([12], 0)),  # fans need rank 2 in the part
            ([(0, 2), (0, 6)], {"xavierUniformForShape": {"seed": 1}}, ([3, 4], 0)),  # fits: valid
            ([(0, 4), (0, 6)], {"ones": {}}, ([], 0)),  # a scalar part holds one element
        ],
    )
    fields = sorted(v.field for v in validation.check(plan_pb2.Plan(params=[p]), resolve=False).report.violations)
    assert fields == [
        "params[0].patches[0].part",
        "params[0].patches[1].part",
        "params[0].patches[2].part.shape",
        "params[0].patches[3].init.xavierUniformForShape",
        "params[0].patches[5].part",
    ], fields


def test_a_patchs_runs_are_charged_before_they_are_built() -> None:
    """256 single-column patches of a [65536, 256] tensor (a plan of a few KB) build 65,536 runs each: 256 MiB of
    run arrays, charged to the memory budget before any is built, so a 64 MiB budget refuses the plan
    (RESOURCE_EXHAUSTED) instead of growing the server by them."""
    import grpc

    from paraminit_client import ParaminitError
    from support import running_server

    p = plan_pb2.Param(name="w", shape=[65536, 256], dtype=plan_pb2.DTYPE_FLOAT32, init=plan_pb2.Init(zeros=plan_pb2.Zeros()))
    for c in range(256):
        q = p.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
        q.box.add(start=0, stop=65536)
        q.box.add(start=c, stop=c + 1)
    plan = plan_pb2.Plan(params=[p])
    assert plan.ByteSize() < 8 << 10
    with running_server(memory_budget=64 << 20) as r, Client(target_of(r)) as c:
        with pytest.raises(ParaminitError) as info:
            next(iter(c.stream(plan)[1]))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in info.value.message
        small = plan_pb2.Plan(params=[plan_pb2.Param(name="w", shape=[64, 4], init=p.init, patches=p.patches[:2])])
        small.params[0].patches[0].box[0].stop = small.params[0].patches[1].box[0].stop = 64
        assert c.materialize(small)["w"][:, :2].all()  # a plan within the budget is served


def far_apart_plan() -> plan_pb2.Plan:
    """Column patches of a wide tensor (runs of one element, 5000 apart) and boxes of short runs far apart, over
    a whole tensor, a row-and-column region and bfloat16: the box path, which fills a patch's box in one call
    and puts it in place."""
    cols = 5000  # more than engine.SPAN_PER_RUN apart: generating the span whole would cost more
    return plan_pb2.Plan(
        params=[
            param(
                "wide",
                [16, cols],
                {"uniform": {"lo": -1, "hi": 1, "seed": 3}},
                [([(0, 16), (c, c + 1)], {"ones": {}}) for c in (5, 2999, 4999)],
            ),
            param(
                "seeded",
                [24, cols],
                {"zeros": {}},
                [
                    ([(1, 23), (100, 102)], {"uniform": {"lo": 2, "hi": 3, "seed": 9}}),
                    ([(0, 24), (4000, 4001)], {"truncatedNormal": {"std": 1.0, "lo": -1.5, "hi": 1.5, "seed": 4}}),
                ],
                region=[(3, 20), (50, 4950)],
            ),
            param("half", [20, cols], {"zeros": {}}, [([(2, 18), (7, 8)], {"normal": {"std": 2.0, "seed": 6}})], dtype="bfloat16"),
        ]
    )


def test_runs_far_apart_are_exact_in_every_window(cpu_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs thousands of elements apart: the same bytes as the oracle at any window, each patch filled by a few
    calls whatever its number of runs (before: one call per run, 3 s of CPU for 64 column patches)."""
    plan = far_apart_plan()
    lay = layout.stream_layout(resolved(plan), digest_of(plan))
    want = {p.name: expected(p).tobytes() for p in plan.params}
    calls: list[int] = []
    real = cpu_backend.fill

    def counted(p: Any, out: Any, l_begin: int = 0) -> None:
        calls.append(out.shape[0])
        real(p, out, l_begin)

    monkeypatch.setattr(cpu_backend, "fill", counted)  # this backend object only
    for window in (4000, 12296, 1 << 23):
        calls.clear()
        assert filled_in_windows(cpu_backend, lay, plan, window) == want, window
    # the last window holds every parameter whole: a base fill and one per patch (6 patches of 16 to 22 short runs)
    assert len(calls) <= 3 + 6, calls
