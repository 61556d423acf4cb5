"""Counts that describe a model's size: nodes, op types, initializers and their bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from graphopt.ir.model import Model
from graphopt.ir.node import AttrKind
from graphopt.ir.tensor import Tensor

__all__ = ["ModelStats", "model_stats"]


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
    ops: Counter[str] = Counter()
    initializers = 0
    size = 0
    graphs = [model.graph, *model.graph.subgraphs()]
    for graph in graphs:
        for value in graph.initializers.values():
            initializers += 1
            size += value.const.nbytes if value.const is not None else 0
        for node in graph:
            ops[f"{node.domain}::{node.op_type}" if not node.in_standard_domain else node.op_type] += 1
            for attr in node.attributes.values():
                if attr.kind == AttrKind.TENSOR and isinstance(attr.value, Tensor):
                    size += attr.value.nbytes
    return ModelStats(sum(ops.values()), initializers, size, dict(ops))
