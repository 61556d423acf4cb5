"""The ``strip-value-info`` pass: leave intermediate types out of the written model.

Inferred types serve the passes; in the output file they are a cost as often as a help.
onnxruntime infers them again at session start, and where a file declares them it applies
fusions it otherwise skips: on corpus/bert_small.onnx, with graphopt's value_info written,
it fuses eight SkipLayerNormalization nodes and runs 1.16x slower on one CPU thread than
without them (measured at ORT_ENABLE_ALL, batch 1, sequence 64).

Types of values produced by ops outside the standard domain stay: no runtime can infer
what a custom op returns. Graph inputs and outputs always keep their types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from graphopt.ir import Model, Value
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["StripValueInfo", "intermediate_values"]


def intermediate_values(model: Model, *, keep_custom: bool = True) -> Iterator[Value]:
    """The typed values whose types the pass leaves out (a reload of the written model lacks them)."""
    for graph in model.all_graphs():
        for node in graph:
            if keep_custom and not node.in_standard_domain:
                continue
            yield from (v for v in node.outputs if v.type is not None and not v.is_graph_output)


@register
class StripValueInfo(Pass, name="strip-value-info"):
    """Leave the types of intermediate values out of the output (runtimes re-infer them)"""

    @dataclass
    class Options:
        keep_custom: bool = option(True, "keep the types of outputs of ops outside the standard domain")

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        stripped = 0
        for value in list(intermediate_values(model, keep_custom=self.options.keep_custom)):
            value.type = None
            stripped += 1
        return PassResult(stripped > 0, {"stripped": stripped})
