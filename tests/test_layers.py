"""The package's rooms import one way: no circle between modules, no import of a higher room.

Read from the source (every ``import`` and ``from ... import``, those inside functions and
under ``TYPE_CHECKING`` too: a lazy import hides a circle, it does not remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "memcompile"

#: The rooms from the bottom up: a module may import its own room and the rooms below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "errors"),
    ("runtime",),
    ("analysis",),
    ("planning",),
    ("records",),
    ("rewrites",),
    ("dynamic",),
    ("step",),
    ("pipeline",),
    ("backends",),
    ("report",),
    ("__init__", "__main__", "zoo", "viz", "cli", "cli_bench", "cli_output", "cli_target"),
)
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The memcompile modules ``module`` imports (a ``from pkg import name`` of a submodule
    counts as that submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("memcompile") and name != module:
                found.add(name)
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    known = set(modules)
    for module, path in modules.items():
        graph.add_node(module)
        for target in sorted(_imports(module, path, known)):
            graph.add_edge(module, target)
    return graph


def test_every_module_is_in_a_room() -> None:
    rooms = {_room(m) for m in _modules()}
    assert rooms <= set(RANK), sorted(rooms - set(RANK))


def test_no_module_imports_a_higher_room() -> None:
    upward = [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if _room(b) != "__init__" and RANK[_room(b)] > RANK[_room(a)]
    ]
    # Importing the package itself (``import memcompile``) from below __init__ is upward too.
    upward += [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if b == "memcompile" and RANK[_room(a)] < RANK["__init__"]
    ]
    assert not upward, upward


def test_no_import_circle() -> None:
    cycles = sorted(sorted(c) for c in nx.simple_cycles(_graph()))
    assert not cycles, cycles[:5]
