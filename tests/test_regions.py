"""Regions: one box type, its defaulting, and the runs every consumer (kernels, patches, checkpoint reads) walks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from paraminit import regions, shapes
from paraminit.regions import Region, Runs
from paraminit.v1 import plan_pb2
from paraminit_server import errors
from paraminit_server.plans.payloads import ValueSources
from paraminit_server.plans.snapshot import RequestSnapshot
from support import digest_of


def _boxes(rng: np.random.Generator, count: int) -> list[tuple[tuple[int, ...], regions.Box]]:
    """Random shapes of rank 0-4 and a non-empty box of each, including whole tensors and single rows."""
    out: list[tuple[tuple[int, ...], regions.Box]] = [((), ()), ((7,), ((0, 7),)), ((3, 4), ((1, 2), (0, 4)))]
    for _ in range(count):
        shape = tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        box = []
        for d in shape:
            if rng.random() < 0.4:
                box.append((0, d))
            else:
                a = int(rng.integers(0, d))
                box.append((a, int(rng.integers(a + 1, d + 1))))
        out.append((shape, tuple(box)))
    return out


def _expected(shape: tuple[int, ...], box: regions.Box) -> np.ndarray:
    """The global flat indices of a box in row-major order, by numpy slicing (the definition)."""
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)[tuple(slice(a, b) for a, b in box)].ravel()


CASES = _boxes(np.random.default_rng(22), 300)


@pytest.mark.parametrize("part", range(4))
def test_runs_walk_the_box_in_row_major_order(part: int) -> None:
    for shape, box in CASES[part::4]:
        _check_runs(shape, box)


def _check_runs(shape: tuple[int, ...], box: regions.Box) -> None:
    want = _expected(shape, box)
    runs = Region.of(shape, box).runs()
    assert runs.global_indices(0, want.size).tolist() == want.tolist()
    assert [runs.global_index(j) for j in range(want.size)] == want.tolist()
    starts, run_len = Region.of(shape, box).run_starts()
    expanded = (starts[:, None] + np.arange(run_len)[None, :]).ravel()
    assert expanded.tolist() == want.tolist() and len(starts) * run_len == want.size


def test_trailing_full_dimensions_merge_into_one_run() -> None:
    assert Region.of((4, 5, 6)).runs().run_len == 120  # a whole tensor: one run
    rows = Region.of((4, 5, 6), ((1, 3), (0, 5), (0, 6))).runs()
    assert (rows.run_len, rows.base, len(rows.outer_ext)) == (60, 30, 0)  # a row shard: one run
    cols = Region.of((4, 6), ((0, 4), (2, 5))).runs()
    assert (cols.run_len, cols.outer_ext.tolist(), cols.outer_stride.tolist(), cols.base) == (3, [4], [6], 2)
    assert Region.of((4, 6), ((0, 4), (2, 5))).run_starts()[0].tolist() == [2, 8, 14, 20]
    scalar = Region.of(()).runs()
    assert (scalar.run_len, scalar.base, scalar.starts().tolist()) == (1, 0, [0])


@pytest.mark.parametrize("part", range(4))
def test_local_runs_cover_box_and_region_in_the_regions_own_order(part: int) -> None:
    for i in range(part, len(CASES), 4):
        _check_local_runs(i, *CASES[i])


def _check_local_runs(i: int, shape: tuple[int, ...], region: regions.Box) -> None:
    rng = np.random.default_rng(i)
    for _ in range(5):
        box = tuple((a, b) for a, b in ((int(rng.integers(0, d + 1)), int(rng.integers(0, d + 1))) for d in shape))
        box = tuple((min(a, b), max(a, b) + (1 if a == b else 0)) for a, b in box)
        box = tuple((min(a, d - 1), min(b, d)) for (a, b), d in zip(box, shape, strict=True))
        local = np.full(shape, -1, dtype=np.int64)
        reg = tuple(slice(a, b) for a, b in region)
        local[reg] = np.arange(int(np.prod([b - a for a, b in region])), dtype=np.int64).reshape([b - a for a, b in region])
        inside = np.zeros(shape, dtype=bool)
        inside[tuple(slice(a, b) for a, b in box)] = True
        want = np.sort(local[inside & (local >= 0)])
        starts, run_len = Region.of(shape, region).local_runs(box)
        got = (starts[:, None] + np.arange(run_len)[None, :]).ravel() if run_len else np.zeros(0, np.int64)
        assert got.tolist() == want.tolist(), (shape, region, box)


def test_boxes_that_miss_the_region_have_no_local_runs() -> None:
    starts, run_len = Region.of((8, 8), ((0, 4), (0, 8))).local_runs(((4, 8), (0, 8)))
    assert run_len == 0 and starts.size == 0
    assert Region.of((8, 8), ((0, 4), (0, 8))).local(((4, 8), (0, 8))) is None
    assert Region.of((8, 8), ((2, 6), (0, 8))).local(((0, 3), (1, 2))) == Region((4, 8), ((0, 1), (1, 2)))


def test_a_parameter_without_a_region_is_the_whole_tensor() -> None:
    p = plan_pb2.Param(name="w", shape=[3, 5])
    assert regions.box_of(p) == ((0, 3), (0, 5)) and Region.of_param(p).is_full
    assert shapes.region_of(p) == [(0, 3), (0, 5)] and shapes.out_shape(p) == (3, 5)
    p.region.add(start=1, stop=3)
    p.region.add(start=0, stop=5)
    r = Region.of_param(p)
    assert r.box == ((1, 3), (0, 5)) and r.out_shape == (2, 5) and r.numel == 10 and not r.is_full
    assert shapes.out_shape(p) == (2, 5) and Region.of((3, 5), None) == Region.of((3, 5), [])


def test_runs_shifted_and_single() -> None:
    runs = Region.of((4, 6), ((1, 3), (2, 4))).runs()
    assert runs.shifted(5).global_indices(0, 4).tolist() == (runs.global_indices(0, 4) - 5).tolist()
    assert Runs.single(9, 3).global_indices(0, 9).tolist() == list(range(3, 12))


def test_a_region_that_does_not_fit_its_checkpoint_tensor_is_an_error_of_the_request(tmp_path: Path) -> None:
    """Digests read checkpoint regions before validation compares shapes: a misfit is INVALID_ARGUMENT, not a crash."""
    save_file({"w": np.arange(4, dtype=np.float32).reshape(2, 2) + 1}, str(tmp_path / "c.safetensors"))
    bound = RequestSnapshot(ValueSources(1 << 20, 60.0, [str(tmp_path)]), "someone")
    path = str(tmp_path / "c.safetensors")
    assert Region.of((2, 2), ((0, 1), (0, 2))).fits and not Region.of((2, 2), ((0, 3), (0, 2))).fits
    for region in (((0, 2),), ((0, 3), (0, 2)), ((0, 1), (0, 1), (0, 1))):
        with pytest.raises(errors.InvalidRequest, match="does not fit tensor"):
            bound.content_hash(path, "w", region)
        with pytest.raises(errors.InvalidRequest, match="does not fit tensor"):
            bound.tensor_values(path, "w", region)
    values, compact = bound.tensor_values(path, "w", ((1, 2), (0, 2)))
    assert compact and values.tolist() == [3.0, 4.0]
    p = plan_pb2.Param(name="w", shape=[4], init=plan_pb2.Init(safetensors=plan_pb2.SafetensorsRef(path=path, tensor="w")))
    p.region.add(start=0, stop=2)
    assert digest_of(plan_pb2.Plan(params=[p]), bound)  # the digest marks it unreadable; validation says why
