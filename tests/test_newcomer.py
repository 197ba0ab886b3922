"""What a new user meets first: `paraminit serve` and its flags, one exit-code scheme for both binaries, --target and
-o checks before any work, -q, the progress/summary numbers, and `make demo`'s closing words."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import running_server, target_of
from paraminit import exitcodes
from paraminit_client import cli

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


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
