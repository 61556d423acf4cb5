"""Q/DQ transparency: what the rules marked ``through_qdq`` see of a statically quantized model.

A QDQ model (onnxruntime's ``quantize_static``, QDQ format) carries every activation between two
quantized ops as ``DequantizeLinear(QuantizeLinear(x, s, z), s, z)`` and every constant of such an
op as ``DequantizeLinear(q, s, z)``. A fusion pattern (a LayerNorm, an Attention, a GELU) is written
over float ops, so across those pairs it never matches. onnxruntime's own QDQ fusions and the NPU
compilers read such a model by its units instead: the fused op reads the dequantized values of its
inputs, computes in float, and its result is quantized again where the original quantized it.

:func:`hidden` gives the rules that contract for one graph, for the length of a ``with`` block:

- an activation pair ``DQ(Q(x))`` whose ``x`` only QuantizeLinear nodes read (no reader sees ``x``
  unquantized; a Reshape to its own shape removed leaves two Qs of one value) and whose quantized
  value only that DQ reads: every reader of the DQ reads ``x`` instead, so
  patterns and plans see the float computation. The pair stays, read by nothing: a fusion whose
  match removes ``x`` (the pair strictly inside the pattern) takes Q and DQ with it (the engine's
  feeders: they feed only the match), and a pair whose quantized value has another reader is not
  hidden, so the value stays quantized for that reader and a match through it is refused;
- a constant's ``DQ(q, s, z)`` of rank 0 or 1 (epsilons, exponents, GELU's constants, a norm's
  weight and bias, a projection's bias): its readers read a float constant of the dequantized
  values, so ``const()`` entries and plans read them. Matrices stay quantized (a fusion that packs
  weights would write them back in float).

When the block ends, every reader of ``x`` that read the DQ before, and every node made in the
block that reads ``x`` (a fused op reading its pattern's input), reads the DQ's output again;
likewise for the float constants, which then go. So the fused op reads the dequantized values,
the Q after its pattern's output now quantizes the fused op's result, every scale and zero point
is kept, and outside the matches the graph is as it was. A rule that would read through a hidden
value's producer instead (an attention mask ``Where(cond, 0, -inf)`` read as ``cond``, or rebuilt
with another fill) reads the value itself where :func:`quantized` says it stands in for a DQ: that
DQ would go unread, and the fused op would compute the mask the original quantized in float.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from graphopt.evaluate.base import EvaluationError
from graphopt.ir import Graph, Model, Node, Value, tensor_dtype, tensor_shape
from graphopt.ir.constness import constant_array, is_constant
from graphopt.ir.rewrite import replace_value
from graphopt.passes.base import PassContext

__all__ = ["SMALL_CONSTANT", "RuleSite", "hidden", "may_dequantize_to_nan", "quantized"]

# The most elements of a quantized constant read as float while hidden (a norm's weight, a bias).
SMALL_CONSTANT = 1 << 16

# The run's state (PassContext.state) holding, while a graph's pairs are hidden, the values standing in for a
# DequantizeLinear's output, by id (each kept alive by its entry), with that DequantizeLinear.
_STANDING_IN = "qdq-standing-in"


class RuleSite(Protocol):
    """Where a rule reads a value (the engine's Site, which imports this module)."""

    @property
    def model(self) -> Model: ...

    @property
    def ctx(self) -> PassContext: ...


def _standing_in(model: Model, ctx: PassContext) -> dict[int, Node]:
    return ctx.state(model, _STANDING_IN, dict)


def quantized(value: Value, site: RuleSite) -> bool:
    """Whether ``value`` stands in for a dequantized value while the pairs are hidden. A rule that reads
    through its producer instead of reading it (a mask's ``Where(cond, 0, -inf)`` read as ``cond``) skips
    that quantization: the fused op would no longer read the dequantized value, the pair would go unread."""
    return id(value) in _standing_in(site.model, site.ctx)


def may_dequantize_to_nan(value: Value, site: RuleSite) -> bool:
    """Whether ``value`` stands in for a DequantizeLinear whose scale is not provably finite: a grid
    calibrated on -inf (a mask's fill) has an infinite scale, and its zero step dequantizes to NaN."""
    dequantize = _standing_in(site.model, site.ctx).get(id(value))
    if dequantize is None:
        return False
    scale = constant_array(dequantize.inputs[1]) if len(dequantize.inputs) > 1 else None
    return scale is None or not bool(np.isfinite(scale).all())


@dataclass
class _Hidden:
    """One hidden DequantizeLinear: ``stand_in`` is what its readers read meanwhile (``x`` of an
    activation pair, which ``quantize`` reads; or a float constant), ``readers`` the reads moved."""

    dequantize: Node
    quantize: Node | None
    stand_in: Value
    readers: list[tuple[Node, int]] = field(default_factory=list)

    def current(self) -> Value | None:
        """What stands in now: a fusion may have replaced ``x`` by its fused op's output (None: the
        pair went with a match)."""
        if self.quantize is None:
            return self.stand_in
        return self.quantize.inputs[0] if self.quantize.graph is not None else None


def _is_op(node: Node | None, op_type: str) -> bool:
    return node is not None and node.is_qdq(op_type)


def _reads(value: Value, graph: Graph) -> list[tuple[Node, int]] | None:
    """``value``'s reads, when there are some, all by nodes of ``graph``, and it is no graph output."""
    if value.is_graph_output:
        return None
    reads = [(use.node, use.index) for use in value.uses()]
    return reads if reads and all(node.graph is graph for node, _ in reads) else None


def _activation_pair(dq: Node, graph: Graph) -> _Hidden | None:
    """``dq`` as the DQ of an activation pair that can be hidden (see the module docstring)."""
    quantized = dq.inputs[0] if dq.inputs else None
    q = quantized.producer if quantized is not None else None
    if quantized is None or q is None or not _is_op(q, "QuantizeLinear") or q.graph is not graph:
        return None
    x = q.inputs[0] if q.inputs else None
    if x is None or quantized.is_graph_output or len(quantized.uses()) != 1:
        return None
    if not all(_is_op(use.node, "QuantizeLinear") and use.index == 0 for use in x.uses()):
        return None  # read unquantized too
    dtype = tensor_dtype(x)
    return _Hidden(dq, q, x) if dtype is not None and dtype == tensor_dtype(dq.outputs[0]) else None


def _small_constant(dq: Node) -> list[Node] | None:
    """The nodes computing ``dq``'s output from constants alone (``DQ(q)``, or ``DQ(Q(c))`` of a constant the
    quantizer took for an activation), when it is of rank 0 or 1 and small; else None."""
    shape = tensor_shape(dq.outputs[0])
    if shape is None or len(shape) > 1 or not all(isinstance(d, int) and d <= SMALL_CONSTANT for d in shape):
        return None
    region = [dq]
    quantized = dq.inputs[0] if dq.inputs else None
    if quantized is not None and _is_op(quantized.producer, "QuantizeLinear") and len(quantized.uses()) == 1:
        region.insert(0, quantized.producer)  # type: ignore[arg-type]
    produced = {id(v) for node in region for v in node.outputs}
    reads = [v for node in region for v in node.inputs if v is not None and id(v) not in produced]
    return region if all(is_constant(v) for v in reads) else None


def _constants(regions: list[list[Node]], model: Model, graph: Graph, ctx: PassContext) -> list[_Hidden]:
    """Float constants standing in for the DQs of small quantized constants (none without an evaluator)."""
    evaluator = ctx.evaluator
    if evaluator is None or not regions:
        return []
    dqs = [region[-1] for region in regions]
    outputs = [dq.outputs[0] for dq in dqs]
    nodes = [node for region in regions for node in region]
    produced = {id(v) for node in nodes for v in node.outputs}
    reads = {v: constant_array(v) for node in nodes for v in node.inputs if v is not None and id(v) not in produced}
    try:
        known = {v: array for v, array in reads.items() if array is not None}
        arrays = evaluator.evaluate(nodes, known, outputs, model.opsets_of(graph))
    except EvaluationError:
        return []
    builder = ctx.builder(model, graph)
    return [_Hidden(dq, None, builder.constant(arrays[out], f"{out.name}_float")) for dq, out in zip(dqs, outputs)]


@contextmanager
def hidden(model: Model, graph: Graph, ctx: PassContext) -> Iterator[bool]:
    """Hide the Q/DQ pairs and small quantized constants of ``model``'s ``graph`` for the block;
    yields whether anything was hidden (see the module docstring)."""
    found: list[_Hidden] = []
    constants: list[list[Node]] = []
    for node in graph.nodes:
        if not _is_op(node, "DequantizeLinear") or _reads(node.outputs[0], graph) is None:
            continue
        region = _small_constant(node)
        pair = _activation_pair(node, graph) if region is None else None
        if region is not None:
            constants.append(region)
        elif pair is not None:
            found.append(pair)
    found += _constants(constants, model, graph, ctx)
    if not found:
        yield False
        return
    existing = {id(n): n for n in graph.nodes}  # kept alive, so no new node takes an old one's id
    by_output = {id(entry.dequantize.outputs[0]): entry for entry in found}
    for entry in found:
        # A value quantized again (Q, DQ, Q, DQ: a Reshape to its own shape went from between them) stands
        # in for the first quantization's float value.
        inner = by_output.get(id(entry.stand_in))
        while inner is not None:
            entry.stand_in = inner.stand_in
            inner = by_output.get(id(entry.stand_in))
        entry.readers = _reads(entry.dequantize.outputs[0], graph) or []
        for node, index in entry.readers:
            node.set_input(index, entry.stand_in)
    standing_in = {id(entry.stand_in): entry.dequantize for entry in found}
    registry = _standing_in(model, ctx)
    registry.update(standing_in)
    try:
        yield True
    finally:
        for key in standing_in:
            registry.pop(key, None)
        # The last quantization of a value first: a new node reading it reads what its readers read.
        for entry in reversed(found):
            _restore(entry, existing, model, graph, ctx)


def _restore(entry: _Hidden, existing: dict[int, Node], model: Model, graph: Graph, ctx: PassContext) -> None:
    """The moved reads, and the new nodes' reads of the stand-in, read the DQ's output again."""
    stand_in, dequantized = entry.current(), entry.dequantize.outputs[0]
    if stand_in is None or entry.dequantize.graph is None:
        return
    moved = {(id(node), index) for node, index in entry.readers}
    for use in stand_in.uses():
        if use.node is not entry.quantize and ((id(use.node), use.index) in moved or id(use.node) not in existing):
            use.node.set_input(use.index, dequantized)
    if entry.quantize is None:  # the float constant goes (a graph output, if a rule made it one, keeps its name)
        replace_value(stand_in, dequantized, ctx.names(model))
        graph.remove_initializer(stand_in)
