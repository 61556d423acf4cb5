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
        "first set the intermediate types strip-value-info rewrites to what it writes (the input's declarations "
        "where they hold, else nothing), so the passes after it see the types a run on the written model sees "
        "(on in the default pipeline's settle group)",
    )


@register
class ShapeInference(Pass, name="shape-infer", options=ShapeInferOptions):
    """Infer tensor types with symbolic dims, past ops onnx's own inference gives up on"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        facts = ctx.facts(model)
        rewritten = list(written_types(model)) if self.options.afresh else []
        before = {value: value.type for value, _ in rewritten}
        for value, written in rewritten:
            value.type = written
            facts.forget(value)
        summary = infer_model(facts, use_onnx=self.options.use_onnx, onnx_max_nodes=self.options.onnx_max_nodes)
        if self.options.afresh:  # changed: the types are not those it set aside
            return PassResult(any(value.type != type_ for value, type_ in before.items()), summary.details)
        return PassResult(summary.changed, summary.details)
