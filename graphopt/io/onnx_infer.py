"""onnx's own shape inference, run on a light copy of a model, read back as IR types.

The ``shape-infer`` pass uses this as a starting point for ops it has no rule for. The
copy keeps the structure but not the weights: every initializer becomes a typed graph
input, except small int tensors, which onnx's data propagation needs to follow shape
arithmetic. So the cost is the model's structure, not its size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from graphopt.io.onnx_io import _Reader, to_proto
from graphopt.ir import DataType, Graph, Model, Node, Tensor, TensorType, Type, Value
from graphopt.ir.clone import clone_model
from graphopt.ir.constness import constant_tensor

__all__ = ["infer_types"]

logger = logging.getLogger(__name__)

# Initializers kept with their data: int tensors this small are shapes, axes and indices.
_KEEP_INT_ELEMENTS = 64
_INT_TYPES = {DataType.INT64, DataType.INT32}


def infer_types(model: Model) -> dict[int, Type]:
    """Types onnx infers for node outputs, keyed by ``id`` of the value in ``model``.

    onnx failing (an invalid model, an op it rejects) is not an error here: the result is
    then whatever it could give, possibly nothing.
    """
    light = clone_model(model)
    # Only the main graph: a body's inputs are fixed by its op (If has none, Loop's are positional).
    _weights_to_inputs(light.graph)
    try:
        proto = to_proto(light)
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    except Exception as err:  # onnx raises assorted C++ exception types
        logger.info("onnx shape inference failed, continuing without it: %s", err)
        return {}
    reader = _Reader(Path.cwd(), independent_dims=False)
    found: dict[int, Type] = {}
    _collect(model.graph, inferred.graph, reader, found)
    return found


def _is_shape_data(tensor: Tensor) -> bool:
    return tensor.dtype in _INT_TYPES and tensor.size <= _KEEP_INT_ELEMENTS


def _weights_to_inputs(graph: Graph) -> None:
    for value in list(graph.initializers.values()):
        tensor = constant_tensor(value)  # an initializer the caller may feed is no shape data
        if tensor is not None and _is_shape_data(tensor):
            continue
        stand_in = Value(value.name, value.type)
        value.replace_all_uses_with(stand_in, outputs=True)
        graph.remove_initializer(value)
        # Before IR version 4 an initializer could also be listed as an input.
        listed = any(v is value for v in graph.inputs)
        graph.inputs = [stand_in if v is value else v for v in graph.inputs] + ([] if listed else [stand_in])
    # Weights held in Constant nodes (as paddle2onnx writes them) become typed inputs read
    # through an Identity, which onnx infers to the same type.
    for node in graph:
        tensor = node.attr("value") if node.op_type == "Constant" and node.in_standard_domain else None
        if not isinstance(tensor, Tensor) or _is_shape_data(tensor):
            continue
        stand_in = Value(f"{node.outputs[0].name}.weights", TensorType(tensor.dtype, tensor.shape))
        graph.inputs = [*graph.inputs, stand_in]
        replacement = Node("Identity", [stand_in], [Value(node.outputs[0].name)])
        node.outputs[0].replace_all_uses_with(replacement.outputs[0], outputs=True)
        graph.insert_before(node, replacement)
        graph.remove(node)


def _collect(graph: Graph, proto: onnx.GraphProto, reader: _Reader, found: dict[int, Type]) -> None:
    """Pair ``graph``'s nodes with ``proto``'s by their outputs' names (unique in a graph)."""
    types = {vi.name: vi.type for vi in [*proto.value_info, *proto.output]}
    protos = {n.output[0]: n for n in proto.node if n.output and n.output[0]}
    for node in graph.topological():
        node_proto = protos.get(node.outputs[0].name) if node.outputs else None
        if node_proto is None:
            continue
        for value in node.outputs:
            type_proto = types.get(value.name)
            kind = reader.type(type_proto) if type_proto is not None else None
            if kind is not None:
                found[id(value)] = kind
        bodies = {a.name: a for a in node_proto.attribute}
        for name, attr in node.attributes.items():
            attr_proto = bodies.get(name)
            if attr_proto is None:
                continue
            for body, body_proto in zip(
                attr.graphs(), [*([attr_proto.g] if attr_proto.HasField("g") else []), *attr_proto.graphs], strict=False
            ):
                _collect(body, body_proto, reader, found)
