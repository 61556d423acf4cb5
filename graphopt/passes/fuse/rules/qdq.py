"""QDQ family: the Q/DQ clean-up of statically quantized models, where it is exact.

A QDQ model (``onnxruntime.quantization.quantize_static``, QDQ format) computes every op on
dequantized values and quantizes its result again. Around an op that only moves data the
quantization is then a round trip: ``Q(Move(DQ(q, s, z)), s, z)`` with the same scale, zero
point and integer type reads each element of ``q`` back. ``DQ`` gives ``y = (q - z) * s``
rounded to the float type, ``Q`` gives ``round(y / s) + z``: two roundings of relative size
``u`` (half the float type's spacing) move ``q - z`` by at most ``|q - z| * 2u`` (``3u`` for a
runtime that divides by multiplying with ``1 / s``), under a half for every int8 or int16
value in float32 and for int8 in float16, so the round trip gives ``q`` itself, and the
integer type holds it (no saturation). So:

- ``Q(Move(DQ(q, s, z)), s, z) -> Move(q)`` for Move a Transpose, Reshape, Flatten, Squeeze,
  Unsqueeze, Slice or Gather (uint8 and 16-bit integers, whose moves onnxruntime's CPU kernels
  take; not int8, see ``_kernel_refusal``): the data moves as integers, as onnxruntime's own
  QDQ clean-up (its "drop" action on DQ -> Transpose -> Q and the like) does it at session time.
  A per-axis quantization stays only where the move carries the DQ's axis to the Q's (a
  Transpose's perm, a Reshape that keeps the elements of each channel together, a Slice or Gather
  along another axis). The DQ stays when something else reads it. Not MaxPool, though exact (the
  largest of a window stays the largest under DQ's increasing map): onnxruntime's int8 MaxPool
  ran resnet18_ts_qdq 1.24x slower than its float one at ORT_ENABLE_ALL.
- ``Q(Concat(DQ(a, s, z), DQ(b, s, z), ...), s, z) -> Concat(a, b, ...)`` when every part is
  dequantized with the Q's parameters (a rotary's halves, a KV cache and its new step).
- ``Q(DQ(q, s, z), s, z) -> q``: a requantization to the same parameters is the identity
  (also for 4-bit integers).
- ``DQ(Q(Gather(DQ(t, s, z), ids), s, z), s, z) -> DQ(Gather(t + 128, ids), s, z + 128)`` for an
  int8 constant table ``t`` (quantize_static's embeddings: weights are int8): onnxruntime keeps
  the table's DequantizeLinear (it folds no DequantizeLinear) and dequantizes the whole table on
  every run, 0.3 to 0.45 ms of 3 to 6 on the QDQ T5, Llama and BERT exports' 8000-row tables; its
  own drop of DQ -> Gather -> Q fails where it has made the rows' int8 pair uint8 first. The rows
  are gathered as integers and dequantized after; uint8 because onnxruntime's x86 integer kernels
  after them (QLinearAdd) take uint8 activations and it converts int8 ones only at Q -> DQ pairs.
  Exact: ``(q + 128) - (z + 128) = q - z``. A table read elsewhere too (GPT-2's tied head), or
  larger than the rules read, stays int8 (a uint8 copy would grow the file): its rows are gathered,
  dequantized and quantized again to uint8 with the zero point + 128, the same numbers.
- ``Move(DQ(q, s, z)) -> DQ(Move(q), s, z)`` where only fused float ops (Attention,
  MultiHeadAttention, GroupQueryAttention, RotaryEmbedding, written by a fusion through Q/DQ)
  or further moves (and Expand) read the move: exact, for any 8- or 16-bit integer (int8 too:
  no integer kernel follows, so no Q -> DQ adjacency is lost). A fusion leaves such a move
  (attention's K^T, a rotary's halves of its cos cache), and onnxruntime's Q/DQ propagation
  then inserts a QuantizeLinear after it whose output_dtype contradicts its zero point at opset
  21 and up (onnxruntime 1.32): the session fails (gpt2_ts_qdq and llama_ts_qdq at
  ``--target-opset 23``). With the DQ after the move, the DQ feeds the fused op directly.
  From opset 21 on, the same where onnxruntime's propagation would carry an int8 DQ across a Slice,
  Reshape, Transpose, Squeeze or Unsqueeze read by another float op (a QOperator model's rotary
  halves: the QOperator Llamas at opset 23 did not load at ORT_ENABLE_EXTENDED and up; BLOOM's ALiBi
  bias split by heads and added to the mask before a fused Attention: bloom's QDQ files at opset 23
  lost their four Attentions to the runtime guard), where that propagation reaches: a standard
  per-tensor DQ, and a move whose one edge out no QuantizeLinear ends. A DQ that other ops read too
  stays for them (one node more).

A ``Q -> DQ`` on a float activation rounds it to the grid of ``s``: that is the quantization
itself, and stays. These rules are late: a fusion that sees through an activation's Q -> DQ
pair (attention's K^T, a rotary's halves) reads the float data movement they would hide.

No rule writes ``DQ(int8 weight) -> MatMul`` as onnxruntime's integer ops for ``--target ort``:
onnxruntime forms QLinearMatMul itself at ORT_ENABLE_ALL (after making int8 activations uint8),
and each form written ahead ran slower there (bert_dynamo_qdq, llama_dynamo_qdq: QLinearMatMul
1.99x and 2.74x, 8-bit MatMulNBits 2.13x and 2.16x, with accuracy_level 4 1.04x and 1.21x); no
block of 32 of their int8 weights is exact in 4 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from math import prod
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.constness import constant_tensor
from graphopt.ir.ops import CARRIERS, MOVES
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import float_info
from graphopt.passes.fuse.rules._helpers import attrs_of, float_array, named_after, static_shape
from graphopt.passes.rewrite.engine import WEIGHT_READ_LIMIT, Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import ANY_DOMAIN, OpPattern, op, optional, var

__all__ = ["RULES"]

FAMILY = "qdq"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY, kind="late")

# Integer types and their value ranges: those onnxruntime's moves take, then those a requantization may have.
_MOVABLE = {
    DataType.INT8: (-128, 127),
    DataType.UINT8: (0, 255),
    DataType.INT16: (-32768, 32767),
    DataType.UINT16: (0, 65535),
}
_QUANTIZED = {**_MOVABLE, DataType.INT4: (-8, 7), DataType.UINT4: (0, 15)}
_RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# Fused ops a fusion through Q/DQ writes that onnxruntime runs in float only (no integer kernel of
# theirs reads a DequantizeLinear); CARRIERS (graphopt.ir.ops) bring a dequantized value to them.
_FLOAT_ONLY = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding"})
# The moves onnxruntime's Q/DQ propagation (ORT_ENABLE_EXTENDED and up) carries an int8 DequantizeLinear across
# from opset 21 on, inserting a QuantizeLinear whose output_dtype contradicts its zero point (onnxruntime 1.32): the
# session fails (each measured alone at opsets 21 to 25; Flatten, Gather and Expand load). (MaxPool-12 fails alike;
# in QDQ and QOperator models a QuantizeLinear reads it, which the propagation skips, and elsewhere the run warns.)
_PROPAGATED_FROM_21 = frozenset({"Reshape", "Slice", "Squeeze", "Transpose", "Unsqueeze"})
# Roundings between q and Q's rounding to an integer (DQ's product, Q's division or its
# reciprocal and product), each of relative size half the float type's spacing.
_ROUNDINGS = 3


@dataclass(frozen=True)
class _Params:
    """A QuantizeLinear's or DequantizeLinear's parameters: the integer type, scale and zero
    point (float64 arrays, the zero point broadcast like the scale), the scale's float type, and
    the axis of a per-axis quantization (None: per tensor)."""

    integer: DataType
    scale: np.ndarray
    zero: np.ndarray
    float_type: DataType
    axis: int | None


def _bound_at_call_site(node: Node) -> bool:
    """Whether an attribute of ``node`` refers to its function's own (known only where it is called)."""
    return node.opaque or any(attr.ref_attr_name for attr in node.attributes.values())


