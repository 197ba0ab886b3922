"""What a new user meets first: `paraminit serve` and its flags, one exit-code scheme for both binaries, --target and
-o checks before any work, -q, the progress/summary numbers, and `make demo`'s closing words."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli, running_server, target_of
from paraminit import exitcodes, times
from paraminit_client import Client, cli, param, plan_of

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent



# -- serve and exit codes -------------------------------------------------------------------------------------------


def test_serve_help_lists_the_server_flags_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "serve", "--help")
    assert code == 0
    for flag in ("--port", "--backend", "--device", "--safetensors-dirs", "PARAMINIT_PORT"):
        assert flag in out, flag
    assert re.search(r"^\s*64\s+usage error", out, re.M) and re.search(r"^\s*0\s+a clean drain", out, re.M)


@pytest.mark.parametrize("binary", [["paraminit-server"], ["paraminit", "serve"]])
def test_both_binaries_share_the_usage_exit_code_and_document_it(binary: list[str]) -> None:
    exe = [str(BIN / binary[0]), *binary[1:]]
    bogus = subprocess.run([*exe, "--bogus"], capture_output=True, text=True, timeout=60)
    assert bogus.returncode == exitcodes.USAGE == 64, bogus.stderr
    assert "--bogus" in bogus.stderr
    bad_choice = subprocess.run([*exe, "--backend", "tpu"], capture_output=True, text=True, timeout=60)
    assert bad_choice.returncode == 64, bad_choice.stderr
    helped = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "exit codes:" in helped.stdout and re.search(r"^\s*64\s", helped.stdout, re.M)


def test_bad_environment_variable_is_a_usage_error() -> None:
    import os

    done = subprocess.run([str(BIN / "paraminit"), "serve", "--port", "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PARAMINIT_SLAB_BYTES": "lots"})
    assert done.returncode == 64 and "PARAMINIT_SLAB_BYTES" in done.stderr and "Traceback" not in done.stderr


def test_paraminit_serve_takes_the_server_flags_and_serves() -> None:
    proc = subprocess.Popen([str(BIN / "paraminit"), "serve", "--port", "0", "--backend", "cpu", "--host",
                             "127.0.0.1", "--drain-seconds", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        assert m, line + (proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
        done = subprocess.run([str(BIN / "paraminit"), "health", "--target", f"127.0.0.1:{m.group(1)}",
                               "--timeout", "60"], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() in ("SERVING", "NOT_SERVING"), done.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_paraminit_help_has_the_exit_code_table(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["materialize", "--help"], ["validate", "--help"], ["inspect", "--help"],
                 ["info", "--help"], ["health", "--help"], ["serve", "--help"]):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and "exit codes:" in out and re.search(r"^\s*64\s+usage error", out, re.M), argv


# -- --target and -o ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "says"), [
    ("localhost", "has no port"),
    ("localhost:99999", "is not a number from 1 to 65535"),
    ("localhost:0", "is not a number from 1 to 65535"),
    ("localhost:http", "is not a number"),
    ("http://localhost:50051", "take no http:// scheme"),
    ("grpc://10.0.0.1:50051", "take no grpc:// scheme"),
    ("::1", "has no port"),
    (":50051", "has no host"),
])
def test_a_malformed_target_is_a_usage_error_before_connecting(target: str, says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "info", "--target", target)
    assert code == cli.EXIT_USAGE, err
    assert says in err and "Connection refused" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("target", ["localhost:50051", "[::1]:50051", "unix:/tmp/x.sock", "dns:///svc:50051", None])
def test_well_formed_targets_pass_the_check(target: str | None) -> None:
    assert cli.check_target(target) == target


def test_health_without_a_target_names_the_default_it_tried(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "DEFAULT_HEALTH_TARGET", "127.0.0.1:1")  # nothing listens on port 1
    code, _, err = run_cli(capsys, "health", "--timeout", "5")
    assert code == cli.EXIT_ERROR and "127.0.0.1:1" in err, err


def test_output_onto_the_plan_is_refused_and_the_plan_kept(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
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
    code, _, err = run_cli(capsys, "plan", "from-safetensors", str(tmp_path / "c.safetensors"), "--fallback",
                           str(fallback), "-o", str(fallback))
    assert code == cli.EXIT_USAGE and "input file" in err and fallback.read_text() == before


def test_output_errors_name_the_target_file_not_a_temporary(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
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
        code, stdout, err = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out),
                                    "--target", target_of(server))
    assert code == 0, err
    m = re.fullmatch(r"wrote .*: 6 parameters, ([\d.]+ \w+) in ([\d.]+) s \(([\d.]+ \w+)/s; ([\d.]+) s of it before "
                     r"the first byte: [^)]*\), plan digest [0-9a-f]{64}\n", stdout)
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
        done = subprocess.run([str(BIN / "paraminit"), "materialize", str(ROOT / "examples/conv.json"), "-o",
                               str(out), "--target", target_of(server), "-q"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "" and out.exists()
        bad = subprocess.run([str(BIN / "paraminit"), "materialize", str(tmp_path / "none.json"), "-o", str(out),
                              "--target", target_of(server), "-q"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == cli.EXIT_ERROR and "none.json" in bad.stderr


def test_quiet_asks_for_no_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    bars: list[int] = []
    monkeypatch.setattr(cli, "_progress_bar", lambda total, name: bars.append(total))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "m.safetensors"
    code, stdout, _ = run_cli(capsys, "materialize", str(ROOT / "examples/mlp.json"), "-o", str(out), "-q")
    assert code == 0 and stdout == "" and bars == []


def test_make_demo_ends_by_saying_how_to_run_paraminit() -> None:
    done = subprocess.run(["make", "-n", "-W", "pyproject.toml", "demo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    tail = done.stdout[done.stdout.index("paraminit materialize"):]
    assert ".venv/bin/paraminit --help" in tail and ". .venv/bin/activate" in tail


# -- in-process plans read the caller's own files -------------------------------------------------------------------


def test_a_checkpoint_plan_materializes_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(7)
    want = {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    save_file(want, str(tmp_path / "mlp.safetensors"))
    code, plan_json, err = run_cli(capsys, "plan", "from-safetensors", str(tmp_path / "mlp.safetensors"))
    assert code == 0, err
    (tmp_path / "ck.json").write_text(plan_json)
    out = tmp_path / "x.safetensors"
    code, _, err = run_cli(capsys, "materialize", str(tmp_path / "ck.json"), "-o", str(out), "-q")
    assert code == 0, err
    got = load_file(str(out))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_an_explicit_allow_list_in_process_is_enforced_and_named(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from paraminit_client import Client, plan_from_safetensors
    from paraminit_client.errors import ParaminitError

    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(tmp_path / "ck" / "m.safetensors"))
    plan = plan_from_safetensors(tmp_path / "ck" / "m.safetensors")
    with Client(safetensors_dirs=[str(tmp_path / "ck")]) as c:
        assert np.array_equal(c.materialize(plan)["w"], np.arange(6, dtype=np.float32))
    with Client(safetensors_dirs=[str(tmp_path / "elsewhere")]) as c, pytest.raises(ParaminitError) as caught:
        c.materialize(plan)
    assert "not under an allowed directory" in caught.value.message and "elsewhere" in caught.value.message
    with pytest.raises(ValueError, match="in process only"):
        Client("127.0.0.1:1", safetensors_dirs=["/"])


# -- leases from the shell ------------------------------------------------------------------------------------------


def test_leases_list_renew_release_from_the_shell(capsys: pytest.CaptureFixture[str]) -> None:
    with running_server() as server, Client(target_of(server)) as c:
        target = target_of(server)
        code, out, _ = run_cli(capsys, "leases", "--target", target)
        assert code == 0 and "no live leases" in out
        lease = c.export(plan_of([param("w", [1024], {"ones": {}})]), ttl_seconds=60)
        code, out, err = run_cli(capsys, "leases", "--target", target)
        assert code == 0, err
        assert lease.lease_id in out and "shm" in out and "4.0 KiB" in out and "1 lease," in out
        assert all(len(line) <= 100 for line in out.splitlines())
        code, out, _ = run_cli(capsys, "leases", "--json", "--target", target)
        (row,) = json.loads(out)
        assert row["lease_id"] == lease.lease_id and row["nbytes"] == 4096 and 0 < row["expires_in_s"] <= 60
        code, out, err = run_cli(capsys, "leases", "renew", lease.lease_id, "--ttl", "600", "--target", target)
        assert code == 0 and "renewed" in out, err
        (status,) = c.leases()
        assert times.epoch(status.lease.expires_at) - time.time() > 300
        code, out, err = run_cli(capsys, "leases", "release", lease.lease_id, "--target", target)
        assert code == 0 and f"{lease.lease_id}: released" in out, err
        assert c.leases() == []
        code, _, err = run_cli(capsys, "leases", "release", "--target", target)
        assert code == cli.EXIT_USAGE and "LEASE_ID" in err
        code, _, err = run_cli(capsys, "leases")
        assert code == cli.EXIT_USAGE and "--target" in err
        lease.stop_renewing()


# -- inspect --------------------------------------------------------------------------------------------------------


def _odd_file(tmp_path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    path = tmp_path / "odd.safetensors"
    save_file({"transformer.encoder.layers.11.self_attention.query_key_value.weight":
               (rng.standard_normal((64, 48)) * 0.02).astype(np.float32),
               "bad": np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)}, str(path))
    return path


def test_inspect_default_fits_100_columns_and_counts_non_finite_values(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from paraminit_client import inspect

    path = _odd_file(tmp_path)
    code, out, _ = run_cli(capsys, "inspect", str(path))
    assert code == 0
    lines = out.splitlines()
    table = lines[:3]
    assert all(len(line) <= inspect.COMPACT_COLUMNS for line in table), [len(x) for x in table]
    assert "non-finite" in lines[0].split() and "min" not in lines[0].split()
    bad = next(line for line in table if line.startswith("bad "))
    assert bad.split()[-1] == "3"  # NaN, +inf, -inf: counted, not hidden behind mean 1 std 0
    long_row = next(line for line in table if line.startswith("transformer."))
    assert "~" in long_row.split()[0] and long_row.split()[0].endswith("value.weight")
    code, wide, _ = run_cli(capsys, "inspect", str(path), "--wide")
    head = wide.splitlines()[0].split()
    assert {"min", "max", "non-finite"} <= set(head)
    assert "transformer.encoder.layers.11.self_attention.query_key_value.weight" in wide


def test_plot_is_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
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


# -- plan from-module: the hf policy and overrides ------------------------------------------------------------------

HF_SRC = """
import torch


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=8))


