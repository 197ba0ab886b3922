"""The initializer table: it names every Init kind of the contract, and validation, resolution, the digest and
`inspect` (patches included) all follow it."""

from __future__ import annotations

import collections
import math
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paraminit import inits, regions
from paraminit.shapes import fan_in_out
from paraminit.v1 import plan_pb2
from paraminit_client import Client, cli, inspect, param, plan_of
from paraminit_client.plans import plan_to_json
from paraminit_server.plans import plan as planlib
from paraminit_server.plans import validation
from paraminit_server.rpc.server import Running
from support import run_cli, running_server, target_of


def test_the_table_names_every_kind_of_the_contract() -> None:
    oneof = plan_pb2.Init.DESCRIPTOR.oneofs_by_name["kind"]
    assert list(inits.KINDS) == [f.name for f in oneof.fields]  # field-number order, none missing or extra
    for f in oneof.fields:
        kind = inits.KINDS[f.name]
        assert kind.json == f.json_name
        assert kind.seeded == ("seed" in f.message_type.fields_by_name), f.name
        assert kind.patchable == (not kind.data)
    assert {k.field for k in inits.KINDS.values() if k.data} == {"flat", "flat_ref", "safetensors", "orthogonal", "eye", "dirac", "sparse"}
    assert {"truncatedNormal", "truncated_normal", "kaimingUniformForShape"} <= inits.SEEDED_JSON
    assert not inits.SEEDED_JSON & {"zeros", "ones", "flat", "flatRef", "safetensors"}


SHAPES = ([7, 5], [3, 4, 2, 2], [6])
SEEDED = [
    ("uniform", {"lo": -0.5, "hi": 2.0}),
    ("normal", {"mean": 0.25, "std": 3.0}),
    ("xavierUniform", {"fanIn": 30, "fanOut": 9}),
    ("kaimingUniform", {"fanIn": 40}),
    ("xavierUniformForShape", {}),
    ("kaimingUniformForShape", {}),
    ("truncatedNormal", {"mean": 0.1, "std": 0.2, "lo": -0.3, "hi": 0.5}),
]


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("name,fields", SEEDED)
def test_resolution_and_inspect_read_the_same_bounds(name: str, fields: dict[str, Any], shape: list[int]) -> None:
    """The server's kernel parameters and inspect's expectation come from one value form: their bounds agree to
    the bit, and the Xavier / Kaiming bound is the one of docs/SAMPLER.md section 3."""
    p = param("w", shape, {name: {**fields, "seed": 11}})
    rp = planlib.resolve_unchecked(0, p)
    exp = inspect.expected_of(p)
    assert exp is not None
    fan_in, fan_out = fan_in_out(shape)
    want = {
        "xavierUniform": math.sqrt(6.0 / 39),
        "kaimingUniform": math.sqrt(6.0 / 40),
        "xavierUniformForShape": math.sqrt(6.0 / (fan_in + fan_out)),
        "kaimingUniformForShape": math.sqrt(6.0 / fan_in),
    }.get(name)
    if want is not None:
        assert rp.formula == planlib.Formula.AFFINE
        assert (rp.p0, rp.p1) == (-want, 2 * want) and (exp.lo, exp.hi) == (-want, want)
    elif name == "uniform":
        assert (rp.p0, rp.p0 + rp.p1) == (exp.lo, exp.hi) == (-0.5, 2.0)
    elif name == "normal":
        assert (rp.formula, rp.p0, rp.p1) == (planlib.Formula.NORMAL, exp.mean, exp.std)
    else:
        assert (rp.formula, rp.lo, rp.hi) == (planlib.Formula.TRUNCNORM, -0.3, 0.5)
        assert (exp.lo, exp.hi) == (pytest.approx(-0.3), pytest.approx(0.5))
    assert rp.key == planlib.sampler.key(11)


