"""Write a layout solution into the graph: the one module of the unwind pass that edits the IR.

Given the layouts of the sinks (graph inputs and constants read only by Transposes),
every other layout follows, node by node in topological order, exactly as in the derived
problem (:mod:`onnx_layouts`). Each value ``v`` is carried by a *holder*, the IR value
whose data is ``v.transpose(physical)``; its *flow* layout is the one the nodes after it
take, the same as ``physical`` except after a fixed node whose profile prescribes another
layout (the holder is then the node's row-major output, and a Transpose is made before
the first reader that wants the prescribed layout):

- a Transpose is a view: its output's holder is its input's, its layouts the input's
  composed with the permutation, and the node goes;
- an element-wise op, a reduction and a per-axis op (:mod:`per_axis`: Pad, Slice,
  Concat, Softmax, ...) run on holders in their input's flow layout, with reduction
  ``axes`` renumbered and the per-axis parameters mapped to it (an attribute rewritten,
  a constant input replaced by a new one); a non-constant operand held in another
  layout gets a Transpose, a constant operand is re-laid out offline (a new initializer);
  a linear or cubic Resize whose mapped scales onnxruntime does not run is fixed;
- a fixed node reads its inputs row-major (a Transpose where they are not) and writes
  its outputs row-major;
- a graph output is converted back to row-major under its own name.

:func:`plan` walks the graph without touching it and returns the number of Transposes
the rewrite would leave, with the edits that write it; the pass applies the edits only
when they leave fewer Transposes than the graph has. Values that the edits create exist
only once the plan is applied: the plan refers to them through :class:`_Made` slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from graphopt.ir import Graph, Model, Node, TensorType, Type, Value
from graphopt.ir.constness import constant_array, constant_tensor, is_constant
from graphopt.ir.rewrite import Builder, Namer, attribute, replace_value
from graphopt.passes.base import PassContext
from graphopt.passes.unwind.onnx_layouts import (
    Derivation,
    Layout,
    Profile,
    Role,
    identity,
    inverse,
    prescribed,
    rank_of,
)
from graphopt.passes.unwind.per_axis import PER_AXIS_OPS, Number, as_array, mapped, runs_in

__all__ = ["Plan", "plan"]

TAG = "unwind"


@dataclass
class Plan:
    transposes: int
    edits: list[Callable[[], object]] = field(default_factory=list)
    # Graph inputs whose declared layout changes: name -> layout.
    relaid_inputs: dict[str, Layout] = field(default_factory=dict)

    def apply(self) -> None:
        for edit in self.edits:
            edit()


@dataclass(eq=False)
class _Made:
    """A value an edit creates when the plan is applied; the edits after it read it here."""

    value: Value | None = None


Carrier = Value | _Made


def _resolved(carrier: Carrier) -> Value:
    if isinstance(carrier, Value):
        return carrier
    assert carrier.value is not None, "an edit read a value before the edit that makes it"
    return carrier.value


def plan(
    model: Model, derivation: Derivation, sink_layouts: dict[Value, Layout], profile: Profile, ctx: PassContext
) -> Plan:
    return _Planner(model, derivation, profile, ctx).plan(sink_layouts)


def _permuted(value_type: Type | None, layout: Layout) -> Type | None:
    if isinstance(value_type, TensorType) and value_type.shape is not None:
        return TensorType(value_type.dtype, tuple(value_type.shape[a] for a in layout), value_type.denotation)
    return value_type


def _all_values(value: Value) -> np.ndarray:
    """Every element of a constant: it is re-laid out whole."""
    tensor = constant_tensor(value)
    array = constant_array(value, tensor.size) if tensor is not None else None
    if array is None:
        raise ValueError(f"unwind: cannot read the constant {value.name!r} to re-lay it out")
    return array


def _composed(perm: Layout, layout: Layout) -> Layout:
    """The layout of ``x.transpose(perm)`` held in ``x``'s data laid out by ``layout``."""
    where = inverse(perm)
    return tuple(where[axis] for axis in layout)


