"""A missing optional package is one line naming it and the command that installs it: exit 1 at the command line
(no traceback), a MissingPackage (a ParaminitError and an ImportError) in Python. Packages are hidden in a child
process (sys.modules[name] = None makes its import fail as a missing one would)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MODEL = textwrap.dedent(
    """
    import torch
    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    """
)


def run(hidden: list[str], code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "mod_missing.py").write_text(MODEL)
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def cli(*argv: str) -> str:
    return f"from paraminit_client import cli\nsys.argv = ['paraminit', *{list(argv)!r}]\nraise SystemExit(cli.main())\n"


@pytest.mark.parametrize(
    ("hidden", "argv", "package", "extra"),
    [
        (["torchtitan"], ["plan", "from-module", "mod_missing:build", "--policy", "torchtitan"], "torchtitan", "torchtitan"),
        (["transformers"], ["plan", "from-module", "mod_missing:build", "--policy", "hf"], "transformers", "hf"),
        (["torch"], ["plan", "from-module", "mod_missing:build"], "torch", "torch"),
        (["matplotlib"], ["inspect", str(ROOT / "examples/mlp.json"), "--plot", "plots"], "matplotlib", "plot"),
        (["torch"], ["materialize", str(ROOT / "examples/mlp.json"), "-o", "d", "--format", "dcp"], "torch", "torch"),
    ],
    ids=["torchtitan", "transformers", "torch", "matplotlib", "dcp-torch"],
)
def test_the_command_line_names_the_package_and_its_install(
    tmp_path: Path, hidden: list[str], argv: list[str], package: str, extra: str
) -> None:
    pytest.importorskip("torch")
    done = run(hidden, cli(*argv), tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"needs {package}, which is not installed" in lines[0] and f"make extra-{extra}" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("hidden", "code", "package"),
    [
        (["torch"], "import paraminit_client.torch", "torch"),
        (
            ["torchtitan"],
            "import torch\nfrom paraminit_client.torch import plan_from_module\n"
            "plan_from_module(torch.nn.Linear(2, 2, device='meta'), seed=0, policy='torchtitan')",
            "torchtitan",
        ),
        (["jax"], "from paraminit_client import jax, param, plan_of\njax.materialize(plan_of([param('w', [2], {'zeros': {}})]))", "jax"),
    ],
    ids=["torch", "torchtitan", "jax"],
)
def test_python_raises_missing_package(tmp_path: Path, hidden: list[str], code: str, package: str) -> None:
    pytest.importorskip("torch")
    check = f"""
    from paraminit_client.errors import MissingPackage, ParaminitError
    try:
        {code.replace(chr(10), chr(10) + "        ")}
    except MissingPackage as exc:
        assert isinstance(exc, ParaminitError) and isinstance(exc, ImportError) and exc.package == {package!r}
        print(exc)
    else:
        raise SystemExit("no MissingPackage")
    """
    done = run(hidden, check, tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"needs {package}, which is not installed" in done.stdout, done.stdout


def test_recipe_settings_are_flags(tmp_path: Path) -> None:
    """A recipe that needs the model's depth takes it from --num-layers (the message says so); a flag the policy
    does not take is a usage error."""
    pytest.importorskip("torch")
    (tmp_path / "mod_missing.py").write_text(MODEL)
    base = [sys.executable, "-m", "paraminit_client.cli", "plan", "from-module", "mod_missing:build", "--policy", "megatron"]
    bare = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0 and "--num-layers" in bare.stderr, bare.stderr
    done = subprocess.run([*base, "--num-layers", "2", "--sigma", "0.01"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"std": 0.01') == 2  # both weights: normal(0, --sigma)
    wrong = subprocess.run([*base, "--d-model", "8"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 64 and "not a setting of policy 'megatron'" in wrong.stderr
