"""Dead code elimination: drop nodes, initializers and local functions nothing reads.

A node is dead when none of its outputs is used: not read by a node (a read from inside
an If / Loop / Scan body counts, the IR records it as a use of the outer value) and not
a graph output. Walking each graph in reverse topological order removes whole dead
chains in one sweep, because a node is visited only after every node that reads it. A
body is swept before its owner's producers are visited, so an outer value that only a
dead inner node read becomes dead in the same sweep.

ONNX operators have no side effects, so every dead node goes, except the op types in
``keep_ops`` (for custom operators that act on the world) and nodes without outputs.
Graph inputs stay even when unused: they are the model's interface.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from graphopt.ir import Graph, Model, Node
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["DeadCodeElimination"]


@dataclass
class DceOptions:
    keep_ops: list[str] = option([], "op types never removed, e.g. custom operators with side effects")


@register
class DeadCodeElimination(Pass, name="dce", options=DceOptions):
    """Remove nodes, initializers and local functions whose results nothing reads"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        keep = set(self.options.keep_ops)
        nodes: Counter[str] = Counter()
        _sweep(model.graph, keep, nodes)
        functions = _sweep_called_functions(model, keep, nodes)
        initializers = 0
        for graph in model.all_graphs():
            for value in list(graph.initializers.values()):
                if not value.is_used() and not value.is_graph_input:
                    graph.remove_initializer(value)
                    initializers += 1
        details: dict[str, Any] = {"nodes": dict(sorted(nodes.items())), "initializers": initializers}
        if functions:
            details["functions"] = functions
        return PassResult(bool(nodes or initializers or functions), details)


def _sweep(graph: Graph, keep: set[str], removed: Counter[str]) -> None:
    for node in reversed(graph.topological()):
        if _is_dead(node, keep):
            removed.update(n.op_type for body in node.subgraphs() for n in body.all_nodes())
            removed[node.op_type] += 1
            graph.remove(node)
        else:
            for body in node.subgraphs():
                _sweep(body, keep, removed)


def _is_dead(node: Node, keep: set[str]) -> bool:
    return bool(node.outputs) and node.op_type not in keep and not any(v.is_used() for v in node.outputs)


def _sweep_called_functions(model: Model, keep: set[str], removed: Counter[str]) -> list[str]:
    """Sweep every local function a live node calls (from the main graph or from such a
    function); remove the others and return their names."""
    by_key = {f.key: f for f in model.functions}
    reached: set[tuple[str, str, str]] = set()
    pending = [model.graph]
    while pending:
        for node in pending.pop().all_nodes():
            key = (node.domain, node.op_type, node.overload)
            if key in by_key and key not in reached:
                reached.add(key)
                body = by_key[key].body
                _sweep(body, keep, removed)  # before its calls are followed: dead calls do not count
                pending.append(body)
    dropped = [f for f in model.functions if f.key not in reached]
    model.functions = [f for f in model.functions if f.key in reached]
    return [f"{f.domain}::{f.name}" if f.domain else f.name for f in dropped]
