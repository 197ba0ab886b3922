"""The deterministic orthogonal initializer (docs/SAMPLER.md 2.3): orthonormal to rounding, PyTorch's matrix for
the same Gaussian draws, the same bytes at any thread count, region or rank, and its rules with the rest."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit_client import Client, ParaminitError, param, plan_of
from support import running_server, serve_subprocess, target_of, wait_until

SHAPES = [[300, 200], [200, 300], [257, 257], [16, 4, 8], [1, 64], [64, 1]]


def orth(
    name: str, shape: list[int], gain: float = 1.0, seed: int = 7, dtype: str = "float64", region: list[tuple[int, int]] | None = None
) -> Any:
    return param(name, shape, {"orthogonal": {"gain": gain, "seed": seed}}, dtype, region=region)


def gram_error(q: np.ndarray[Any, Any]) -> float:
    """max |M M^T - I| over the smaller side of the rows x cols view."""
    m = q.reshape(q.shape[0], -1).astype(np.float64)
    g = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m
    return float(np.abs(g - np.eye(g.shape[0])).max())


@pytest.mark.slow
def test_orthonormal_to_rounding_in_float64_and_float32() -> None:
    plan = plan_of(
        [orth(f"q{i}", s) for i, s in enumerate(SHAPES)]
        + [orth(f"f{i}", s, dtype="float32") for i, s in enumerate(SHAPES)]
        + [orth("big", [1024, 1024], seed=3), orth("big32", [1024, 1024], seed=3, dtype="float32")]
    )
    with Client() as c:
        got = c.materialize(plan)
    for i, shape in enumerate(SHAPES):
        assert got[f"q{i}"].shape == tuple(shape) and gram_error(got[f"q{i}"]) <= 1e-12, shape
        assert gram_error(got[f"f{i}"]) <= 1e-5, shape
        assert got[f"f{i}"].tobytes() == got[f"q{i}"].astype(np.float32).tobytes()  # one rounding from binary64
    assert gram_error(got["big"]) <= 1e-12 and gram_error(got["big32"]) <= 1e-5
    assert np.unique(got["big"]).size > 1000  # not a constant, nor a permutation matrix


@pytest.mark.slow
def test_pytorchs_matrix_for_the_same_draws() -> None:
    """orthogonal_ is QR of the Gaussian matrix with Q * sign(diag R): from the plan's own normal(0, 1) draws,
    torch.linalg.qr gives the same matrix to rounding; the gain scales it."""
    torch = pytest.importorskip("torch")
    for shape in ([40, 24], [24, 40], [8, 3, 5]):
        rows = shape[0]
        with Client() as c:
            got = c.materialize(
                plan_of([orth("q", shape, gain=2.5, seed=11), param("g", shape, {"normal": {"std": 1, "seed": 11}}, "float64")])
            )
        g = torch.from_numpy(got["g"].reshape(rows, -1).copy())
        a = g.T if rows < g.shape[1] else g
        q, r = torch.linalg.qr(a)
        q = q * torch.sign(torch.diagonal(r))
        want = (q.T if rows < g.shape[1] else q) * 2.5
        assert np.abs(got["q"].reshape(rows, -1) - want.numpy()).max() <= 1e-12, shape


def test_same_bytes_at_any_thread_count_region_and_rank() -> None:
    shape = [96, 160]
    whole_plan = plan_of([orth("w", shape, gain=0.5, seed=5, dtype="bfloat16")])
    with running_server(threads=1) as one, running_server(threads=2) as two, Client(target_of(one)) as c1, Client(target_of(two)) as c2:
        whole = c1.materialize(whole_plan)["w"]
        assert c2.materialize(whole_plan)["w"].tobytes() == whole.tobytes()
        # four ranks, each asking for its own block of a 2 x 2 mesh, from either server
        for k, (r0, c0) in enumerate([(0, 0), (0, 80), (48, 0), (48, 80)]):
            client = (c1, c2)[k % 2]
            part = client.materialize(plan_of([orth("w", shape, 0.5, 5, "bfloat16", [(r0, r0 + 48), (c0, c0 + 80)])]))["w"]
            assert part.tobytes() == np.ascontiguousarray(whole[r0 : r0 + 48, c0 : c0 + 80]).tobytes(), k
    with Client() as here:
        assert here.materialize(whole_plan)["w"].tobytes() == whole.tobytes()


def test_rules_are_reported_with_the_rest() -> None:
    plan = plan_of(
        [
            orth("ok", [4, 4]),
            orth("vector", [8]),
            orth("no_gain", [4, 4], gain=0.0),
            orth("inf_gain", [4, 4]),
            orth("huge", [8192, 8192]),
            orth("fp8", [4, 4], gain=500.0, dtype="float8_e4m3fn"),
            param("bad_normal", [4], {"normal": {"std": -1}}),
        ]
    )
    plan.params[3].init.orthogonal.gain = float("inf")
    patched = orth("patched", [4, 4])
    q = patched.patches.add(init=plan.params[0].init)
    q.box.add(start=0, stop=1)
    q.box.add(start=0, stop=1)
    plan.params.append(patched)
    with Client() as c, pytest.raises(ParaminitError) as info:
        c.materialize(plan)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    found = {v.index: (v.field, v.message) for v in err.violations}
    assert sorted(found) == [1, 2, 3, 4, 5, 6, 7]
    assert found[1] == ("params[1].init.orthogonal", "orthogonal initialization expects at least 2 dimensions, got [8]")
    assert found[2][0] == "params[2].init.orthogonal.gain" and "an omitted gain is 0" in found[2][1]
    assert found[3][0] == "params[3].init.orthogonal.gain"
    assert found[4][0] == "params[4].init.orthogonal" and "4096^3" in found[4][1]
    assert "500.0 (|gain|), beyond 448" in found[5][1]
    assert found[7][0] == "params[7].patches[0].init.orthogonal" and "a patch cannot use orthogonal" in found[7][1]


def test_torchtitan_style_orthogonal_init_is_translated() -> None:
    pytest.importorskip("torch")
    import functools

    from torch import nn

    from paraminit_client.titan import translate

    got = translate(functools.partial(nn.init.orthogonal_, gain=2.0), seed=9)
    init = got.init
    assert got.decided and init.WhichOneof("kind") == "orthogonal"
    assert init.orthogonal.gain == 2.0 and init.orthogonal.seed == 9
    assert translate(nn.init.orthogonal_, seed=1).init.orthogonal.gain == 1.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_large_matrix_is_computed_inside_a_slot_and_stops_at_the_deadline() -> None:
    """A 60-byte plan asks for a 2048 x 2048 factorization (a 1 x 1 region of it): the work runs inside a concurrency
    slot (with --max-concurrent 1 a second such call waits for the first), and the deadline stops it between blocks
    of the factorization, not after it."""
    proc, target = serve_subprocess({"PARAMINIT_MAX_CONCURRENT": "1", "PARAMINIT_MAX_QUEUED": "0"})
    try:
        bomb = plan_of([orth("w", [2048, 2048], region=[(0, 1), (0, 1)])])
        with Client(target, timeout=4.0) as first, Client(target, timeout=30.0) as second:
            idle = _cpu_seconds(proc.pid)
            started = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(first.materialize, bomb)
                assert wait_until(lambda: _cpu_seconds(proc.pid) > idle + 0.3, timeout=20)  # factorizing, in the only slot
                assert not running.done()
                with pytest.raises(ParaminitError) as queued:  # the one slot is taken by the first call's checks
                    second.materialize(plan_of([orth("small", [4, 4])]))
                assert queued.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                with pytest.raises(ParaminitError) as late:
                    running.result()
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 10
            time.sleep(0.5)  # the server notices the deadline at its next block (about 0.1 s of work)
            spent = _cpu_seconds(proc.pid)
            time.sleep(1.5)
            assert _cpu_seconds(proc.pid) - spent < 0.5  # the factorization stopped, not run to its end
            assert second.materialize(plan_of([orth("small", [4, 4])]))["small"].shape == (4, 4)  # the slot is free again
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_factorization_work_is_capped_per_plan() -> None:
    """Three 3000 x 3000 matrices are each under the per-parameter cap (4096^3) but not together: a limit of the
    plan (RESOURCE_EXHAUSTED), whatever their regions, since each is computed whole."""
    three = plan_of([orth(f"w{i}", [3000, 3000], region=[(0, 1), (0, 1)]) for i in range(3)])
    two = plan_of([orth(f"w{i}", [3000, 3000], region=[(0, 1), (0, 1)]) for i in range(2)])
    with Client() as c:
        report = c.validate(three)
        assert report.valid and not report.fits_limits
        (v,) = report.violations
        assert v.index == -1 and "orthogonal matrices need 81000000000 steps" in v.message and "4096^3" in v.message
        assert c.validate(two).ok
        with pytest.raises(ParaminitError) as info:
            c.materialize(three)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
