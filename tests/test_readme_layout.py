"""README's Layout section is true to the imports: what it says each package may import, the code imports, and
every module it names exists where it says (tests/test_layers.py holds the server's own layers)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"paraminit": ROOT / "proto", "paraminit_server": ROOT / "server", "paraminit_client": ROOT / "client"}


def layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Layout")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def bullets() -> dict[str, str]:
    """The section's bullets, by the package they open with, each as one line (the README wraps them)."""
    found = re.findall(r"^- `([\w.]+)`([^\n]*(?:\n  [^\n]*)*)", layout_section(), re.M)
    return {name: " ".join(body.split()) for name, body in found}


def sources(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every module of a package, generated code left out."""
    base = PACKAGES[package]
    for path in sorted((base / package).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        parts = path.relative_to(base).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imported(path: Path) -> set[str]:
    """Every module an import statement of the file names (those inside functions and TYPE_CHECKING blocks too),
    `from a import b` as a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_only_the_rpc_package_imports_grpc() -> None:
    assert "Only this package imports `grpc`" in bullets()["paraminit_server.rpc"]
    found = [
        f"{name} -> {m}"
        for name, path in sources("paraminit_server")
        if not name.startswith("paraminit_server.rpc")
        for m in imported(path)
        if m == "grpc" or m.startswith(("grpc.", "grpc_"))
    ]
    assert not found, found
    assert any(m == "grpc" for m in imported(ROOT / "server/paraminit_server/rpc/edge.py")), "the rule can bite"


def test_the_client_reaches_the_server_only_through_embedded() -> None:
    assert "the one module the client imports server code through" in bullets()["paraminit_server.embedded"]
    allowed = {"paraminit_server", "paraminit_server.embedded", "paraminit_server.embedded.InProcess"}
    found = [
        f"{name} -> {m}"
        for name, path in sources("paraminit_client")
        for m in imported(path)
        if m.startswith("paraminit_server") and m not in allowed
    ]
    assert not found, found


def test_the_shared_vocabulary_imports_neither_end() -> None:
    assert "It imports neither the server nor the client" in bullets()["paraminit"]
    found = [
        f"{name} -> {m}"
        for name, path in sources("paraminit")
        for m in imported(path)
        if m.startswith(("paraminit_server", "paraminit_client"))
    ]
    assert not found, found


def test_every_module_the_section_names_exists_in_its_package() -> None:
    """A backticked lower-case word in a package's bullet is one of its modules or subpackages (or, for the
    data plane, a module of its admission), so a moved or renamed module shows here."""
    known_words = {"grpc", "v1/", "cpu_kernels/", "cli/", "slots", "budget", "Client", "Delivery", "Ruling"}
    missing = []
    for package, body in bullets().items():
        root = package.split(".")[0]
        if root not in PACKAGES:
            continue
        modules = {name for name, _ in sources(root)}
        for word in re.findall(r"`([\w/.]+)`", body):
            if word in known_words or not word[0].islower():
                continue
            if "." in word:  # a module named whole, in any package
                if word not in {name for top in PACKAGES for name, _ in sources(top)}:
                    missing.append(f"{package}: {word}")
                continue
            candidates = {f"{package}.{word}", f"{root}.{word}", f"{package}.admission.{word}"}
            if not candidates & modules and not (PACKAGES[root] / root / word).exists():
                missing.append(f"{package}: {word}")
    assert not missing, missing
    assert len(bullets()) >= 8, "the section was read"