def _params(node: Node, integer: DataType | None, floats: Value | None, rank: int | None) -> _Params | Refuse:
    """``node``'s parameters, with ``integer`` its integer type, ``floats`` its float tensor and
    ``rank`` that tensor's rank."""
    if _bound_at_call_site(node):
        return Refuse(f"the {node.op_type}'s attributes are bound at a function's call site")
    if Site.int_attr(node, "block_size", 0):
        return Refuse("a blocked quantization")
    if integer is None or integer not in _QUANTIZED:
        return Refuse(f"the {node.op_type}'s integer type is not 4-, 8- or 16-bit")
    scale_type = Site.dtype(node.inputs[1])
    scale = float_array(node.inputs[1])
    if scale is None or scale_type is None:
        return Refuse("a scale is not a float constant")
    if Site.dtype(floats) != scale_type:
        return Refuse(f"the {node.op_type}'s float tensor is not of its scale's type")
    zero_given = node.inputs[2] if len(node.inputs) > 2 else None
    zero = np.zeros_like(scale) if zero_given is None else Site.array(zero_given)
    if zero is None or zero.shape != scale.shape:
        return Refuse("a zero point is not a constant of the scale's shape")
    axis = None
    if scale.size > 1:
        if rank is None or scale.ndim != 1:
            return Refuse("a per-axis quantization of unknown rank")
        axis = Site.int_attr(node, "axis", 1) % rank
    return _Params(integer, scale.ravel(), zero.astype(np.float64).ravel(), scale_type, axis)


