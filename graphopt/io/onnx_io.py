"""ONNX protobuf -> IR: the reader (graphopt.io.onnx_write writes; its docstring lists what a
round trip normalizes).

Tensors are not decoded on load: an in-file tensor keeps its parsed TensorProto and is
written back as it came unless a pass replaced it; external data is memory-mapped, so a
model larger than memory (or than protobuf's 2 GB limit) loads with bounded RAM.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError

from graphopt import ir
from graphopt.errors import InputError, bounded
from graphopt.io import wire
from graphopt.io.builder import NodeEntry, Scope, build_graph
from graphopt.io.external import external_file
from graphopt.io.sources import MODEL_HEADER, TYPED_FIELDS, ProtoSource, input_file

__all__ = ["MAX_SUBGRAPH_NESTING", "external_locations", "from_proto", "load"]

_log = logging.getLogger(__name__)

# Protobuf parsers (upb in Python, onnxruntime's C++) read 100 message levels: a model and
# its graph take two, each subgraph three more (node, attribute, graph), and a value's type
# in the innermost graph five (value info, type, tensor type, shape, dim): 2 + 3 * 31 + 5.
MAX_SUBGRAPH_NESTING = 31


# -- loading ------------------------------------------------------------------------------


# Files people give an ONNX tool by mistake, by their first bytes: (offset, magic, what it is, what to do).
_OTHER_FORMATS = (
    (0, b"PK\x03\x04", "a zip archive (a PyTorch checkpoint saved with torch.save?)", "export the model to ONNX"),
    # The PROTO opcode of pickle protocols 2 to 5 (an ONNX file that failed to parse may start so too: the
    # table is read only for files that did).
    (0, b"\x80", "a Python pickle (a PyTorch or scikit-learn checkpoint?)", "export the model to ONNX"),
    (0, b"\x89HDF", "an HDF5 file (a Keras model?)", "convert it with tf2onnx"),
    (4, b"TFL3", "a TensorFlow Lite model", "convert it with tf2onnx (--tflite)"),
    (0, b"GGUF", "a GGUF file (llama.cpp weights)", "export the model to ONNX"),
)


def _not_onnx(path: Path) -> str | None:
    """What a file that does not parse as ONNX is instead, when its first bytes say so, and
    what to do with it; None when they say nothing."""
    try:
        with path.open("rb") as handle:
            head = handle.read(16)
    except OSError:
        return None
    for offset, magic, what, remedy in _OTHER_FORMATS:
        if head[offset : offset + len(magic)] == magic:
            return f"{path}: {what}, not an ONNX model; {remedy} first (graphopt reads .onnx and .json graphs)"
    header = int.from_bytes(head[:8], "little")
    if len(head) > 8 and head[8:9] == b"{" and 0 < header < path.stat().st_size:  # safetensors: length, then JSON
        return f"{path}: a safetensors file (weights only), not an ONNX model; export the model to ONNX first"
    return None


def load(path: str | os.PathLike[str], *, independent_dims: bool = False) -> ir.Model:
    """Read an ONNX file. External data is mapped, not read. Raises InputError on bad input."""
    path = input_file(Path(path))
    proto = onnx.ModelProto()
    try:
        # Large inline weights stay in the file, mapped on demand (see io/wire.py).
        payload = wire.split_inline_weights(path)
        if payload is None:
            payload = path.read_bytes()
        proto.ParseFromString(payload)
        del payload
    except OSError as err:
        raise InputError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (DecodeError, RuntimeError, ValueError, IndexError) as err:
        if "MaxDepth" in str(err):  # upb's limit of 100 message levels, as in onnxruntime's parser
            raise InputError(
                f"{path}: subgraphs nested deeper than protobuf parsers read (at most {MAX_SUBGRAPH_NESTING} "
                "inside one another; onnx and onnxruntime cannot load it either)"
            ) from None
        raise InputError(_not_onnx(path) or f"{path}: not a valid ONNX protobuf ({_first_line(err)})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise InputError(f"{path}: not an ONNX model (no graph or no ir_version)")
    try:
        _check_text(proto, "model")
        return from_proto(proto, base_dir=path.parent, independent_dims=independent_dims, model_file=path)
    except (InputError, ir.GraphError) as err:
        raise InputError(f"{path}: {err}") from None


def external_locations(path: Path) -> set[str]:
    """The external data locations the ONNX file at ``path`` names, read without its tensor
    data (large inline weights are mapped, not read); empty for a file that is not a model."""
    proto = onnx.ModelProto()
    try:
        payload = wire.split_inline_weights(path)
        proto.ParseFromString(path.read_bytes() if payload is None else payload)
    except (OSError, DecodeError, RuntimeError, ValueError, IndexError):
        return set()
    tensors: list[onnx.TensorProto] = []
    graphs = [proto.graph]
    nodes = [n for f in proto.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            tensors += [*graph.initializer, *(t for s in graph.sparse_initializer for t in (s.values, s.indices))]
            nodes += graph.node
        for node in nodes:
            for attr in node.attribute:
                sparse = [attr.sparse_tensor, *attr.sparse_tensors]
                tensors += [attr.t, *attr.tensors, *(t for s in sparse for t in (s.values, s.indices))]
                graphs += [attr.g, *attr.graphs]
        nodes = []
    locations: set[str] = set()
    for tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            if wire.INLINE_KEY not in entries and entries.get("location"):
                locations.add(entries["location"])
    return locations


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return bounded(text[0]) if text else type(err).__name__


@functools.cache
def _text_fields(descriptor: Any) -> tuple[frozenset[str], frozenset[str]]:
    """The names of a message type's string fields and of its message fields."""
    strings = {f.name for f in descriptor.fields if f.type == f.TYPE_STRING}
    messages = {f.name for f in descriptor.fields if f.type == f.TYPE_MESSAGE}
    return frozenset(strings), frozenset(messages)


