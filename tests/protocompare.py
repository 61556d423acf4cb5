"""Field-by-field comparison of ONNX protos up to graphopt's documented normalizations."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def _strip_defaults(message: Message) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.is_repeated:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in getattr(message, field.name):
                    _strip_defaults(item)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(field.name):
                _strip_defaults(getattr(message, field.name))
        elif message.HasField(field.name) and getattr(message, field.name) == field.default_value:
            message.ClearField(field.name)


def _normalize_graph(graph: onnx.GraphProto) -> None:
    defined = {o for n in graph.node for o in n.output} - {v.name for v in graph.input} - {v.name for v in graph.output}
    infos = sorted((v for v in graph.value_info if v.name in defined), key=lambda v: v.name)
    kept = [onnx.ValueInfoProto().FromString(v.SerializeToString()) for v in infos]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    _drop_trailing_empty_inputs(graph.node)
    for node in graph.node:
        node.ClearField("device_configurations")
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else []:
                _normalize_graph(sub)
            for sub in attr.graphs:
                _normalize_graph(sub)
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        _strip_dim_denotation(vi.type)


def _drop_trailing_empty_inputs(nodes: Iterable[onnx.NodeProto]) -> None:
    for node in nodes:
        while node.input and not node.input[-1]:
            node.input.pop()


def _strip_dim_denotation(tp: onnx.TypeProto) -> None:
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        for dim in getattr(tp, which).shape.dim:
            dim.ClearField("denotation")
    elif which == "sequence_type":
        _strip_dim_denotation(tp.sequence_type.elem_type)
    elif which == "optional_type":
        _strip_dim_denotation(tp.optional_type.elem_type)
    elif which == "map_type":
        _strip_dim_denotation(tp.map_type.value_type)


def normalized(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    _normalize_graph(copy.graph)
    for function in copy.functions:
        infos = sorted(function.value_info, key=lambda v: v.name)
        kept = [onnx.ValueInfoProto().FromString(v.SerializeToString()) for v in infos]
        del function.value_info[:]
        function.value_info.extend(kept)
        _drop_trailing_empty_inputs(function.node)
    _strip_defaults(copy)
    return copy


def first_difference(a: onnx.ModelProto, b: onnx.ModelProto) -> str | None:
    """None when equal after normalization, else a short description of where they differ."""
    na, nb = normalized(a), normalized(b)
    if na.SerializeToString(deterministic=True) == nb.SerializeToString(deterministic=True):
        return None
    for field in na.DESCRIPTOR.fields:
        if getattr(na, field.name) != getattr(nb, field.name):
            if field.name == "graph":
                for gfield in na.graph.DESCRIPTOR.fields:
                    x, y = getattr(na.graph, gfield.name), getattr(nb.graph, gfield.name)
                    if x != y:
                        if gfield.is_repeated:
                            for i, (p, q) in enumerate(zip(x, y)):
                                if p != q:
                                    return f"graph.{gfield.name}[{i}]: {str(p)[:300]!r} != {str(q)[:300]!r}"
                            return f"graph.{gfield.name}: {len(x)} != {len(y)} entries"
                        return f"graph.{gfield.name}: {x!r} != {y!r}"
            return f"model.{field.name} differs"
    return "serialized bytes differ"