def _exact(p: _Params) -> Refuse | None:
    """Why quantizing ``p``'s dequantized values again may not give them back (None: it does)."""
    low, high = _QUANTIZED[p.integer]
    spacing = p.float_type.epsilon
    span = high - low  # the largest |q - z|
    if spacing is None:
        return Refuse("the scale's float type is unknown")
    if span * _ROUNDINGS * spacing / 2 >= 0.5:
        return Refuse(f"{p.float_type.name.lower()} cannot hold every {p.integer.name.lower()} step exactly")
    try:
        finfo = float_info(p.float_type.numpy())
    except TypeError:
        return Refuse(f"no numpy type for {p.float_type.name.lower()}")
    if not (np.all(np.isfinite(p.scale)) and np.all(p.scale >= finfo.tiny) and span * p.scale.max() < finfo.max):
        return Refuse("a scale is not a positive normal number whose steps stay finite")
    return None


def _same(dq: _Params, q: _Params) -> Refuse | None:
    """Why ``q`` does not undo ``dq`` (axes aside): another type, scale or zero point."""
    if dq.integer != q.integer:
        return Refuse(
            f"the integer types differ ({dq.integer.name.lower()} dequantized, {q.integer.name.lower()} quantized)"
        )
    if dq.float_type != q.float_type or not np.array_equal(dq.scale, q.scale):
        return Refuse("the scales differ")
    if not np.array_equal(dq.zero, q.zero):
        return Refuse("the zero points differ")
    return _exact(dq)


def _dequantizer(value: Value) -> Node:
    """The DequantizeLinear that computes ``value`` (the pattern's test found it)."""
    node = value.producer
    assert node is not None
    return node


def _is_dequantized(value: Value) -> bool:
    """Whether a DequantizeLinear computes ``value`` (a structural test: other values are no near miss)."""
    node = value.producer
    return node is not None and node.is_qdq("DequantizeLinear")


def _dq_params(dq: Node) -> _Params | Refuse:
    return _params(dq, Site.dtype(dq.inputs[0]), dq.outputs[0], Site.rank(dq.inputs[0]))


def _q_params(q: Node) -> _Params | Refuse:
    return _params(q, Site.dtype(q.outputs[0]), q.inputs[0], Site.rank(q.inputs[0]))


# -- Q(DQ(q)) -> q -------------------------------------------------------------------------------