def _check_text(message: Any, where: str) -> None:
    """Every string field is valid UTF-8 (protobuf hands invalid ones over as bytes, which
    would fail much later, at save): raise InputError naming the first that is not."""
    strings, messages = _text_fields(message.DESCRIPTOR)
    for field, value in message.ListFields():
        items = value if field.is_repeated else [value]
        if field.name in strings:
            for i, text in enumerate(items):
                if not isinstance(text, str):
                    index = f"[{i}]" if field.is_repeated else ""
                    raise InputError(f"{where}: field {field.name}{index} is not valid UTF-8 ({bytes(text[:40])!r})")
        elif field.name in messages:
            for item in items:
                _check_text(item, f"{where} > {field.name}{_message_label(item)}")


def _message_label(message: Any) -> str:
    name = getattr(message, "name", "")
    return f" {name!r}" if isinstance(name, str) and name else ""


def from_proto(
    proto: onnx.ModelProto,
    *,
    base_dir: Path | None = None,
    independent_dims: bool = False,
    model_file: Path | None = None,
) -> ir.Model:
    """The IR of ``proto``; external data is read from ``base_dir`` (``model_file``, the
    file the proto came from, holds the weights io/wire.py left inline); a tensor stored
    as external data is bad input without it."""
    reader = _Reader(base_dir, independent_dims, model_file)
    graph = reader.graph(proto.graph, [])
    graph.topological()  # a cycle is bad input, found now rather than in a pass
    if reader.negative_dims:
        name, dim = reader.negative_dims[0]
        more = f" (and {len(reader.negative_dims) - 1} more)" if len(reader.negative_dims) > 1 else ""
        # Named by its file where there is one: `inspect A B` and the CI gate read several models.
        where = f"{model_file}: " if model_file is not None else ""
        _log.warning("%svalue %r declares dim %d%s: read as an unknown dim", where, name, dim, more)
    model = ir.Model(
        graph=graph,
        opset_imports={o.domain: o.version for o in proto.opset_import},
        **{name: getattr(proto, name) for name in MODEL_HEADER},
        metadata_props={p.key: p.value for p in proto.metadata_props},
        functions=[reader.function(f) for f in proto.functions],
    )
    for field_name in ("training_info", "configuration"):
        items = getattr(proto, field_name)
        if len(items):
            model.opaque_fields[field_name] = [item.SerializeToString() for item in items]
    return model