class _Planner:
    def __init__(self, model: Model, derivation: Derivation, profile: Profile, ctx: PassContext) -> None:
        self.model = model
        self.graph = model.graph
        self.ctx = ctx
        self.names: Namer = ctx.names(model)
        self.ranks = derivation.ranks
        self.roles = derivation.roles
        self.profile = profile
        self.physical: dict[Value, Layout] = {}
        self.flows: dict[Value, Layout] = {}  # where the flow layout is not the physical one
        self.holders: dict[Value, Carrier] = {}
        self.conversions: dict[tuple[int, Layout], Carrier] = {}
        self.relaid: dict[tuple[int, Layout], Carrier] = {}
        self.parameters: dict[tuple[int, tuple[Number, ...]], Carrier] = {}
        # Constants some node stopped reading (re-laid out or renumbered axes).
        self.replaced: dict[int, Value] = {}
        # Transposes the derivation could not read as views stay.
        kept = sum(1 for node in self.graph if node.op_type == "Transpose" and self._role(node).kind != "transpose")
        self.result = Plan(kept)

    # -- helpers --------------------------------------------------------------------------
    def _role(self, node: Node) -> Role:
        return self.roles.get(node, Role("fixed"))

    def _edit(self, function: Callable[..., object], *args: object) -> None:
        self.result.edits.append(partial(function, *args))

    def _builder(self, before: Node | None) -> Builder:
        return self.ctx.builder(self.model, self.graph, before=before, tag=TAG)

    def _physical(self, value: Value) -> Layout | None:
        rank = rank_of(value, self.ranks)
        return None if rank is None else self.physical.get(value, identity(rank))

    def _flow(self, value: Value) -> Layout | None:
        return self.flows.get(value) or self._physical(value)

    def _holder(self, value: Value) -> Carrier:
        return self.holders.get(value, value)

    def _read(self, node: Node, index: int, carrier: Carrier) -> None:
        """Let ``node`` read ``carrier`` at ``index`` (once the plan is applied)."""
        if carrier is not node.inputs[index]:
            self._edit(_set_input, node, index, carrier)

    def _convert(self, value: Value, target: Layout, before: Node) -> Carrier:
        """What carries ``value`` in layout ``target`` (a new Transpose before ``before`` if needed)."""
        current = self._physical(value)
        holder = self._holder(value)
        if current is None or current == target:
            return holder
        perm = tuple(inverse(current)[axis] for axis in target)
        key = (id(holder), perm)
        if key not in self.conversions:
            self.result.transposes += 1
            made = self.conversions[key] = _Made()
            self._edit(self._make_transpose, made, holder, perm, before)
        return self.conversions[key]

    def _make_transpose(self, made: _Made, source: Carrier, perm: Layout, before: Node | None) -> None:
        made.value = self._builder(before).op("Transpose", _resolved(source), perm=list(perm))

    def _relaid_constant(self, value: Value, rank: int, target: Layout) -> Carrier:
        """``value`` broadcast to ``rank`` and stored in layout ``target``, as an initializer."""
        if target == identity(rank):
            return value
        key = (id(value), target)
        if key not in self.relaid:
            made = self.relaid[key] = _Made()
            self.replaced[id(value)] = value
            self._edit(self._make_relaid, made, value, rank, target)
        return self.relaid[key]

    def _make_relaid(self, made: _Made, value: Value, rank: int, target: Layout) -> None:
        array = _all_values(value)
        array = array.reshape((1,) * (rank - array.ndim) + array.shape).transpose(target)
        made.value = self._builder(None).constant(np.ascontiguousarray(array), value.name or "constant")

    def _output_layout(self, value: Value, layout: Layout) -> None:
        """``value`` is written in ``layout`` by its own node."""
        if layout != identity(len(layout)):
            self.physical[value] = layout
            self._edit(setattr, value, "type", _permuted(value.type, layout))
            self._edit(setattr, value, "declared", _permuted(value.declared, layout))  # what the file said, moved

    # -- the walk -------------------------------------------------------------------------
    def plan(self, sink_layouts: dict[Value, Layout]) -> Plan:
        graph, result = self.graph, self.result
        for value, layout in sink_layouts.items():
            if layout == identity(len(layout)):
                continue
            self.physical[value] = layout
            if is_constant(value):
                made = self.holders[value] = _Made()
                self.replaced[id(value)] = value
                self._edit(self._make_relaid, made, value, len(layout), layout)
            else:
                result.relaid_inputs[value.name] = layout
                self._edit(setattr, value, "type", _permuted(value.type, layout))
        output_types = {v: v.type for v in graph.outputs}
        views: list[Node] = []
        for node in graph.topological():
            kind = self._role(node).kind
            if kind == "transpose":
                views.append(node)
                self._view(node)
            elif kind == "elementwise":
                self._elementwise(node)
            elif kind == "reduce":
                self._axes(node)
            elif kind == "per_axis":
                self._per_axis(node)
            else:
                self._fixed(node)
        for value in dict.fromkeys(graph.outputs):  # an output listed twice is restored once
            current = self._physical(value)
            if current is None or (current == identity(len(current)) and self._holder(value) is value):
                continue
            if current != identity(len(current)):
                result.transposes += 1
            self._edit(self._restore_output, value, self._holder(value), current, output_types[value])
        for view in reversed(views):
            self._edit(_drop, view)
        for original in self.replaced.values():
            self._edit(_drop_constant, graph, original)
        return result

    def _view(self, node: Node) -> None:
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        physical, flow = self._physical(x), self._flow(x)
        assert physical is not None and flow is not None
        perm = tuple(node.attr("perm", list(reversed(range(len(physical))))))
        self.physical[y] = _composed(perm, physical)
        if flow != physical:
            self.flows[y] = _composed(perm, flow)
        self.holders[y] = self._holder(x)

    def _elementwise(self, node: Node) -> None:
        main_index = self._role(node).unwind
        target = self._carry(node, main_index, list(range(len(node.inputs))))
        self._output_layout(node.outputs[0], target)

    def _carry(self, node: Node, main_index: int, indices: list[int]) -> Layout:
        """Let ``node`` read its inputs at ``indices`` in the flow layout of input
        ``main_index`` (a constant re-laid out offline, anything else converted); that layout."""
        main = node.inputs[main_index]
        assert main is not None
        target = self._flow(main)
        assert target is not None
        for index in indices:
            value = node.inputs[index]
            if value is None or rank_of(value, self.ranks) == 0:
                continue
            if index != main_index and is_constant(value):
                self._read(node, index, self._relaid_constant(value, len(target), target))
            else:
                self._read(node, index, self._convert(value, target, node))
        return target

    def _per_axis(self, node: Node) -> None:
        """The op runs in its input's flow layout, its per-axis parameters mapped to it."""
        readings = self._role(node).params
        x = node.inputs[0]
        assert x is not None
        source = self._flow(x)
        assert source is not None
        if not runs_in(node, readings, source):
            self._fixed(node)
            return
        self._carry(node, 0, PER_AXIS_OPS[node.op_type].data_inputs(node))
        for param, values in mapped(readings, source).items():
            if isinstance(param.at, str):
                self._edit(_set_attribute, node, param.at, values[0] if param.maps == "axis" else list(values))
            else:
                self._read(node, param.at, self._parameter(node, param.at, values))
        for value in node.outputs:
            self._output_layout(value, source)

    def _parameter(self, node: Node, index: int, values: tuple[Number, ...]) -> Carrier:
        """A constant holding ``values`` in the dtype of ``node``'s input ``index``, which it replaces."""
        original = node.inputs[index]
        assert original is not None
        key = (id(original), values)
        if key not in self.parameters:
            made = self.parameters[key] = _Made()
            self.replaced[id(original)] = original
            self._edit(self._make_parameter, made, original, values)
        return self.parameters[key]

    def _make_parameter(self, made: _Made, original: Value, values: tuple[Number, ...]) -> None:
        array = as_array(constant_array(original), values)
        made.value = self._builder(None).constant(array, original.name or "parameter")

    def _axes(self, node: Node) -> None:
        role = self._role(node)
        x = node.inputs[0]
        assert x is not None
        source = self._flow(x)
        assert source is not None
        self._read(node, 0, self._convert(x, source, node))
        where = inverse(source)
        rank = len(source)
        physical = sorted(where[a] for a in role.axes)
        if physical != list(role.axes):
            original = node.inputs[1] if node.attr("axes") is None else None
            if original is None:
                self._edit(_set_attribute, node, "axes", physical)
            else:
                self._read(node, 1, self._parameter(node, 1, tuple(physical)))
        if role.keepdims:
            self._output_layout(node.outputs[0], source)
        else:
            kept = [a for a in range(rank) if a not in role.axes]
            self._output_layout(node.outputs[0], tuple(kept.index(source[j]) for j in range(rank) if j not in physical))

    def _fixed(self, node: Node) -> None:
        """Row-major in and out; the nodes after it take the layout the profile prescribes."""
        for index, value in enumerate(node.inputs):
            rank = rank_of(value, self.ranks)
            if value is not None and rank is not None:
                self._read(node, index, self._convert(value, identity(rank), node))
        for value in node.outputs:
            rank = rank_of(value, self.ranks)
            if rank is not None and prescribed(node, rank, self.profile) != identity(rank):
                self.flows[value] = prescribed(node, rank, self.profile)

    def _restore_output(self, value: Value, holder: Carrier, layout: Layout, logical: Type | None) -> None:
        """The graph output ``value`` becomes row-major ``holder`` data under its own name and
        type; the nodes that read ``value`` go on reading it."""
        restored = _resolved(holder)
        if layout != identity(len(layout)):
            restored = self._builder(None).op("Transpose", restored, perm=list(inverse(layout)))
        positions = [i for i, v in enumerate(self.graph.outputs) if v is value]
        replace_value(value, restored, self.names, keep=[use.node for use in value.uses()])
        for position in positions:
            self.graph.outputs[position].type = logical


def _set_input(node: Node, index: int, carrier: Carrier) -> None:
    node.set_input(index, _resolved(carrier))


def _set_attribute(node: Node, name: str, value: object) -> None:
    node.attributes[name] = attribute(name, value)


def _drop(node: Node) -> None:
    """Remove a Transpose that became a view, once nothing reads its output."""
    graph = node.graph
    if graph is not None and not any(v.is_used() or v.is_graph_output for v in node.outputs):
        graph.remove(node)


def _drop_constant(graph: Graph, value: Value) -> None:
    """Remove a constant that no node reads any more (an initializer, or a Constant node)."""
    if value.is_used() or value.is_graph_output or value.is_graph_input:
        return
    producer = value.producer
    if producer is not None:
        if producer.graph is graph:
            graph.remove(producer)
    elif graph.initializers.get(value.name) is value:
        graph.remove_initializer(value)
