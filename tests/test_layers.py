"""The server package's layers only look down, its modules import one another without a circle, and no code switches on
which value form it holds.

Layers, lowest first: the floors (errors, the ledger, host limits, config: what every layer may use), `plans/`
(reading, checking and resolving plans), `backends/` (kernels and buffers), `plane/` (the transport-free data
plane), and the doors (`rpc/`, the embedded door, the command, the kernel prebuild). Every import statement
counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import import_cycles

SERVER = Path(__file__).resolve().parent.parent / "server" / "paraminit_server"
FLOORS = {"__init__", "errors", "ledger", "host_limits", "config"}
LAYERS = {"floor": 0, "plans": 1, "backends": 2, "plane": 3, "rpc": 4, "embedded": 4, "__main__": 4, "prebuild": 4}


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    head = parts[1]
    return 0 if head in FLOORS else LAYERS[head]


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The paraminit_server modules a file imports (`from pkg import name` counts name when it is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:
            continue  # `if TYPE_CHECKING:` blocks
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("paraminit_server"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paraminit_server"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                known = (SERVER.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    SERVER.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                out.add(sub if known else node.module)
    return out


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SERVER.rglob("*.py")}


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for name, path in modules().items():
        for target in imports(path):
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} -> {target}")
    assert not upward, upward
    assert layer_of("paraminit_server.plans.plan") < layer_of("paraminit_server.backends.cpu")  # the rule can bite


def test_imports_have_no_circle() -> None:
    """No module reaches itself through the imports it states: every import statement counts, those under
    TYPE_CHECKING and inside functions too (a lazy import is still a dependency, and a circle of them a knot)."""
    mods = modules()
    graph = {name: {t for t in imports(path) if t in mods and t != name} for name, path in mods.items()}
    assert not import_cycles(graph), import_cycles(graph)
    assert graph["paraminit_server.backends.choice"] >= {"paraminit_server.backends.cpu"}, "lazy imports were read"
    graph["paraminit_server.backends"].add("paraminit_server.backends.choice")
    assert import_cycles(graph), "a circle is found"


def test_module_level_imports_have_no_circle() -> None:
    """At import time a package's __init__ runs before its submodules: with that edge added, module-level imports
    still form no circle."""
    mods = modules()
    graph = {name: {t for t in imports(path, top_level_only=True) if t in mods and t != name} for name, path in mods.items()}
    for name in list(graph):
        parent = name.rsplit(".", 1)[0]
        if parent in graph and parent != name and name != "paraminit_server":
            graph[name].add(parent)
    assert not import_cycles(graph), import_cycles(graph)
    assert graph["paraminit_server.backends.cpu"], "the graph was read"


def test_value_forms_carry_their_behaviour() -> None:
    """No code outside a form switches on which form it has (`isinstance`, `is`, `==` on a form class): the forms
    answer for themselves (their kernel, bound, label, moments) and readers take one method per form
    (inits.FormReader), so adding a form is one class that mypy holds every reader to."""
    from paraminit import inits

    classes = (inits.Distribution, *inits.Distribution.__subclasses__(), *inits.Data.__args__)
    forms = {c.__name__ for c in classes}
    assert {"Normal", "Inline", "Checkpoint", "Distribution"} <= forms

    def names(node: ast.AST) -> set[str]:
        return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)}

    roots = [SERVER, SERVER.parent.parent / "client" / "paraminit_client", SERVER.parent.parent / "proto" / "paraminit"]
    found = []
    for root in roots:
        for path in root.rglob("*.py"):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                switch: ast.AST | None = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and node.args[1:]:
                    switch = node.args[1]
                elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot | ast.Eq) for op in node.ops):
                    switch = ast.Tuple(elts=[node.left, *node.comparators])
                if switch is not None and names(switch) & forms:
                    found.append(f"{path.name}:{getattr(node, 'lineno', 0)}")
    assert not found
