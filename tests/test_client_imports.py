"""The client package's modules import one another without a circle, rule results are asked rather than told apart
by type, and deliveries and policies are values rather than strings compared in place.

Every import statement counts, those under `if TYPE_CHECKING:` and inside functions too: a lazy import is still a
dependency, and a circle through one is still a circle (it only fails later, or in another order). A package's
`__init__` importing its own submodules is how a package is composed, not a circle; a submodule importing its
package back is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import import_cycles

CLIENT = Path(__file__).resolve().parent.parent / "client" / "paraminit_client"
PACKAGE = "paraminit_client"


def module_name(path: Path) -> str:
    parts = path.relative_to(CLIENT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in CLIENT.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The paraminit_client modules a file imports, wherever the statement is (`from pkg import name` counts name
    when it is a module, else pkg); relative imports are resolved against the file's package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) for name, path in mods.items()}


def test_the_cycle_finder_finds_circles() -> None:
    """The check can fail: a circle through a TYPE_CHECKING import and one through a function's import are found."""
    assert import_cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert not import_cycles({"a": {"b"}, "b": {"c"}, "c": set()})
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paraminit_client.rules import Ruling\n"
        "def f():\n    from paraminit_client import policies\n"
    )
    probe = CLIENT / "_probe_imports.py"
    probe.write_text(source)
    try:
        assert imports(probe, {"paraminit_client.rules", "paraminit_client.policies"}) == {
            "paraminit_client.rules",
            "paraminit_client.policies",
        }
    finally:
        probe.unlink()


def test_client_modules_import_without_a_circle() -> None:
    g = graph()
    assert {"paraminit_client.rules", "paraminit_client.torch_rules"} <= g["paraminit_client.policies"], "the graph was read"
    assert "paraminit_client.cli.common" in g["paraminit_client.cli.materialize"]
    assert not import_cycles(g), import_cycles(g)


def test_the_rules_module_imports_no_policy_module() -> None:
    """rules.py is the floor the policy modules stand on: it imports none of them (nor anything of the client)."""
    assert not graph()["paraminit_client.rules"]


def test_no_private_name_crosses_modules() -> None:
    """What one client module uses of another is public: no `from paraminit_client.x import _name`."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


# the modules that build and read rule results
POLICY_MODULES = ("rules", "policies", "recipes", "titan", "hf", "torch_rules", "torch")
RULE_TYPES = {"Init", "Ruling", "Verdict", "FusedQKV", "_Skip", "Assigned"}
# parsing what callers pass, not rule results: a policy's walk.inits entry (an Init or a reason, the public Policy
# protocol) read back as a Ruling, in one place; a policy name or object; an AST docstring node; a user override's
# return (an Init or its JSON form)
ALLOWED = {("rules", "ruling"), ("policies", "policy_of"), ("hf", "fingerprint"), ("torch", "_override_init")}


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Every node -> the name of the function it is in ("" at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else fn
            owner[child] = here
            visit(child, here)

    visit(tree, "")
    return owner


def test_rule_results_are_not_told_apart_by_type() -> None:
    """A Ruling says what it is (its verdict, its methods): no isinstance on a rule result type, and no isinstance
    against str in the policy modules beyond the parsing ALLOWED lists. (replay.py's own value kinds, whose init
    gives an Init or a reason, are its internal model and not held to this; what it hands out, emit, is a Ruling.)"""
    found = []
    for short in POLICY_MODULES:
        tree = ast.parse((CLIENT / f"{short}.py").read_text())
        owner = _functions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and node.args[1:]):
                continue
            kinds = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Name | ast.Attribute)}
            fn = owner.get(node, "")
            if (kinds & RULE_TYPES or "str" in kinds) and (short, fn) not in ALLOWED:
                found.append(f"{short}.py:{node.lineno} ({fn})")
    assert not found, found


DELIVERIES = {"auto", "in_process", "stream", "shm", "cuda_ipc"}


def _compared_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants compared (==, !=, in, a dict key of a lookup table) anywhere in the tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        out.append((node.lineno, c.value))
        elif isinstance(node, ast.Dict):
            out += [(node.lineno, k.value) for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return out


def test_deliveries_are_compared_as_members() -> None:
    """Delivery strings are parsed once (delivery.py) and compared as Delivery members everywhere else."""
    found = [
        f"{name}:{line} {value!r}"
        for name, path in modules().items()
        if name != "paraminit_client.delivery"
        for line, value in _compared_strings(ast.parse(path.read_text()))
        if value in DELIVERIES
    ]
    assert not found, found


def test_no_code_switches_on_a_policy_name() -> None:
    """What sets one policy apart from another is a value it carries (torch_rules.Semantics), not a comparison of
    its name; the registry maps names to factories once (policies._REGISTRY)."""
    names = {"own", "torch", "torchlean", "hf", "torchtitan", "megatron", "neox", "olmo", "mup", "replay"}
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [n for side in [node.left, *node.comparators] for n in ast.walk(side)]
            named = {n.id if isinstance(n, ast.Name) else n.attr for n in sides if isinstance(n, ast.Name | ast.Attribute)}
            if named & {"name", "policy"}:  # a policy's name or the policy argument ("torchtitan" in sys.modules is a package)
                found += [f"{name}:{node.lineno} {n.value!r}" for n in sides if isinstance(n, ast.Constant) and n.value in names]
    assert not found, found
