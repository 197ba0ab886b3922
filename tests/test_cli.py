"""The command line and the contract as users meet them: inspect, plan builders, help, versions, sizes, errors,
exit codes, progress, reflection, times, the zero dtype."""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.metadata
import json
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import grpc
import numpy as np
import pytest
import reference
from safetensors.numpy import load_file, save_file

import paraminit_client
from paraminit import sizes, times
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import Client, cli, inspect, load_plan, param, plan_from_dict, plan_from_safetensors, plan_of
from paraminit_client.plans import PlanFileError, plan_to_json
from paraminit_server import config as server_config
from paraminit_server.backends.cpu import CpuBackend
from paraminit_server.plans import plan as planlib
from paraminit_server.rpc.server import Running
from support import resolved, run_cli, running_server, serve_subprocess, target_of, wait_until

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def server(ckpt_dir: Path) -> Iterator[Running]:
    with running_server(safetensors_dirs=str(ckpt_dir)) as r:
        yield r


@pytest.fixture(scope="module")
def target(server: Running) -> str:
    return target_of(server)


def write_plan(path: Path, plan: plan_pb2.Plan) -> Path:
    path.write_text(plan_to_json(plan))
    return path


MIXED = plan_of(
    [
        param("w.normal", [300, 200], {"normal": {"mean": 0.5, "std": 0.02, "seed": 1}}),
        param("w.uniform", [1000], {"uniform": {"lo": -2.0, "hi": 3.0, "seed": 2}}),
        param("w.kaiming", [64, 48, 3], {"kaimingUniformForShape": {"seed": 3}}, "bfloat16"),
        param("w.xavier", [40, 50], {"xavierUniform": {"fanIn": 10, "fanOut": 30, "seed": 4}}, "float16"),
        param("w.kaiming_fans", [4000], {"kaimingUniform": {"fanIn": 6, "seed": 5}}, "float64"),
        param("b.zeros", [7], {"zeros": {}}),
        param("b.ones", [3, 3], {"ones": {}}, "bf16"),
        param("w.flat", [2, 3], {"flat": {"values": [1, 2, 3, 4, 5, 6]}}),
    ]
)


