"""The package's layers: a module imports only what sits below it, and importing a leaf stays cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "graphopt"

# Lowest first. A module may import its own room and any room listed before it.
LAYERS = [
    {"errors", "options", "files", "schemas", "version", "processes"},
    {"settings", "ir"},
    {"facts", "io", "writer", "cache"},
    {"evaluate"},
    {"passes", "layout"},
    {"numerics", "report", "runtime"},
    {"api"},
    {"runner", "batch"},
    {"cli"},
    {"__init__"},
]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(*, top_level: bool = False) -> dict[str, set[str]]:
    """module -> the graphopt modules it imports (type-only imports included: they are still
    arrows); with ``top_level``, only the imports that run when the module loads, not those
    a function makes when called."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        nodes = _top_level(tree.body) if top_level else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from graphopt.evaluate import shaping`` names the submodule, not the package.
                targets = [
                    f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                    for a in node.names
                ]
            else:
                continue
            found[module].update(t for t in targets if t == "graphopt" or t.startswith("graphopt."))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    found: list[ast.stmt] = []
    for statement in body:
        found.append(statement)
        if isinstance(statement, (ast.If, ast.Try)):
            found += _top_level(statement.body + statement.orelse)
    return found


def test_no_module_imports_a_room_above_its_own() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _imports().items()
        for target in targets
        if RANK[_room(target)] > RANK[_room(module)]
    )
    assert upward == []


def test_every_room_has_a_layer() -> None:
    rooms = {_room(m) for m in _imports()} | {_room(t) for ts in _imports().values() for t in ts}
    assert rooms <= set(RANK)


def test_no_import_cycle_outside_the_ir() -> None:
    modules = _imports(top_level=True)
    # A module's arrows, to the modules it names (``from graphopt.ir import Graph`` names graphopt.ir).
    arrows = {m: {t for t in targets if t in modules and t != m} for m, targets in modules.items()}
    cycles = [c for c in _strongly_connected(arrows) if len(c) > 1]
    assert [c for c in cycles if not all(m.startswith("graphopt.ir.") for m in c)] == []


def _strongly_connected(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of the module graph, iteratively (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in arrows:
        if start in index:
            continue
        work = [(start, iter(sorted(arrows[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def test_importing_a_leaf_module_loads_only_what_it_needs() -> None:
    code = "import sys, graphopt.ir.dims; print(' '.join(m for m in sys.modules if m.startswith('graphopt')))"
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert not loaded & {"graphopt.api", "graphopt.io", "graphopt.passes", "graphopt.numerics"}, sorted(loaded)
