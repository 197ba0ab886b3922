"""Every public entry point's `Example:` block runs as written (torch, JAX and distributed adapters)."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import pytest


def example(fn: Any) -> str:
    """The code of a docstring's `Example:` section: the indented block after the heading."""
    doc = inspect.getdoc(fn) or ""
    assert "\nExample:\n" in doc, f"{fn.__qualname__} has no Example: block"
    return textwrap.dedent(doc.split("\nExample:\n", 1)[1])


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("paraminit_client.torch", "materialize_module"),
        ("paraminit_client.jax", "materialize"),
        ("paraminit_client.distributed", "materialize_region"),
    ],
)
def test_the_example_runs(module: str, name: str) -> None:
    pytest.importorskip("torch")
    if module.endswith("jax"):
        pytest.importorskip("jax")
    fn = getattr(pytest.importorskip(module), name)
    code = example(fn)
    assert "assert " in code  # an example shows what it gives, and checks it
    exec(compile(code, f"<{name} example>", "exec"), {})
