"""Every code block of README.md and docs/*.md runs as written (from a scratch directory holding the examples)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
# Install and project commands are what `make test` itself runs; they are not re-run from here.
NOT_RUN = re.compile(r"^\s*(pip install|make |docker|kubectl|kustomize|buildah)", re.M)


# The sampler spec's blocks are pseudo-code; every other page's blocks are run.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "SAMPLER.md")]


def blocks(lang: str, pages: list[Path] = PAGES) -> list[str]:
    return [body for page in pages for kind, body in BLOCK.findall(page.read_text()) if kind == lang]


def _scratch(tmp_path: Path) -> dict[str, str]:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    code = blocks("python")[index]
    for optional in ("torch", "transformers", "torchtitan", "jax"):
        if optional in code:
            pytest.importorskip(optional)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_scratch(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python block {index} failed:\n{code}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("sh"))))
def test_shell_block_runs(index: int, tmp_path: Path) -> None:
    code = blocks("sh")[index]
    if NOT_RUN.search(code):
        pytest.skip("install/build commands: exercised by make test and the image check")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=_scratch(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"sh block {index} failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_readme_has_runnable_blocks() -> None:
    readme = [ROOT / "README.md"]
    assert len(blocks("python", readme)) >= 3 and any(not NOT_RUN.search(b) for b in blocks("sh", readme))


@pytest.mark.parametrize("page", ["concepts.md", "cli.md", "plan-format.md", "pytorch.md", "troubleshooting.md"])
def test_docs_pages_exist_have_runnable_blocks_and_are_linked(page: str) -> None:
    path = ROOT / "docs" / page
    assert path in PAGES and f"docs/{page}" in (ROOT / "README.md").read_text()
    runnable = [b for kind, b in BLOCK.findall(path.read_text()) if kind in ("python", "sh", "json")]
    assert runnable, f"docs/{page} has no block the tests run"


@pytest.mark.parametrize("index", range(len(blocks("json"))))
def test_json_block_is_a_valid_plan(index: int) -> None:
    import json

    from paraminit_client import Client, plan_from_dict

    plan = plan_from_dict(json.loads(blocks("json")[index]))
    with Client() as c:
        report = c.validate(plan)
    assert report.ok and len(plan.params) >= 1, report.lines()


def test_make_demo_ends_by_saying_how_to_run_paraminit() -> None:
    done = subprocess.run(["make", "-n", "-W", "pyproject.toml", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tail = done.stdout[done.stdout.index("paraminit materialize") :]
    assert ".venv/bin/paraminit --help" in tail and ". .venv/bin/activate" in tail
