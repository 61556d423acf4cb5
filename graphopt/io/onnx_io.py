"""ONNX protobuf <-> IR. The only module (with json_io) that knows the file formats.

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

import functools
import hashlib
import io
import itertools
import logging
import math
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from graphopt.errors import InputError, bounded
from graphopt.files import temporary_file
from graphopt.io import wire
from graphopt.io.builder import NodeEntry, Scope, build_graph
from graphopt.io.external import external_file
from graphopt.ir import (
    Attr,
    AttrKind,
    DataType,
    Dim,
    ExternalSource,
    Function,
    Graph,
    GraphError,
    MapType,
    Model,
    Node,
    OpaqueType,
    OptionalType,
    SequenceType,
    SparseTensor,
    SparseTensorType,
    Sym,
    Tensor,
    TensorType,
    Type,
    Value,
    parse_dim,
)

__all__ = [
    "MAX_SUBGRAPH_NESTING",
    "ProtoSource",
    "all_tensors",
    "content_addressed_name",
    "digest",
    "external_locations",
    "from_proto",
    "is_data_file_of",
    "load",
    "raw_buffer",
    "save",
    "to_proto",
]

_log = logging.getLogger(__name__)

# Tensors at least this large go to the external-data file when one is written.
EXTERNAL_THRESHOLD = 1024
# Protobuf parsers (upb in Python, onnxruntime's C++) read 100 message levels: a model and
# its graph take two, each subgraph three more (node, attribute, graph), and a value's type
# in the innermost graph five (value info, type, tensor type, shape, dim): 2 + 3 * 31 + 5.
MAX_SUBGRAPH_NESTING = 31
# Above this many tensor bytes a model cannot be one protobuf message.
PROTOBUF_LIMIT = 2**31 - 2**26


@dataclass
class ProtoSource:
    """Values still inside the TensorProto they were parsed from."""

    proto: onnx.TensorProto

    def read(self) -> np.ndarray:
        return numpy_helper.to_array(self.proto)


# -- loading ------------------------------------------------------------------------------


def load(path: str | os.PathLike[str], *, independent_dims: bool = False) -> Model:
    """Read an ONNX file. External data is mapped, not read. Raises InputError on bad input."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
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
        raise InputError(f"{path}: not a valid ONNX protobuf ({_first_line(err)})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise InputError(f"{path}: not an ONNX model (no graph or no ir_version)")
    try:
        _check_text(proto, "model")
        return from_proto(proto, base_dir=path.parent, independent_dims=independent_dims, model_file=path)
    except (InputError, GraphError) as err:
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
) -> Model:
    """The IR of ``proto``; external data is read from ``base_dir`` (``model_file``, the
    file the proto came from, holds the weights io/wire.py left inline)."""
    reader = _Reader(base_dir or Path.cwd(), independent_dims, model_file)
    graph = reader.graph(proto.graph, [])
    graph.topological()  # a cycle is bad input, found now rather than in a pass
    if reader.negative_dims:
        name, dim = reader.negative_dims[0]
        more = f" (and {len(reader.negative_dims) - 1} more)" if len(reader.negative_dims) > 1 else ""
        _log.warning("value %r declares dim %d%s: read as an unknown dim", name, dim, more)
    model = Model(
        graph=graph,
        opset_imports={o.domain: o.version for o in proto.opset_import},
        ir_version=proto.ir_version,
        producer_name=proto.producer_name,
        producer_version=proto.producer_version,
        domain=proto.domain,
        model_version=proto.model_version,
        doc_string=proto.doc_string,
        metadata_props={p.key: p.value for p in proto.metadata_props},
        functions=[reader.function(f) for f in proto.functions],
    )
    for field_name in ("training_info", "configuration"):
        items = getattr(proto, field_name)
        if len(items):
            model.opaque_fields[field_name] = [item.SerializeToString() for item in items]
    return model