class _Reader:
    def __init__(self, base_dir: Path | None, independent_dims: bool, model_file: Path | None = None) -> None:
        self.base_dir = base_dir
        self.independent_dims = independent_dims
        self.model_file = model_file
        self.uids = itertools.count(1)
        # Declared dims below zero, read as unknown: (value name, dim).
        self.negative_dims: list[tuple[str, int]] = []
        self.annotating = ""

    # types
    def dim(self, proto: onnx.TensorShapeProto.Dimension) -> ir.Dim:
        which = proto.WhichOneof("value")
        if which == "dim_value":
            if proto.dim_value < 0:
                # onnx's checker lets a negative dim pass; no tensor has one, so it says nothing.
                self.negative_dims.append((self.annotating, int(proto.dim_value)))
                return None
            return int(proto.dim_value)
        if which == "dim_param":
            dim = ir.parse_dim(proto.dim_param)
            if self.independent_dims and isinstance(dim, ir.Sym):
                return ir.Sym(dim.name, next(self.uids))
            return dim
        return None

    def type(self, proto: onnx.TypeProto) -> ir.Type | None:
        which = proto.WhichOneof("value")
        denotation = proto.denotation
        if which == "tensor_type" or which == "sparse_tensor_type":
            tensor = proto.tensor_type if which == "tensor_type" else proto.sparse_tensor_type
            shape = tuple(self.dim(d) for d in tensor.shape.dim) if tensor.HasField("shape") else None
            dtype = _dtype(tensor.elem_type, "a value type")
            cls = ir.TensorType if which == "tensor_type" else ir.SparseTensorType
            return cls(dtype, shape, denotation)
        if which == "sequence_type":
            return ir.SequenceType(self.type(proto.sequence_type.elem_type), denotation)
        if which == "map_type":
            key = _dtype(proto.map_type.key_type, "a map key")
            return ir.MapType(key, self.type(proto.map_type.value_type), denotation)
        if which == "optional_type":
            return ir.OptionalType(self.type(proto.optional_type.elem_type), denotation)
        if which == "opaque_type":
            return ir.OpaqueType(proto.opaque_type.domain, proto.opaque_type.name, denotation)
        return None

    # tensors
    def tensor(self, proto: onnx.TensorProto) -> ir.Tensor:
        dtype = _dtype(proto.data_type, f"tensor {proto.name!r}")
        shape = tuple(int(d) for d in proto.dims)
        if any(d < 0 for d in shape):
            raise InputError(f"tensor {proto.name!r} has a negative dimension {shape}")
        source: Any
        if proto.data_location == onnx.TensorProto.EXTERNAL:
            source = self.external(proto, dtype, shape)
        else:
            _check_inline_size(proto, dtype, shape)
            source = ProtoSource(proto)
        return ir.Tensor(
            proto.name,
            dtype,
            shape,
            source,
            doc_string=proto.doc_string,
            metadata_props={p.key: p.value for p in proto.metadata_props},
        )

    def external(self, proto: onnx.TensorProto, dtype: ir.DataType, shape: tuple[int, ...]) -> ir.ExternalSource:
        """A tensor's bytes in another file, under onnx's rules (see io/external.py): inside
        the model's folder, offset and length non-negative and within the file, and the
        length exactly what the shape needs."""
        info = {e.key: e.value for e in proto.external_data}
        what = f"tensor {proto.name!r}"
        inline = wire.INLINE_KEY in info
        location = info.get("location", "")
        if inline and self.model_file is not None and location == self.model_file.name:
            file = self.model_file  # weights io/wire.py left in the model file itself
        elif self.base_dir is None:  # the working folder may hold a file of that name, not the model's
            raise InputError(
                f"{what} is stored as external data ({location!r}) and the model's folder is not known:"
                " give base_dir (the folder of the model file), or load it with its external data"
            )
        else:
            inline = False
            file = external_file(self.base_dir, location, f"{what}: external data file")
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
        except ValueError:
            raise InputError(f"{what}: external data offset or length is not a number") from None
        needed = (math.prod(shape) * dtype.itemsize_bits + 7) // 8
        for key, number in (("offset", offset), ("length", length)):
            if number is not None and number < 0:
                raise InputError(f"{what}: external data {key} {number} is negative")
        if length is not None and length != needed:
            raise InputError(f"{what}: external data length {length} is not the {needed} bytes its shape {shape} needs")
        if offset + needed > file.stat().st_size:
            raise InputError(f"{what}: external data file {str(file)!r} is too short")
        return ir.ExternalSource(file, offset, length, dtype, shape, inline=inline)

    def sparse(self, proto: onnx.SparseTensorProto) -> ir.SparseTensor:
        return ir.SparseTensor(self.tensor(proto.values), self.tensor(proto.indices), tuple(proto.dims))

    # attributes
    def attribute(self, proto: onnx.AttributeProto, scope: Scope) -> ir.Attr:
        kind = ir.AttrKind(proto.type) if proto.type else _infer_attr_kind(proto)
        value: Any
        if proto.ref_attr_name:
            value = None
        elif kind == ir.AttrKind.FLOAT:
            value = float(proto.f)
        elif kind == ir.AttrKind.INT:
            value = int(proto.i)
        elif kind == ir.AttrKind.STRING:
            value = bytes(proto.s)
        elif kind == ir.AttrKind.TENSOR:
            value = self.tensor(proto.t)
        elif kind == ir.AttrKind.GRAPH:
            value = self.graph(proto.g, scope)
        elif kind == ir.AttrKind.SPARSE_TENSOR:
            value = self.sparse(proto.sparse_tensor)
        elif kind == ir.AttrKind.TYPE_PROTO:
            value = self.type(proto.tp)
        elif kind == ir.AttrKind.FLOATS:
            value = [float(x) for x in proto.floats]
        elif kind == ir.AttrKind.INTS:
            value = [int(x) for x in proto.ints]
        elif kind == ir.AttrKind.STRINGS:
            value = [bytes(x) for x in proto.strings]
        elif kind == ir.AttrKind.TENSORS:
            value = [self.tensor(t) for t in proto.tensors]
        elif kind == ir.AttrKind.GRAPHS:
            value = [self.graph(g, scope) for g in proto.graphs]
        elif kind == ir.AttrKind.SPARSE_TENSORS:
            value = [self.sparse(t) for t in proto.sparse_tensors]
        elif kind == ir.AttrKind.TYPE_PROTOS:
            value = [self.type(t) for t in proto.type_protos]
        else:
            value = None
        return ir.Attr(proto.name, kind, value, proto.ref_attr_name, proto.doc_string)

    # graphs
    def graph(self, proto: onnx.GraphProto, scope: Scope) -> ir.Graph:
        where = f"graph {proto.name!r}" if proto.name else "the graph"
        initializers = [self._initializer(t) for t in proto.initializer]
        initializers += [self._sparse_initializer(t) for t in proto.sparse_initializer]
        nodes = [
            NodeEntry(
                p.op_type,
                p.input,
                p.output,
                functools.partial(self._attributes, p),
                label=f"{where}: node {p.name or p.op_type!r}",
                domain=p.domain,
                name=p.name,
                overload=p.overload,
                doc_string=p.doc_string,
                metadata_props={m.key: m.value for m in p.metadata_props},
            )
            for p in proto.node
        ]
        graph, _ = build_graph(
            scope,
            name=proto.name,
            where=where,
            initializers=initializers,
            inputs=[(vi.name, functools.partial(self._annotate, vi=vi)) for vi in proto.input],
            nodes=nodes,
            annotations={vi.name: functools.partial(self._annotate, vi=vi, declares=True) for vi in proto.value_info},
            outputs=[(vi.name, functools.partial(self._annotate, vi=vi)) for vi in proto.output],
        )
        graph.doc_string = proto.doc_string
        graph.metadata_props = {p.key: p.value for p in proto.metadata_props}
        graph.quantization_annotation = [
            (a.tensor_name, {p.key: p.value for p in a.quant_parameter_tensor_names})
            for a in proto.quantization_annotation
        ]
        return graph

    def _initializer(self, proto: onnx.TensorProto) -> ir.Value:
        tensor = self.tensor(proto)
        return ir.Value(tensor.name, ir.TensorType(tensor.dtype, tensor.shape), tensor)

    def _sparse_initializer(self, proto: onnx.SparseTensorProto) -> ir.Value:
        sparse = self.sparse(proto)
        return ir.Value(sparse.name, ir.SparseTensorType(sparse.values.dtype, sparse.dims), sparse)

    def _attributes(self, proto: onnx.NodeProto, scope: Scope) -> list[ir.Attr]:
        return [self.attribute(a, scope) for a in proto.attribute]

    def _annotate(self, value: ir.Value, vi: onnx.ValueInfoProto, declares: bool = False) -> None:
        """``vi``'s type, doc and metadata on ``value``; ``declares``: a value_info entry, whose type the
        writer declares again where it still holds (Value.declared)."""
        self.annotating = vi.name
        if vi.HasField("type"):
            found = self.type(vi.type)
            value.type = found or value.type
            if declares:
                value.declared = found
        value.doc_string = vi.doc_string or value.doc_string
        value.metadata_props.update({p.key: p.value for p in vi.metadata_props})

    def function(self, proto: onnx.FunctionProto) -> ir.Function:
        body_proto = onnx.GraphProto(node=proto.node, value_info=proto.value_info, name=proto.name)
        body_proto.input.extend(onnx.ValueInfoProto(name=n) for n in proto.input)
        body_proto.output.extend(onnx.ValueInfoProto(name=n) for n in proto.output)
        body = self.graph(body_proto, [])
        return ir.Function(
            domain=proto.domain,
            name=proto.name,
            body=body,
            attributes=list(proto.attribute),
            attribute_defaults={a.name: self.attribute(a, []) for a in proto.attribute_proto},
            opset_imports={o.domain: o.version for o in proto.opset_import},
            overload=proto.overload,
            doc_string=proto.doc_string,
            metadata_props={p.key: p.value for p in proto.metadata_props},
        )