@pytest.fixture(scope="module")
def mixed_file(server: Running, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "mixed.safetensors"
    with Client(target_of(server)) as c:
        c.materialize_to_file(MIXED, out)
    return out


# -- inspect --------------------------------------------------------------------------------------------------------


def test_inspect_statistics_are_those_of_the_file(mixed_file: Path) -> None:
    arrays = {k: v.astype(np.float64) for k, v in load_file(str(mixed_file)).items() if v.dtype != np.uint16}
    report = inspect.inspect_file(mixed_file)
    rows = {r.name: r for r in report.rows}
    assert set(rows) == {p.name for p in MIXED.params}
    for name, a in arrays.items():
        s = rows[name].stats
        assert s is not None and s.count == a.size, name
        assert s.mean == pytest.approx(a.mean(), rel=1e-9, abs=1e-12), name
        assert s.std == pytest.approx(a.std(), rel=1e-7, abs=1e-12), name
        assert (s.min, s.max) == (a.min(), a.max()), name
    kaiming = rows["w.kaiming"]
    assert kaiming.dtype == "bfloat16" and kaiming.shape == (64, 48, 3) and kaiming.nbytes == 64 * 48 * 3 * 2


def test_inspect_small_chunks_give_the_same_statistics(mixed_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = {r.name: r.stats for r in inspect.inspect_file(mixed_file).rows}
    monkeypatch.setattr(inspect, "CHUNK_ELEMENTS", 333)
    for r in inspect.inspect_file(mixed_file).rows:
        a, b = whole[r.name], r.stats
        assert a is not None and b is not None
        assert (a.count, a.min, a.max) == (b.count, b.min, b.max)
        assert b.mean == pytest.approx(a.mean, rel=1e-9, abs=1e-12) and b.std == pytest.approx(a.std, rel=1e-9, abs=1e-12)


def test_inspect_with_its_plan_passes_every_tensor(mixed_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "plan.json", MIXED)
    code, out, err = run_cli(capsys, "inspect", str(mixed_file), "--plan", str(plan), "--wide")
    assert code == cli.EXIT_OK, out + err
    lines = out.splitlines()
    assert lines[0].split()[:8] == ["name", "dtype", "shape", "bytes", "mean", "std", "min", "max"]
    assert "expected" in lines[0] and lines[0].split()[-1] == "check"
    body = {ln.split()[0]: ln for ln in lines[1 : 1 + len(MIXED.params)]}
    assert set(body) == {p.name for p in MIXED.params}
    for line in body.values():
        assert line.rstrip().endswith(" ok"), line
    assert "normal(0.5, 0.02)" in body["w.normal"]
    assert "kaiming_uniform(fan_in=144)" in body["w.kaiming"]  # 48 * 3
    assert "every tensor matches the plan" in lines[-1]


def test_expected_distributions_follow_the_formulas() -> None:
    normal = inspect.expected_of(param("n", [10], {"normal": {"mean": 1.0, "std": 0.5}}))
    assert normal is not None and (normal.mean, normal.std) == (1.0, 0.5)
    assert normal.hi == pytest.approx(1.0 + 0.5 * math.sqrt(-2 * math.log(1e-6)))
    kaiming = inspect.expected_of(param("k", [8, 24], {"kaimingUniformForShape": {}}))
    assert kaiming is not None and kaiming.hi == pytest.approx(math.sqrt(6 / 24)) and kaiming.lo == -kaiming.hi
    assert kaiming.std == pytest.approx(math.sqrt(6 / 24) / math.sqrt(3))
    xavier = inspect.expected_of(param("x", [8, 24, 2], {"xavierUniformForShape": {}}))
    assert xavier is not None and xavier.hi == pytest.approx(math.sqrt(6 / (48 + 16)))
    uniform = inspect.expected_of(param("u", [3], {"uniform": {"lo": -1, "hi": 5}}))
    assert uniform is not None and (uniform.mean, uniform.std) == (2.0, pytest.approx(6 / math.sqrt(12)))
    assert inspect.expected_of(param("f", [2], {"flatRef": {"payloadId": "x"}})) is None


def test_inspect_judges_a_part_by_its_own_shape(tmp_path: Path) -> None:
    """A fused tensor's parts (Patch.part) are judged against their initializer over the part's shape: the second
    half's Kaiming bound comes from its own fan-in of 128, twice the full [64, 512] tensor's, so judging it over
    the full shape would flag it."""
    p = param("w13", [64, 512], {"zeros": {}})
    for rows, part in (((0, 32), [32, 512]), ((32, 64), [128, 128])):
        q = p.patches.add(init=plan_pb2.Init(kaiming_uniform_for_shape=plan_pb2.KaimingUniformForShape(seed=rows[0] + 1)))
        q.box.add(start=rows[0], stop=rows[1])
        q.box.add(start=0, stop=512)
        q.part.shape.extend(part)
    plan = plan_pb2.Plan(params=[p])
    path = tmp_path / "fused.safetensors"
    with Client() as c:
        c.materialize_to_file(plan, path)
    assert np.abs(load_file(path)["w13"][32:]).max() > 1.5 * math.sqrt(6 / 512)  # beyond the full shape's bound
    assert inspect.inspect_file(path, plan).rows[0].problems == []
    whole = plan_pb2.Plan()
    whole.CopyFrom(plan)
    whole.params[0].patches[1].ClearField("part")  # the same tensor judged as if the half were drawn over [64, 512]
    assert any("patch 1" in x for x in inspect.inspect_file(path, whole).rows[0].problems)


def test_truncated_normal_expectation_fits_the_kernels_and_flags_a_plain_normal(cpu_backend: Any) -> None:
    """The moments of the truncated normal (asymmetric bounds) against 200000 values the CPU kernels draw, and
    the untruncated normal of the same seed is flagged (values outside the bounds, std too large)."""
    init = {"truncatedNormal": {"mean": 0.1, "std": 0.02, "lo": 0.07, "hi": 0.16, "seed": 5}}
    exp = inspect.expected_of(param("t", [200000], init))
    assert exp is not None and exp.lo == pytest.approx(0.07) and exp.hi == pytest.approx(0.16)
    assert 0.1 < exp.mean < 0.11 and exp.std < 0.02  # the cut at -1.5 sigma pulls the mean up, narrows the spread
    got = np.empty(200000, np.float64)
    got.fill(np.nan)
    cpu_backend.fill(planlib.resolve_unchecked(0, param("t", [200000], init, "float64")), got)
    assert inspect.judge(inspect.tensor_stats(iter([got])), exp, "float64") == []
    plain = np.empty(200000, np.float64)
    plain.fill(np.nan)
    cpu_backend.fill(
        planlib.resolve_unchecked(0, param("n", [200000], {"normal": {"mean": 0.1, "std": 0.02, "seed": 5}}, "float64")), plain
    )
    problems = inspect.judge(inspect.tensor_stats(iter([plain])), exp, "float64")
    assert any("values in" in p for p in problems) and any(p.startswith("std") for p in problems), problems


def test_inspect_flags_what_does_not_match(mixed_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = plan_pb2.Plan()
    wrong.CopyFrom(MIXED)
    wrong.params[0].init.normal.std = 0.021  # 5 % off: far beyond the standard error of 60000 values
    wrong.params[1].init.uniform.lo = -1.0  # mean and bounds off
    wrong.params[5].shape[:] = [8]
    del wrong.params[6]  # b.ones: in the file, not in the plan
    wrong.params.add().CopyFrom(param("missing", [2], {"zeros": {}}))
    code, out, _ = run_cli(capsys, "inspect", str(mixed_file), "--plan", str(write_plan(tmp_path / "p.json", wrong)))
    assert code == cli.EXIT_FLAGGED
    flags = [ln for ln in out.splitlines() if ln.startswith("FLAG ")]
    assert any(ln.startswith("FLAG w.normal: std") for ln in flags), flags
    assert any(ln.startswith("FLAG w.uniform: mean") for ln in flags), flags
    assert any(ln.startswith("FLAG b.zeros: shape [7], the plan says [8]") for ln in flags), flags
    assert "FLAG b.ones: not in the plan" in flags
    assert "FLAG missing: in the plan, not in the file" in flags
    assert not any(ln.startswith(("FLAG w.kaiming", "FLAG w.xavier", "FLAG w.flat")) for ln in flags), flags
    assert "5 flagged" in out.splitlines()[-1]


def test_judge_catches_a_wrong_distribution_and_accepts_a_right_one() -> None:
    rng = np.random.default_rng(0)
    exp = inspect.expected_of(param("w", [100000], {"uniform": {"lo": -1, "hi": 1}}))
    assert exp is not None
    right = inspect.tensor_stats(iter([rng.uniform(-1, 1, 100000)]))
    assert inspect.judge(right, exp, "float32") == []
    same_std_normal = np.clip(rng.normal(0, 1 / math.sqrt(3), 100000), -1, 1)  # std close, shape different
    wrong = inspect.tensor_stats(iter([rng.uniform(-1, 1.02, 100000)]))
    assert any("values in" in p for p in inspect.judge(wrong, exp, "float32"))
    assert inspect.judge(inspect.tensor_stats(iter([same_std_normal * 0.9])), exp, "float32")
    nan = inspect.tensor_stats(iter([np.array([0.5, np.nan, np.inf])]))
    assert nan.nonfinite == 2 and inspect.judge(nan, exp, "float32") == ["2 values are not finite"]


def test_inspect_json(mixed_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "plan.json", MIXED)
    code, out, _ = run_cli(capsys, "inspect", str(mixed_file), "--plan", str(plan), "--json")
    assert code == 0
    data = json.loads(out)  # strict JSON: no NaN
    assert data["ok"] is True and data["missing"] == [] and data["metadata"]["plan_digest"]
    tensors = {t["name"]: t for t in data["tensors"]}
    assert tensors["w.normal"]["expected"]["init"] == "normal(0.5, 0.02)"
    assert tensors["w.normal"]["check"] == "ok" and tensors["w.normal"]["shape"] == [300, 200]
    rows = {r.name: r for r in inspect.inspect_file(mixed_file).rows}
    stats = rows["w.uniform"].stats
    assert stats is not None and tensors["w.uniform"]["mean"] == stats.mean and tensors["w.uniform"]["count"] == 1000
    code, out, _ = run_cli(capsys, "inspect", str(mixed_file), "--json")
    doc = json.loads(out)  # without a plan nothing is judged: no check column, and no missing list
    assert code == 0 and doc["ok"] is True and "missing" not in doc and "check" not in doc["tensors"][0]


def test_inspect_refuses_a_file_that_is_not_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes((10_000).to_bytes(8, "little") + b"{}")
    code, _, err = run_cli(capsys, "inspect", str(bad))
    assert code == cli.EXIT_ERROR and "not a safetensors file" in err


def test_inspect_plot_draws_the_expected_density(mixed_file: Path, tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = inspect.inspect_file(mixed_file, MIXED)
    written = inspect.plot(report, tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted(f"{p.name}.png" for p in MIXED.params)
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # the histogram's bars follow the curve drawn over them
    row = next(r for r in report.rows if r.name == "w.normal")
    entry = next(e for e in inspect.read_header(mixed_file)[1] if e.name == "w.normal")
    fig, ax = plt.subplots()
    inspect._draw(ax, row, inspect._values(mixed_file, entry), 60)
    heights = np.array([b.get_height() for b in ax.patches])
    peak = 1 / (0.02 * math.sqrt(2 * math.pi))
    assert heights.max() == pytest.approx(peak, rel=0.08)
    curve = ax.lines[0].get_ydata()
    assert max(curve) == pytest.approx(peak, rel=0.01)
    widths = [b.get_width() for b in ax.patches]
    assert sum(h * w for h, w in zip(heights, widths, strict=True)) == pytest.approx(1.0, abs=0.01)
    plt.close(fig)


def test_inspect_gpt2_demo_plan(server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's own plan (its first transformer block and the position embedding): normal(0, 0.02) where it
    says so, and a histogram whose bars follow that density."""
    pytest.importorskip("matplotlib")
    gpt2 = load_plan(ROOT / "examples/gpt2_small.json")
    part = plan_of(p for p in gpt2.params if p.name.startswith(("h.0.", "wpe.")))
    plan = write_plan(tmp_path / "gpt2_part.json", part)
    out = tmp_path / "gpt2.safetensors"
    code, _, err = run_cli(capsys, "materialize", str(plan), "-o", str(out), "--target", target_of(server), "-q")
    assert code == 0, err
    code, table, _ = run_cli(capsys, "inspect", str(out), "--plan", str(plan), "--plot", str(tmp_path / "png"), "--wide")
    assert code == 0, table
    line = next(ln for ln in table.splitlines() if ln.startswith("h.0.attn.c_attn.weight "))
    assert "normal(0, 0.02)" in line and line.rstrip().endswith("ok")
    assert (tmp_path / "png" / "h.0.attn.c_attn.weight.png").stat().st_size > 5000
    assert len(list((tmp_path / "png").glob("*.png"))) == len(part.params)


# -- plan builders --------------------------------------------------------------------------------------------------


def test_plan_from_safetensors_takes_every_tensor(
    server: Running, ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(1)
    ckpt = {
        "enc.weight": rng.standard_normal((6, 5)).astype(np.float32),
        "enc.bias": rng.standard_normal(6).astype(np.float64),
        "extra": rng.standard_normal((2, 2)).astype(np.float16),
    }
    path = ckpt_dir / "model.safetensors"
    save_file(ckpt, str(path))
    fallback = write_plan(
        tmp_path / "fallback.json",
        plan_of([param("enc.weight", [6, 5], {"zeros": {}}), param("head", [3, 6], {"kaimingUniformForShape": {"seed": 2}})]),
    )
    code, out, err = run_cli(capsys, "plan", "from-safetensors", str(path), "--fallback", str(fallback))
    assert code == 0, err
    plan = plan_from_dict(json.loads(out))
    assert [p.name for p in plan.params] == ["enc.weight", "head", "enc.bias", "extra"]
    assert plan.params[1].init.WhichOneof("kind") == "kaiming_uniform_for_shape"
    with Client(target_of(server)) as c:
        got = c.materialize(plan)
    for name, want in ckpt.items():
        assert got[name].tobytes() == want.tobytes(), name
    only = plan_from_safetensors(path)  # no fallback: the whole checkpoint
    assert sorted(p.name for p in only.params) == sorted(ckpt) and all(p.init.HasField("safetensors") for p in only.params)
    out_file = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "plan", "from-safetensors", str(path), "-o", str(out_file))
    assert code == 0 and out == "" and plan_from_dict(json.loads(out_file.read_text())) == only


def test_plan_from_safetensors_refuses_integer_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ints.safetensors"
    save_file({"steps": np.arange(3, dtype=np.int64)}, str(path))
    with pytest.raises(ValueError, match="steps: checkpoint dtype I64 is not one a plan can hold"):
        plan_from_safetensors(path)


MODULE_SRC = """
import torch.nn as nn

def small():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))

NOT_A_MODULE = 3

def number():
    return 3
"""


def test_plan_from_module(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(MODULE_SRC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    code, out, err = run_cli(capsys, "plan", "from-module", "mymodels.nets:small", "--seed", "7")
    assert code == 0, err
    plan = plan_from_dict(json.loads(out))
    with torch.device("meta"):
        want = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    assert [(p.name, list(p.shape)) for p in plan.params] == [(k, list(v.shape)) for k, v in want.state_dict().items()]
    from paraminit_client.torch import plan_from_module

    assert plan == plan_from_module(want, seed=7)
    code, _, err = run_cli(capsys, "plan", "from-module", "mymodels.nets:nope")
    assert code == cli.EXIT_ERROR and "small" in err and "nope" in err
    code, _, err = run_cli(capsys, "plan", "from-module", "mymodels.nets:number")
    assert code == cli.EXIT_ERROR and "not a torch.nn.Module" in err
    code, _, err = run_cli(capsys, "plan", "from-module", "mymodels.nets")
    assert code == cli.EXIT_USAGE and "package.module:factory" in err
    from paraminit_client import torch as adapter

    assert cli.POLICIES == adapter.POLICIES  # the CLI takes every policy Python takes
    for policy in adapter.POLICIES:
        code, _, err = run_cli(capsys, "plan", "from-module", "mymodels.nets:small", "--policy", policy)
        assert "invalid choice" not in err, (policy, err)


# -- validate, versions, help, sizes --------------------------------------------------------------------------------


def test_validate_json(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "validate", str(ROOT / "examples/mlp.json"), "--json", "--target", target)
    data = json.loads(out)
    plan = load_plan(ROOT / "examples/mlp.json")
    assert code == 0 and data["valid"] and data["violations"] == []
    assert [p["name"] for p in data["params"]] == [p.name for p in plan.params]
    assert data["total_bytes"] == sum(p["bytes"] for p in data["params"]) > 0 and len(data["plan_digest"]) == 64
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"params": [{"name": "a", "shape": [5], "init": {"normal": {"std": -1}}}, {"name": "a", "shape": [2], "init": {"zeros": {}}}]}
        )
    )
    code, out, _ = run_cli(capsys, "validate", str(bad), "--json", "--target", target)
    data = json.loads(out)
    assert code == cli.EXIT_INVALID and not data["valid"]
    assert {(v["index"], v["field"]) for v in data["violations"]} == {(0, "params[0].init.normal"), (1, "params[1].name")}
    assert any(v["message"] == "initialization: normal standard deviation must be nonnegative" for v in data["violations"])


@pytest.mark.slow
def test_version_everywhere() -> None:
    version = importlib.metadata.version("paraminit")
    assert paraminit_client.__version__ == version
    for argv in (
        ["paraminit", "--version"],
        ["paraminit", "inspect", "--version"],
        ["paraminit", "plan", "from-module", "--version"],
        ["paraminit-server", "--version"],
        ["paraminit", "serve", "--version"],
    ):
        done = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and version in done.stdout, (argv, done.stdout, done.stderr)


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_argument_has_help_and_every_help_lists_the_exit_codes() -> None:
    for p in _all_parsers(cli.build_parser()):
        for action in p._actions:
            assert action.help, f"{p.prog}: {action.dest} has no help"
        text = p.format_help()
        if p.add_help:
            # `paraminit serve` is the server: its table is the server's (no plan, no inspect, drains on Ctrl-C)
            for code in (0, 1, 64) if p.prog.endswith(" serve") else (0, 1, 2, 3, 64, 130):
                assert re.search(rf"^  {code}\s+\w", text, re.M), (p.prog, code)
    health = next(p for p in _all_parsers(cli.build_parser()) if p.prog.endswith(" health"))
    assert "127.0.0.1:50051" in health.format_help()


def test_server_help_says_what_each_flag_means() -> None:
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for f in dataclasses.fields(server_config.ServerConfig):
        assert server_config.HELP.get(f.name), f.name
        assert f"env PARAMINIT_{f.name.upper()}; default" in text, f.name
    assert "0 = every core" in text and "0 = half of the memory available at start" in text
    assert "default 16GiB" in text and "default 4032KiB" in text


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("2GiB", 2 << 30),
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("64k", 65536),
        ("10KB", 10_000),
        ("1Mi", 1 << 20),
        (" 3 mib ", 3 << 20),
        ("0", 0),
    ],
)
def test_human_sizes(text: str, value: int) -> None:
    assert sizes.parse_size(text) == value
    assert sizes.parse_size(sizes.exact_size(value)) == value


@pytest.mark.parametrize("text", ["-1", "2X", "GiB", "1iB", "", "1e3"])
def test_bad_sizes_say_what_a_size_is(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        sizes.parse_size(text)


def test_every_size_flag_and_variable_takes_human_sizes() -> None:
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    assert {f.name for f in dataclasses.fields(server_config.ServerConfig)} >= server_config.SIZE_FIELDS
    for name in server_config.SIZE_FIELDS:
        flag = f"--{name.replace('_', '-')}"
        args = parser.parse_args([flag, "3MiB"])
        assert server_config.from_args(args).__getattribute__(name) == 3 << 20, name
        env = server_config.ServerConfig.from_env({f"PARAMINIT_{name.upper()}": "2GiB"})
        assert getattr(env, name) == 2 << 30, name
    with pytest.raises(ValueError, match=r"PARAMINIT_SLAB_BYTES='lots' is not a valid size"):
        server_config.ServerConfig.from_env({"PARAMINIT_SLAB_BYTES": "lots"})
    assert [
        f
        for f in dataclasses.fields(server_config.ServerConfig)
        if f.name.endswith(("_bytes", "_budget")) and f.name not in server_config.SIZE_FIELDS
    ] == []


def test_summary_throughput_leaves_compiling_out(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiling kernels during a materialize is reported apart, and the rate is over the rest of the time."""
    ticks = [100.0]  # the start; every later reading (first byte, end) is 0.501 s on, 0.5 s of it compiling

    def clock() -> float:
        now = ticks[-1]
        ticks.append(100.501)
        return now

    compiled = iter([2.0, 2.5])
    monkeypatch.setattr(cli.materialize, "time", type("Clock", (), {"time": staticmethod(clock)}))
    monkeypatch.setattr(cli.materialize, "_compile_seconds", lambda: next(compiled))
    code, stdout, err = run_cli(
        capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(tmp_path / "m.safetensors"), "--target", target
    )
    assert code == 0, err
    # 940544 bytes over 0.001 s; over the whole 0.501 s it would read 1.8 MiB/s.
    assert re.fullmatch(
        r"wrote .*: 6 parameters, 918\.5 KiB in 0\.00 s plus 0\.5 s compiling CPU kernels "
        r"\(897\.0 MiB/s; 0\.00 s of it before the first byte: 0\.00 s plan checks\), plan digest [0-9a-f]{64}\n",
        stdout,
    ), stdout


def test_summary_tells_starting_the_data_plane_from_plan_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, the time before the first byte is mostly starting the data plane (importing numba, loading the
    cached kernels): the summary says so, apart from the plan's checks."""
    ticks = [100.0]  # the start; every later reading (first byte, end) is 0.5 s on

    def clock() -> float:
        now = ticks[-1]
        ticks.append(100.5)
        return now

    waited = iter([3.0, 3.4])  # this command's calls waited 0.4 s for the data plane to start
    monkeypatch.setattr(cli.materialize, "time", type("Clock", (), {"time": staticmethod(clock)}))
    monkeypatch.setattr(cli.materialize, "_start_seconds", lambda: next(waited))
    code, stdout, err = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(tmp_path / "m.safetensors"))
    assert code == 0, err
    assert "0.50 s of it before the first byte: 0.40 s starting the data plane (numba, cached CPU kernels), 0.10 s plan checks)" in stdout


def test_the_start_wait_is_counted_once_per_start() -> None:
    """embedded.start_wait_seconds grows by the time a call waited for a data plane still starting, not after."""
    import concurrent.futures

    from paraminit_server import embedded

    slow: concurrent.futures.Future[Any] = concurrent.futures.Future()
    door = embedded.InProcess(slow)
    threading.Timer(0.3, lambda: slow.set_result(embedded.data_plane("cpu"))).start()
    before = embedded.start_wait_seconds()
    assert door.plane is door.plane
    waited = embedded.start_wait_seconds() - before
    assert 0.2 < waited < 30
    assert door.plane is not None  # ready now: no wait counted
    assert embedded.start_wait_seconds() - before == waited


def test_chunk_bytes_takes_a_size(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.safetensors"
    code, stdout, err = run_cli(
        capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out), "--chunk-bytes", "64KiB", "--target", target
    )
    assert code == 0, err
    assert re.fullmatch(
        r"wrote .*: 6 parameters, 918\.5 KiB in [\d.]+ s \([\d.]+ [KMGT]?i?B/s; [^)]*\), "
        r"plan digest [0-9a-f]{64}\n",
        stdout,
    )
    code, _, err = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out), "--chunk-bytes", "lots")
    assert code == cli.EXIT_USAGE and "is not a size" in err


# -- errors and exit codes ------------------------------------------------------------------------------------------


def _plan_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, data: Any) -> tuple[int, str]:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "validate", str(path), "--target", target)
    return code, err