def _pair(x: Value, q: Node) -> tuple[_Params, _Params] | Refuse:
    """The parameters of the DequantizeLinear computing ``x`` and of QuantizeLinear ``q``, or why not readable."""
    before, after = _dq_params(_dequantizer(x)), _q_params(q)
    if isinstance(before, Refuse):
        return before
    return after if isinstance(after, Refuse) else (before, after)


def _plan_requantize(m: Match, site: Site) -> Refuse | None:
    found = _pair(m.value("x"), m.root)
    if isinstance(found, Refuse):
        return found
    before, after = found
    if before.axis != after.axis:
        return Refuse("the per-axis quantizations are along different axes")
    return _same(before, after)


def _build_requantized(b: Builder, m: Match, plan: None) -> Value:
    quantized = _dequantizer(m.value("x")).inputs[0]
    assert quantized is not None  # a DequantizeLinear's input 0 is never omitted
    return quantized


# -- Q(Move(DQ(q))) -> Move(q) -------------------------------------------------------------------


def _moved_axis(move: Node, axis: int) -> int | None:
    """Where ``move`` takes the elements of one index along ``axis`` of its input: the output
    axis holding exactly them (None: the move mixes or cuts that axis, or it is not provable)."""
    rank = Site.rank(move.inputs[0])
    if rank is None:
        return None
    if move.op_type == "Transpose":
        perm = Site.ints_attr(move, "perm") or list(range(rank - 1, -1, -1))
        return perm.index(axis) if axis in perm else None
    if move.op_type in _RESHAPES:
        return _reshaped_axis(move, axis)
    if move.op_type == "Slice":
        ends = Site.array(move.inputs[2]) if len(move.inputs) > 2 else None
        given = move.inputs[3] if len(move.inputs) > 3 else None
        axes = Site.array(given) if given is not None else None if ends is None else np.arange(ends.size)
        return None if axes is None or axis in {int(a) % rank for a in axes.ravel()} else axis
    gathered = Site.int_attr(move, "axis", 0) % rank  # a Gather
    indices = Site.rank(move.inputs[1])
    if gathered == axis or indices is None:
        return None
    return axis if axis < gathered else axis + indices - 1


def _reshaped_axis(move: Node, axis: int) -> int | None:
    """The output axis of a Reshape-like ``move`` with the same dims before it and the same size:
    the row-major order is kept, so each element keeps its index along it."""
    before, after = static_shape(move.inputs[0]), static_shape(move.outputs[0])
    if before is None or after is None:
        return None
    leading = prod(before[:axis])
    for index, dim in enumerate(after):
        if prod(after[:index]) == leading and dim == before[axis]:
            return index
    return None


def _kernel_refusal(op_type: str, integer: DataType) -> Refuse | None:
    """Why ``op_type`` should not run on ``integer`` (None: it may): a type onnxruntime's CPU kernels
    do not take, or int8, which onnxruntime on x86 turns into uint8 for its integer kernels only at
    a Q -> DQ pair it finds adjacent (its QDQ selectors refuse int8 activations there): moved
    between them, the int8 tensor keeps the MatMul after it in float (gpt2_dynamo_qdq ran 3.6x
    slower at ORT_ENABLE_ALL, its 256 x 8000 head dequantized on every run)."""
    if integer == DataType.INT8:
        return Refuse(
            "onnxruntime (x86) makes int8 activations uint8 only at adjacent Q -> DQ pairs, which this would part"
        )
    return None if integer in _MOVABLE else Refuse(f"onnxruntime's CPU {op_type} does not take {integer.name.lower()}")


def _carried(m: Match) -> tuple[_Params, _Params] | Refuse:
    """The parameters of the DequantizeLinear before the move and of the QuantizeLinear "q" after it, or why
    the move does not carry the one's quantization to the other's."""
    move = m.node("move")
    found = _pair(m.value("x"), m.node("q"))
    if isinstance(found, Refuse):
        return found
    before, after = found
    if _bound_at_call_site(move):
        return Refuse("the move's attributes are bound at a function's call site")
    if before.axis is not None and _moved_axis(move, before.axis) != after.axis:
        return Refuse("the move does not carry the per-axis quantization's axis to the QuantizeLinear's")
    if (before.axis is None) != (after.axis is None):
        return Refuse("one quantization is per axis, the other per tensor")
    return found


