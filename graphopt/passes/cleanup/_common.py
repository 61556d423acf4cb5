"""What the cleanup passes share: graph-output-safe value replacement, constants, opsets.

Replacing a value ``old`` by ``new`` is easy while ``old`` is internal: every reader is
pointed at ``new``. A graph output is part of the model's interface, so its name must
survive. Then ``new`` may take over the name only when it is an output of a node in the
same graph and is not itself a graph output (renaming it would rename that output); a
graph input or an initializer is never renamed. When neither works the caller keeps the
node: a missed simplification is cheaper than a changed interface.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from graphopt.ir import Graph, Model, Node, Tensor, Value

__all__ = ["can_replace", "constant_array", "graphs_with_opset", "replace"]

# The domains of the standard operators a rule may reason about.

# Constants larger than this many elements are not read just to test a rule.
_READ_LIMIT = 1 << 16

# Constant's attribute spellings other than a tensor, and the element type each implies.
_CONSTANT_SCALARS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def can_replace(old: Value, new: Value) -> bool:
    """Whether :func:`replace` may substitute ``new`` for ``old`` without renaming an output."""
    if not old.is_graph_output:
        return True
    producer = new.producer
    return producer is not None and producer.graph is old.graph and not new.is_graph_output


def replace(old: Value, new: Value) -> None:
    """Point every reader of ``old`` at ``new``; a graph output keeps its name and type.

    The caller checked :func:`can_replace` and removes ``old``'s producer right after, so
    the two values share a name only for that moment.
    """
    if old.is_graph_output:
        new.name = old.name
        new.type = old.type if old.type is not None else new.type
        new.doc_string = new.doc_string or old.doc_string
    old.replace_all_uses_with(new, outputs=True)


def constant_array(value: Value | None, limit: int = _READ_LIMIT) -> np.ndarray | None:
    """The values of a constant (initializer or ``Constant`` node), or None if not one.

    An initializer that is also a graph input is not a constant: the caller may feed it.
    """
    if value is None:
        return None
    if isinstance(value.const, Tensor):
        if value.is_graph_input:
            return None
        return _read(value.const, limit)
    producer = value.producer
    if producer is None or producer.op_type != "Constant" or not producer.in_standard_domain:
        return None
    return _constant_node_array(producer, limit)


def _constant_node_array(node: Node, limit: int) -> np.ndarray | None:
    if len(node.attributes) != 1:
        return None
    (attr,) = node.attributes.values()
    if attr.ref_attr_name or attr.value is None:
        return None
    if attr.name == "value" and isinstance(attr.value, Tensor):
        return _read(attr.value, limit)
    scalar_type = _CONSTANT_SCALARS.get(attr.name)
    if scalar_type is None:
        return None
    return np.asarray(attr.value, dtype=scalar_type)


def _read(tensor: Tensor, limit: int) -> np.ndarray | None:
    if tensor.size > limit:
        return None
    try:
        return tensor.numpy()
    except (TypeError, ValueError):  # element types numpy cannot represent
        return None


def graphs_with_opset(model: Model) -> Iterator[tuple[Graph, int]]:
    """Every graph of the model with the default-domain opset its nodes follow."""
    for graph in [model.graph, *model.graph.subgraphs()]:
        yield graph, model.opset
    for function in model.functions:
        imports = function.opset_imports
        opset = imports.get("", imports.get("ai.onnx", model.opset))
        for graph in [function.body, *function.body.subgraphs()]:
            yield graph, opset
