"""Constants kept the way runtimes like them: as initializers, each content stored once.

- ``Constant`` nodes become initializers of their graph, in bodies too (function bodies
  have no initializers: their Constants stay).
- Initializers with equal content are stored once; a body's copy of an outer
  initializer reads the outer one. An initializer that is also a graph input is never
  merged: the caller may feed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np

from graphopt.ir import Attr, AttrKind, DataType, Graph, Model, Node, Tensor, TensorType, Value
from graphopt.ir.constness import constant_node_tensor, constant_tensor
from graphopt.ir.rewrite import Namer, replace_value

__all__ = ["constants_to_initializers", "deduplicate_initializers", "replace_by_constant"]


def _graphs_with_initializers(model: Model) -> Iterator[Graph]:
    """The main graph and its bodies, outer graphs first (function bodies hold no initializers)."""
    yield model.graph
    yield from model.graph.subgraphs()


def constants_to_initializers(model: Model, names: Namer) -> int:
    """Turn every literal ``Constant`` node outside function bodies into an initializer."""
    moved = 0
    for graph in list(_graphs_with_initializers(model)):
        for node in graph.nodes:
            if node.op_type != "Constant" or not node.in_standard_domain:
                continue
            tensor = constant_node_tensor(node)
            out = node.outputs[0]
            if tensor is None or out.is_graph_output:
                continue
            value = Value(names.fresh(out.name or "const"), out.type, tensor)
            graph.add_initializer(value)
            replace_value(out, value, names)
            graph.remove(node)
            moved += 1
    return moved


def replace_by_constant(value: Value, array: np.ndarray, names: Namer) -> None:
    """Make ``value``'s readers read a constant holding ``array``: an initializer, or for a
    graph output (whose name an initializer cannot take over) a ``Constant`` node."""
    graph = value.graph
    assert graph is not None
    tensor = Tensor.from_array(array, names.fresh(value.name or "folded"))
    if value.is_graph_output and value.producer is not None:
        constant = Node("Constant", [], [Value(tensor.name, TensorType(tensor.dtype, tensor.shape))], name=tensor.name)
        constant.attributes["value"] = Attr("value", AttrKind.TENSOR, tensor)
        graph.insert_before(value.producer, constant)
        replacement = constant.outputs[0]
    else:
        replacement = graph.add_initializer(Value(tensor.name, TensorType(tensor.dtype, tensor.shape), tensor))
    replace_value(value, replacement, names)


def _signature(value: Value) -> tuple[int, tuple[int, ...], int] | None:
    tensor = value.const
    if tensor is None or value.is_graph_input or not hasattr(tensor, "shape"):
        return None
    return (int(tensor.dtype), tuple(tensor.shape), tensor.nbytes)  # type: ignore[union-attr]


def _digest(value: Value, *, probe: bool = False) -> bytes | None:
    tensor = constant_tensor(value)
    if not isinstance(tensor, Tensor) or tensor.dtype == DataType.STRING:
        return None
    return tensor.digest(probe=probe)


def deduplicate_initializers(model: Model, names: Namer) -> int:
    """Make readers of a repeated initializer read its first copy; return how many went."""
    graphs = list(_graphs_with_initializers(model))
    # Only tensors whose dtype, shape and size occur twice are probed (a few slices hashed),
    # and only those whose probes agree too are hashed whole.
    counts = Counter(s for g in graphs for v in g.initializers.values() if (s := _signature(v)) is not None)
    candidates = [
        (graph, value, signature, _digest(value, probe=True))
        for graph in graphs
        for value in list(graph.initializers.values())
        if (signature := _signature(value)) is not None and counts[signature] > 1 and not value.is_graph_output
    ]
    probes: Counter[tuple[object, ...]] = Counter((signature, probe) for _, _, signature, probe in candidates)
    kept: dict[tuple[object, ...], Value] = {}
    merged = 0
    for graph, value, signature, probe in candidates:
        if probe is None or probes[(signature, probe)] < 2:
            continue
        digest = _digest(value)
        if digest is None:
            continue
        first = kept.setdefault((signature, digest), value)
        if first is value or first.graph is None or not _visible(first.graph, graph):
            continue
        replace_value(value, first, names)
        graph.remove_initializer(value)
        merged += 1
    return merged


def _visible(defining: Graph, reader: Graph) -> bool:
    return any(g is defining for g in reader.enclosing())
