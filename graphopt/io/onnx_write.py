"""IR -> ONNX protobuf: the writer (graphopt.io.onnx_io reads).

Round trips are lossless up to these normalizations:

- nodes are written in a topological order (the stored order whenever it already is one);
- ``value_info`` lists the typed intermediate values in node order, and drops entries for
  names that no node defines;
- dimension denotations and NodeProto.device_configurations are not kept;
- repeated keys in ``metadata_props`` keep their last value;
- an attribute without a declared type gets the type of the field that is set;
- trailing empty (omitted optional) inputs of a node are not written: the spec reads an
  absent trailing input as omitted, and onnxruntime's NCHWc layout transformer skips a Conv
  whose bias is ``""`` where it takes one without the input.

Tensors are not decoded on load: an in-file tensor keeps its parsed TensorProto and is
written back as it came unless a pass replaced it; external data is memory-mapped and
copied in chunks on save, so a model larger than memory (or than protobuf's 2 GB limit)
goes through with bounded RAM.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx

from graphopt import ir
from graphopt.files import HashingFile, atomic_write, temporary_file
from graphopt.io import wire
from graphopt.io.builder import value_info_of
from graphopt.io.sources import MODEL_HEADER, TYPED_FIELDS, ProtoSource, raw_buffer, raw_layout, tensor_proto_from_array

__all__ = ["all_tensors", "content_addressed_name", "digest", "is_data_file_of", "save", "to_proto"]

# Tensors at least this large go to the external-data file when one is written.
EXTERNAL_THRESHOLD = 1024
# Above this many tensor bytes a model cannot be one protobuf message.
PROTOBUF_LIMIT = 2**31 - 2**26


# -- saving -------------------------------------------------------------------------------


def save(
    model: ir.Model,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
    location: str | None = None,
    content_addressed: bool = False,
) -> dict[str, str]:
    """Write ``model`` atomically. ``external_data=None`` keeps external data when the model
    was loaded with it or when it would not fit in one protobuf message.

    The external data file is ``location`` (default ``<model file name>.data``); with
    ``content_addressed`` it is named after its sha256, ``<model file name>.<16 hex>.data``,
    so a new model's weights never take the name of the weights an older model at the same
    path reads (see graphopt.runner: the model is renamed into place last).

    Returns the sha256 of every file written, by file name, computed as the bytes went out
    (so a report need not read a multi-gigabyte output again)."""
    path = Path(path)
    tensors = list(all_tensors(model))
    if external_data is None:
        external_data = any(isinstance(t.source, ir.ExternalSource) and not t.source.inline for t in tensors) or (
            sum(t.nbytes for t in tensors) > PROTOBUF_LIMIT
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = location or f"{path.name}.data"
    data_tmp: Path | None = None
    writer: _ExternalWriter | None = None
    if external_data:
        handle, data_tmp = temporary_file(path.parent)
        os.close(handle)
        writer = _ExternalWriter(data_tmp, data_name)
    digests: dict[str, str] = {}
    try:
        if writer is not None:
            proto = to_proto(model, writer)
            writer.close()
            if content_addressed:
                data_name = content_addressed_name(path, writer.digest.hexdigest())
                writer.relocate(data_name)
            digests[path.name] = _atomic_write(path, proto.SerializeToString())
        else:
            digests[path.name] = _atomic_write_streaming(path, model)
        if data_tmp is not None and writer is not None and writer.offset > 0:
            os.replace(data_tmp, path.parent / data_name)
            digests[data_name] = writer.digest.hexdigest()
            data_tmp = None
    finally:
        if writer is not None:
            writer.close()
        if data_tmp is not None:
            data_tmp.unlink(missing_ok=True)
    return digests


def content_addressed_name(path: Path, sha256: str) -> str:
    """The name of the external data file of ``path`` whose bytes have this sha256."""
    return f"{path.name}.{sha256[:16]}.data"


def is_data_file_of(path: Path, candidate: Path, *, hashed: bool = False) -> bool:
    """Whether ``candidate`` is named as the external data of ``path`` is: content-addressed
    ``<name>.<16 hex>.data``, or (unless ``hashed``) ``<name>.data``."""
    name, prefix = candidate.name, path.name + "."
    if candidate.parent != path.parent or not name.startswith(prefix) or not name.endswith(".data"):
        return False
    middle = name[len(prefix) : -len(".data")]
    if middle == "":
        return not hashed
    return len(middle) == 16 and all(c in "0123456789abcdef" for c in middle)


def _atomic_write(path: Path, payload: bytes) -> str:
    return atomic_write(path, lambda out: out.write(payload))


def _write_streaming(out: BinaryIO, model: ir.Model) -> None:
    """One protobuf message, its main-graph initializers streamed rather than held in memory."""
    writer = _Writer(None, stream=True)
    proto = to_proto(model, writer=writer)
    graph = proto.graph.SerializeToString()
    proto.ClearField("graph")
    wire.write_pieces(out, [proto.SerializeToString(), wire.Frame(wire.MODEL_GRAPH, [graph, *writer.streamed])])


def _atomic_write_streaming(path: Path, model: ir.Model) -> str:
    return atomic_write(path, lambda out: _write_streaming(out, model))


def digest(model: ir.Model) -> str:
    """sha256 of the bytes ``save`` would write as one file, computed without holding them."""
    sink = HashingFile()
    _write_streaming(sink, model)  # type: ignore[arg-type]
    return sink.digest.hexdigest()


def all_tensors(model: ir.Model) -> Iterable[ir.Tensor]:
    """Every dense tensor of the model: initializers (sparse ones as values and indices) and tensor attributes."""
    for graph in model.all_graphs():
        for value in graph.initializers.values():
            if isinstance(value.const, ir.Tensor):
                yield value.const
            elif isinstance(value.const, ir.SparseTensor):
                yield value.const.values
                yield value.const.indices
        for node in graph:
            for attr in node.attributes.values():
                if attr.kind == ir.AttrKind.TENSOR and attr.value is not None:
                    yield attr.value
                elif attr.kind == ir.AttrKind.TENSORS:
                    yield from attr.value


class _ExternalWriter:
    """Appends tensor bytes to one data file, aligned, chunk by chunk."""

    def __init__(self, file: Path, location: str) -> None:
        self.location = location
        self.file = file.open("wb")
        self.out = HashingFile(self.file)  # type: ignore[arg-type]
        self.digest = self.out.digest
        self.offset = 0
        # The tensors whose bytes went in, for relocate().
        self.protos: list[onnx.TensorProto] = []

    def write(self, tensor: ir.Tensor, proto: onnx.TensorProto) -> None:
        aligned = (self.offset + 4095) // 4096 * 4096
        self.out.write(b"\0" * (aligned - self.offset))
        start = aligned
        if isinstance(tensor.source, ir.ExternalSource):
            length = 0
            for chunk in tensor.source.chunks():
                self.out.write(chunk)
                length += len(chunk)
        else:
            payload = raw_buffer(tensor)
            self.out.write(payload)
            length = len(payload)
        self.offset = start + length
        self.protos.append(proto)
        proto.data_location = onnx.TensorProto.EXTERNAL
        del proto.external_data[:]
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(length))):
            proto.external_data.add(key=key, value=value)

    def relocate(self, location: str) -> None:
        """Name another file as the location of every tensor written so far."""
        self.location = location
        for proto in self.protos:
            for entry in proto.external_data:
                if entry.key == "location":
                    entry.value = location

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def _streams_from_array(tensor: ir.Tensor) -> bool:
    return not isinstance(tensor.source, ProtoSource) and raw_layout(tensor)


def _streamable_attribute(attr: ir.Attr) -> bool:
    """A tensor attribute worth streaming: large, and not already bytes in a parsed proto."""
    value = attr.value
    return (
        attr.kind == ir.AttrKind.TENSOR
        and isinstance(value, ir.Tensor)
        and value.nbytes >= wire.SPLIT_THRESHOLD
        and (isinstance(value.source, ir.ExternalSource) or _streams_from_array(value))
    )


def to_proto(
    model: ir.Model, external: _ExternalWriter | None = None, *, writer: _Writer | None = None
) -> onnx.ModelProto:
    """The model as one ModelProto (tensor data included unless ``external`` or ``writer`` take it)."""
    writer = writer or _Writer(external)
    proto = onnx.ModelProto(**_given(**{name: getattr(model, name) for name in MODEL_HEADER}))
    for domain, version in model.opset_imports.items():
        proto.opset_import.add(domain=domain, version=version)
    _props(proto.metadata_props, model.metadata_props)
    writer.graph(model.graph, proto.graph, main=True)
    for function in model.functions:
        writer.function(function, proto.functions.add())
    for field_name, items in model.opaque_fields.items():
        container = getattr(proto, field_name)
        for item in items:
            container.add().ParseFromString(item)
    return proto


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that differ from their default: empty strings and zeros are not written."""
    return {key: value for key, value in fields.items() if value}