def test_misspelled_names_get_suggestions_and_the_valid_list(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _plan_error(tmp_path, capsys, target, {"params": [{"name": "w", "shape": [4], "init": {"normall": {"std": 1}}}]})
    assert code == cli.EXIT_INVALID
    assert "params[0].init: unknown initializer 'normall' (did you mean 'normal'?)" in err
    assert "xavierUniformForShape" in err and "Available Fields" not in err and "Failed to parse" not in err
    code, err = _plan_error(tmp_path, capsys, target, {"params": [{"name": "w", "shape": [4], "init": {"kaiming_uniform_for_shap": {}}}]})
    assert "did you mean 'kaimingUniformForShape'?" in err
    code, err = _plan_error(tmp_path, capsys, target, {"params": [{"name": "w", "shape": [4], "init": {"normal": {"stdd": 1}}}]})
    assert "params[0].init.normal: unknown field 'stdd' (did you mean 'std'?); valid: mean, std, seed" in err
    code, err = _plan_error(tmp_path, capsys, target, {"params": [{"name": "w", "shape": [4], "dtype": "flaot16", "init": {"zeros": {}}}]})
    assert code == cli.EXIT_INVALID
    assert "params[0].dtype: unknown dtype 'flaot16' (did you mean 'float16'?)" in err
    assert "float32, float64, float16, bfloat16" in err and "bf16" in err
    code, err = _plan_error(tmp_path, capsys, target, {"params": [{"name": "w", "shape": [4, -2], "init": {"zeros": {}}}]})
    assert "params[0].shape[1]: must not be negative, got -2" in err
    with pytest.raises(ValueError, match=r"init: unknown initializer 'unifrom' \(did you mean 'uniform'\?\)"):
        param("w", [2], {"unifrom": {}})
    with pytest.raises(ValueError, match=r"unknown dtype 'bf61' \(did you mean 'bf16'\?\)"):
        param("w", [2], {"zeros": {}}, "bf61")


@pytest.mark.parametrize(
    ("name", "enum"),
    [
        ("bf16", plan_pb2.DTYPE_BFLOAT16),
        ("BF16", plan_pb2.DTYPE_BFLOAT16),
        ("fp16", plan_pb2.DTYPE_FLOAT16),
        ("half", plan_pb2.DTYPE_FLOAT16),
        ("f32", plan_pb2.DTYPE_FLOAT32),
        ("double", plan_pb2.DTYPE_FLOAT64),
        ("bfloat16", plan_pb2.DTYPE_BFLOAT16),
        ("DTYPE_FLOAT16", plan_pb2.DTYPE_FLOAT16),
    ],
)
def test_plan_files_accept_dtype_aliases(name: str, enum: int, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        f"params:\n- name: w\n  shape: [2]\n  dtype: {name}\n  init: {{zeros: {{}}}}\n"
        f"- name: c\n  shape: [1]\n  init: {{safetensors: {{path: x, tensor: t, dtype: {name}}}}}\n"
    )
    plan = load_plan(path)
    assert plan.params[0].dtype == enum and plan.params[1].init.safetensors.dtype == enum


def test_usage_errors_have_their_own_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["validate"],
        ["materialize", "x.json"],
        ["inspect", "f", "--bogus"],
        ["nope"],
        [],
        ["plan", "from-module", "m:f", "--policy", "pytorch"],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == cli.EXIT_USAGE == 64, argv
        assert "usage:" in err
    assert cli.EXIT_USAGE not in (cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_INVALID, cli.EXIT_FLAGGED)
    done = subprocess.run([str(BIN / "paraminit"), "serve", "--port", "notaport"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 64, done.stderr


def test_errors_read_as_words_not_status_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "info", "--target", "127.0.0.1:1", "--timeout", "5")
    assert code == cli.EXIT_ERROR
    assert re.fullmatch(r"paraminit: cannot connect to 127\.0\.0\.1:1: [^:()]+ \(gRPC status UNAVAILABLE\)\n", err), err
    code, _, err = run_cli(capsys, "validate", str(tmp_path / "absent.json"))
    assert code == cli.EXIT_ERROR and err.strip() == f"paraminit: {tmp_path / 'absent.json'}: No such file or directory"


def test_readme_documents_the_exit_codes_and_the_memory_budget_default() -> None:
    reference = (ROOT / "docs/cli.md").read_text()  # the README links it; every --help has the table too
    assert "docs/cli.md" in README
    for code, meaning in re.findall(r"^  (\d+)\s+(\S[^:\n]*)", cli.EXIT_CODES_HELP, re.M):
        assert re.search(rf"`{code}`", reference), f"docs/cli.md does not document exit code {code} ({meaning})"
    assert "half of free memory" not in README
    assert "half the container's memory limit" in README and "half of the memory available (MemAvailable) at start" in README
    assert "paraminit inspect" in README and "paraminit plan from-safetensors" in README


# -- progress -------------------------------------------------------------------------------------------------------


def test_without_a_tty_success_is_one_line(target: str, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    done = subprocess.run(
        [str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out), "--target", target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(done.stdout.splitlines()) == 1 and "10 parameters" in done.stdout and out.exists()
    done = subprocess.run(
        [str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out), "--target", target, "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_on_a_tty_the_bar_stays_and_a_final_line_follows(target: str, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a terminal 100 columns wide
    proc = subprocess.Popen(
        [str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out), "--target", target],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert re.search(r"m\.safetensors: 100%\|[^\r\n]*\]\r?\n", screen), f"the finished bar stays: {screen!r}"
    final = screen.rstrip().splitlines()[-1]
    assert re.fullmatch(r"wrote .*m\.safetensors: 10 parameters, .* [KMGT]?i?B/s; [^)]*\), plan digest [0-9a-f]{64}", final), screen


# -- the contract ---------------------------------------------------------------------------------------------------


def _reflect(channel: grpc.Channel, service: str) -> list[str]:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r

    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=r.ServerReflectionRequest.SerializeToString,
        response_deserializer=r.ServerReflectionResponse.FromString,
    )
    requests = [
        r.ServerReflectionRequest(list_services=""),
        r.ServerReflectionRequest(file_containing_symbol="paraminit.v1.InitService"),
        r.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    ]
    found: list[str] = []
    for resp in call(iter(requests), timeout=10):
        kind = resp.WhichOneof("message_response")
        assert kind != "error_response", resp
        if kind == "list_services_response":
            found += [s.name for s in resp.list_services_response.service]
        else:
            found += [descriptor_pb2.FileDescriptorProto.FromString(b).name for b in resp.file_descriptor_response.file_descriptor_proto]
    return found


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_v1_and_v1alpha(target: str, service: str) -> None:
    with grpc.insecure_channel(target) as ch:
        found = _reflect(ch, service)
    assert {
        "paraminit.v1.InitService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(found)
    assert "paraminit/v1/init_service.proto" in found and "grpc/reflection/v1/reflection.proto" in found


def test_times_are_timestamps_and_durations(target: str) -> None:
    with Client(target) as c:
        stub = c.stub
        before = time.time()
        resp = next(
            iter(
                stub.Materialize(
                    pb.MaterializeRequest(
                        plan=plan_of([param("w", [16], {"ones": {}})]), delivery=pb.DELIVERY_SHM, lease_ttl=times.duration(90.5)
                    ),
                    timeout=30,
                )
            )
        )
        lease = resp.export.lease
        assert lease.expires_at.seconds > 0
        assert before + 90 <= times.epoch(lease.expires_at) <= time.time() + 91
        renewed = stub.Renew(pb.RenewRequest(lease_id=lease.lease_id, ttl=times.duration(200)), timeout=10).lease
        assert times.epoch(renewed.expires_at) >= before + 199
        status = stub.ListLeases(pb.ListLeasesRequest(), timeout=10).leases
        mine = next(s for s in status if s.lease.lease_id == lease.lease_id)
        assert 0 <= times.seconds(mine.age) < 60 and mine.age.ByteSize() >= 0
        stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=10)
        ref = stub.UploadPayload(
            iter([pb.PayloadChunk(dtype=plan_pb2.DTYPE_FLOAT32, count=2, data=np.array([1, 2], np.float32).tobytes())]), timeout=10
        )
        assert times.epoch(ref.expires_at) > before + 60
    assert pb.Lease.DESCRIPTOR.fields_by_name["expires_at"].message_type.full_name == "google.protobuf.Timestamp"
    assert pb.LeaseStatus.DESCRIPTOR.fields_by_name["age"].message_type.full_name == "google.protobuf.Duration"
    assert pb.PayloadRef.DESCRIPTOR.fields_by_name["expires_at"].message_type.full_name == "google.protobuf.Timestamp"


def test_zero_dtype_means_float32_everywhere(target: str) -> None:
    values = np.array([0.1, -2.5, 3.25, 7.0], np.float32)
    with Client(target) as c:
        ref = c.stub.UploadPayload(iter([pb.PayloadChunk(count=4, data=values.tobytes())]), timeout=10)  # dtype 0
        assert ref.count == 4
        plan = plan_of([plan_pb2.Param(name="p", shape=[4], init=plan_pb2.Init(flat_ref=plan_pb2.FlatRef(payload_id=ref.payload_id)))])
        assert plan.params[0].dtype == plan_pb2.DTYPE_UNSPECIFIED
        header, chunks = c.stream(plan)
        data = b"".join(bytes(ch.data) for ch in chunks)
    assert header.tensors[0].dtype in (plan_pb2.DTYPE_UNSPECIFIED, plan_pb2.DTYPE_FLOAT32)
    assert json.loads(header.safetensors_prefix[8:])["p"]["dtype"] == "F32"
    assert np.frombuffer(data, np.float32).tobytes() == values.tobytes()


def test_stream_order_and_crc32c_are_as_documented(target: str) -> None:
    plan = plan_of(
        [
            param("h", [3], {"ones": {}}, "float16"),
            param("s", [5], {"normal": {"std": 1, "seed": 1}}),
            param("d", [2], {"uniform": {"lo": 0, "hi": 1, "seed": 2}}, "float64"),
            param("b", [3], {"ones": {}}, "bfloat16"),
        ]
    )
    with Client(target) as c:
        header, _ = c.stream(plan)
        raw = list(c.stub.Materialize(pb.MaterializeRequest(plan=plan), timeout=30))
    offsets = {t.name: t.offset for t in header.tensors}
    assert [t.name for t in header.tensors] == ["h", "s", "d", "b"]  # plan order
    assert offsets["d"] < offsets["s"] < offsets["h"] < offsets["b"]  # data: by descending item size
    chunks = [m.chunk for m in raw if m.WhichOneof("msg") == "chunk"]
    assert chunks and all(crc32c.crc32c(ch.data) == ch.crc32c for ch in chunks)
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    proto = (ROOT / "proto/paraminit/v1/init_service.proto").read_text()
    assert "Castagnoli" in proto and "0xE3069283" in proto and "of `data` only" in proto
    assert "google.rpc.BadRequest" in proto and "descending item size" in proto
    plan_proto = (ROOT / "proto/paraminit/v1/plan.proto").read_text()
    for phrase in ("gain sqrt(2)", "gain 1", "[lo, hi)", "5.2565", "DTYPE_UNSPECIFIED (0) means float32"):
        assert phrase in plan_proto, phrase
    assert "README" not in plan_proto.split("syntax")[0]


def test_plan_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(PlanFileError, match=r"p\.json: not a valid plan"):
        load_plan(path)


def test_every_paraminit_help_has_the_exit_code_table(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--help"],
        ["materialize", "--help"],
        ["validate", "--help"],
        ["inspect", "--help"],
        ["info", "--help"],
        ["health", "--help"],
        ["serve", "--help"],
    ):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and "exit codes:" in out and re.search(r"^\s*64\s+usage error", out, re.M), argv


# -- --target and -o ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("localhost", "has no port"),
        ("localhost:99999", "is not a number from 1 to 65535"),
        ("localhost:0", "is not a number from 1 to 65535"),
        ("localhost:http", "is not a number"),
        ("http://localhost:50051", "take no http:// scheme"),
        ("grpc://10.0.0.1:50051", "take no grpc:// scheme"),
        ("::1", "has no port"),
        (":50051", "has no host"),
    ],
)
def test_a_malformed_target_is_a_usage_error_before_connecting(target: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "info", "--target", target)
    assert code == cli.EXIT_USAGE, err
    assert says in err and "Connection refused" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("target", ["localhost:50051", "[::1]:50051", "unix:/tmp/x.sock", "dns:///svc:50051", None])
def test_well_formed_targets_pass_the_check(target: str | None) -> None:
    assert cli.check_target(target) == target


def test_health_without_a_target_names_the_default_it_tried(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.health, "DEFAULT_HEALTH_TARGET", "127.0.0.1:1")  # nothing listens on port 1
    code, _, err = run_cli(capsys, "health", "--timeout", "5")
    assert code == cli.EXIT_ERROR and "127.0.0.1:1" in err, err


def test_output_onto_the_plan_is_refused_and_the_plan_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    text = (ROOT / "examples/mlp.json").read_text()
    plan.write_text(text)
    code, _, err = run_cli(capsys, "materialize", str(plan), "-o", str(plan))
    assert code == cli.EXIT_USAGE and "input file" in err, err
    assert plan.read_text() == text
    code, _, err = run_cli(capsys, "materialize", str(plan), "-o", str(tmp_path / "." / "plan.json"))
    assert code == cli.EXIT_USAGE and plan.read_text() == text


def test_plan_output_onto_its_fallback_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, dtype=np.float32)}, str(tmp_path / "c.safetensors"))
    fallback = tmp_path / "fallback.json"
    fallback.write_text('{"params": [{"name": "w", "shape": [3], "init": {"zeros": {}}}]}')
    before = fallback.read_text()
    code, _, err = run_cli(
        capsys, "plan", "from-safetensors", str(tmp_path / "c.safetensors"), "--fallback", str(fallback), "-o", str(fallback)
    )
    assert code == cli.EXIT_USAGE and "input file" in err and fallback.read_text() == before