def _plan_move(m: Match, site: Site) -> Refuse | None:
    found = _carried(m)
    if isinstance(found, Refuse):
        return found
    before, after = found
    return _kernel_refusal(m.node("move").op_type, before.integer) or _same(before, after)


def _build_moved(b: Builder, m: Match, plan: None) -> Value:
    move = m.node("move")
    return b.op(move.op_type, _dequantizer(m.value("x")).inputs[0], *move.inputs[1:], **attrs_of(move))


# -- DQ(Q(Gather(DQ(int8 table)))) -> DQ(Gather(uint8 table)) ----------------------------------------


@dataclass(frozen=True)
class _Rows:
    """How the gathered rows reach onnxruntime's integer kernels as uint8: the zero point + 128 (shaped like the
    scale), and whether the table itself becomes uint8 (else the rows are requantized)."""

    zero: np.ndarray
    table_converted: bool


def _plan_gathered_table(m: Match, site: Site) -> _Rows | Refuse:
    found = _carried(m)
    if isinstance(found, Refuse):
        return found
    before, after = found
    if before.integer != DataType.INT8:
        return Refuse("the table is not int8 (qdq-move-integers moves the others)")
    table = _dequantizer(m.value("x")).inputs[0]
    tensor = constant_tensor(table)
    if table is None or tensor is None:
        return Refuse("the dequantized data is not a constant table")
    last, scale = _dq_params(m.root), float_array(m.root.inputs[1])
    if isinstance(last, Refuse):
        return last
    if after.axis != last.axis:
        return Refuse("the rows are quantized and dequantized along different axes")
    refusal = _same(before, after) or _same(after, last)
    if refusal is not None or scale is None:
        return refusal or Refuse("a scale is not a float constant")
    dequantized = m.value("x")
    # A table or dequantized table read elsewhere too stays (a uint8 copy beside it would grow the file).
    read_alone = not (table.is_graph_output or dequantized.is_graph_output)
    read_alone = read_alone and len(table.uses()) == len(dequantized.uses()) == 1
    zero = (last.zero + 128).astype(np.uint8).reshape(scale.shape)
    return _Rows(zero, read_alone and prod(tensor.shape) <= WEIGHT_READ_LIMIT)


def _build_gathered_table(b: Builder, m: Match, rows: _Rows) -> Value:
    gather, table, scale = m.node("move"), _dequantizer(m.value("x")).inputs[0], m.root.inputs[1]
    assert table is not None  # a DequantizeLinear's input 0 is never omitted
    # int8 q -> uint8 q + 128 (the sign bit flipped), its zero point alike: (q - z) * s stays bit for bit.
    zero = b.constant(rows.zero, named_after(m.root.inputs[2] if len(m.root.inputs) > 2 else None, "uint8"))
    dequantize = attrs_of(m.root)  # its axis along the rows, and its float type
    if rows.table_converted:
        values = Site.array(table)
        assert values is not None  # the plan bounded its size
        converted = b.constant(values.view(np.uint8) ^ np.uint8(0x80), named_after(table, "uint8"))
        return b.op(
            "DequantizeLinear",
            b.op("Gather", converted, *gather.inputs[1:], **attrs_of(gather)),
            scale,
            zero,
            domain=m.root.domain,
            **dequantize,
        )
    int8_rows = b.op(
        "DequantizeLinear",
        b.op("Gather", table, *gather.inputs[1:], **attrs_of(gather)),
        *m.root.inputs[1:],
        domain=_dequantizer(m.value("x")).domain,
        **dequantize,
    )
    requantize = m.node("q")
    requantized = b.op(
        "QuantizeLinear", int8_rows, scale, zero, domain=requantize.domain, **attrs_of(m.root, output_dtype=None)
    )
    return b.op("DequantizeLinear", requantized, scale, zero, domain=m.root.domain, **dequantize)


