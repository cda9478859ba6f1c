"""The package's import graph reads top-down: server -> steering -> engine -> speculative -> runner ->
sample -> models -> layers -> kv -> quantization -> kernels, every room importing only rooms below it
(and the leaf modules), with no cycle between modules. steering sits between the server (which reads
requests' strengths and runs the refusal detector from it) and the engine (which its direction build
drives). Imports under `if TYPE_CHECKING:` are types
only and do not count."""

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
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "tokenmill" or n.startswith("tokenmill."))
    return found


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
