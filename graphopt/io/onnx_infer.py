"""onnx's own shape inference, run on a light copy of a model, read back as IR types.

The ``shape-infer`` pass uses this as a starting point for ops it has no rule for. The
copy keeps the structure but not the weights: every initializer becomes a typed graph
input, except small int tensors, which onnx's data propagation needs to follow shape
arithmetic. So the cost is the model's structure, not its size.

onnx's inference functions are C++ code that trusts the model: on a malformed node (a
TreeEnsemble without its input, a Split with more outputs than split sizes) they crash
the process (a segmentation fault, a failed assertion) instead of raising. Where the
platform can fork, inference runs in a forked child, so such a model only loses onnx's
types: the child shares the parent's memory, so the copy costs no serialization in and
a few milliseconds.
"""

from __future__ import annotations

import faulthandler
import logging
import os
from pathlib import Path

import onnx

from graphopt.errors import InputError
from graphopt.io.onnx_io import _Reader
from graphopt.io.onnx_write import to_proto
from graphopt.ir import DataType, Graph, Model, Node, Tensor, TensorType, Type, Value
from graphopt.ir.clone import clone_model
from graphopt.ir.constness import constant_tensor

__all__ = ["infer_proto", "infer_types"]

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
        inferred = infer_proto(to_proto(light))
    except Exception as err:  # onnx raises assorted C++ exception types
        logger.info("onnx shape inference failed, continuing without it: %s", err)
        return {}
    reader = _Reader(Path.cwd(), independent_dims=False)
    found: dict[int, Type] = {}
    _collect(model.graph, inferred.graph, reader, found)
    return found


def infer_proto(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's inference on ``proto``, in a forked child where the platform can fork (see the
    module docstring); raises what onnx raises, or InferenceCrashed."""
    return _isolated(proto) if hasattr(os, "fork") else _infer(proto)


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)


class InferenceCrashed(Exception):
    """onnx's inference ended its process (see the module docstring)."""


def _isolated(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``_infer`` in a forked child, which sends back a status byte and the result (or error)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(read_end)
        faulthandler.disable()  # the parent reports a crash in one line; no dump of this process's stack
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # a failed assertion's text is no news to the user
        try:
            payload = b"\0" + _infer(proto).SerializeToString()
        except BaseException as err:
            payload = b"\1" + f"{type(err).__name__}: {err}".encode(errors="replace")
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        payload = source.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not payload:
        raise InferenceCrashed(f"it crashed the process that ran it (wait status {status})")
    if payload[:1] != b"\0":
        raise InferenceCrashed(payload[1:].decode(errors="replace"))
    inferred = onnx.ModelProto()
    inferred.ParseFromString(payload[1:])
    return inferred


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
        if not isinstance(tensor, Tensor) or _is_shape_data(tensor) or len(node.outputs) != 1:
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
            try:
                kind = reader.type(type_proto) if type_proto is not None else None
            except InputError:  # what onnx made of a malformed node (an element type -1)
                continue
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