# -- Move(DQ(q)) -> DQ(Move(q)) before a fused op ---------------------------------------------------


def _plan_dequantize_after(m: Match, site: Site) -> tuple[_Params, int | None] | Refuse:
    move = m.node("move")
    if _bound_at_call_site(move):
        return Refuse("the move's attributes are bound at a function's call site")
    dequantize = _dequantizer(m.value("x"))
    before = _dq_params(dequantize)
    if isinstance(before, Refuse):
        return before
    if not (_feeds_fused_floats(move.outputs[0]) or _propagation_trips(move, dequantize, before, site)):
        return Refuse(
            "the move is not read by fused float ops alone (those have no integer kernel to keep), nor one"
            " onnxruntime's Q/DQ propagation fails on"
        )
    if before.integer not in _MOVABLE:
        return Refuse(f"onnxruntime's CPU {move.op_type} does not take {before.integer.name.lower()}")
    if before.axis is None:
        return before, None
    axis = None if move.op_type == "Expand" else _moved_axis(move, before.axis)
    return (before, axis) if axis is not None else Refuse("the move does not carry the per-axis quantization's axis")


def _feeds_fused_floats(value: Value) -> bool:
    """Whether ``value`` is read, and only by fused float ops, directly or through further moves."""
    readers = [use.node for use in value.uses()]
    return bool(readers) and all(
        node.op_type in _FLOAT_ONLY or (node.op_type in CARRIERS and _feeds_fused_floats(node.outputs[0]))
        for node in readers
    )


def _propagation_trips(move: Node, dequantize: Node, grid: _Params, site: Site) -> bool:
    """Whether onnxruntime's Q/DQ propagation carries ``dequantize`` across ``move`` at the site's opset, and fails
    there. From opset 21 on it crosses the moves of ``_PROPAGATED_FROM_21``, for a standard DequantizeLinear with one
    scale and zero point, where the move's output has one edge out and no QuantizeLinear ends it (one reader, or the
    graph's output that nothing reads; not two readers, nor one reading it twice, nor a graph output also read),
    also where the DQ has other readers (onnxruntime gave each Slice of a rotary's halves its own copy); and it fails
    where the integers are int8 (it makes them uint8 first; a uint8 DQ loads)."""
    moved = move.outputs[0]
    readers = [use.node for use in moved.uses()]
    one_edge = len(readers) + moved.is_graph_output == 1
    return (
        site.opset >= 21
        and move.op_type in _PROPAGATED_FROM_21
        and dequantize.in_standard_domain
        and grid.integer == DataType.INT8
        and grid.axis is None
        and one_edge
        and not any(node.is_qdq("QuantizeLinear") for node in readers)
    )


def _build_dequantized_after(b: Builder, m: Match, plan: tuple[_Params, int | None]) -> Value:
    move, dequantize = m.node("move"), _dequantizer(m.value("x"))
    moved = b.op(move.op_type, dequantize.inputs[0], *move.inputs[1:], **attrs_of(move))
    attributes = attrs_of(dequantize) | ({"axis": plan[1]} if plan[1] is not None else {})
    return b.op("DequantizeLinear", moved, *dequantize.inputs[1:], domain=dequantize.domain, **attributes)


# -- Q(Concat(DQ(a), DQ(b), ...)) -> Concat(a, b, ...) ---------------------------------------------


def _parts(concat: Node) -> list[Value]:
    """The Concat's inputs, each dequantized (the pattern's tests found it)."""
    return [part for part in concat.inputs if part is not None]


def _plan_concat(m: Match, site: Site) -> Refuse | None:
    concat = m.node("concat")
    if _bound_at_call_site(concat):
        return Refuse("the Concat's attributes are bound at a function's call site")
    rank = site.rank(m.root.inputs[0])
    joined = None if rank is None else site.int_attr(concat, "axis", 0) % rank
    for part in _parts(concat):
        found = _pair(part, m.root)
        if isinstance(found, Refuse):
            return found
        before, after = found
        refusal = _kernel_refusal("Concat", before.integer) or _same(before, after)
        if refusal is not None:
            return refusal
        if before.axis != after.axis or (before.axis is not None and before.axis == joined):
            return Refuse("a per-axis quantization is not along the same axis, other than the joined one")
    return None