def test_validation_reports_the_tables_checks_for_params_and_patches() -> None:
    bad_patch = param("e", [4, 3], {"normal": {"std": 1}})
    bad_patch.patches.add(
        box=[plan_pb2.Range(start=0, stop=1), plan_pb2.Range(start=0, stop=3)], init=plan_pb2.Init(flat=plan_pb2.Flat(values=[0.0] * 12))
    )
    bad_patch.patches.add(
        box=[plan_pb2.Range(start=1, stop=2), plan_pb2.Range(start=0, stop=3)], init=plan_pb2.Init(uniform=plan_pb2.Uniform(lo=1.0, hi=0.0))
    )
    bad_patch.patches.add(box=[plan_pb2.Range(start=2, stop=3), plan_pb2.Range(start=0, stop=3)])
    plan = plan_of(
        [
            param("u", [2], {"uniform": {"lo": 1, "hi": -1}}),
            param("k", [5], {"kaimingUniformForShape": {}}),
            param("t", [5], {"truncatedNormal": {"std": 1, "lo": -0.1, "hi": 3}}),
            param("f", [3], plan_pb2.Init(flat=plan_pb2.Flat(values=[1.0, math.nan]))),
            bad_patch,
        ]
    )
    got = [(v.field, v.message) for v in validation.check(plan, resolve=False).report.violations]
    fields = [f for f, _ in got]
    assert fields == [
        "params[0].init.uniform",
        "params[1].init.kaimingUniformForShape",
        "params[2].init.truncatedNormal",
        "params[3].init.flat.values",
        "params[3].init.flat.values",
        "params[4].patches[0].init.flat",
        "params[4].patches[1].init.uniform",
        "params[4].patches[2].init",
    ], got
    assert "Kaiming initialization expects at least 2 dimensions, got [5]" in got[1][1]
    assert got[3][1].endswith("(expected 3, got 2)") and "1 not finite" in got[4][1]
    assert "a patch cannot use flat values" in got[5][1]
    assert got[7][1].startswith("initializer is not set (expected one of zeros, ones, uniform")
    # initializers named as plans spell them, like the field paths
    assert "xavierUniform, kaimingUniform" in got[7][1] and "truncatedNormal" in got[7][1] and "_" not in got[7][1]
    assert "(patches take zeros, ones, uniform, normal, xavierUniform," in got[5][1]


# One message per row: each breaks at most the rules named with it (NaN and infinities in every position).
_INF, _NAN = math.inf, math.nan
RULE_ROWS: dict[str, list[tuple[dict[str, float], str | None]]] = {
    "uniform": [
        ({"lo": -1.0, "hi": 1.0}, None),
        ({"lo": 2.0, "hi": 2.0}, None),
        ({"lo": _NAN, "hi": 1.0}, "bounds must be finite"),
        ({"lo": 0.0, "hi": _INF}, "bounds must be finite"),
        ({"lo": 1.0, "hi": -1.0}, "lower bound must not exceed"),
        ({"lo": -1.7e308, "hi": 1.7e308}, "overflows binary64"),
    ],
    "normal": [
        ({"mean": 0.5, "std": 0.0}, None),
        ({"mean": _INF, "std": 1.0}, "must be finite"),
        ({"mean": 0.0, "std": _NAN}, "must be finite"),
        ({"mean": 0.0, "std": -1e-300}, "must be nonnegative"),
    ],
    "truncated_normal": [
        ({"mean": 0.0, "std": 1.0, "lo": -0.5, "hi": 0.5}, None),
        ({"mean": 0.0, "std": 1.0, "lo": -_INF, "hi": 0.5}, "must be finite"),
        ({"mean": 0.0, "std": -1.0, "lo": -0.5, "hi": 0.5}, "must be nonnegative"),
        ({"mean": 0.0, "std": 1.0, "lo": -0.49, "hi": 0.5}, "too tight"),
        ({"mean": 0.0, "std": 1.0, "lo": -0.5, "hi": 0.25}, "too tight"),
    ],
}


