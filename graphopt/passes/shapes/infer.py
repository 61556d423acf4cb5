"""The ``shape-infer`` pass: type every value, symbolic dims kept (see graphopt.facts.infer)."""

from __future__ import annotations

from dataclasses import dataclass

from graphopt.facts import infer_model
from graphopt.ir import Model
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["ShapeInference"]


@dataclass
class ShapeInferOptions:
    use_onnx: bool = option(
        True,
        "fill what the shape rules leave unknown from onnx's own inference (run on demand, on a copy without weights)",
    )
    onnx_max_nodes: int = option(50_000, "skip onnx's inference on models with more nodes than this")


@register
class ShapeInference(Pass, name="shape-infer", options=ShapeInferOptions):
    """Infer tensor types with symbolic dims, past ops onnx's own inference gives up on"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        summary = infer_model(
            ctx.facts(model), use_onnx=self.options.use_onnx, onnx_max_nodes=self.options.onnx_max_nodes
        )
        return PassResult(summary.changed, summary.details)
