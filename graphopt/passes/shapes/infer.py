"""The ``shape-infer`` pass: type every value, symbolic dims kept (see graphopt.facts.infer)."""

from __future__ import annotations

from dataclasses import dataclass

from graphopt.facts import infer_model
from graphopt.ir import Model
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.shapes.strip import written_types

__all__ = ["ShapeInference"]


@dataclass
class ShapeInferOptions:
    use_onnx: bool = option(
        True,
        "fill what the shape rules leave unknown from onnx's own inference (run on demand, on a copy without weights)",
    )
    onnx_max_nodes: int = option(50_000, "skip onnx's inference on models with more nodes than this")
    afresh: bool = option(
        False,
        "first forget the intermediate types strip-value-info rewrites (the input's declarations among them), "
        "so the passes after it see graphopt's own inference, as this pass sees it on a run on the written "
        "model (on in the default pipeline's settle group)",
    )


@register
class ShapeInference(Pass, name="shape-infer", options=ShapeInferOptions):
    """Infer tensor types with symbolic dims, past ops onnx's own inference gives up on"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        facts = ctx.facts(model)
        forgotten = {value: value.type for value, _ in written_types(model)} if self.options.afresh else {}
        for value in forgotten:
            value.type = None
            facts.forget(value)
        summary = infer_model(facts, use_onnx=self.options.use_onnx, onnx_max_nodes=self.options.onnx_max_nodes)
        if self.options.afresh:  # changed: the types are not those it forgot
            return PassResult(any(value.type != type_ for value, type_ in forgotten.items()), summary.details)
        return PassResult(summary.changed, summary.details)