@pytest.mark.parametrize("field", list(RULE_ROWS))
def test_a_form_rule_rejects_the_same_rows_one_by_one_and_as_columns(field: str) -> None:
    """A form's rules are stated once (the form class's RULES): a row's check reports the first rule it breaks, and
    a large plan's columns pass exactly the rows whose check is empty."""
    kind = inits.KINDS[field]
    assert kind.forms is not None
    rows = RULE_ROWS[field]
    messages = []
    for values, broken in rows:
        msg = getattr(plan_pb2.Init(), field)
        for k, v in values.items():
            setattr(msg, k, v)
        problems = kind.checks(msg, [4])
        messages.append(problems)
        if broken is None:
            assert problems == [], values
        else:
            assert len(problems) == 1 and problems[0][0] == f"init.{field}" and broken in problems[0][1], (values, problems)
    names = list(rows[0][0])
    columns = {k: np.array([values[k] for values, _ in rows]) for k in names}
    columns["seed"] = np.arange(len(rows), dtype=np.uint64)
    forms = kind.forms(columns.__getitem__, len(rows))
    assert forms.ok.tolist() == [not m for m in messages]
    assert set(forms.fields) == set(columns)
    for k, v in columns.items():
        np.testing.assert_array_equal(forms.fields[k], v)  # NaN where NaN
    # every rule of the form is the first one broken by some row
    form = type(kind.form(getattr(plan_pb2.Init(), field), [4]))
    assert len({b for _, b in rows if b}) == len(form.RULES) > 1


def test_xavier_and_kaiming_bounds_are_one_rule_for_a_row_and_for_columns() -> None:
    fan_in = np.array([0, 1, 3, 7, 2**53 + 1, 2**63 + 5, 2**64 - 1], dtype=np.uint64)
    fan_out = np.array([0, 0, 5, 2**60, 2**53, 1, 2**64 - 1], dtype=np.uint64)
    xs, ks = inits.xavier_bound(fan_in, fan_out), inits.kaiming_bound(fan_in)
    for i in range(fan_in.shape[0]):
        x, k = inits.xavier_bound(int(fan_in[i]), int(fan_out[i])), inits.kaiming_bound(int(fan_in[i]))
        assert type(x) is float and type(k) is float
        assert x == xs[i] and k == ks[i] and math.copysign(1.0, x) == 1.0
        denom = float(int(fan_in[i])) + float(int(fan_out[i]))
        assert x == (0.0 if denom == 0.0 else math.sqrt(6.0 / denom))
        assert k == (0.0 if fan_in[i] == 0 else math.sqrt(6.0 / float(int(fan_in[i]))))


def test_with_seed_sets_seeded_kinds_only() -> None:
    for name, fields in SEEDED:
        init = param("w", [4, 4], {name: fields}).init
        seeded = inits.with_seed(init, 99)
        kind = inits.kind_of(seeded)
        assert kind is not None and getattr(seeded, kind.field).seed == 99
        assert getattr(init, kind.field).seed == 0  # a copy: the original keeps its seed
    ones = plan_pb2.Init(ones=plan_pb2.Ones())
    assert inits.with_seed(ones, 5) == ones


# -- inspect --plan with patches --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    with running_server() as r:
        yield r


def _padded_plan() -> plan_pb2.Plan:
    """An embedding with a zero padding row (torch's padding_idx) and a normal(0.5, 0.1) block, row-sharded."""
    emb = param("emb", [400, 64], {"normal": {"std": 0.02, "seed": 1}})
    emb.patches.add(box=[plan_pb2.Range(start=3, stop=4), plan_pb2.Range(start=0, stop=64)], init=plan_pb2.Init(zeros=plan_pb2.Zeros()))
    emb.patches.add(
        box=[plan_pb2.Range(start=100, stop=300), plan_pb2.Range(start=0, stop=32)],
        init=plan_pb2.Init(normal=plan_pb2.Normal(mean=0.5, std=0.1, seed=2)),
    )
    shard = param("shard", [400, 64], {"uniform": {"lo": -1, "hi": 1, "seed": 3}}, region=[(0, 200), (0, 64)])
    shard.patches.add(box=[plan_pb2.Range(start=0, stop=400), plan_pb2.Range(start=60, stop=64)], init=plan_pb2.Init(ones=plan_pb2.Ones()))
    return plan_of([emb, shard, param("plain", [1000], {"normal": {"std": 1, "seed": 4}})])