def test_output_errors_name_the_target_file_not_a_temporary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = ROOT / "examples/mlp.json"
    code, _, err = run_cli(capsys, "materialize", str(plan), "-o", str(tmp_path))
    assert code == cli.EXIT_ERROR and str(tmp_path) in err and "is a directory" in err and ".part" not in err, err
    missing = tmp_path / "nope" / "m.safetensors"
    code, _, err = run_cli(capsys, "materialize", str(plan), "-o", str(missing))
    assert code == cli.EXIT_ERROR and str(missing) in err and "does not exist" in err and ".part" not in err, err


# -- progress, summary, -q ------------------------------------------------------------------------------------------


def test_summary_rate_is_its_bytes_over_its_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from paraminit import sizes

    with running_server() as server:
        out = tmp_path / "m.safetensors"
        code, stdout, err = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out), "--target", target_of(server))
    assert code == 0, err
    m = re.fullmatch(
        r"wrote .*: 6 parameters, ([\d.]+ \w+) in ([\d.]+) s \(([\d.]+ \w+)/s; ([\d.]+) s of it before "
        r"the first byte: [^)]*\), plan digest [0-9a-f]{64}\n",
        stdout,
    )
    assert m, stdout
    total, seconds, rate, setup = sizes.parse_size(m[1].replace(" ", "")), float(m[2]), m[3], float(m[4])
    assert abs(total - out.stat().st_size) < out.stat().st_size * 0.01
    assert 0 <= setup <= seconds
    # the printed rate is the printed bytes over the printed seconds (to the printed precision)
    if seconds >= 0.05:
        assert sizes.parse_size(rate.replace(" ", "")) == pytest.approx(total / seconds, rel=0.15)


