"""The package's import graph reads top-down: server -> steering -> engine -> speculative -> runner ->
sample -> models -> layers -> kv -> quantization -> kernels, every room importing only rooms below it
(and the leaf modules), with no cycle between modules. steering sits between the server (which reads
requests' strengths and runs the refusal detector from it) and the engine (which its direction build
drives). Imports under `if TYPE_CHECKING:` are types only and do not count. Imports are absolute: a
relative one is flagged (and still counted, resolved, so that it cannot hide an edge)."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

ORDER = ["server", "steering", "engine", "speculative", "runner", "sample", "models", "layers", "kv", "quantization", "kernels"]
# Front ends above every room, and leaves any room may import (the package itself is one: its
# names load lazily).
TOP = {"cli", "llm", "bench", "quantize", "__main__"}
LEAVES = {"__init__", "config", "errors", "numerics", "transfer", "sampling_params", "outputs", "data"}
PACKAGE = Path(tokenmill.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """tokenmill modules imported at run time (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = absolute_module(path, node)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "tokenmill" or n.startswith("tokenmill."))
    return found


def absolute_module(path: Path, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, a relative one resolved against `path`'s package."""
    if node.level == 0:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def relative_imports(source: str) -> list[str]:
    """`line: from .x import y` for each relative import in a module's source (TYPE_CHECKING too)."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level > 0]


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in runtime_imports(path):
            while imported not in modules and "." in imported:  # `from pkg import name` of a non-module
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def test_rooms_import_only_rooms_below_them() -> None:
    upward = []
    for module, targets in graph().items():
        source = room(module)
        if source in TOP or source in LEAVES:
            continue
        assert source in ORDER, f"{module}: room {source!r} has no place in the import order; add it"
        for target in targets:
            dest = room(target)
            if dest in LEAVES or dest == source:
                continue
            if dest in TOP or ORDER.index(dest) < ORDER.index(source):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the room order:\n" + "\n".join(sorted(upward))


def test_leaves_import_only_leaves() -> None:
    for module, targets in graph().items():
        if room(module) in LEAVES:
            assert all(room(t) in LEAVES for t in targets), (module, targets)


def test_no_module_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [node])


def test_imports_are_absolute() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in relative_imports(path.read_text())]
    assert not found, "relative imports (write them as `from tokenmill... import`):\n" + "\n".join(found)


def test_relative_imports_are_flagged_and_resolved() -> None:
    """The scanner itself: relative imports are flagged, and each resolves to the module it names
    (from a module and from a package's __init__), so the room-order check still sees the edge."""
    source = "import torch\nfrom tokenmill.kv import pool\nfrom . import batch\nif TYPE_CHECKING:\n" \
             "    from ..engine.request import Request\n"
    assert relative_imports(source) == ["3: from . import batch", "5: from ..engine.request import Request"]
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    module, package = PACKAGE / "runner" / "memory.py", PACKAGE / "runner" / "__init__.py"
    assert [absolute_module(module, n) for n in nodes] == ["tokenmill.kv", "tokenmill.runner", "tokenmill.engine.request"]
    assert [absolute_module(package, n) for n in nodes] == ["tokenmill.kv", "tokenmill.runner", "tokenmill.engine.request"]