def proj_uniform(name, tensor):
    if name.endswith("c_proj.weight"):
        return {"uniform": {"lo": -0.125, "hi": 0.125}}
    return None
"""


def test_plan_from_module_takes_the_hf_policy_and_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "hfmodels.py").write_text(HF_SRC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out, err = run_cli(capsys, "plan", "from-module", "hfmodels:tiny_gpt2", "--policy", "hf", "--seed", "3",
                             "--overrides", "hfmodels:proj_uniform")
    assert code == 0, err
    from paraminit_client import plan_from_dict
    from paraminit_client.torch import plan_from_module

    plan = plan_from_dict(json.loads(out))
    import hfmodels  # type: ignore[import-not-found]

    with torch.device("meta"):
        model = hfmodels.tiny_gpt2()
    assert plan == plan_from_module(model, seed=3, policy="hf", overrides=hfmodels.proj_uniform)
    by_name = {p.name: p for p in plan.params}
    assert by_name["transformer.h.0.attn.c_proj.weight"].init.WhichOneof("kind") == "uniform"
    assert by_name["transformer.h.0.attn.c_attn.weight"].init.normal.std == pytest.approx(0.02)
    code, _, err = run_cli(capsys, "plan", "from-module", "hfmodels:tiny_gpt2", "--overrides", "hfmodels:nothing")
    assert code == cli.EXIT_ERROR and "nothing" in err


def test_hf_extra_installs_transformers_and_info_help_speaks_of_a_server() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"]) and any(d.startswith("torch") for d in extras["hf"])
    info = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "info")[1]
    text = info.format_help()
    assert not re.search(r"\bplans?\b", text.split("exit codes:")[0]), text