def test_quiet_prints_nothing_but_errors(tmp_path: Path) -> None:
    with running_server() as server:
        out = tmp_path / "m.safetensors"
        done = subprocess.run(
            [str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out), "--target", target_of(server), "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "" and out.exists()
        bad = subprocess.run(
            [str(BIN / "paraminit"), "materialize", str(tmp_path / "none.json"), "-o", str(out), "--target", target_of(server), "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == cli.EXIT_ERROR and "none.json" in bad.stderr


def test_quiet_asks_for_no_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bars: list[int] = []
    monkeypatch.setattr(cli.materialize, "progress_bar", lambda total, name: bars.append(total))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "m.safetensors"
    code, stdout, _ = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out), "-q")
    assert code == 0 and stdout == "" and bars == []


# -- inspect --------------------------------------------------------------------------------------------------------


def _odd_file(tmp_path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    path = tmp_path / "odd.safetensors"
    save_file(
        {
            "transformer.encoder.layers.11.self_attention.query_key_value.weight": (rng.standard_normal((64, 48)) * 0.02).astype(
                np.float32
            ),
            "bad": np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32),
        },
        str(path),
    )
    return path


def test_inspect_fits_the_terminal_and_counts_non_finite_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from paraminit_client import inspect

    path = _odd_file(tmp_path)
    name = "transformer.encoder.layers.11.self_attention.query_key_value.weight"
    code, out, _ = run_cli(capsys, "inspect", str(path))  # not a terminal: names whole
    assert code == 0 and name in out
    lines = out.splitlines()
    assert "non-finite" in lines[0].split() and "min" not in lines[0].split()
    bad = next(line for line in lines[:3] if line.startswith("bad "))
    assert bad.split()[-1] == "3"  # NaN, +inf, -inf: counted, not hidden behind mean 1 std 0
    report = inspect.inspect_file(path)
    full = inspect.format_table(report).splitlines()
    assert max(len(line) for line in full) > 100  # the whole table is wider than the narrow terminals below
    for width in (40, 80, 100, 140):  # a terminal of that width: whole names, other columns give way first
        table = inspect.format_table(report, columns=width).splitlines()
        assert all(len(line) <= width for line in table), (width, [len(x) for x in table])
        if len(name) <= width:  # whole on one line; longer than the terminal: on lines of its own, not cut
            assert any(line.split() and line.split()[0] == name for line in table), (width, table)
        else:
            at = next(i for i, line in enumerate(table) if line.startswith("transformer"))
            assert table[at] + table[at + 1] == name, table[at : at + 2]
        assert {"bad", "mean"} & set(" ".join(table).split()), table  # rows and cells still there
        left_out = [line for line in table if line.startswith("(left out to fit")]
        assert bool(left_out) == (max(len(line) for line in full[:4]) > width), (width, left_out)
    narrow = inspect.format_table(report, columns=70).splitlines()
    at = narrow.index(name)
    assert narrow[at + 1].startswith("  ") and narrow[at + 1].split()[-1] in ("-", "3", "0")  # its cells, indented
    code, wide, _ = run_cli(capsys, "inspect", str(path), "--wide")
    head = wide.splitlines()[0].split()
    assert {"min", "max", "non-finite"} <= set(head)
    assert "transformer.encoder.layers.11.self_attention.query_key_value.weight" in wide


def test_plot_is_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from paraminit_client import inspect

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    worked: list[str] = []
    monkeypatch.setattr(inspect, "inspect_file", lambda *a, **k: worked.append("stats"))
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _, err = run_cli(capsys, "inspect", str(tmp_path / "x.safetensors"), "--plot", str(tmp_path / "png"))
    assert code == cli.EXIT_ERROR and "pip install 'paraminit[plot]'" in err and worked == []


def test_plot_log_draws_the_tails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = _odd_file(tmp_path)
    code, _, err = run_cli(capsys, "inspect", str(path), "--plot", str(tmp_path / "png"), "--plot-log")
    assert code == 0, err
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert len(pngs) == 2 and all((tmp_path / "png" / p).stat().st_size > 5000 for p in pngs)


def test_hf_extra_installs_transformers_and_info_help_speaks_of_a_server() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"]) and any(d.startswith("torch") for d in extras["hf"])
    info = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "info")[1]
    text = info.format_help()
    assert not re.search(r"\bplans?\b", text.split("exit codes:")[0]), text


