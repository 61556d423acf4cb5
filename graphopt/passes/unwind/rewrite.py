"""Write a layout solution into the graph: the one module of the unwind pass that edits the IR.

Given the layouts of the sinks (graph inputs and Transpose-only initializers), every
other layout follows, node by node in topological order, exactly as in the derived
problem (:mod:`onnx_layouts`). Each value ``v`` is carried by a *holder*, the IR value
whose data is ``v.transpose(layout)``:

- a Transpose is a view: its output's holder is its input's, its layout the input's
  composed with the permutation, and the node goes;
- an element-wise op, a Softmax-like op, a reduction and a Concat run on the holders
  as they are, with axes attributes (Concat ``axis``, reduction ``axes``, Softmax
  ``axis``) renumbered to the layout; a non-constant operand in another layout gets a
  Transpose, a constant operand is re-laid out offline (a new initializer);
- a fixed node reads its inputs row-major (a Transpose where they are not) and writes
  its outputs row-major, or, for a profile that prescribes another layout, a Transpose
  after it;
- a graph output is converted back to row-major under its own name.

:func:`plan` walks the graph without touching it and returns the number of Transposes
the rewrite would leave, with the edits that write it; the pass applies the edits only
when they leave fewer Transposes than the graph has.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from graphopt.ir import Attr, AttrKind, DataType, Graph, Node, Tensor, TensorType, Type, Value
from graphopt.passes.unwind.onnx_layouts import (
    Derivation,
    Layout,
    Role,
    constant_array,
    identity,
    inverse,
    prescribed,
    rank_of,
)

__all__ = ["Plan", "plan"]


@dataclass
class Plan:
    transposes: int
    edits: list[Callable[[], object]] = field(default_factory=list)
    # Graph inputs whose declared layout changes: name -> layout.
    relaid_inputs: dict[str, Layout] = field(default_factory=dict)

    def apply(self) -> None:
        for edit in self.edits:
            edit()


def plan(graph: Graph, derivation: Derivation, sink_layouts: dict[Value, Layout], profile: str) -> Plan:
    return _Planner(graph, derivation, profile).plan(sink_layouts)


def _permuted(value_type: Type | None, layout: Layout) -> Type | None:
    if isinstance(value_type, TensorType) and value_type.shape is not None:
        return TensorType(value_type.dtype, tuple(value_type.shape[a] for a in layout), value_type.denotation)
    return value_type


class _Planner:
    def __init__(self, graph: Graph, derivation: Derivation, profile: str) -> None:
        self.graph = graph
        self.ranks = derivation.ranks
        self.roles = derivation.roles
        self.profile = profile
        self.layouts: dict[Value, Layout] = {}
        self.holders: dict[Value, Value] = {}
        self.conversions: dict[tuple[int, Layout], Value] = {}
        self.relaid: dict[tuple[int, Layout], Value] = {}
        # Constants some node stopped reading (re-laid out or renumbered axes).
        self.replaced: dict[int, Value] = {}
        # Transposes the derivation could not read as views stay.
        kept = sum(1 for node in graph if node.op_type == "Transpose" and self._role(node).kind != "transpose")
        self.result = Plan(kept)
        self.taken = {v.name for v in graph.values()}
        self.counter = itertools.count()

    # -- helpers --------------------------------------------------------------------------
    def _role(self, node: Node) -> Role:
        return self.roles.get(node, Role("fixed"))

    def _edit(self, function: Callable[..., object], *args: object) -> None:
        self.result.edits.append(partial(function, *args))

    def _name(self, base: str) -> str:
        while True:
            name = f"{base}__unwind{next(self.counter)}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def _layout(self, value: Value) -> Layout | None:
        rank = rank_of(value, self.ranks)
        return None if rank is None else self.layouts.get(value, identity(rank))

    def _holder(self, value: Value) -> Value:
        return self.holders.get(value, value)

    def _transpose(self, source: Value, perm: Layout, out: Value) -> Node:
        attr = Attr("perm", AttrKind.INTS, list(perm))
        return Node("Transpose", [source], [out], [attr], name=self._name("Transpose"))

    def _convert(self, value: Value, target: Layout, before: Node) -> Value:
        """The value that carries ``value`` in layout ``target`` (a new Transpose if needed)."""
        current = self._layout(value)
        if current is None or current == target:
            return self._holder(value)
        key = (id(value), target)
        if key not in self.conversions:
            self.result.transposes += 1
            perm = tuple(inverse(current)[axis] for axis in target)
            converted = Value(self._name(value.name or "value"), _permuted(value.type, target))
            self.conversions[key] = converted
            self._edit(self.graph.insert_before, before, self._transpose(self._holder(value), perm, converted))
        return self.conversions[key]

    def _relaid_constant(self, value: Value, rank: int, target: Layout) -> Value:
        """``value`` broadcast to ``rank`` and stored in layout ``target``, as an initializer."""
        if target == identity(rank):
            return value
        key = (id(value), target)
        if key not in self.relaid:
            array = constant_array(value)
            assert array is not None
            array = np.ascontiguousarray(array.reshape((1,) * (rank - array.ndim) + array.shape).transpose(target))
            name = self._name(value.name or "constant")
            dtype = DataType.from_numpy(array.dtype)
            self.relaid[key] = Value(name, TensorType(dtype, array.shape), Tensor.from_array(array, name))
            self.replaced[id(value)] = value
            self._edit(self.graph.add_initializer, self.relaid[key])
        return self.relaid[key]

    def _output_layout(self, value: Value, layout: Layout) -> None:
        if layout != identity(len(layout)):
            self.layouts[value] = layout
            self._edit(setattr, value, "type", _permuted(value.type, layout))

    # -- the walk -------------------------------------------------------------------------
    def plan(self, sink_layouts: dict[Value, Layout]) -> Plan:
        graph, result = self.graph, self.result
        for value, layout in sink_layouts.items():
            if layout == identity(len(layout)):
                continue
            self.layouts[value] = layout
            if isinstance(value.const, Tensor):
                self._edit(_relayout_initializer, value, layout)
            else:
                result.relaid_inputs[value.name] = layout
                self._edit(setattr, value, "type", _permuted(value.type, layout))
        output_types = {v: v.type for v in graph.outputs}
        views: list[Node] = []
        logical: set[Value] = set()  # fixed nodes' outputs, row-major, converted after them
        for node in graph.topological():
            kind = self._role(node).kind
            if kind == "transpose":
                views.append(node)
                self._view(node)
            elif kind in ("elementwise", "concat"):
                self._elementwise(node)
            elif kind in ("reduce", "axis"):
                self._axes(node)
            else:
                logical.update(self._fixed(node))
        for value in dict.fromkeys(graph.outputs):  # an output listed twice is restored once
            current = self._layout(value)
            if current is None or value in logical:
                continue
            if current == identity(len(current)) and self._holder(value) is value:
                continue
            if current != identity(len(current)):
                result.transposes += 1
            restored = Value(value.name, output_types[value])
            self._edit(_restore_output, graph, value, self._holder(value), restored, current, self._name)
        for view in reversed(views):
            self._edit(_drop, view)
        for original in self.replaced.values():
            if original.name in graph.initializers and graph.initializers[original.name] is original:
                self._edit(_drop_initializer, graph, original)
        return result

    def _view(self, node: Node) -> None:
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        source = self._layout(x)
        assert source is not None
        perm = tuple(node.attr("perm", list(reversed(range(len(source))))))
        self.layouts[y] = tuple(inverse(perm)[axis] for axis in source)
        self.holders[y] = self._holder(x)

    def _elementwise(self, node: Node) -> None:
        role = self._role(node)
        main_index = role.unwind if role.kind == "elementwise" else 0
        main = node.inputs[main_index]
        assert main is not None
        target = self._layout(main)
        assert target is not None
        for index, value in enumerate(node.inputs):
            if value is None or rank_of(value, self.ranks) == 0:
                continue
            if index != main_index and constant_array(value) is not None:
                replacement = self._relaid_constant(value, len(target), target)
            else:
                replacement = self._convert(value, target, node)
            if replacement is not value:
                self._edit(node.set_input, index, replacement)
        if role.kind == "concat":
            axis = node.attr("axis", 0) % len(target)
            self._edit(_set_int, node, "axis", inverse(target)[axis])
        self._output_layout(node.outputs[0], target)

    def _axes(self, node: Node) -> None:
        role = self._role(node)
        x = node.inputs[0]
        assert x is not None
        source = self._layout(x)
        assert source is not None
        if self._holder(x) is not x:
            self._edit(node.set_input, 0, self._holder(x))
        where = inverse(source)
        rank = len(source)
        if role.kind == "axis":
            axis = node.attr("axis", -1) % rank
            if where[axis] != axis:
                self._edit(_set_int, node, "axis", where[axis])
            self._output_layout(node.outputs[0], source)
            return
        physical = sorted(where[a] for a in role.axes)
        if physical != list(role.axes):
            if node.attr("axes") is not None:
                self._edit(node.attributes.__setitem__, "axes", Attr("axes", AttrKind.INTS, physical))
            else:
                name = self._name("axes")
                array = np.array(physical, dtype=np.int64)
                axes = Value(name, TensorType(DataType.INT64, array.shape), Tensor.from_array(array, name))
                self._edit(self.graph.add_initializer, axes)
                self._edit(node.set_input, 1, axes)
                original = node.inputs[1]
                assert original is not None
                self.replaced[id(original)] = original
        if role.keepdims:
            self._output_layout(node.outputs[0], source)
        else:
            kept = [a for a in range(rank) if a not in role.axes]
            self._output_layout(node.outputs[0], tuple(kept.index(source[j]) for j in range(rank) if j not in physical))

    def _fixed(self, node: Node) -> list[Value]:
        """Row-major in; the profile's layout out. Returns the outputs that stay row-major
        while a Transpose after the node carries them on in another layout."""
        for index, value in enumerate(node.inputs):
            rank = rank_of(value, self.ranks)
            if value is not None and rank is not None:
                replacement = self._convert(value, identity(rank), node)
                if replacement is not value:
                    self._edit(node.set_input, index, replacement)
        carried = []
        for value in node.outputs:
            rank = rank_of(value, self.ranks)
            if rank is None or prescribed(node, rank, self.profile) == identity(rank):
                continue
            want = prescribed(node, rank, self.profile)
            converted = Value(self._name(value.name or "value"), _permuted(value.type, want))
            self.result.transposes += 1
            self._edit(_append_after, self.graph, node, value, converted, self._transpose(value, want, converted))
            self.holders[value] = converted
            self.layouts[value] = want
            carried.append(value)
        return carried


def _set_int(node: Node, name: str, value: int) -> None:
    node.attributes[name] = Attr(name, AttrKind.INT, int(value))


def _drop(node: Node) -> None:
    """Remove a Transpose that became a view, once nothing reads its output."""
    graph = node.graph
    if graph is not None and not any(v.is_used() for v in node.outputs):
        graph.remove(node)


def _drop_initializer(graph: Graph, value: Value) -> None:
    if not value.is_used() and not value.is_graph_input:
        graph.remove_initializer(value)


def _append_after(graph: Graph, node: Node, value: Value, converted: Value, transpose: Node) -> None:
    """Insert ``transpose`` (value -> converted) after ``node``; the readers of ``value``
    read ``converted``."""
    readers = value.uses()
    graph.insert_after(node, transpose)
    for use in readers:
        use.node.set_input(use.index, converted)


def _restore_output(
    graph: Graph, value: Value, carrier: Value, restored: Value, layout: Layout, fresh_name: Callable[[str], str]
) -> None:
    """Let ``restored`` (row-major, computed from ``carrier``) take over the graph output
    ``value`` and its name; ``value`` itself is renamed (and dropped if it was a view)."""
    value.name = fresh_name(value.name)
    if layout == identity(len(layout)):
        node = Node("Identity", [carrier], [restored], name=fresh_name("Identity"))
    else:
        perm = Attr("perm", AttrKind.INTS, list(inverse(layout)))
        node = Node("Transpose", [carrier], [restored], [perm], name=fresh_name("Transpose"))
    graph.append(node)
    graph.outputs = [restored if v is value else v for v in graph.outputs]


def _relayout_initializer(value: Value, layout: Layout) -> None:
    assert isinstance(value.const, Tensor)
    array = np.ascontiguousarray(value.const.numpy().transpose(layout))
    value.const = Tensor.from_array(array, value.name)
    value.type = _permuted(value.type, layout)
