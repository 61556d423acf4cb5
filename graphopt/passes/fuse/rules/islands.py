"""Islands family: a float32 value between two fused ops computed in float32 stays float32.

The float32 rules (_float32.py) write a fused float16 op in float32 between Casts because onnxruntime's CPU
provider runs the float16 chain it replaces in float32, rounding to float16 only where a kernel with a float16 form
follows. Two such ops in a row, or with one Transpose or Reshape between them, leave a Cast to float16 and one back
to float32 that the chains they replaced did not have: onnxruntime's float32 chain ran straight through, where it
keeps a pair of Casts between two float32 kernels (qwen3_dynamo_fp16 at ``--target-opset 23``: its
RotaryEmbedding's result rounded to float16 and back before the Attention, its query and key normalized, rounded
and widened again before the RotaryEmbedding). So a Cast to float32 that such a rule wrote, reading a Cast to
float16 that such a rule wrote (through one Transpose or Reshape), reads the float32 value itself:
``Widen(Move(Narrow(v))) -> Move(v)``. The match is the widening Cast alone: the float16 value stays for its other
readers. The rules name the Casts they write (``NARROWED``, ``WIDENED``); a pair of Casts the model has is never
taken. Two cases drop a rounding onnxruntime does make, towards the float32 model, as the check judges: a float16
op the model has itself (an opset 23 export's RMSNormalization), whose float16 kernel rounds its result; and a Cast
to float32 of the model's that cse merged with an identical one a rule wrote. Late: the Casts exist once the
float32 rules ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of, cast_source
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, op, var

__all__ = ["NARROWED", "RULES", "WIDENED"]

FAMILY = "islands"

# The name prefixes of the Casts the float32 rules write around a fused op: to float16 after it, to float32 before.
NARROWED = "float32_result_narrowed"
WIDENED = "float32_input_widened"


def _written(node: Node | None, prefix: str) -> bool:
    return node is not None and node.name.startswith(prefix)


def _narrowed(value: Value | None) -> Value | None:
    """The float32 value a float32 rule's Cast to float16 narrowed into ``value``, if it did."""
    if value is None or not _written(value.producer, NARROWED):
        return None
    return cast_source(value, DataType.FLOAT16)


def _moved(value: Value | None) -> Node | None:
    """The Transpose or Reshape making ``value`` from a float32 rule's Cast to float16, if one did."""
    move = None if value is None else value.producer
    if move is None or move.op_type not in ("Transpose", "Reshape") or not move.in_standard_domain:
        return None
    return move if _narrowed(move.inputs[0]) is not None else None


_Found = TypeVar("_Found", Value, Node)


def _widening(found: Callable[[Value | None], object]) -> Pattern:
    """A float32 rule's Cast to float32 of a value ``found`` recognizes. The Cast alone is the match: what it reads
    stays for its other readers (dce drops it where it has none)."""

    def where(node: Node) -> bool:
        to_float = Site.int_attr(node, "to", 0) == DataType.FLOAT
        return _written(node, WIDENED) and to_float and found(node.inputs[0]) is not None

    return op.Cast(var("source"), name="widen", where=where)


def _island(found: Callable[[Value | None], _Found | None]) -> Callable[[Match, Site], _Found | Refuse]:
    """The plan: what ``found`` recognizes behind the Cast (the pattern's ``where`` made sure it does)."""

    def plan(m: Match, site: Site) -> _Found | Refuse:
        recognized = found(m.value("source"))
        return Refuse("no float32 rule's Cast to float16 behind it") if recognized is None else recognized

    return plan


def _direct(b: Builder, m: Match, wide: Value) -> Value:
    return wide


def _through_move(b: Builder, m: Match, move: Node) -> Value:
    return b.op(move.op_type, _narrowed(move.inputs[0]), *move.inputs[1:], **attrs_of(move))


_DOC = "Cast to float32 of {}a Cast to float16, both written by a float32 rule -> {}"


def _rule(name: str, found: Callable[[Value | None], _Found | None], build: Any, between: str) -> Rule[Any]:
    """The rule ``name``: a widening Cast of what ``found`` recognizes, ``build`` reading the float32 value."""
    return Rule(
        name=name,
        family=FAMILY,
        pattern=_widening(found),
        plan=_island(found),
        build=build,
        kind="late",
        label="float32 island",
        doc=_DOC.format(between, f"{between}the float32 value"),
    )


RULES: tuple[Rule[Any], ...] = (
    _rule("float32-island", _narrowed, _direct, ""),
    _rule("float32-island-moved", _moved, _through_move, "a Transpose or Reshape of "),
)