def expected_arrays(plan: plan_pb2.Plan) -> dict[str, np.ndarray[Any, Any]]:
    return {p.name: reference.materialize(p) for p in resolved(plan)}


def test_cli_against_serve_subprocess(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    proc, target = serve_subprocess(stderr=subprocess.STDOUT)
    try:
        assert subprocess.run([str(BIN / "paraminit"), "health", "--target", target]).returncode == 0
        out = tmp_path / "conv.safetensors"
        r = subprocess.run(
            [str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o", str(out), "--target", target, "--summary"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        assert "10 parameters" in r.stdout
        loaded = load_file(str(out))
        want = expected_arrays(load_plan(ROOT / "examples/conv.json"))
        assert set(loaded) == set(want)
        for name, w in want.items():
            assert loaded[name].tobytes() == w.tobytes(), name

        bad = tmp_path / "bad.json"
        bad.write_text(
            json.dumps(
                {
                    "params": [
                        {"name": "a", "shape": [5], "init": {"xavierUniformForShape": {"seed": 1}}},
                        {"name": "b", "shape": [2], "init": {"normal": {"std": -1}}},
                    ]
                }
            )
        )
        existing = tmp_path / "keep.safetensors"
        existing.write_bytes(b"precious")
        r = subprocess.run(
            [str(BIN / "paraminit"), "materialize", str(bad), "-o", str(existing), "--target", target], capture_output=True, text=True
        )
        assert r.returncode == 2
        assert "torch.runtimeInit: Xavier initialization expects at least 2 dimensions, got [5]" in r.stderr
        assert "initialization: normal standard deviation must be nonnegative" in r.stderr
        assert existing.read_bytes() == b"precious"
        assert not list(tmp_path.glob(".*.part"))

        r = subprocess.run([str(BIN / "paraminit"), "info", "--target", target], capture_output=True, text=True)
        assert r.returncode == 0 and "backend=cpu" in r.stdout
        r = subprocess.run(
            [str(BIN / "paraminit"), "validate", str(ROOT / "examples/mlp.json"), "--target", target], capture_output=True, text=True
        )
        assert r.returncode == 0 and "6 parameters" in r.stdout
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_health_unreachable_exits_1() -> None:
    r = subprocess.run([str(BIN / "paraminit"), "health", "--target", "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


class GatedBackend(CpuBackend):
    """Blocks the fill of parameter 'slow' until the test opens the gate: the stream is mid-file, for sure."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def fill(self, p: Any, out: Any, l_begin: int = 0) -> None:
        if p.name == "slow":
            self.gate.wait(120)
        super().fill(p, out, l_begin)


def _writes_in(pid: int, directory: Path) -> bool:
    """Whether process `pid` holds a file of `directory` open (named or not)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        links = [os.readlink(fds / fd) for fd in os.listdir(fds)]
    except OSError:
        return False
    return any(link.startswith(f"{directory}/") for link in links)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_interrupted_materialize_leaves_no_partial_file(tmp_path: Path, sig: signal.Signals) -> None:
    backend = GatedBackend()
    plan = plan_of([param("a", [1 << 18], {"ones": {}}), param("slow", [1 << 18], {"ones": {}})])
    (tmp_path / "plan.json").write_text(plan_to_json(plan))
    out = tmp_path / "out" / "big.safetensors"
    out.parent.mkdir()
    # The command starts with SIGHUP and SIGINT at their defaults: a run started under `nohup` or as a background
    # job of a non-interactive shell inherits them ignored, and the command rightly leaves ignored signals ignored.
    argv = [str(Path(sys.executable).parent / "paraminit"), "materialize", str(tmp_path / "plan.json"), "-o", str(out)]
    defaults = (
        "import os, signal, sys\n"
        "for s in (signal.SIGHUP, signal.SIGINT): signal.signal(s, signal.SIG_DFL)\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    with running_server(backend) as r:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", defaults, *argv, "--target", target_of(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            # the output is open (unnamed, O_TMPFILE, or a hidden temporary): the command is mid-file
            assert wait_until(lambda: _writes_in(proc.pid, out.parent) or proc.poll() is not None, 120)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            backend.gate.set()
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig)
    assert f"interrupted by {sig.name}" in err and "was not written" in err, err
    assert list(out.parent.iterdir()) == []


def test_a_fifo_without_a_writer_never_hangs_a_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`validate`, `inspect` and `plan from-safetensors` on a FIFO nobody writes: an answer at once (a plan
    reads as empty; a safetensors file must be a regular file), not a wait forever for a writer."""
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    done: list[tuple[int, str, str]] = []
    for argv in (["validate", str(fifo)], ["inspect", str(fifo)], ["plan", "from-safetensors", str(fifo)]):
        t = threading.Thread(target=lambda a=argv: done.append(run_cli(capsys, *a)), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"{argv} hangs on a FIFO with no writer"
    assert [code for code, _, _ in done] == [2, 1, 1], done  # invalid plan (empty), error, error
    assert "not a regular file" in done[1][2] and "not a regular file" in done[2][2], done


def test_inspect_of_a_file_truncated_while_read_is_an_error_not_sigbus(tmp_path: Path) -> None:
    from paraminit_client import inspect

    path = tmp_path / "w.safetensors"
    save_file({"w": np.ones(3 * inspect.CHUNK_ELEMENTS, dtype=np.float32)}, str(path))
    _meta, entries = inspect.read_header(path)
    chunks = inspect._values(path, entries[0])
    next(chunks)  # the first chunk is read, then the file shrinks under the reader
    os.truncate(path, 4096)
    with pytest.raises(inspect.SafetensorsError, match="ends inside the tensor's data"):
        list(chunks)


def test_materialize_to_standard_output(tmp_path: Path) -> None:
    """`-o -` writes the safetensors bytes to stdout (not a file named `-`); the summary goes to stderr."""
    plan = ROOT / "examples/mlp.json"
    ref = tmp_path / "ref.safetensors"
    assert subprocess.run([str(BIN / "paraminit"), "materialize", str(plan), "-o", str(ref), "-q"]).returncode == 0
    r = subprocess.run([str(BIN / "paraminit"), "materialize", str(plan), "-o", "-"], capture_output=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ref.read_bytes() and b"wrote stdout: 6 parameters" in r.stderr
    assert not (tmp_path / "-").exists()


def test_an_in_process_limit_names_the_variable_that_raises_it(tmp_path: Path) -> None:
    """In process there is no server: a plan over the per-parameter limit says so with sizes in units and the
    variable that raises the limit, and the variable works."""
    plan = tmp_path / "big.json"
    plan.write_text(json.dumps({"params": [{"name": "w", "shape": [1024, 1024], "init": {"zeros": {}}}]}))
    env = {**os.environ, "PARAMINIT_MAX_PARAM_BYTES": "1MiB"}
    r = subprocess.run(
        [str(BIN / "paraminit"), "materialize", str(plan), "-o", str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode != 0 and "server" not in r.stderr, r.stderr
    assert "over a limit of this process" in r.stderr and "4.0 MiB" in r.stderr and "1.0 MiB" in r.stderr
    assert "PARAMINIT_MAX_PARAM_BYTES" in r.stderr
    env["PARAMINIT_MAX_PARAM_BYTES"] = "8MiB"
    r = subprocess.run(
        [str(BIN / "paraminit"), "materialize", str(plan), "-o", str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr


def test_a_reader_that_stops_early_fails_the_file_and_not_a_report(tmp_path: Path) -> None:
    """`paraminit materialize plan -o - | head -c 10`: a safetensors file cut short is no file, so the command fails
    (exit 1) saying how many bytes went out, with no traceback; `paraminit inspect file | head -n 1` stays quiet
    (exit 0): a report's first lines are what its reader wanted."""
    plan = write_plan(tmp_path / "p.json", plan_of([param(f"w{i}", [1 << 16], {"normal": {"std": 1.0, "seed": i}}) for i in range(64)]))
    proc = subprocess.Popen([str(BIN / "paraminit"), "materialize", str(plan), "-o", "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10  # the 16 MiB file is far larger than a pipe holds
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == cli.EXIT_ERROR, err
    found = re.search(r"standard output was closed when at least (\d+) of the file's (\d+) bytes were written", err)
    assert found and int(found.group(1)) < int(found.group(2)) and int(found.group(2)) > 16 << 20 and "incomplete" in err, err
    assert "Broken pipe" not in err and "Traceback" not in err
    out_file = tmp_path / "w.safetensors"
    assert subprocess.run([str(BIN / "paraminit"), "materialize", str(plan), "-o", str(out_file)], capture_output=True).returncode == 0
    proc = subprocess.Popen([str(BIN / "paraminit"), "inspect", str(out_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0 and err == "", err


def test_json_everywhere_has_one_envelope(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json on every command that reports: one object on stdout, "ok" and "exit_code" first, the command's own
    fields on success, and one shape for every failure (error, violations)."""
    plan = write_plan(tmp_path / "p.json", plan_of([param("w", [4, 4], {"normal": {"std": 1.0, "seed": 1}})]))
    out_file = tmp_path / "w.safetensors"
    docs = {}
    for argv in (
        ("materialize", str(plan), "-o", str(out_file), "--target", target),
        ("validate", str(plan), "--target", target),
        ("inspect", str(out_file), "--plan", str(plan)),
        ("info", "--target", target),
        ("health", "--target", target),
        ("leases", "--target", target),
    ):
        code, out, err = run_cli(capsys, *argv, "--json")
        doc = json.loads(out)
        assert list(doc)[:2] == ["ok", "exit_code"] and doc["ok"] is True and doc["exit_code"] == code == 0, (argv, err)
        docs[argv[0]] = doc
    assert docs["materialize"]["parameters"] == 1 and docs["materialize"]["bytes"] == 64
    assert docs["materialize"]["plan_digest"] == docs["validate"]["plan_digest"] == docs["inspect"]["metadata"]["plan_digest"]
    assert docs["info"]["backend"] == "cpu" and "float32" in docs["info"]["dtypes"] and docs["info"]["limits"]["max_chunk_bytes"] > 0
    assert docs["health"]["status"] == "SERVING" and docs["leases"]["leases"] == []
    failures = [
        ("materialize", str(plan), "-o", "-"),  # usage: the file and the summary would share stdout
        ("info", "--target", "127.0.0.1:1"),  # unreachable
        ("validate", str(tmp_path / "missing.json")),
    ]
    for argv in failures:
        code, out, _ = run_cli(capsys, *argv, "--json")
        doc = json.loads(out)
        assert code != 0 and doc["ok"] is False and doc["exit_code"] == code and doc["error"] and doc["violations"] == [], argv


def test_every_violation_in_json_has_one_shape(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file's syntax, a server's Validate and a refused Materialize report violations with the same keys,
    the initializer named as the plan spells it and the file's line."""
    broken = tmp_path / "broken.json"
    broken.write_text('{"params": [\n')
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [\n {"name": "w", "shape": [4], "init": {"truncatedNormal": {"std": -1, "lo": -2, "hi": 2}}}\n]}\n')
    keys = ["file", "line", "index", "name", "field", "message", "limit"]
    shapes = {}
    for argv in (
        ("validate", str(broken)),
        ("validate", str(bad), "--target", target),
        ("materialize", str(bad), "-o", str(tmp_path / "x.safetensors"), "--target", target),
    ):
        code, out, _ = run_cli(capsys, *argv, "--json")
        doc = json.loads(out)
        assert code == cli.EXIT_INVALID and doc["ok"] is False and doc["violations"], argv
        shapes[argv[0] + str(len(shapes))] = doc["violations"]
        for v in doc["violations"]:
            assert list(v) == keys and v["file"] and v["line"] == 2 and v["message"], (argv, v)
    for got in list(shapes.values())[1:]:
        (v,) = got
        assert (v["index"], v["name"], v["field"], v["limit"]) == (0, "w", "params[0].init.truncatedNormal", False)
        assert v["message"] == "initialization: truncated normal standard deviation must be nonnegative"


@pytest.mark.parametrize("how", ["pipe", "redirect"])
def test_dash_reads_a_safetensors_file_from_stdin(mixed_file: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`-` is standard input for inspect too, piped or redirected from a file; a plan from a checkpoint refers to
    the file by path, so `plan from-safetensors -` is refused with the reason."""
    want = subprocess.run([str(BIN / "paraminit"), "inspect", str(mixed_file), "--json"], capture_output=True, timeout=120)
    assert want.returncode == 0, want.stderr
    argv = [str(BIN / "paraminit"), "inspect", "-", "--json"]
    if how == "pipe":
        got = subprocess.run(argv, input=mixed_file.read_bytes(), capture_output=True, timeout=120)
    else:
        with mixed_file.open("rb") as f:
            got = subprocess.run(argv, stdin=f, capture_output=True, timeout=120)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["tensors"] == json.loads(want.stdout)["tensors"] and len(doc["tensors"]) > 3 and doc["file"] == "<stdin>"
    code, _, err = run_cli(capsys, "plan", "from-safetensors", "-")
    assert code == cli.EXIT_USAGE and "give the path" in err


def test_version_and_the_package_load_nothing_heavy() -> None:
    """`paraminit --version` and `import paraminit_client` load no grpc, numpy or protobuf (a CLI start stays
    well under half a second); the package's names still come from their modules on first use."""
    code = textwrap.dedent(
        """
        import sys
        sys.argv = ["paraminit", "--version"]
        from paraminit_client.launch import main
        assert main() == 0
        heavy = [m for m in ("grpc", "numpy", "google.protobuf", "paraminit_client.client") if m in sys.modules]
        import paraminit_client
        assert paraminit_client.Client.__module__ == "paraminit_client.client" and "grpc" in sys.modules
        print(heavy)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    version, heavy = done.stdout.splitlines()
    assert version == f"paraminit {importlib.metadata.version('paraminit')}" and heavy == "[]"
