"""Counts that describe a model's size: nodes, op types, initializers and their bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from graphopt.ir.graph import Graph
from graphopt.ir.model import Model
from graphopt.ir.node import STANDARD_DOMAINS, AttrKind
from graphopt.ir.tensor import Tensor

__all__ = ["ModelStats", "model_stats"]

_BODIES = (AttrKind.GRAPH, AttrKind.GRAPHS)


@dataclass(frozen=True)
class ModelStats:
    nodes: int
    initializers: int
    initializer_bytes: int
    ops: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "initializers": self.initializers,
            "initializer_bytes": self.initializer_bytes,
            "ops": dict(sorted(self.ops.items())),
        }


def model_stats(model: Model) -> ModelStats:
    """Counts over the main graph and every nested body (not function bodies, which
    are counted where they are called); bytes include Constant nodes' tensors."""
    keys: list[str] = []
    initializers = 0
    size = 0
    # Graph by graph in the order of Graph.subgraphs (so ops keep their first-seen order), each
    # graph's bodies found while its nodes are counted rather than by a second walk.
    pending = [model.graph]
    while pending:
        graph = pending.pop()
        for value in graph.initializers.values():
            initializers += 1
            size += value.const.nbytes if value.const is not None else 0
        bodies: list[Graph] = []
        for node in graph:
            keys.append(node.op_type if node.domain in STANDARD_DOMAINS else f"{node.domain}::{node.op_type}")
            for attr in node.attributes.values():
                if attr.kind == AttrKind.TENSOR and isinstance(attr.value, Tensor):
                    size += attr.value.nbytes
                elif attr.kind in _BODIES:
                    bodies += attr.graphs()
        pending += reversed(bodies)
    return ModelStats(len(keys), initializers, size, dict(Counter(keys)))
