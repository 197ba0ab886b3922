"""8-bit float parameters (docs/SAMPLER.md section 4.1): the spec's cases through a server and in process, the
range rule reported with every other violation (plain, patched, large, payload and checkpoint plans), payloads and
checkpoints in and out of 8-bit formats, regions and windows, torch views and inspect."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import reference
from safetensors.numpy import save_file

from paraminit import dtypes
from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, inspect, param, plan_of
from paraminit_server.plans import columns
from paraminit_server.plans.plan import resolve_unchecked
from paraminit_server.rpc.server import Running
from support import CASES, case_param, poisoned, running_server, target_of

F8_CASES = [c for c in CASES if c["dtype"].startswith("float8_")]
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("f8ckpt")


@pytest.fixture(scope="module")
def server(ckpt_dir: Path) -> Iterator[Running]:
    with running_server(safetensors_dirs=str(ckpt_dir)) as r:
        yield r


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    with Client(target_of(server)) as c:
        yield c


def bits(case: dict[str, Any]) -> bytes:
    return bytes(int(b, 16) for b in case["bits"])


def test_the_spec_cases_through_a_server_and_in_process(client: Client) -> None:
    assert len(F8_CASES) >= 7
    plan = plan_of([case_param(c) for c in F8_CASES])
    remote = client.materialize(plan)
    with Client() as local:
        here = local.materialize(plan)
    for case in F8_CASES:
        dt = dtypes.by_name(case["dtype"])
        got = remote[case["name"]]
        assert got.dtype == dt.numpy and got.shape == tuple(case["shape"]), case["name"]
        assert got.tobytes() == bits(case) == here[case["name"]].tobytes(), case["name"]
        # ml_dtypes reads the bits back as the spec's binary64 values rounded once
        want = reference.cast(np.asarray([float(x) for x in case["float64"]]), dt)
        assert got.reshape(-1).view(np.uint8).tobytes() == want.tobytes(), case["name"]


def test_one_rounding_where_pytorch_rounds_twice() -> None:
    """1.0625 + 2^-40 lies just above a tie of float8_e4m3fn: one rounding gives 1.125; through float32 the
    2^-40 is lost and the tie goes to even, 1.0."""
    v = 1.0625 + 2.0**-40
    p = resolve_unchecked(0, param("t", [1], {"flat": {"values": [v]}}, E4M3))
    assert reference.materialize(p).tobytes() == bytes([0x39])
    assert np.asarray([v], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0] == 0x38  # rounded twice
    with Client() as c:
        assert c.materialize(plan_of([param("t", [1], {"flat": {"values": [v]}}, E4M3)]))["t"].view(np.uint8)[0] == 0x39


def test_regions_and_windows_are_slices_of_the_whole(cpu_backend: Any) -> None:
    for dtype in (E4M3, E5M2):
        for init in (
            {"normal": {"std": 0.02, "seed": 4}},
            {"uniform": {"lo": -2, "hi": 2, "seed": 5}},
            {"truncatedNormal": {"std": 1, "lo": -2, "hi": 2, "seed": 6}},
            {"kaimingUniformForShape": {}},
        ):
            whole = resolve_unchecked(0, param("w", [40, 70], init, dtype))
            full = poisoned(whole.numel, whole.dtype.storage)
            cpu_backend.fill(whole, full)
            assert (full == reference.materialize(whole).reshape(-1)).all(), (dtype, init)
            assert np.unique(full).size > 8, (dtype, init)  # not a constant
            grid = full.reshape(40, 70)
            part = resolve_unchecked(0, param("w", [40, 70], init, dtype, region=[(3, 37), (10, 69)]))
            out = poisoned(part.numel, part.dtype.storage)
            cpu_backend.fill(part, out)
            assert out.tobytes() == np.ascontiguousarray(grid[3:37, 10:69]).tobytes(), (dtype, init)
            for a, b in ((1, whole.numel - 1), (999, 1000), (700, 2100)):
                window = poisoned(b - a, whole.dtype.storage)
                cpu_backend.fill(whole, window, a)
                assert window.tobytes() == full[a:b].tobytes(), (dtype, init, a, b)


# -- the range rule: values that could round beyond the largest finite value are refused ----------------------------


def _patched(name: str, dtype: str, init: dict[str, Any]) -> plan_pb2.Param:
    p = param(name, [4, 4], {"zeros": {}}, dtype)
    q = p.patches.add()
    q.box.add(start=0, stop=2)
    q.box.add(start=1, stop=3)
    q.init.CopyFrom(param("x", [1], init).init)
    return p


def test_the_range_rule_is_reported_with_every_other_violation(client: Client) -> None:
    plan = plan_of(
        [
            param("uniform_edge", [4], {"uniform": {"lo": -448, "hi": 448}}, E4M3),  # exactly the largest: valid
            param("normal_edge", [4], {"normal": {"mean": 1, "std": 85}}, E4M3),  # 1 + 85 * 5.2566 = 447.8: valid
            param("normal_over", [4], {"normal": {"mean": 1, "std": 85.2}}, E4M3),  # 448.9
            param("uniform_over", [4], {"uniform": {"lo": -449, "hi": 0}}, E4M3),
            param("trunc_over", [4], {"truncatedNormal": {"std": 1, "lo": -1, "hi": 60000}}, E5M2),
            param("flat_over", [2], {"flat": {"values": [0.5, -57345]}}, E5M2),
            param("wide_is_fine", [4], {"uniform": {"lo": -1e30, "hi": 1e30}}, "float32"),
            param("bad_std", [4], {"normal": {"std": -1}}, E4M3),  # the normal's own rule, not the range rule
            _patched("patched", E4M3, {"uniform": {"lo": 0, "hi": 500}}),
            _patched("patched_ok", E4M3, {"uniform": {"lo": 0, "hi": 448}}),
        ]
    )
    with pytest.raises(ParaminitError) as info:
        client.materialize(plan)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    found = {(v.index, v.field): v.message for v in err.violations}
    assert sorted(found) == [
        (2, "params[2].init.normal"),
        (3, "params[3].init.uniform"),
        (4, "params[4].init.truncatedNormal"),
        (5, "params[5].init.flat"),
        (7, "params[7].init.normal"),
        (8, "params[8].patches[0].init.uniform"),
    ]
    assert "could reach 448.86232 (|mean| + std * 5.2566), beyond 448," in found[(2, "params[2].init.normal")]
    assert "largest finite float8_e4m3fn value" in found[(3, "params[3].init.uniform")]
    assert "57345.0 (the largest |value|), beyond 57344" in found[(5, "params[5].init.flat")]
    assert found[(7, "params[7].init.normal")] == "initialization: normal standard deviation must be nonnegative"
    assert "500.0" in found[(8, "params[8].patches[0].init.uniform")]
    good = plan_of([plan.params[i] for i in (0, 1, 6, 9)])
    got = client.materialize(good)
    assert np.abs(got["uniform_edge"].astype(np.float64)).max() <= 448
    assert np.isfinite(got["normal_edge"].astype(np.float64)).all()


def test_large_plans_apply_the_rule_as_columns() -> None:
    """A plan read as columns: in-range rows stay plain, out-of-range ones take the per-parameter checks, which
    name them."""
    n = max(columns.SCAN_MIN, 1000) + 100  # rows 700 and 900 among many plain ones
    params = [param(f"p{i}", [4, 4], {"normal": {"std": 0.02, "seed": i}}, E4M3) for i in range(n)]
    params[700] = param("p700", [4, 4], {"normal": {"std": 100.0, "seed": 1}}, E4M3)
    params[900] = param("p900", [4, 4], {"uniform": {"lo": -60000, "hi": 1, "seed": 1}}, E5M2)
    plan = plan_of(params)
    cols = columns.of(plan)
    assert cols is not None and not cols.plain[700] and not cols.plain[900] and cols.plain[:700].all()
    with Client() as c:
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert [(v.index, v.field) for v in info.value.violations] == [(700, "params[700].init.normal"), (900, "params[900].init.uniform")]
        del params[900], params[700]
        got = c.materialize(plan_of(params))
    assert len(got) == n - 2 and got["p0"].dtype == ml_dtypes.float8_e4m3fn


# -- payloads and checkpoints ---------------------------------------------------------------------------------------


def test_payloads_into_and_of_8_bit_floats(client: Client) -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal(5000) * 40
    x[:4] = [1.0625 + 2.0**-40, 448.0, -(2.0**-10), 0.0029296875]  # above a tie, the largest, half the least, a tie
    pid = client.upload_payload(x)  # float64 values, rounded once into the 8-bit parameter
    got = client.materialize(plan_of([param("w", [50, 100], {"flatRef": {"payloadId": pid}}, E4M3)]))["w"]
    assert got.view(np.uint8).reshape(-1).tobytes() == reference.cast(x, dtypes.FLOAT8_E4M3FN).tobytes()
    assert got.view(np.uint8).reshape(-1)[:4].tolist() == [0x39, 0x7E, 0x80, 0x02]
    over = x.copy()
    over[4321] = 449.0
    pid_over = client.upload_payload(over)
    with pytest.raises(ParaminitError) as info:
        client.materialize(
            plan_of(
                [
                    param("w", [5000], {"flatRef": {"payloadId": pid_over}}, E4M3),
                    param("v", [5000], {"flatRef": {"payloadId": pid_over}}, E5M2),
                ]
            )
        )
    [v] = info.value.violations  # float8_e5m2 holds 449
    assert v.field == "params[0].init.flatRef" and "449.0 (the largest |value|)" in v.message
    # a payload of 8-bit floats keeps its bits, and converts exactly into any wider dtype
    f8 = got.reshape(-1)
    pid8 = client.upload_payload(f8)
    back = client.materialize(
        plan_of(
            [param("a", [5000], {"flatRef": {"payloadId": pid8}}, E4M3), param("b", [5000], {"flatRef": {"payloadId": pid8}}, "float32")]
        )
    )
    assert back["a"].tobytes() == f8.tobytes()
    assert back["b"].tobytes() == f8.astype(np.float32).tobytes()


def test_checkpoints_into_and_of_8_bit_floats(client: Client, ckpt_dir: Path) -> None:
    rng = np.random.default_rng(9)
    wide = (rng.standard_normal((8, 16)) * 30).astype(np.float32)
    wide[3, 4] = 1000.0  # beyond float8_e4m3fn, within float8_e5m2
    narrow = (rng.standard_normal((8, 16)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    path = ckpt_dir / "mixed.safetensors"
    save_file({"wide": wide, "narrow": narrow}, str(path))

    def ref(tensor: str, dtype: str) -> plan_pb2.Param:
        return param(tensor + dtype, [8, 16], {"safetensors": {"path": str(path), "tensor": tensor}}, dtype)

    with pytest.raises(ParaminitError) as info:
        client.materialize(plan_of([ref("wide", E4M3), ref("wide", E5M2), ref("narrow", E4M3)]))
    [v] = info.value.violations
    assert v.index == 0 and "1000.0 (the largest |value|)" in v.message and str(path) not in v.message
    got = client.materialize(plan_of([ref("wide", E5M2), ref("narrow", E4M3), ref("narrow", E5M2)]))
    assert (
        got["wide" + E5M2].view(np.uint8).reshape(-1).tobytes()
        == reference.cast(wide.astype(np.float64).reshape(-1), dtypes.FLOAT8_E5M2).tobytes()
    )
    assert got["narrow" + E4M3].tobytes() == narrow.tobytes()  # same format: the same bits
    assert (
        got["narrow" + E5M2].view(np.uint8).reshape(-1).tobytes()
        == reference.cast(narrow.astype(np.float64).reshape(-1), dtypes.FLOAT8_E5M2).tobytes()
    )


# -- the caller's side: files, torch, inspect -----------------------------------------------------------------------


def test_a_checkpoint_file_torch_reads_and_inspect_passes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    plan = plan_of(
        [
            param("a", [64, 64], {"normal": {"std": 0.02, "seed": 1}}, E4M3),
            param("b", [64, 32], {"xavierUniformForShape": {"seed": 2}}, E5M2),
            param("c", [32], {"ones": {}}, E5M2),
        ]
    )
    out = tmp_path / "f8.safetensors"
    with Client() as c:
        arrays = c.materialize(plan)
        c.materialize_to_file(plan, out)
        with c.export(plan) as lease:
            views = lease.torch()
            assert views["a"].dtype == torch.float8_e4m3fn and views["b"].dtype == torch.float8_e5m2
            assert views["a"].view(torch.uint8).numpy().tobytes() == arrays["a"].tobytes()
    loaded = load_file(str(out))
    assert loaded["a"].dtype == torch.float8_e4m3fn and loaded["b"].dtype == torch.float8_e5m2
    for name, arr in arrays.items():
        assert loaded[name].view(torch.uint8).numpy().tobytes() == arr.tobytes(), name
    report = inspect.inspect_file(out, plan)
    assert [r.dtype for r in report.rows] == [E4M3, E5M2, E5M2]
    assert not any(r.problems for r in report.rows), [r.problems for r in report.rows]
    # a file that does not hold the plan's values is flagged
    shifted = {"a": (arrays["a"].astype(np.float64) + 0.05).astype(ml_dtypes.float8_e4m3fn), "b": arrays["b"], "c": arrays["c"]}
    save_file(shifted, str(tmp_path / "bad.safetensors"))
    flagged = inspect.inspect_file(tmp_path / "bad.safetensors", plan)
    assert flagged.rows[0].problems and not flagged.rows[1].problems


def test_a_float8_module_built_on_meta_is_materialized() -> None:
    """The torch adapter plans a float8 module (PyTorch's own rules) and fills it in place or from a stream."""
    torch = pytest.importorskip("torch")
    from paraminit_client.torch import materialize_module, plan_from_module

    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    m = m.to(torch.float8_e4m3fn)
    plan = plan_from_module(m, seed=3)
    assert {p.dtype for p in plan.params} == {plan_pb2.DTYPE_FLOAT8_E4M3FN}
    with Client() as c:
        want = c.materialize(plan)
        for delivery in ("in_process", "stream"):
            materialize_module(m, c, delivery=delivery, plan=plan)
            state = m.state_dict()
            for name, arr in want.items():
                assert state[name].dtype == torch.float8_e4m3fn, (delivery, name)
                assert state[name].view(torch.uint8).numpy().tobytes() == arr.tobytes(), (delivery, name)
    bound = 1 / 8  # kaiming_uniform_(a=sqrt(5)) on fan_in 64: 1/sqrt(64)
    w = want["0.weight"].astype(np.float64)
    assert np.abs(w).max() <= bound and w.std() > bound / 3
    assert (want["1.weight"].astype(np.float64) == 1).all()


def test_the_range_message_prints_the_bound_as_written(client: Client) -> None:
    """|mean| + std * 5.2566 for std 1000 is 5256.599999999999 in binary64: the message says 5256.6."""
    report = client.validate(plan_of([param("w", [4], {"normal": {"std": 1000}}, E4M3)]))
    (v,) = report.violations
    assert "could reach 5256.6 (" in v.message and "5256.59999" not in v.message, v.message