@pytest.fixture(scope="module")
def padded_file(server: Running, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("padded")
    out, plan_path = tmp / "padded.safetensors", tmp / "plan.json"
    with Client(target_of(server)) as c:
        c.materialize_to_file(_padded_plan(), out)
    plan_path.write_text(plan_to_json(_padded_plan()))
    return out, plan_path


def test_inspect_plan_honours_patches(padded_file: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path, plan_path = padded_file
    arrays = load_file(str(path))
    assert not arrays["emb"][3].any() and arrays["emb"][4].all()  # the padding row is there, the next is not
    assert np.all(arrays["shard"][:, 60:] == 1.0)
    code, out, _ = run_cli(capsys, "inspect", str(path), "--plan", str(plan_path))
    assert code == 0, out
    assert "every tensor matches the plan" in out.splitlines()[-1]


def test_inspect_plan_flags_a_patched_row_that_is_wrong(
    padded_file: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A padding row that is not zero, and a block that is not its patch's distribution, are flagged."""
    path, plan_path = padded_file
    arrays = {k: v.copy() for k, v in load_file(str(path)).items()}
    arrays["emb"][3, 5] = 0.01  # the padding row holds one nonzero value
    arrays["shard"][:, 60:] = 0.0  # ones expected
    broken = tmp_path / "broken.safetensors"
    save_file(arrays, str(broken))
    code, out, _ = run_cli(capsys, "inspect", str(broken), "--plan", str(plan_path))
    assert code == cli.EXIT_FLAGGED, out
    flags = [ln for ln in out.splitlines() if ln.startswith("FLAG ")]
    assert any(ln.startswith("FLAG emb: patch 0 (zeros): ") for ln in flags), flags
    assert any(ln.startswith("FLAG shard: patch 0 (ones): ") for ln in flags), flags
    assert not any(ln.startswith("FLAG plain") for ln in flags), flags


def test_expected_of_describes_a_patch_over_its_parameter() -> None:
    p = _padded_plan().params[0]
    base = inspect.expected_of(p)
    patch = inspect.expected_of(p, p.patches[1].init)
    assert base is not None and patch is not None
    assert (base.mean, base.std) == (0.0, 0.02) and (patch.mean, patch.std) == (0.5, 0.1)
    assert patch.label == "normal(0.5, 0.1)"


def test_part_statistics_over_chunks_match_numpy() -> None:
    """Each part's statistics, gathered chunk by chunk over a row shard, equal NumPy's over that part's elements;
    where boxes overlap the later patch owns the element."""
    p = param("e", [50, 8], {"normal": {"std": 1}}, region=[(10, 50), (0, 8)])
    p.patches.add(box=[plan_pb2.Range(start=0, stop=20), plan_pb2.Range(start=0, stop=4)], init=plan_pb2.Init(zeros=plan_pb2.Zeros()))
    p.patches.add(box=[plan_pb2.Range(start=15, stop=30), plan_pb2.Range(start=0, stop=8)], init=plan_pb2.Init(ones=plan_pb2.Ones()))
    values = np.random.default_rng(7).standard_normal(40 * 8) * 3 + 1
    values[-1] = math.nan  # a base element (row 49)
    parts = inspect._part_stats(iter(np.array_split(values, 7)), p, list(p.patches))
    rows, cols = np.meshgrid(np.arange(10, 50), np.arange(8), indexing="ij")
    owner = np.zeros((40, 8), dtype=int)
    owner[(rows < 20) & (cols < 4)] = 1
    owner[(rows >= 15) & (rows < 30)] = 2
    grid = values.reshape(40, 8)
    for k, got in enumerate(parts):
        sel = grid[owner == k]
        finite = sel[np.isfinite(sel)]
        assert (got.count, got.nonfinite) == (finite.size, sel.size - finite.size)
        assert got.mean == pytest.approx(finite.mean(), rel=1e-12)
        assert got.std == pytest.approx(finite.std(), rel=1e-12)
        assert (got.min, got.max) == (finite.min(), finite.max())
    assert [parts[1].count, parts[2].count] == [5 * 4, 15 * 8]


# -- one reading of each initializer --------------------------------------------------------------------------------


class _Entries:
    """Counts calls into paraminit.inits and paraminit.regions from code outside them, in every thread started
    after it is installed, while `on`: how often a materialization goes back to the table."""

    def __init__(self) -> None:
        self.files = {inits.__file__, regions.__file__}
        self.on = False
        self.seen: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call" or frame.f_code.co_filename not in self.files:
            return
        if frame.f_back is not None and frame.f_back.f_code.co_filename in self.files:
            return  # a call inside the module
        with self.lock:
            self.seen[f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"] += 1

    def count(self, call: Callable[[], object]) -> collections.Counter[str]:
        call()  # warm: kernels, caches
        self.seen.clear()
        self.on = True
        try:
            call()
        finally:
            self.on = False
        return collections.Counter(self.seen)


def test_a_materialization_reads_each_initializer_once() -> None:
    """Validation reads an initializer once (inits.read) and resolution takes that reading; a large plan's plain rows
    are read once per kind, as columns (inits.Forms carries their bound and kernel arguments). In process and
    through a server's stream alike."""
    from paraminit_server.plans import columns

    kinds = [{"normal": {"std": 0.02, "seed": 1}}, {"uniform": {"lo": -0.1, "hi": 0.1, "seed": 2}}, {"zeros": {}}]
    small = plan_of(param(f"p{i}", [8, 8], kinds[i]) for i in range(3))
    large = plan_of(param(f"p{i}", [8, 8], kinds[i % 3]) for i in range(2 * columns.SCAN_MIN))
    entries = _Entries()
    sys.setprofile(entries)
    threading.setprofile(entries)  # the server's threads start after this
    try:
        with Client() as local, running_server() as r, Client(target_of(r)) as remote:
            for c in (local, remote):
                got = entries.count(lambda: c.materialize(small))  # noqa: B023 (called at once)
                assert got == {"inits.read": 3}, got  # once a parameter
                got = entries.count(lambda: c.materialize(large))  # noqa: B023
                assert got.total() == 3 and set(got) <= {"inits.forms", "inits.<lambda>"}, got  # once a kind
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def test_one_sweep_reads_each_initializer_once() -> None:
    """Checking, digesting and resolving a plan read every initializer once (inits.read): rows with regions,
    inline data and patches, none read again to resolve them or to name their content."""
    from unittest import mock

    from paraminit_server.plans import columns

    rows = [param(f"w{i}", [6, 4], {"normal": {"std": 0.1, "seed": i}}, region=[(0, 3), (0, 4)]) for i in range(20)]
    rows.append(param("flat", [2], {"flat": {"values": [0.5, -1.0]}}))
    patched = param("patched", [4, 4], {"uniform": {"lo": -1.0, "hi": 1.0, "seed": 3}})
    q = patched.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
    q.box.add(start=0, stop=2)
    q.box.add(start=1, stop=3)
    rows.append(patched)
    plan = plan_of(rows)
    assert not columns.of(plan).plain.any()  # regions, data, patches: every row is read one by one
    with (
        mock.patch.object(inits, "read", wraps=inits.read) as reads,
        mock.patch.object(inits, "value_form", side_effect=AssertionError("read again")),
    ):
        got = validation.check(plan)
    assert got.report.ok and got.params is not None
    assert reads.call_count == len(rows) + 1  # each row's initializer and the patch's
    assert [got.params[i].p1 for i in range(20)] == [0.1] * 20
    assert got.params[21].patches and got.params[20].values is not None
    assert got.digest == validation.check(plan, resolve=False).digest
