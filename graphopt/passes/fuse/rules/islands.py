"""Islands family: a float32 value between two fused ops computed in float32 stays float32.

The float32 rules (_float32.py) write a fused float16 op in float32 between Casts because onnxruntime's CPU
provider runs the float16 chain it replaces in float32, rounding to float16 only where a kernel with a float16 form
follows. Two such ops in a row, or with only a Transpose or Reshape between them, leave a Cast to float16 and one
back to float32 that the chains they replaced did not have: onnxruntime's float32 chain ran straight through,
where it keeps a pair of Casts between two float32 kernels (qwen3_dynamo_fp16 at ``--target-opset 23``: its
RotaryEmbedding's result rounded to float16 and back before the Attention, its query and key normalized, rounded
and widened again before the RotaryEmbedding). So a Cast to float32 that such a rule wrote, reading a Cast to
float16 that such a rule wrote (through one Transpose or Reshape), reads the float32 value itself:
``Widen(Move(Narrow(v))) -> Move(v)``. The rules name the Casts they write (``NARROWED``, ``WIDENED``); a Cast
the model has is never taken: the model's own rounding stays. Late: the Casts exist once the float32 rules ran.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of
from graphopt.passes.rewrite.engine import Match, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, op, optional, var

__all__ = ["NARROWED", "RULES", "WIDENED"]

FAMILY = "islands"

# The name prefixes of the Casts the float32 rules write around a fused op: to float16 after it, to float32 before.
NARROWED = "float32_result_narrowed"
WIDENED = "float32_input_widened"


def _written(prefix: str, to: DataType) -> Any:
    def where(node: Node) -> bool:
        return node.name.startswith(prefix) and Site.int_attr(node, "to", 0) == to

    return where


_NARROW = op.Cast(var("v"), name="narrow", where=_written(NARROWED, DataType.FLOAT16))


def _widened(source: Pattern) -> Pattern:
    return op.Cast(source, name="widen", where=_written(WIDENED, DataType.FLOAT))


_MOVED = op.any_of(("Transpose", "Reshape"), _NARROW, optional(var("shape")), name="move", commute=False)


def _direct(b: Builder, m: Match, plan: None) -> Value:
    return m.value("v")


def _moved(b: Builder, m: Match, plan: None) -> Value:
    move = m.node("move")
    return b.op(move.op_type, m.value("v"), *move.inputs[1:], **attrs_of(move))


_DOC = "Cast to float32 of {}a Cast to float16, both written by a float32 rule -> {}"

_rule = partial(Rule, family=FAMILY, kind="late", label="float32 island")

RULES: tuple[Rule[Any], ...] = (
    _rule(name="float32-island", pattern=_widened(_NARROW), build=_direct, doc=_DOC.format("", "the float32 value")),
    _rule(
        name="float32-island-moved",
        pattern=_widened(_MOVED),
        build=_moved,
        doc=_DOC.format("a Transpose or Reshape of ", "the Transpose or Reshape of the float32 value"),
    ),
)