def _build_concat(b: Builder, m: Match, plan: None) -> Value:
    concat = m.node("concat")
    return b.op("Concat", *(_dequantizer(part).inputs[0] for part in _parts(concat)), **attrs_of(concat))


# Both domains of the standard's contract (graphopt.ir.QDQ_DOMAINS): onnxruntime's own ops carry 16-bit QDQ.
_QUANTIZE = partial(
    op.QuantizeLinear, name="q", commute=False, domain=ANY_DOMAIN, where=lambda node: node.is_qdq("QuantizeLinear")
)
_PARAMS = (var("scale"), optional(var("zero")))
_DEQUANTIZED = var("x", _is_dequantized)


def _moving(ops: tuple[str, ...]) -> OpPattern:
    """One of ``ops`` (named "move") moving a dequantized value, its other inputs whatever they are."""
    return op.any_of(ops, _DEQUANTIZED, *(optional(var(f"_{i}")) for i in range(1, 5)), name="move", commute=False)


# The most parts of a Concat the rule reads (a rotary's halves, a cache and its new step, ViT's class token).
_MOST_PARTS = 8

RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="qdq-move-integers",
        pattern=_QUANTIZE(
            _moving(MOVES),
            *_PARAMS,
        ),
        plan=_plan_move,
        build=_build_moved,
        min_opset=10,
        label="DequantizeLinear -> move -> QuantizeLinear",
        doc="Q(Transpose(DQ(q, s, z)), s, z) -> Transpose(q), and Reshape, Flatten, Squeeze, Unsqueeze, Slice, Gather",
    ),
    _rule(
        name="qdq-dequantize-after-move",
        pattern=_moving(tuple(sorted(CARRIERS))),
        plan=_plan_dequantize_after,
        build=_build_dequantized_after,
        min_opset=10,
        label="DequantizeLinear -> move -> fused op",
        doc="Transpose(DQ(q, s, z)) -> DQ(Transpose(q), s, z) where fused float ops read it, and the other moves",
    ),
    _rule(
        name="qdq-gather-table-uint8",
        pattern=op.DequantizeLinear(
            _QUANTIZE(op.Gather(_DEQUANTIZED, var("indices"), name="move", commute=False), *_PARAMS),
            var("row_scale"),
            optional(var("row_zero")),
            commute=False,
            domain=ANY_DOMAIN,
            where=lambda node: node.is_qdq("DequantizeLinear"),
        ),
        plan=_plan_gathered_table,
        build=_build_gathered_table,
        min_opset=10,
        label="int8 table -> DequantizeLinear -> Gather -> QuantizeLinear -> DequantizeLinear",
        doc="DQ(Q(Gather(DQ(t, s, z), ids), s, z), s, z) -> DQ(Gather(t + 128, ids), s, z + 128), t int8 (a table "
        "read elsewhere too: its rows requantized to uint8)",
    ),
    _rule(
        name="qdq-concat-integers",
        pattern=_QUANTIZE(
            op.Concat(
                _DEQUANTIZED,
                *(optional(var(f"x{i}", _is_dequantized)) for i in range(1, _MOST_PARTS)),
                name="concat",
                commute=False,
            ),
            *_PARAMS,
        ),
        plan=_plan_concat,
        build=_build_concat,
        min_opset=10,
        label="DequantizeLinear -> Concat -> QuantizeLinear",
        doc="Q(Concat(DQ(a, s, z), DQ(b, s, z)), s, z) -> Concat(a, b), every part of the same parameters",
    ),
    _rule(
        name="qdq-requantize-same",
        pattern=_QUANTIZE(_DEQUANTIZED, *_PARAMS),
        plan=_plan_requantize,
        build=_build_requantized,
        min_opset=10,
        label="DequantizeLinear -> QuantizeLinear",
        doc="Q(DQ(q, s, z), s, z) -> q",
    ),
)
