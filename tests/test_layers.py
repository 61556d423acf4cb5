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
    {"errors", "options", "files", "schemas", "version"},
    {"settings", "ir"},
    {"facts", "io"},
    {"evaluate"},
    {"passes", "layout"},
    {"check", "numerics", "report", "runtime"},
    {"api"},
    {"runner", "batch"},
    {"cli"},
    {"__init__"},
]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> dict[str, set[str]]:
    """module -> the graphopt modules it imports (type-only imports included: they are still arrows)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            else:
                continue
            found[module].update(t for t in targets if t == "graphopt" or t.startswith("graphopt."))
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


def test_importing_a_leaf_module_loads_only_what_it_needs() -> None:
    code = "import sys, graphopt.ir.dims; print(' '.join(m for m in sys.modules if m.startswith('graphopt')))"
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert not loaded & {"graphopt.api", "graphopt.io", "graphopt.passes", "graphopt.check"}, sorted(loaded)
