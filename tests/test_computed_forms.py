"""Sampler spec version 5 (docs/SAMPLER.md 2.4-2.6): eye, dirac and the counter-based sparse, PyTorch's eye_, dirac_
and sparse_ as plan forms: their values (against PyTorch's and the spec's own definition), the same bytes in any
region, dtype and delivery, and their rules reported with the rest."""

from __future__ import annotations

import math
from typing import Any

import grpc
import numpy as np
import pytest
import reference

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.plans import sampler
from support import server_fixture

server = server_fixture()


def sparse(name: str, shape: list[int], sparsity: float = 0.3, std: float = 0.5, seed: int = 7, **kw: Any) -> Any:
    return param(name, shape, {"sparse": {"sparsity": sparsity, "std": std, "seed": seed}}, kw.pop("dtype", "float64"), **kw)


def test_eye_and_dirac_are_pytorchs_in_every_dtype() -> None:
    torch = pytest.importorskip("torch")
    shapes = {"eye": [5, 7], "tall": [7, 3], "d1": [6, 6, 3], "d2": [8, 4, 3, 3], "d3": [4, 6, 1, 2, 5]}
    for dtype in ("float32", "bfloat16", "float8_e4m3fn", "float64"):
        plan = plan_of(
            [
                param("eye", shapes["eye"], {"eye": {}}, dtype),
                param("tall", shapes["tall"], {"eye": {}}, dtype),
                param("d1", shapes["d1"], {"dirac": {"groups": 1}}, dtype),
                param("d2", shapes["d2"], {"dirac": {"groups": 2}}, dtype),
                param("d3", shapes["d3"], {"dirac": {"groups": 4}}, dtype),
            ]
        )
        with Client() as c:
            got = c.materialize(plan)
        for name, groups in [("eye", 0), ("tall", 0), ("d1", 1), ("d2", 2), ("d3", 4)]:
            want = torch.full(shapes[name], float("nan"), dtype=torch.float64)
            torch.nn.init.eye_(want) if groups == 0 else torch.nn.init.dirac_(want, groups=groups)
            assert np.array_equal(got[name].astype(np.float64), want.numpy()), (dtype, name)
            assert got[name].astype(np.float64).sum() > 0


def test_sparse_is_its_spec_zeros_among_the_normal_values() -> None:
    rows, cols, sparsity, std, seed = 40, 9, 0.3, 0.5, 11
    plan = plan_of(
        [sparse("s", [rows, cols], sparsity, std, seed), param("n", [rows, cols], {"normal": {"std": std, "seed": seed}}, "float64")]
    )
    with Client() as c:
        got = c.materialize(plan)
    s, n = got["s"], got["n"]
    # the spec's own definition, from the reference unit draws: z = ceil(sparsity * rows) smallest keys per column
    zseed = (seed + 64 * 0x9E3779B97F4A7C15) % (1 << 64)
    keys = reference.units(sampler.key(zseed), np.arange(rows * cols, dtype=np.uint64)).reshape(rows, cols)
    z = math.ceil(sparsity * rows)
    want_zero = np.zeros((rows, cols), dtype=bool)
    for c_ in range(cols):
        want_zero[sorted(range(rows), key=lambda r: (keys[r, c_], r))[:z], c_] = True
    assert np.array_equal(s == 0, want_zero) and (want_zero.sum(axis=0) == z).all()
    assert np.array_equal(s[~want_zero], n[~want_zero])  # the other elements are the normal(0, std, seed) values
    torch = pytest.importorskip("torch")
    ref = torch.empty(rows, cols)
    torch.nn.init.sparse_(ref, sparsity, std)
    assert ((ref == 0).sum(dim=0) == z).all()  # PyTorch's count of zeros per column, the same rule


def test_same_bytes_in_any_region_dtype_and_delivery(server: Any) -> None:
    shape = [64, 24]
    for dtype in ("float32", "bfloat16"):
        whole_plan = plan_of([sparse("w", shape, 0.25, 0.02, 3, dtype=dtype), param("e", [24, 24], {"eye": {}}, dtype)])
        with Client() as here, Client(f"127.0.0.1:{server.port}") as remote:
            whole = here.materialize(whole_plan)
            streamed = remote.materialize(whole_plan)
            assert all(whole[k].tobytes() == streamed[k].tobytes() for k in whole)
            for r0, c0 in [(0, 0), (32, 12), (10, 5)]:
                region = [(r0, r0 + 20), (c0, c0 + 7)]
                part = here.materialize(plan_of([sparse("w", shape, 0.25, 0.02, 3, dtype=dtype, region=region)]))["w"]
                assert part.tobytes() == np.ascontiguousarray(whole["w"][r0 : r0 + 20, c0 : c0 + 7]).tobytes()


def test_rules_are_reported_with_the_rest() -> None:
    plan = plan_of(
        [
            param("eye3", [2, 2, 2], {"eye": {}}),
            param("dirac2", [4, 4], {"dirac": {"groups": 1}}),
            param("no_groups", [4, 4, 3], {"dirac": {}}),
            param("uneven", [6, 4, 3], {"dirac": {"groups": 4}}),
            sparse("sparse1", [8]),
            sparse("too_sparse", [8, 8], sparsity=1.5),
            sparse("bad_std", [8, 8], std=-1.0),
            sparse("fp8", [8, 8], std=100.0, dtype="float8_e4m3fn"),
            param("ok", [4, 4], {"eye": {}}),
        ]
    )
    patched = param("patched", [4, 4], {"zeros": {}})
    q = patched.patches.add()
    q.init.eye.SetInParent()
    q.box.add(start=0, stop=1)
    q.box.add(start=0, stop=1)
    plan.params.append(patched)
    with Client() as c, pytest.raises(ParaminitError) as info:
        c.materialize(plan)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    found = {v.index: (v.field, v.message) for v in info.value.violations}
    assert sorted(found) == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert found[0] == ("params[0].init.eye", "eye expects 2 dimensions, got [2, 2, 2]")
    assert found[1] == ("params[1].init.dirac", "dirac expects 3 to 5 dimensions, got [4, 4]")
    assert found[2][0] == "params[2].init.dirac.groups" and "an omitted groups is 0" in found[2][1]
    assert found[3] == ("params[3].init.dirac.groups", "dirac groups (4) must divide the output channels (6)")
    assert found[4] == ("params[4].init.sparse", "sparse expects 2 dimensions, got [8]")
    assert found[5][0] == "params[5].init.sparse.sparsity" and found[6][0] == "params[6].init.sparse.std"
    assert "std * 5.2566" in found[7][1]
    assert found[9][0] == "params[9].patches[0].init.eye" and "a patch cannot use eye" in found[9][1]


def test_computing_values_looks_at_the_requests_end_first() -> None:
    """Each computed parameter's values are made whole in resolution: a request that ended (deadline, cancellation,
    drain) is not computed for."""
    from paraminit_server import errors
    from paraminit_server.backends.cpu_kernels import sparse_zero_keys, standard_normal
    from paraminit_server.plans.payloads import ValueSources
    from paraminit_server.plans.plan import resolve_unchecked
    from paraminit_server.plans.snapshot import RequestSnapshot

    p = sparse("s", [64, 8])
    over = [False]
    sources = RequestSnapshot(ValueSources(1 << 20, 60.0), "someone", None, standard_normal, sparse_zero_keys, lambda: over[0])
    assert resolve_unchecked(0, p, sources).values is not None
    over[0] = True
    with pytest.raises(errors.Cancelled, match="before its sparse"):
        resolve_unchecked(0, p, sources)