# The fields a node and a function both have, under the same names in the IR and the proto.
_IDENTITY = ("domain", "name", "doc_string", "overload")


def _set(proto: Any, **fields: Any) -> None:
    for key, value in _given(**fields).items():
        setattr(proto, key, value)


def _props(container: Any, props: dict[str, str]) -> None:
    for key, value in props.items():
        container.add(key=key, value=value)


def _format_dim(dim: ir.Dim, proto: onnx.TensorShapeProto.Dimension) -> None:
    if isinstance(dim, int):
        proto.dim_value = dim
    elif dim is not None:
        proto.dim_param = str(dim)


# Where each kind of attribute value goes in an AttributeProto, and for messages which of
# _Writer's methods writes one.
_SCALAR_FIELDS = {ir.AttrKind.FLOAT: "f", ir.AttrKind.INT: "i", ir.AttrKind.STRING: "s"}
_LIST_FIELDS = {ir.AttrKind.FLOATS: "floats", ir.AttrKind.INTS: "ints", ir.AttrKind.STRINGS: "strings"}
_MESSAGE_FIELDS = {
    ir.AttrKind.TENSOR: ("t", "tensor"),
    ir.AttrKind.GRAPH: ("g", "graph"),
    ir.AttrKind.SPARSE_TENSOR: ("sparse_tensor", "sparse"),
    ir.AttrKind.TYPE_PROTO: ("tp", "type"),
}
_MESSAGE_LIST_FIELDS = {
    ir.AttrKind.TENSORS: ("tensors", "tensor"),
    ir.AttrKind.GRAPHS: ("graphs", "graph"),
    ir.AttrKind.SPARSE_TENSORS: ("sparse_tensors", "sparse"),
    ir.AttrKind.TYPE_PROTOS: ("type_protos", "type"),
}


