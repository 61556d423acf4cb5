"""One graph builder for both readers: scopes, definitions, name resolution and annotations.

The ONNX and JSON readers walk their own format and hand over what they find; what makes a
loaded graph valid (one definition per name in a scope, a body's reuse of an outer name
renamed, each graph input listed once, every read resolved) is decided here, once, so the
two formats cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from graphopt.errors import InputError
from graphopt.ir import Attr, Graph, Node, Value

__all__ = ["Annotate", "NodeEntry", "Scope", "build_graph"]

# The values visible to a graph, innermost scope last.
Scope = list[dict[str, Value]]
# Sets a value's declared type, doc string and metadata from the format's annotation.
Annotate = Callable[[Value], None]


@dataclass
class NodeEntry:
    """A node as a reader found it: value names, and its attributes built in the node's scope
    (a body attribute resolves names of the graph that holds the node)."""

    op_type: str
    inputs: Sequence[str]
    outputs: Sequence[str]
    attributes: Callable[[Scope], list[Attr]]
    # Names the node in messages, as the format locates it ("node 'Add'", "graph.nodes[3]").
    label: str
    domain: str = ""
    name: str = ""
    overload: str = ""
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)


def build_graph(
    scope: Scope,
    *,
    name: str,
    where: str,
    initializers: Iterable[Value],
    inputs: Iterable[tuple[str, Annotate]],
    nodes: Sequence[NodeEntry],
    annotations: Mapping[str, Annotate],
    outputs: Iterable[tuple[str, Annotate]],
) -> tuple[Graph, set[str]]:
    """The graph of these parts, read inside ``scope``; and the names in ``annotations`` that
    annotate no node output. ``where`` locates the graph in messages. Raises InputError."""
    local: dict[str, Value] = {}

    def define(value: Value, definer: str = where) -> Value:
        if value.name and value.name in local:
            raise InputError(f"{definer}: value {value.name!r} is defined twice")
        if value.name:
            local[value.name] = value
            if any(value.name in frame for frame in scope):
                # A body may reuse an outer name (onnxruntime takes it: body inputs and outputs
                # are positional); the IR keeps names unique across scopes, so the inner value
                # is renamed (its readers hold the value, not the name).
                value.name = _unshadowed(value.name, [*scope, local])
        return value

    graph_initializers = [define(value) for value in initializers]
    graph_inputs: list[Value] = []
    listed: set[str] = set()
    for input_name, annotate in inputs:
        if input_name in listed:
            raise InputError(f"{where}: graph input {input_name!r} is listed twice")
        listed.add(input_name)
        # Before IR version 4 initializers were also listed as inputs: one value, two roles.
        value = local.get(input_name) or define(Value(input_name))
        annotate(value)
        graph_inputs.append(value)
    # Outputs first, inputs second: a graph whose nodes are out of order still loads.
    unused = set(annotations)
    for value in graph_initializers:
        if value.name in annotations:  # an initializer's doc and metadata; its type is its tensor's
            described = Value(value.name)
            annotations[value.name](described)
            value.doc_string, value.metadata_props = described.doc_string, described.metadata_props
            unused.discard(value.name)
    outputs_of: list[list[Value]] = []
    for entry in nodes:
        produced = [define(Value(output), entry.label) for output in entry.outputs]
        for output, value in zip(entry.outputs, produced):
            if output in annotations:
                annotations[output](value)
                unused.discard(output)
        outputs_of.append(produced)
    inner = [*scope, local]

    def resolve(value_name: str, reader: str) -> Value:
        for frame in reversed(inner):
            if value_name in frame:
                return frame[value_name]
        raise InputError(f"{reader} reads {value_name!r}, which nothing defines")

    graph_nodes = []
    for entry, produced in zip(nodes, outputs_of):
        node = Node(
            entry.op_type,
            [resolve(n, entry.label) if n else None for n in entry.inputs],
            produced,
            entry.attributes(inner),
            domain=entry.domain,
            name=entry.name,
            overload=entry.overload,
        )
        node.doc_string = entry.doc_string
        node.metadata_props = entry.metadata_props
        graph_nodes.append(node)
    graph_outputs = []
    for output_name, annotate in outputs:
        value = resolve(output_name, f"{where}: a graph output")
        annotate(value)
        graph_outputs.append(value)
    return Graph(graph_inputs, graph_outputs, graph_nodes, graph_initializers, name=name), unused


def _unshadowed(name: str, frames: Scope) -> str:
    index = 1
    while any(f"{name}__{index}" in frame for frame in frames):
        index += 1
    frames[-1][f"{name}__{index}"] = frames[-1][name]  # a later name in this scope cannot take it
    return f"{name}__{index}"


def value_info_of(graph: Graph, order: Iterable[Node]) -> list[Value]:
    """What a writer lists as ``graph``'s value_info, in node ``order``: the named intermediate
    values with a type, a doc or metadata, and the initializers with a doc or metadata (their
    type is their tensor's; build_graph reads the doc and metadata back)."""
    described = [v for v in graph.initializers.values() if v.doc_string or v.metadata_props]
    boundary = {id(v) for v in [*graph.inputs, *graph.outputs, *described]}
    return described + [
        value
        for node in order
        for value in node.outputs
        if value.name
        and id(value) not in boundary
        and (value.type is not None or value.doc_string or value.metadata_props)
    ]
