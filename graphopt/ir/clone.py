"""Structural copies of models, sharing tensor data, and snapshots to rebuild them from.

Tensor data is treated as immutable (a pass that changes a constant installs a new
:class:`~graphopt.ir.tensor.Tensor`), so a copy only duplicates the graph structure. The
pipeline takes a :class:`Snapshot` before a pass to restore the model when the pass fails
half way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from dataclasses import fields
from typing import Any

from graphopt.ir.graph import Graph
from graphopt.ir.model import Function, Model
from graphopt.ir.node import Attr, AttrKind, Node
from graphopt.ir.value import Value

__all__ = ["Snapshot", "clone_graph", "clone_model"]


def _clone_value(value: Value) -> Value:
    copy = Value(value.name, value.type, value.const)
    copy.declared = value.declared
    copy.doc_string = value.doc_string
    copy.metadata_props = dict(value.metadata_props)
    return copy


def clone_graph(graph: Graph, outer: dict[int, Value] | None = None) -> Graph:
    """Copy ``graph``; ``outer`` maps ids of values from enclosing scopes to their copies.

    Bodies share their enclosing scope's map (ids never clash) rather than copying it, which
    made a copy quadratic in the number of bodies.
    """
    mapping: dict[int, Value] = {} if outer is None else outer

    def copy_of(value: Value) -> Value:
        if id(value) not in mapping:
            mapping[id(value)] = _clone_value(value)
        return mapping[id(value)]

    inputs = [copy_of(v) for v in graph.inputs]
    initializers = [copy_of(v) for v in graph.initializers.values()]
    nodes = []
    for node in graph:
        outputs = [copy_of(v) for v in node.outputs]
        for value in outputs:
            mapping[id(value)] = value
    for node in graph:
        # Inputs may refer to values defined later in the stored order or outside the graph.
        inputs_copy = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
        attributes = [_clone_attr(a, mapping) for a in node.attributes.values()]
        copy = Node(
            node.op_type,
            inputs_copy,
            [mapping[id(v)] for v in node.outputs],
            attributes,
            domain=node.domain,
            name=node.name,
            overload=node.overload,
        )
        copy.doc_string = node.doc_string
        copy.metadata_props = dict(node.metadata_props)
        copy.opaque = node.opaque
        nodes.append(copy)
    outputs = [mapping.get(id(v), v) for v in graph.outputs]
    copy_graph = Graph(inputs, outputs, nodes, initializers, name=graph.name)
    copy_graph.doc_string = graph.doc_string
    copy_graph.metadata_props = dict(graph.metadata_props)
    copy_graph.quantization_annotation = [(n, dict(p)) for n, p in graph.quantization_annotation]
    return copy_graph


def _clone_attr(attr: Attr, mapping: dict[int, Value]) -> Attr:
    value = attr.value
    if attr.kind == AttrKind.GRAPH and value is not None:
        value = clone_graph(value, mapping)
    elif attr.kind == AttrKind.GRAPHS:
        value = [clone_graph(g, mapping) for g in value]
    elif isinstance(value, list):
        value = list(value)
    return Attr(attr.name, attr.kind, value, attr.ref_attr_name, attr.doc_string)


def clone_model(model: Model) -> Model:
    functions = [Function(**_copied_fields(f, "body"), body=clone_graph(f.body)) for f in model.functions]
    return Model(**_copied_fields(model, "graph", "functions"), graph=clone_graph(model.graph), functions=functions)


# -- snapshots ------------------------------------------------------------------------------

_ATOMS = (int, float, str, bytes, bool)
_NO_VALUE = -1
_PER_VALUE = 6  # entries of Snapshot._values per value
# How an attribute's value is kept: as it is (an atom), an index into the shared objects, a
# list kept as a tuple, one graph, several.
_ATOM, _SHARED, _LIST, _GRAPH, _GRAPHS = range(5)


class Snapshot:
    """A model frozen into a flat list of strings and numbers (plus a table of the objects it
    shares with the model: types, tensors, other attribute values), to rebuild it from.

    The pipeline takes one before every pass and drops it after. A structural copy is ~13
    objects per node for the cyclic garbage collector to trace, and every copy of a
    100,000-node model set off full collections: copies and collections took twice as long
    as the passes themselves. A flat list is one object, freed as soon as it is dropped.
    """

    def __init__(self, model: Model) -> None:
        self._shared: list[object] = []
        self._shared_index: dict[int, int] = {}
        self._value_index: dict[int, int] = {}
        self._values: list[Any] = []  # name, type, const, declared, doc_string, metadata: six per value
        self._records: list[Any] = []  # the graphs, in the order _thaw_graph reads them
        self._freeze_graph(model.graph)
        for function in model.functions:
            self._freeze_graph(function.body)
        self._functions = [_copied_fields(f, "body") for f in model.functions]
        self._model_fields = _copied_fields(model, "graph", "functions")
        del self._shared_index, self._value_index  # only needed while freezing

    def model(self) -> Model:
        """A new model equal to the one the snapshot was taken of (each call builds another)."""
        values: list[Value | None] = [None] * (len(self._values) // _PER_VALUE)
        take = iter(self._records).__next__
        graph = self._thaw_graph(take, values)
        functions = [Function(**_copied(kept), body=self._thaw_graph(take, values)) for kept in self._functions]
        return Model(**_copied(self._model_fields), graph=graph, functions=functions)

    # -- freezing -----------------------------------------------------------------------------
    def _share(self, thing: object) -> int:
        if thing is None:
            return _NO_VALUE
        index = self._shared_index.get(id(thing))
        if index is None:
            index = self._shared_index[id(thing)] = len(self._shared)
            self._shared.append(thing)
        return index

    def _freeze_value(self, value: Value) -> int:
        index = self._value_index.get(id(value))
        if index is None:
            index = self._value_index[id(value)] = len(self._values) // _PER_VALUE
            metadata = tuple(value.metadata_props.items())
            shared = self._share(value.type), self._share(value.const), self._share(value.declared)
            self._values += (value.name, *shared, value.doc_string, metadata)
        return index

    def _freeze_values(self, values: Sequence[Value | None]) -> None:
        self._records.append(len(values))
        self._records += [_NO_VALUE if v is None else self._freeze_value(v) for v in values]

    def _freeze_graph(self, graph: Graph) -> None:
        out = self._records
        annotations = tuple((name, tuple(props.items())) for name, props in graph.quantization_annotation)
        out += (graph.name, graph.doc_string, tuple(graph.metadata_props.items()), annotations)
        self._freeze_values(graph.inputs)
        self._freeze_values(list(graph.initializers.values()))
        self._freeze_values(graph.outputs)
        nodes = graph.nodes
        out.append(len(nodes))
        for node in nodes:
            metadata = tuple(node.metadata_props.items())
            out += (node.op_type, node.domain, node.name, node.overload, node.doc_string, metadata, node.opaque)
            self._freeze_values(node.inputs)
            self._freeze_values(node.outputs)
            out.append(len(node.attributes))
            for attr in node.attributes.values():
                self._freeze_attr(attr)

    def _freeze_attr(self, attr: Attr) -> None:
        out = self._records
        value = attr.value
        out += (attr.name, int(attr.kind), attr.ref_attr_name, attr.doc_string)
        if attr.kind == AttrKind.GRAPH and value is not None:
            out.append(_GRAPH)
            self._freeze_graph(value)
        elif attr.kind == AttrKind.GRAPHS:
            out += (_GRAPHS, len(value))
            for body in value:
                self._freeze_graph(body)
        elif isinstance(value, list):
            out += (_LIST, tuple(value))
        elif value is None or isinstance(value, _ATOMS):
            out += (_ATOM, value)
        else:
            out += (_SHARED, self._share(value))

    # -- thawing ------------------------------------------------------------------------------
    def _thaw_value(self, index: int, values: list[Value | None]) -> Value:
        value = values[index]
        if value is None:
            name, type_index, const_index, declared_index, doc_string, metadata = self._values[
                _PER_VALUE * index : _PER_VALUE * (index + 1)
            ]
            value = values[index] = Value(name, self._shared_or_none(type_index), self._shared_or_none(const_index))
            value.declared = self._shared_or_none(declared_index)
            value.doc_string = doc_string
            value.metadata_props = dict(metadata)
        return value

    def _shared_or_none(self, index: int) -> Any:
        return None if index == _NO_VALUE else self._shared[index]

    def _thaw_values(self, take: Callable[[], Any], values: list[Value | None]) -> list[Value | None]:
        return [None if i == _NO_VALUE else self._thaw_value(i, values) for i in [take() for _ in range(take())]]

    def _thaw_defined(self, take: Callable[[], Any], values: list[Value | None]) -> list[Value]:
        return [self._thaw_value(take(), values) for _ in range(take())]

    def _thaw_graph(self, take: Callable[[], Any], values: list[Value | None]) -> Graph:
        name, doc_string, metadata, annotations = take(), take(), take(), take()
        inputs = self._thaw_defined(take, values)
        initializers = self._thaw_defined(take, values)
        outputs = self._thaw_defined(take, values)
        nodes = []
        for _ in range(take()):
            op_type, domain, node_name, overload, node_doc, node_metadata, opaque = (take() for _ in range(7))
            reads = self._thaw_values(take, values)
            writes = self._thaw_defined(take, values)
            attributes = [self._thaw_attr(take, values) for _ in range(take())]
            node = Node(op_type, reads, writes, attributes, domain=domain, name=node_name, overload=overload)
            node.doc_string = node_doc
            node.metadata_props = dict(node_metadata)
            node.opaque = opaque
            nodes.append(node)
        graph = Graph(inputs, outputs, nodes, initializers, name=name)
        graph.doc_string = doc_string
        graph.metadata_props = dict(metadata)
        graph.quantization_annotation = [(n, dict(props)) for n, props in annotations]
        return graph

    def _thaw_attr(self, take: Callable[[], Any], values: list[Value | None]) -> Attr:
        name, kind, ref_attr_name, doc_string, how = take(), take(), take(), take(), take()
        value: Any
        if how == _GRAPH:
            value = self._thaw_graph(take, values)
        elif how == _GRAPHS:
            value = [self._thaw_graph(take, values) for _ in range(take())]
        elif how == _LIST:
            value = list(take())
        elif how == _SHARED:
            value = self._shared[take()]
        else:
            value = take()
        return Attr(name, AttrKind(kind), value, ref_attr_name, doc_string)


def _copied_fields(thing: Model | Function, *leave_out: str) -> dict[str, Any]:
    return _copied({f.name: getattr(thing, f.name) for f in fields(thing) if f.name not in leave_out})


def _copied(found: Mapping[str, Any]) -> dict[str, Any]:
    """Fields of a model or function, their containers copied; what they hold is immutable
    and shared, except the free-form extensions."""
    copies = {name: type(v)(v) if isinstance(v, (list, dict)) else v for name, v in found.items()}
    if "extensions" in copies:
        copies["extensions"] = deepcopy(found["extensions"])
    if "opaque_fields" in copies:
        copies["opaque_fields"] = {k: list(v) for k, v in found["opaque_fields"].items()}
    return copies
