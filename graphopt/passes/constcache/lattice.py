"""Constness: COMPILE_CONST < RUNTIME_CONST < VAR for every value, graph bodies included.

An op's outputs get the join (the maximum) of what it reads, captured outer values
included, raised to VAR for ops that must not fold:

- random ops and a Dropout that may be in training mode (``graphopt.ir.constness``);
- ops the evaluator cannot run (a domain without one; a body that holds such an op);
- QuantizeLinear / DequantizeLinear, so quantized models keep their structure, unless
  ``fold_qdq``; with ``defer_growth`` the DequantizeLinear of a constant weight becomes a
  runtime constant instead (it is folded once per process, the file keeps int8);
- outputs that are not tensors (an initializer cannot hold a sequence).

Where values start: an initializer is COMPILE_CONST unless it is also a graph input (the
caller may feed it: the seed's "Type 2" constant, RUNTIME_CONST); a main-graph input whose
name matches a ``const_input`` glob is RUNTIME_CONST; every other input, body inputs
included (a Loop's carried values change per iteration), is VAR.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from graphopt.ir import QDQ_DOMAINS, Graph, Model, Node, TensorType, Value
from graphopt.ir.constness import is_deterministic

if TYPE_CHECKING:  # the evaluator reaches passes through the context only
    from graphopt.evaluate import Evaluator

__all__ = ["QDQ_OPS", "Constness", "Lattice", "analyze"]

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


class Constness(IntEnum):
    COMPILE_CONST = 0
    RUNTIME_CONST = 1
    VAR = 2


@dataclass(frozen=True)
class Rules:
    """What decides constness besides the graph: the run's settings and the evaluator."""

    const_inputs: Sequence[str] = ()
    fold_qdq: bool = False
    defer_growth: bool = False
    evaluator: Evaluator | None = None


class Lattice:
    """The constness of every value of a model (main graph, bodies, function bodies)."""

    def __init__(self, model: Model, rules: Rules) -> None:
        self.model = model
        self.rules = rules
        self.of: dict[Value, Constness] = {}

    def __getitem__(self, value: Value | None) -> Constness:
        if value is None:
            return Constness.COMPILE_CONST
        found = self.of.get(value)
        return found if found is not None else self._start(value)

    def _start(self, value: Value) -> Constness:
        """The constness of a value no node of the analyzed graphs produces."""
        if value.const is not None:
            return Constness.RUNTIME_CONST if value.is_graph_input else Constness.COMPILE_CONST
        graph = value.graph
        if graph is self.model.graph and graph.is_input(value) and _matches(value.name, self.rules.const_inputs):
            return Constness.RUNTIME_CONST
        return Constness.VAR

    def graph(self, graph: Graph) -> None:
        """Analyze ``graph`` in topological order; bodies before the node that owns them."""
        opsets = self.model.opsets_of(graph)
        for node in graph.topological():
            for body in node.subgraphs():
                self.graph(body)
            level = self.node(node, opsets)
            for value in node.outputs:
                self.of[value] = level if isinstance(value.type, TensorType) or value.type is None else Constness.VAR

    def node(self, node: Node, opsets: Mapping[str, int]) -> Constness:
        reads = [v for v in node.inputs if v is not None]
        if node.attributes and any(True for _ in node.subgraphs()):
            reads += node.captures()
        level = max((self[v] for v in reads), default=Constness.COMPILE_CONST)
        if level == Constness.VAR:
            return level
        if node.domain in QDQ_DOMAINS and node.op_type in QDQ_OPS and not self.rules.fold_qdq:
            if self.rules.defer_growth and node.op_type == "DequantizeLinear":
                return Constness.RUNTIME_CONST
            return Constness.VAR
        evaluator = self.rules.evaluator
        if evaluator is None or not is_deterministic(node, _opset(opsets)) or not evaluator.can_evaluate(node, opsets):
            return Constness.VAR
        return level

    def values(self, level: Constness) -> list[Value]:
        return [v for v, c in self.of.items() if c == level]


def analyze(model: Model, rules: Rules) -> Lattice:
    """The lattice of every graph of ``model`` (function bodies start from VAR inputs)."""
    lattice = Lattice(model, rules)
    lattice.graph(model.graph)
    for function in model.functions:
        lattice.graph(function.body)
    return lattice


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _opset(opsets: Mapping[str, int]) -> int | None:
    return opsets.get("", opsets.get("ai.onnx"))