def _check_inline_size(proto: onnx.TensorProto, dtype: ir.DataType, shape: tuple[int, ...]) -> None:
    """Data that does not fit the declared shape is bad input, found now rather than when a pass reads it."""
    if proto.HasField("raw_data") and dtype != ir.DataType.STRING:
        needed = (math.prod(shape) * dtype.itemsize_bits + 7) // 8
        if len(proto.raw_data) != needed:
            raise InputError(f"tensor {proto.name!r} of shape {shape} holds {len(proto.raw_data)} bytes, not {needed}")
    elif math.prod(shape) and not any(len(getattr(proto, name)) for name in TYPED_FIELDS):
        raise InputError(f"tensor {proto.name!r} of shape {shape} holds no data")


def _dtype(code: int, what: str) -> ir.DataType:
    try:
        return ir.DataType(code)
    except ValueError:
        raise InputError(f"{what} has an unknown element type {code}") from None


_ATTR_FIELDS = [
    ("graphs", ir.AttrKind.GRAPHS),
    ("tensors", ir.AttrKind.TENSORS),
    ("sparse_tensors", ir.AttrKind.SPARSE_TENSORS),
    ("type_protos", ir.AttrKind.TYPE_PROTOS),
    ("strings", ir.AttrKind.STRINGS),
    ("ints", ir.AttrKind.INTS),
    ("floats", ir.AttrKind.FLOATS),
]


def _infer_attr_kind(proto: onnx.AttributeProto) -> ir.AttrKind:
    for single, kind in [
        ("g", ir.AttrKind.GRAPH),
        ("t", ir.AttrKind.TENSOR),
        ("sparse_tensor", ir.AttrKind.SPARSE_TENSOR),
        ("tp", ir.AttrKind.TYPE_PROTO),
    ]:
        if proto.HasField(single):
            return kind
    for repeated, kind in _ATTR_FIELDS:
        if len(getattr(proto, repeated)):
            return kind
    for single, kind in [("s", ir.AttrKind.STRING), ("i", ir.AttrKind.INT), ("f", ir.AttrKind.FLOAT)]:
        if proto.HasField(single):
            return kind
    return ir.AttrKind.UNDEFINED
