"""Structural copies of models, sharing tensor data.

Tensor data is treated as immutable (a pass that changes a constant installs a new
:class:`~graphopt.ir.tensor.Tensor`), so a copy only duplicates the graph structure. The
pipeline uses this to restore the model when a pass fails half way.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace

from graphopt.ir.graph import Graph
from graphopt.ir.model import Model
from graphopt.ir.node import Attr, AttrKind, Node
from graphopt.ir.value import Value

__all__ = ["clone_graph", "clone_model"]


def _clone_value(value: Value) -> Value:
    copy = Value(value.name, value.type, value.const)
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
    functions = [
        replace(
            f,
            body=clone_graph(f.body),
            attributes=list(f.attributes),
            attribute_defaults=dict(f.attribute_defaults),
            opset_imports=dict(f.opset_imports),
            metadata_props=dict(f.metadata_props),
        )
        for f in model.functions
    ]
    # Fields not named here are immutable values and are shared.
    return replace(
        model,
        graph=clone_graph(model.graph),
        opset_imports=dict(model.opset_imports),
        metadata_props=dict(model.metadata_props),
        functions=functions,
        opaque_fields={k: list(v) for k, v in model.opaque_fields.items()},
        extensions=deepcopy(model.extensions),
    )