class _Writer:
    def __init__(self, external: _ExternalWriter | None, *, stream: bool = False) -> None:
        self.external = external
        # With ``stream``, the main graph's nodes and dense initializers are collected here as
        # pieces for io/wire.py to write, their weights copied in chunks, instead of being
        # put into the GraphProto.
        self.stream = stream
        self.streamed: list[wire.Piece] = []

    def type(self, value_type: ir.Type | None, proto: onnx.TypeProto) -> None:
        if value_type is None:
            return
        if value_type.denotation:
            proto.denotation = value_type.denotation
        if isinstance(value_type, (ir.TensorType, ir.SparseTensorType)):
            tensor = proto.tensor_type if isinstance(value_type, ir.TensorType) else proto.sparse_tensor_type
            tensor.elem_type = int(value_type.dtype)
            if value_type.shape is not None:
                tensor.shape.SetInParent()
                for dim in value_type.shape:
                    _format_dim(dim, tensor.shape.dim.add())
        elif isinstance(value_type, ir.SequenceType):
            proto.sequence_type.SetInParent()
            self.type(value_type.element, proto.sequence_type.elem_type)
        elif isinstance(value_type, ir.MapType):
            proto.map_type.key_type = int(value_type.key)
            self.type(value_type.value, proto.map_type.value_type)
        elif isinstance(value_type, ir.OptionalType):
            proto.optional_type.SetInParent()
            self.type(value_type.element, proto.optional_type.elem_type)
        elif isinstance(value_type, ir.OpaqueType):
            proto.opaque_type.SetInParent()
            proto.opaque_type.domain = value_type.domain
            proto.opaque_type.name = value_type.name

    # Every method fills a message in place: building sub-messages and copying them into
    # their parents would copy each weight once per level of nesting.
    def value_info(self, value: ir.Value, proto: onnx.ValueInfoProto) -> None:
        _set(proto, name=value.name, doc_string=value.doc_string)
        if value.type is not None:
            self.type(value.type, proto.type)
        _props(proto.metadata_props, value.metadata_props)

    def tensor(self, tensor: ir.Tensor, proto: onnx.TensorProto, allow_external: bool = True) -> None:
        source = tensor.source
        if isinstance(source, ProtoSource):
            proto.CopyFrom(source.proto)
            proto.name = tensor.name
            del proto.metadata_props[:]
        elif isinstance(source, ir.ExternalSource):
            _set(proto, name=tensor.name, data_type=int(tensor.dtype))
            proto.dims.extend(tensor.shape)
        else:
            proto.CopyFrom(tensor_proto_from_array(tensor, source.read()))
        if tensor.doc_string:
            proto.doc_string = tensor.doc_string
        _props(proto.metadata_props, tensor.metadata_props)
        if (
            allow_external
            and self.external is not None
            and tensor.dtype != ir.DataType.STRING
            and tensor.nbytes >= EXTERNAL_THRESHOLD
        ):
            _clear_data_fields(proto)
            self.external.write(tensor, proto)
        elif isinstance(source, ir.ExternalSource):
            proto.raw_data = source.raw()

    def tensor_piece(self, number: int, name: str, tensor: ir.Tensor) -> wire.Piece:
        """The tensor as field ``number``: a data-less header, then its bytes in chunks."""
        source = tensor.source
        header = onnx.TensorProto(name=name, data_type=int(tensor.dtype), dims=list(tensor.shape))
        if tensor.doc_string:
            header.doc_string = tensor.doc_string
        _props(header.metadata_props, tensor.metadata_props)
        if isinstance(source, ir.ExternalSource):
            return wire.tensor_piece(number, header.SerializeToString(), source.size, source.chunks())
        if _streams_from_array(tensor):
            array = np.ascontiguousarray(source.read())
            # A byte view, since exotic dtypes (bfloat16, float8) do not export a buffer.
            data = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            return wire.tensor_piece(number, header.SerializeToString(), array.nbytes, [data])
        full = onnx.TensorProto()
        self.tensor(tensor, full, allow_external=False)
        full.name = name
        return wire.length_field(number, full.SerializeToString())

    def node_piece(self, node: ir.Node) -> wire.Piece:
        """A main-graph node; its large tensor attributes (Constant weights) stream."""
        streamed = [a for a in node.attributes.values() if _streamable_attribute(a)]
        proto = onnx.NodeProto()
        self.node(node, proto, skip={a.name for a in streamed})
        if not streamed:
            return wire.length_field(wire.GRAPH_NODE, proto.SerializeToString())
        pieces: list[wire.Piece] = [proto.SerializeToString()]
        for attr in streamed:
            header = onnx.AttributeProto()
            _set(header, name=attr.name, type=int(attr.kind), doc_string=attr.doc_string)
            tensor = self.tensor_piece(wire.ATTRIBUTE_TENSOR, attr.value.name, attr.value)
            pieces.append(wire.Frame(wire.NODE_ATTRIBUTE, [header.SerializeToString(), tensor]))
        return wire.Frame(wire.GRAPH_NODE, pieces)

    def sparse(self, sparse: ir.SparseTensor, proto: onnx.SparseTensorProto) -> None:
        proto.dims.extend(sparse.dims)
        self.tensor(sparse.values, proto.values)
        self.tensor(sparse.indices, proto.indices)

    def attribute(self, attr: ir.Attr, proto: onnx.AttributeProto) -> None:
        _set(proto, name=attr.name, type=int(attr.kind), doc_string=attr.doc_string)
        if attr.ref_attr_name:
            proto.ref_attr_name = attr.ref_attr_name
            return
        kind, value = attr.kind, attr.value
        if kind in _SCALAR_FIELDS:
            setattr(proto, _SCALAR_FIELDS[kind], value)
        elif kind in _LIST_FIELDS:
            getattr(proto, _LIST_FIELDS[kind]).extend(value)
        elif kind in _MESSAGE_FIELDS:
            field_name, write = _MESSAGE_FIELDS[kind]
            getattr(self, write)(value, getattr(proto, field_name))
        else:  # a list of messages
            field_name, write = _MESSAGE_LIST_FIELDS[kind]
            for item in value:
                getattr(self, write)(item, getattr(proto, field_name).add())

    def node(self, node: ir.Node, proto: onnx.NodeProto, skip: Collection[str] = ()) -> None:
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        proto.input.extend(v.name if v is not None else "" for v in inputs)
        proto.output.extend(v.name for v in node.outputs)
        _set(proto, op_type=node.op_type, **{field: getattr(node, field) for field in _IDENTITY})
        for attr in node.attributes.values():
            if attr.name not in skip:
                self.attribute(attr, proto.attribute.add())
        _props(proto.metadata_props, node.metadata_props)

    def body(self, graph: ir.Graph, nodes: Any, value_info: Any, *, streamed: bool = False) -> None:
        """A graph's nodes (in topological order; with ``streamed``, as pieces) and the
        value_info of its intermediate values."""
        order = graph.topological()
        for node in order:
            if streamed:
                self.streamed.append(self.node_piece(node))
            else:
                self.node(node, nodes.add())
        for value in value_info_of(graph, order):
            self.value_info(value, value_info.add())

    def graph(self, graph: ir.Graph, proto: onnx.GraphProto, *, main: bool = False) -> None:
        _set(proto, name=graph.name, doc_string=graph.doc_string)
        initializers: list[wire.Piece] = []
        for value in graph.initializers.values():
            if isinstance(value.const, ir.SparseTensor):
                self.sparse(value.const, proto.sparse_initializer.add())
            elif isinstance(value.const, ir.Tensor) and main and self.stream:
                initializers.append(self.tensor_piece(wire.GRAPH_INITIALIZER, value.name, value.const))
            elif isinstance(value.const, ir.Tensor):
                tensor_proto = proto.initializer.add()
                self.tensor(value.const, tensor_proto)
                tensor_proto.name = value.name
        for value in graph.inputs:
            self.value_info(value, proto.input.add())
        for value in graph.outputs:
            self.value_info(value, proto.output.add())
        # Streamed, nodes go before initializers: each repeated field keeps its own order.
        self.body(graph, proto.node, proto.value_info, streamed=main and self.stream)
        self.streamed.extend(initializers)
        _props(proto.metadata_props, graph.metadata_props)
        for tensor_name, params in graph.quantization_annotation:
            annotation = proto.quantization_annotation.add(tensor_name=tensor_name)
            _props(annotation.quant_parameter_tensor_names, params)

    def function(self, function: ir.Function, proto: onnx.FunctionProto) -> None:
        proto.input.extend(v.name for v in function.body.inputs)
        proto.output.extend(v.name for v in function.body.outputs)
        proto.attribute.extend(function.attributes)
        self.body(function.body, proto.node, proto.value_info)
        _set(proto, **{field: getattr(function, field) for field in _IDENTITY})
        for attr in function.attribute_defaults.values():
            self.attribute(attr, proto.attribute_proto.add())
        for domain, version in function.opset_imports.items():
            proto.opset_import.add(domain=domain, version=version)
        _props(proto.metadata_props, function.metadata_props)


def _clear_data_fields(proto: onnx.TensorProto) -> None:
    for name in TYPED_FIELDS:
        proto.ClearField(name)  # type: ignore[arg-type]
    proto.ClearField("raw_data")
    del proto.external_data[:]
