"""IR -> JSON graph: the writer (graphopt.io.json_io reads; its docstring describes the format)."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from graphopt import ir
from graphopt.errors import InputError
from graphopt.files import temporary_file
from graphopt.io.builder import value_info_of
from graphopt.io.json_io import (
    ATTR_KEYS,
    DTYPE_NAMES,
    ELEMENT_KIND,
    FIELDS,
    FORMAT_MARKER,
    FORMAT_VERSION,
    SIDECAR_THRESHOLD,
    NpySource,
    decode_numbers,
    nest,
    numpy_or_none,
    short_floats,
    storage_dtype,
    text_or_base64,
    typed_field,
)
from graphopt.io.json_text import dump, parse_type_text, type_text
from graphopt.io.sources import ProtoSource, raw_buffer

__all__ = ["save"]


def save(model: ir.Model, path: str | os.PathLike[str], *, content_addressed: bool = False) -> None:
    """Write ``model`` as JSON, large tensors as sidecar .npy files; all or nothing.

    Sidecars are named ``<json stem>.<n>.npy``, or with ``content_addressed``
    ``<json stem>.<16 hex>.npy`` after their contents, so that new sidecars never replace
    the ones an older JSON of that name reads (the file runner's commit relies on it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = _Writer(path, content_addressed)
    staged = writer.staged
    try:
        text = dump(writer.model(model)) + "\n"
        handle, tmp_json = temporary_file(path.parent)
        staged.append(str(tmp_json))
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        for tmp, final in writer.sidecars.values():
            os.replace(tmp, final)
        os.replace(tmp_json, path)
    except BaseException:
        for tmp in staged:
            Path(tmp).unlink(missing_ok=True)
        raise
    # A tensor read lazily from an older sidecar of this name would now see another
    # tensor's file; point such tensors at the file just written with their own values.
    for name, tensors in writer.tensors.items():
        for tensor in tensors:
            if isinstance(tensor.source, NpySource):
                tensor.source = NpySource(writer.sidecars[name][1], tensor.dtype, tensor.shape)


class _Writer:
    def __init__(self, path: Path, content_addressed: bool = False) -> None:
        self.path = path
        self.content_addressed = content_addressed
        self.dims: dict[str, None] = {}
        # Sidecars by file name: (temporary path, final path), and the tensors stored there
        # (identical tensors share one file when content-addressed).
        self.sidecars: dict[str, tuple[str, Path]] = {}
        self.tensors: dict[str, list[ir.Tensor]] = {}
        # Temporary files written so far, removed again if the save fails.
        self.staged: list[str] = []

    def model(self, model: ir.Model) -> dict[str, Any]:
        graph = self.graph(model.graph)
        functions = [self.function(f) for f in model.functions]
        opaque = {k: [base64.b64encode(b).decode("ascii") for b in v] for k, v in model.opaque_fields.items()}
        head = {"format": FORMAT_MARKER, "format_version": FORMAT_VERSION, "ir_version": model.ir_version}
        return (
            head
            | _given(
                producer=_given(name=model.producer_name, version=model.producer_version),
                domain=model.domain,
                model_version=model.model_version,
                doc_string=model.doc_string,
                metadata_props=dict(model.metadata_props),
            )
            | {"opsets": dict(model.opset_imports)}
            | _given(dims=list(self.dims))
            | {"graph": graph}
            | _given(
                functions=functions,
                opaque_fields=opaque,
                layout=model.extensions.get("layout"),
                extensions={k: v for k, v in model.extensions.items() if k != "layout"},
            )
        )

    # types
    def dim(self, dim: ir.Dim) -> int | str | None:
        if dim is None or isinstance(dim, int):
            return dim
        text = str(dim)
        self.dims[text] = None
        return text

    def type(self, value_type: ir.Type | None) -> Any:
        structured = self._structured(value_type)
        text = type_text(structured)
        return text if text is not None and parse_type_text(text) == structured else structured

    def _structured(self, value_type: ir.Type | None) -> Any:
        if value_type is None:
            return None
        fields: dict[str, Any]
        if isinstance(value_type, (ir.TensorType, ir.SparseTensorType)):
            kind = "tensor" if isinstance(value_type, ir.TensorType) else "sparse_tensor"
            fields = {"kind": kind, "dtype": DTYPE_NAMES[value_type.dtype]}
            if value_type.shape is not None:
                fields["shape"] = [self.dim(d) for d in value_type.shape]
        elif isinstance(value_type, ir.SequenceType):
            fields = {"kind": "sequence", "element": self._structured(value_type.element)}
        elif isinstance(value_type, ir.OptionalType):
            fields = {"kind": "optional", "element": self._structured(value_type.element)}
        elif isinstance(value_type, ir.MapType):
            fields = {"kind": "map", "key": DTYPE_NAMES[value_type.key], "value": self._structured(value_type.value)}
        else:
            fields = {"kind": "opaque", "domain": value_type.domain, "name": value_type.name}
        if value_type.denotation:
            fields["denotation"] = value_type.denotation
        return fields

    def value(self, value: ir.Value) -> str | dict[str, Any]:
        entry = _given(
            name=value.name,
            type=self.type(value.type),
            doc_string=value.doc_string,
            metadata_props=dict(value.metadata_props),
        )
        return value.name if list(entry) == ["name"] else {"name": value.name, **entry}

    # tensors
    def tensor(self, tensor: ir.Tensor, name: bool = True) -> dict[str, Any]:
        entry: dict[str, Any] = _given(name=tensor.name if name else "")
        entry["dtype"] = DTYPE_NAMES[tensor.dtype]
        entry["shape"] = list(tensor.shape)
        entry.update(self._tensor_data(tensor))
        entry.update(_given(doc_string=tensor.doc_string, metadata_props=dict(tensor.metadata_props)))
        return entry

    def _tensor_data(self, tensor: ir.Tensor) -> dict[str, Any]:
        source = tensor.source
        field = typed_field(source.proto) if isinstance(source, ProtoSource) else None
        if field is None and tensor.dtype == ir.DataType.STRING:
            field = "string_data"
        if field == "string_data":
            if isinstance(source, ProtoSource):
                items = list(source.proto.string_data)
            else:
                items = [x if isinstance(x, bytes) else str(x).encode("utf-8") for x in source.read().ravel()]
            return {"string_data": [text_or_base64(bytes(x)) for x in items]}
        if field is not None:
            assert isinstance(source, ProtoSource)
            contents = np.array(getattr(source.proto, field), dtype=FIELDS[field])
            listed = _exact_list(contents)
            return {field: listed if listed is not None else base64.b64encode(contents.tobytes()).decode("ascii")}
        storage = storage_dtype(tensor.dtype)
        if storage is not None and tensor.nbytes > SIDECAR_THRESHOLD:
            return {"file": self._sidecar(tensor)}
        raw = raw_buffer(tensor).tobytes()
        native = numpy_or_none(tensor.dtype)
        # An empty tensor's shape cannot be read off nested lists, so it stays base64 ("").
        if native is not None and native.kind in "biuf" and tensor.size and len(raw) == tensor.size * native.itemsize:
            values = _exact_list(np.frombuffer(raw, dtype=native))
            if values is not None:
                return {"data": nest(values, tensor.shape)}
        return {"base64": base64.b64encode(raw).decode("ascii")}

    def _sidecar(self, tensor: ir.Tensor) -> str:
        raw = raw_buffer(tensor)
        if self.content_addressed:
            digest = hashlib.blake2b(repr((int(tensor.dtype), tensor.shape)).encode(), digest_size=8)
            digest.update(raw)
            name = f"{self.path.stem}.{digest.hexdigest()}.npy"
        else:
            name = f"{self.path.stem}.{len(self.sidecars)}.npy"
        self.tensors.setdefault(name, []).append(tensor)
        if name in self.sidecars:
            return name  # the same values again: one file serves both
        handle, tmp_path = temporary_file(self.path.parent)
        self.staged.append(str(tmp_path))
        self.sidecars[name] = (str(tmp_path), self.path.parent / name)
        with os.fdopen(handle, "wb") as out:
            array = np.frombuffer(raw, dtype=storage_dtype(tensor.dtype)).reshape(tensor.shape)
            np.lib.format.write_array(out, array, allow_pickle=False)
        return name

    def sparse(self, sparse: ir.SparseTensor, name: str | None = None) -> dict[str, Any]:
        head = {"name": name} if name is not None else {}
        return {
            **head,
            "dims": list(sparse.dims),
            "values": self.tensor(sparse.values, name=name is None),
            "indices": self.tensor(sparse.indices),
        }

    # attributes, nodes, graphs
    def attribute(self, attr: ir.Attr) -> dict[str, Any]:
        if attr.ref_attr_name:
            entry: dict[str, Any] = {"ref_attr_name": attr.ref_attr_name, "kind": ATTR_KEYS[attr.kind]}
        else:
            entry = {ATTR_KEYS[attr.kind]: self._attr_value(attr.kind, attr.value)}
        return entry | _given(doc_string=attr.doc_string)

    def _attr_value(self, kind: ir.AttrKind, value: Any) -> Any:
        if kind == ir.AttrKind.FLOAT:
            return short_floats(np.array([value], dtype=np.float32))[0]
        if kind == ir.AttrKind.FLOATS:
            return short_floats(np.array(value, dtype=np.float32))
        if kind in (ir.AttrKind.INT, ir.AttrKind.INTS, ir.AttrKind.UNDEFINED):
            return value
        if kind == ir.AttrKind.STRING:
            return text_or_base64(value)
        if kind == ir.AttrKind.STRINGS:
            return [text_or_base64(v) for v in value]
        one: dict[ir.AttrKind, Callable[[Any], Any]] = {
            ir.AttrKind.TENSOR: self.tensor,
            ir.AttrKind.GRAPH: self.graph,
            ir.AttrKind.SPARSE_TENSOR: self.sparse,
            ir.AttrKind.TYPE_PROTO: self.type,
        }
        if kind in ELEMENT_KIND:
            return [one[ELEMENT_KIND[kind]](v) for v in value]
        return one[kind](value)

    def node(self, node: ir.Node) -> dict[str, Any]:
        return _given(
            op=node.op_type,
            domain=node.domain,
            overload=node.overload,
            name=node.name,
            inputs=[v.name if v is not None else "" for v in node.inputs],
            outputs=[v.name for v in node.outputs],
            attributes={name: self.attribute(a) for name, a in node.attributes.items()},
            doc_string=node.doc_string,
            metadata_props=dict(node.metadata_props),
        )

    def graph(self, graph: ir.Graph) -> dict[str, Any]:
        initializers: list[dict[str, Any]] = []
        for value in graph.initializers.values():
            if isinstance(value.const, ir.SparseTensor):
                initializers.append(self.sparse(value.const, value.name))
            elif isinstance(value.const, ir.Tensor):
                initializers.append({"name": value.name, **self.tensor(value.const, name=False)})
        nodes = graph.topological()
        value_info = [self.value(v) for v in value_info_of(graph, nodes)]
        return _given(
            name=graph.name,
            doc_string=graph.doc_string,
            inputs=[self.value(v) for v in graph.inputs],
            outputs=[self.value(v) for v in graph.outputs],
            initializers=initializers,
            nodes=[self.node(n) for n in nodes],
            value_info=value_info,
            metadata_props=dict(graph.metadata_props),
            quantization_annotation=[{"tensor": t, "params": dict(p)} for t, p in graph.quantization_annotation],
        )

    def function(self, function: ir.Function) -> dict[str, Any]:
        body = self.graph(function.body)
        return _given(
            domain=function.domain,
            name=function.name,
            overload=function.overload,
            doc_string=function.doc_string,
            opsets=dict(function.opset_imports),
            attributes=list(function.attributes),
            attribute_defaults={n: self.attribute(a) for n, a in function.attribute_defaults.items()},
            inputs=body.get("inputs", []),
            outputs=body.get("outputs", []),
            nodes=body.get("nodes", []),
            value_info=body.get("value_info", []),
            metadata_props=dict(function.metadata_props),
        )


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that differ from their default: empty strings, lists, dicts and zeros go."""
    return {key: value for key, value in fields.items() if value or value is False}


def _exact_list(array: np.ndarray) -> list[Any] | None:
    """``array`` as JSON numbers when they read back to the very same bytes, else None."""
    if array.dtype.kind == "f":
        values: list[Any] = short_floats(array)
    elif array.dtype.kind in "biu":
        values = array.tolist()
    else:
        return None
    try:
        back = decode_numbers(values, array.dtype, "")
    except InputError:
        return None
    return values if back.tobytes() == array.tobytes() else None