class _Reader:
    def __init__(self, base_dir: Path, independent_dims: bool, model_file: Path | None = None) -> None:
        self.base_dir = base_dir
        self.independent_dims = independent_dims
        self.model_file = model_file
        self.uids = itertools.count(1)
        # Declared dims below zero, read as unknown: (value name, dim).
        self.negative_dims: list[tuple[str, int]] = []
        self.annotating = ""

    # types
    def dim(self, proto: onnx.TensorShapeProto.Dimension) -> Dim:
        which = proto.WhichOneof("value")
        if which == "dim_value":
            if proto.dim_value < 0:
                # onnx's checker lets a negative dim pass; no tensor has one, so it says nothing.
                self.negative_dims.append((self.annotating, int(proto.dim_value)))
                return None
            return int(proto.dim_value)
        if which == "dim_param":
            dim = parse_dim(proto.dim_param)
            if self.independent_dims and isinstance(dim, Sym):
                return Sym(dim.name, next(self.uids))
            return dim
        return None

    def type(self, proto: onnx.TypeProto) -> Type | None:
        which = proto.WhichOneof("value")
        denotation = proto.denotation
        if which == "tensor_type" or which == "sparse_tensor_type":
            tensor = proto.tensor_type if which == "tensor_type" else proto.sparse_tensor_type
            shape = tuple(self.dim(d) for d in tensor.shape.dim) if tensor.HasField("shape") else None
            dtype = _dtype(tensor.elem_type, "a value type")
            cls = TensorType if which == "tensor_type" else SparseTensorType
            return cls(dtype, shape, denotation)
        if which == "sequence_type":
            return SequenceType(self.type(proto.sequence_type.elem_type), denotation)
        if which == "map_type":
            key = _dtype(proto.map_type.key_type, "a map key")
            return MapType(key, self.type(proto.map_type.value_type), denotation)
        if which == "optional_type":
            return OptionalType(self.type(proto.optional_type.elem_type), denotation)
        if which == "opaque_type":
            return OpaqueType(proto.opaque_type.domain, proto.opaque_type.name, denotation)
        return None

    # tensors
    def tensor(self, proto: onnx.TensorProto) -> Tensor:
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
        return Tensor(
            proto.name,
            dtype,
            shape,
            source,
            doc_string=proto.doc_string,
            metadata_props={p.key: p.value for p in proto.metadata_props},
        )

    def external(self, proto: onnx.TensorProto, dtype: DataType, shape: tuple[int, ...]) -> ExternalSource:
        """A tensor's bytes in another file, under onnx's rules (see io/external.py): inside
        the model's folder, offset and length non-negative and within the file, and the
        length exactly what the shape needs."""
        info = {e.key: e.value for e in proto.external_data}
        what = f"tensor {proto.name!r}"
        inline = wire.INLINE_KEY in info
        location = info.get("location", "")
        if inline and self.model_file is not None and location == self.model_file.name:
            file = self.model_file  # weights io/wire.py left in the model file itself
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
        return ExternalSource(file, offset, length, dtype, shape, inline=inline)

    def sparse(self, proto: onnx.SparseTensorProto) -> SparseTensor:
        return SparseTensor(self.tensor(proto.values), self.tensor(proto.indices), tuple(proto.dims))

    # attributes
    def attribute(self, proto: onnx.AttributeProto, scope: Scope) -> Attr:
        kind = AttrKind(proto.type) if proto.type else _infer_attr_kind(proto)
        value: Any
        if proto.ref_attr_name:
            value = None
        elif kind == AttrKind.FLOAT:
            value = float(proto.f)
        elif kind == AttrKind.INT:
            value = int(proto.i)
        elif kind == AttrKind.STRING:
            value = bytes(proto.s)
        elif kind == AttrKind.TENSOR:
            value = self.tensor(proto.t)
        elif kind == AttrKind.GRAPH:
            value = self.graph(proto.g, scope)
        elif kind == AttrKind.SPARSE_TENSOR:
            value = self.sparse(proto.sparse_tensor)
        elif kind == AttrKind.TYPE_PROTO:
            value = self.type(proto.tp)
        elif kind == AttrKind.FLOATS:
            value = [float(x) for x in proto.floats]
        elif kind == AttrKind.INTS:
            value = [int(x) for x in proto.ints]
        elif kind == AttrKind.STRINGS:
            value = [bytes(x) for x in proto.strings]
        elif kind == AttrKind.TENSORS:
            value = [self.tensor(t) for t in proto.tensors]
        elif kind == AttrKind.GRAPHS:
            value = [self.graph(g, scope) for g in proto.graphs]
        elif kind == AttrKind.SPARSE_TENSORS:
            value = [self.sparse(t) for t in proto.sparse_tensors]
        elif kind == AttrKind.TYPE_PROTOS:
            value = [self.type(t) for t in proto.type_protos]
        else:
            value = None
        return Attr(proto.name, kind, value, proto.ref_attr_name, proto.doc_string)

    # graphs
    def graph(self, proto: onnx.GraphProto, scope: Scope) -> Graph:
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
            annotations={vi.name: functools.partial(self._annotate, vi=vi) for vi in proto.value_info},
            outputs=[(vi.name, functools.partial(self._annotate, vi=vi)) for vi in proto.output],
        )
        graph.doc_string = proto.doc_string
        graph.metadata_props = {p.key: p.value for p in proto.metadata_props}
        graph.quantization_annotation = [
            (a.tensor_name, {p.key: p.value for p in a.quant_parameter_tensor_names})
            for a in proto.quantization_annotation
        ]
        return graph

    def _initializer(self, proto: onnx.TensorProto) -> Value:
        tensor = self.tensor(proto)
        return Value(tensor.name, TensorType(tensor.dtype, tensor.shape), tensor)

    def _sparse_initializer(self, proto: onnx.SparseTensorProto) -> Value:
        sparse = self.sparse(proto)
        return Value(sparse.name, SparseTensorType(sparse.values.dtype, sparse.dims), sparse)

    def _attributes(self, proto: onnx.NodeProto, scope: Scope) -> list[Attr]:
        return [self.attribute(a, scope) for a in proto.attribute]

    def _annotate(self, value: Value, vi: onnx.ValueInfoProto) -> None:
        self.annotating = vi.name
        if vi.HasField("type"):
            value.type = self.type(vi.type) or value.type
        value.doc_string = vi.doc_string or value.doc_string
        value.metadata_props.update({p.key: p.value for p in vi.metadata_props})

    def function(self, proto: onnx.FunctionProto) -> Function:
        body_proto = onnx.GraphProto(node=proto.node, value_info=proto.value_info, name=proto.name)
        body_proto.input.extend(onnx.ValueInfoProto(name=n) for n in proto.input)
        body_proto.output.extend(onnx.ValueInfoProto(name=n) for n in proto.output)
        body = self.graph(body_proto, [])
        return Function(
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


_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _check_inline_size(proto: onnx.TensorProto, dtype: DataType, shape: tuple[int, ...]) -> None:
    """Data that does not fit the declared shape is bad input, found now rather than when a pass reads it."""
    if proto.HasField("raw_data") and dtype != DataType.STRING:
        needed = (math.prod(shape) * dtype.itemsize_bits + 7) // 8
        if len(proto.raw_data) != needed:
            raise InputError(f"tensor {proto.name!r} of shape {shape} holds {len(proto.raw_data)} bytes, not {needed}")
    elif math.prod(shape) and not any(len(getattr(proto, name)) for name in _TYPED_FIELDS):
        raise InputError(f"tensor {proto.name!r} of shape {shape} holds no data")


def _dtype(code: int, what: str) -> DataType:
    try:
        return DataType(code)
    except ValueError:
        raise InputError(f"{what} has an unknown element type {code}") from None


_ATTR_FIELDS = [
    ("graphs", AttrKind.GRAPHS),
    ("tensors", AttrKind.TENSORS),
    ("sparse_tensors", AttrKind.SPARSE_TENSORS),
    ("type_protos", AttrKind.TYPE_PROTOS),
    ("strings", AttrKind.STRINGS),
    ("ints", AttrKind.INTS),
    ("floats", AttrKind.FLOATS),
]


def _infer_attr_kind(proto: onnx.AttributeProto) -> AttrKind:
    for single, kind in [
        ("g", AttrKind.GRAPH),
        ("t", AttrKind.TENSOR),
        ("sparse_tensor", AttrKind.SPARSE_TENSOR),
        ("tp", AttrKind.TYPE_PROTO),
    ]:
        if proto.HasField(single):
            return kind
    for repeated, kind in _ATTR_FIELDS:
        if len(getattr(proto, repeated)):
            return kind
    for single, kind in [("s", AttrKind.STRING), ("i", AttrKind.INT), ("f", AttrKind.FLOAT)]:
        if proto.HasField(single):
            return kind
    return AttrKind.UNDEFINED


# -- saving -------------------------------------------------------------------------------


def save(
    model: Model,
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
        external_data = any(isinstance(t.source, ExternalSource) and not t.source.inline for t in tensors) or (
            sum(t.nbytes for t in tensors) > PROTOBUF_LIMIT
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = location or f"{path.name}.data"
    data_tmp: Path | None = None
    writer: _ExternalWriter | None = None
    if external_data:
        handle, data_tmp = temporary_file(path.parent, data_name)
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
    return _atomic_write_with(path, lambda out: out.write(payload))


class _HashingFile(io.RawIOBase):
    """A write-only file that also hashes what goes through it (with no file: hashes only)."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self.out = out
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)


def _atomic_write_with(path: Path, write: Callable[[BinaryIO], object]) -> str:
    """Write through ``write`` into a temporary file, rename it to ``path``; return its sha256."""
    handle, tmp = temporary_file(path.parent, path.name)
    try:
        with os.fdopen(handle, "wb") as out:
            hashing = _HashingFile(out)
            write(hashing)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hashing.digest.hexdigest()


def _write_streaming(out: BinaryIO, model: Model) -> None:
    """One protobuf message, its main-graph initializers streamed rather than held in memory."""
    writer = _Writer(None, stream=True)
    proto = to_proto(model, writer=writer)
    graph = proto.graph.SerializeToString()
    proto.ClearField("graph")
    wire.write_pieces(out, [proto.SerializeToString(), wire.Frame(wire.MODEL_GRAPH, [graph, *writer.streamed])])


def _atomic_write_streaming(path: Path, model: Model) -> str:
    return _atomic_write_with(path, lambda out: _write_streaming(out, model))


def digest(model: Model) -> str:
    """sha256 of the bytes ``save`` would write as one file, computed without holding them."""
    sink = _HashingFile()
    _write_streaming(sink, model)  # type: ignore[arg-type]
    return sink.digest.hexdigest()


def all_tensors(model: Model) -> Iterable[Tensor]:
    """Every dense tensor of the model: initializers (sparse ones as values and indices) and tensor attributes."""
    for graph in model.all_graphs():
        for value in graph.initializers.values():
            if isinstance(value.const, Tensor):
                yield value.const
            elif isinstance(value.const, SparseTensor):
                yield value.const.values
                yield value.const.indices
        for node in graph:
            for attr in node.attributes.values():
                if attr.kind == AttrKind.TENSOR and attr.value is not None:
                    yield attr.value
                elif attr.kind == AttrKind.TENSORS:
                    yield from attr.value


class _ExternalWriter:
    """Appends tensor bytes to one data file, aligned, chunk by chunk."""

    def __init__(self, file: Path, location: str) -> None:
        self.location = location
        self.file = file.open("wb")
        self.out = _HashingFile(self.file)  # type: ignore[arg-type]
        self.digest = self.out.digest
        self.offset = 0
        # The tensors whose bytes went in, for relocate().
        self.protos: list[onnx.TensorProto] = []

    def write(self, tensor: Tensor, proto: onnx.TensorProto) -> None:
        aligned = (self.offset + 4095) // 4096 * 4096
        self.out.write(b"\0" * (aligned - self.offset))
        start = aligned
        if isinstance(tensor.source, ExternalSource):
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


def raw_buffer(tensor: Tensor) -> memoryview:
    """The tensor's bytes as ONNX raw_data holds them (4-bit types packed), without a copy
    where possible. Not for string tensors, which have no raw form."""
    source = tensor.source
    if isinstance(source, ProtoSource) and source.proto.HasField("raw_data"):
        return memoryview(source.proto.raw_data)
    if isinstance(source, ExternalSource):
        return memoryview(source.raw())
    array = source.read()
    if _raw_layout(tensor) and array.dtype != np.dtype(object):
        return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(_tensor_proto_from_array(tensor, array).raw_data)


def _streams_from_array(tensor: Tensor) -> bool:
    return not isinstance(tensor.source, ProtoSource) and _raw_layout(tensor)


def _streamable_attribute(attr: Attr) -> bool:
    """A tensor attribute worth streaming: large, and not already bytes in a parsed proto."""
    value = attr.value
    return (
        attr.kind == AttrKind.TENSOR
        and isinstance(value, Tensor)
        and value.nbytes >= wire.SPLIT_THRESHOLD
        and (isinstance(value.source, ExternalSource) or _streams_from_array(value))
    )


def _raw_layout(tensor: Tensor) -> bool:
    """Whether raw_data is the array's memory as numpy holds it (not strings, not packed 4-bit)."""
    return tensor.dtype != DataType.STRING and tensor.dtype.itemsize_bits % 8 == 0


def _tensor_proto_from_array(tensor: Tensor, array: np.ndarray) -> onnx.TensorProto:
    if not _raw_layout(tensor) or array.dtype == np.dtype(object):
        proto = numpy_helper.from_array(array, tensor.name)
        proto.data_type = int(tensor.dtype)
        return proto
    proto = onnx.TensorProto(name=tensor.name, data_type=int(tensor.dtype), dims=list(tensor.shape))
    proto.raw_data = np.ascontiguousarray(array).tobytes()
    return proto


def to_proto(
    model: Model, external: _ExternalWriter | None = None, *, writer: _Writer | None = None
) -> onnx.ModelProto:
    """The model as one ModelProto (tensor data included unless ``external`` or ``writer`` take it)."""
    writer = writer or _Writer(external)
    proto = onnx.ModelProto(
        **_given(
            ir_version=model.ir_version,
            producer_name=model.producer_name,
            producer_version=model.producer_version,
            domain=model.domain,
            model_version=model.model_version,
            doc_string=model.doc_string,
        )
    )
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


def _set(proto: Any, **fields: Any) -> None:
    for key, value in _given(**fields).items():
        setattr(proto, key, value)


def _props(container: Any, props: dict[str, str]) -> None:
    for key, value in props.items():
        container.add(key=key, value=value)


def _format_dim(dim: Dim, proto: onnx.TensorShapeProto.Dimension) -> None:
    if isinstance(dim, int):
        proto.dim_value = dim
    elif dim is not None:
        proto.dim_param = str(dim)


class _Writer:
    def __init__(self, external: _ExternalWriter | None, *, stream: bool = False) -> None:
        self.external = external
        # With ``stream``, the main graph's nodes and dense initializers are collected here as
        # pieces for io/wire.py to write, their weights copied in chunks, instead of being
        # put into the GraphProto.
        self.stream = stream
        self.streamed: list[wire.Piece] = []

    def type(self, value_type: Type | None, proto: onnx.TypeProto) -> None:
        if value_type is None:
            return
        if value_type.denotation:
            proto.denotation = value_type.denotation
        if isinstance(value_type, (TensorType, SparseTensorType)):
            tensor = proto.tensor_type if isinstance(value_type, TensorType) else proto.sparse_tensor_type
            tensor.elem_type = int(value_type.dtype)
            if value_type.shape is not None:
                tensor.shape.SetInParent()
                for dim in value_type.shape:
                    _format_dim(dim, tensor.shape.dim.add())
        elif isinstance(value_type, SequenceType):
            proto.sequence_type.SetInParent()
            self.type(value_type.element, proto.sequence_type.elem_type)
        elif isinstance(value_type, MapType):
            proto.map_type.key_type = int(value_type.key)
            self.type(value_type.value, proto.map_type.value_type)
        elif isinstance(value_type, OptionalType):
            proto.optional_type.SetInParent()
            self.type(value_type.element, proto.optional_type.elem_type)
        elif isinstance(value_type, OpaqueType):
            proto.opaque_type.SetInParent()
            proto.opaque_type.domain = value_type.domain
            proto.opaque_type.name = value_type.name

    # Every method fills a message in place: building sub-messages and copying them into
    # their parents would copy each weight once per level of nesting.
    def value_info(self, value: Value, proto: onnx.ValueInfoProto) -> None:
        _set(proto, name=value.name, doc_string=value.doc_string)
        if value.type is not None:
            self.type(value.type, proto.type)
        _props(proto.metadata_props, value.metadata_props)

    def tensor(self, tensor: Tensor, proto: onnx.TensorProto, allow_external: bool = True) -> None:
        source = tensor.source
        if isinstance(source, ProtoSource):
            proto.CopyFrom(source.proto)
            proto.name = tensor.name
            del proto.metadata_props[:]
        elif isinstance(source, ExternalSource):
            _set(proto, name=tensor.name, data_type=int(tensor.dtype))
            proto.dims.extend(tensor.shape)
        else:
            proto.CopyFrom(_tensor_proto_from_array(tensor, source.read()))
        if tensor.doc_string:
            proto.doc_string = tensor.doc_string
        _props(proto.metadata_props, tensor.metadata_props)
        if (
            allow_external
            and self.external is not None
            and tensor.dtype != DataType.STRING
            and tensor.nbytes >= EXTERNAL_THRESHOLD
        ):
            _clear_data_fields(proto)
            self.external.write(tensor, proto)
        elif isinstance(source, ExternalSource):
            proto.raw_data = source.raw()

    def tensor_piece(self, number: int, name: str, tensor: Tensor) -> wire.Piece:
        """The tensor as field ``number``: a data-less header, then its bytes in chunks."""
        source = tensor.source
        header = onnx.TensorProto(name=name, data_type=int(tensor.dtype), dims=list(tensor.shape))
        if tensor.doc_string:
            header.doc_string = tensor.doc_string
        _props(header.metadata_props, tensor.metadata_props)
        if isinstance(source, ExternalSource):
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

    def node_piece(self, node: Node) -> wire.Piece:
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

    def sparse(self, sparse: SparseTensor, proto: onnx.SparseTensorProto) -> None:
        proto.dims.extend(sparse.dims)
        self.tensor(sparse.values, proto.values)
        self.tensor(sparse.indices, proto.indices)

    def attribute(self, attr: Attr, proto: onnx.AttributeProto) -> None:
        _set(proto, name=attr.name, type=int(attr.kind), doc_string=attr.doc_string)
        if attr.ref_attr_name:
            proto.ref_attr_name = attr.ref_attr_name
            return
        kind, value = attr.kind, attr.value
        if kind == AttrKind.FLOAT:
            proto.f = value
        elif kind == AttrKind.INT:
            proto.i = value
        elif kind == AttrKind.STRING:
            proto.s = value
        elif kind == AttrKind.TENSOR:
            self.tensor(value, proto.t)
        elif kind == AttrKind.GRAPH:
            self.graph(value, proto.g)
        elif kind == AttrKind.SPARSE_TENSOR:
            self.sparse(value, proto.sparse_tensor)
        elif kind == AttrKind.TYPE_PROTO:
            self.type(value, proto.tp)
        elif kind == AttrKind.FLOATS:
            proto.floats.extend(value)
        elif kind == AttrKind.INTS:
            proto.ints.extend(value)
        elif kind == AttrKind.STRINGS:
            proto.strings.extend(value)
        elif kind == AttrKind.TENSORS:
            for item in value:
                self.tensor(item, proto.tensors.add())
        elif kind == AttrKind.GRAPHS:
            for item in value:
                self.graph(item, proto.graphs.add())
        elif kind == AttrKind.SPARSE_TENSORS:
            for item in value:
                self.sparse(item, proto.sparse_tensors.add())
        elif kind == AttrKind.TYPE_PROTOS:
            for item in value:
                self.type(item, proto.type_protos.add())

    def node(self, node: Node, proto: onnx.NodeProto, skip: Collection[str] = ()) -> None:
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        proto.input.extend(v.name if v is not None else "" for v in inputs)
        proto.output.extend(v.name for v in node.outputs)
        _set(
            proto,
            op_type=node.op_type,
            domain=node.domain,
            name=node.name,
            doc_string=node.doc_string,
            overload=node.overload,
        )
        for attr in node.attributes.values():
            if attr.name not in skip:
                self.attribute(attr, proto.attribute.add())
        _props(proto.metadata_props, node.metadata_props)

    def body(self, graph: Graph, nodes: Any, value_info: Any, *, streamed: bool = False) -> None:
        """A graph's nodes (in topological order; with ``streamed``, as pieces) and the
        value_info of its intermediate values."""
        order = graph.topological()
        for node in order:
            if streamed:
                self.streamed.append(self.node_piece(node))
            else:
                self.node(node, nodes.add())
        boundary = {id(v) for v in [*graph.inputs, *graph.outputs]}
        for node in order:
            for value in node.outputs:
                if (
                    value.name
                    and id(value) not in boundary
                    and (value.type is not None or value.doc_string or value.metadata_props)
                ):
                    self.value_info(value, value_info.add())

    def graph(self, graph: Graph, proto: onnx.GraphProto, *, main: bool = False) -> None:
        _set(proto, name=graph.name, doc_string=graph.doc_string)
        initializers: list[wire.Piece] = []
        for value in graph.initializers.values():
            if isinstance(value.const, SparseTensor):
                self.sparse(value.const, proto.sparse_initializer.add())
            elif isinstance(value.const, Tensor) and main and self.stream:
                initializers.append(self.tensor_piece(wire.GRAPH_INITIALIZER, value.name, value.const))
            elif isinstance(value.const, Tensor):
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

    def function(self, function: Function, proto: onnx.FunctionProto) -> None:
        proto.input.extend(v.name for v in function.body.inputs)
        proto.output.extend(v.name for v in function.body.outputs)
        proto.attribute.extend(function.attributes)
        self.body(function.body, proto.node, proto.value_info)
        _set(
            proto,
            domain=function.domain,
            name=function.name,
            doc_string=function.doc_string,
            overload=function.overload,
        )
        for attr in function.attribute_defaults.values():
            self.attribute(attr, proto.attribute_proto.add())
        for domain, version in function.opset_imports.items():
            proto.opset_import.add(domain=domain, version=version)
        _props(proto.metadata_props, function.metadata_props)


def _clear_data_fields(proto: onnx.TensorProto) -> None:
    for name in _TYPED_FIELDS:
        proto.ClearField(name)  # type: ignore[arg-type]
    proto.ClearField("raw_data")
    del proto.external_data[:]
