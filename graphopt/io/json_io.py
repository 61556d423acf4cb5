"""graphopt's JSON form of a model: readable, diffable, and lossless against the IR.

The layout (schemas/graph.schema.json is the full contract)::

    {"format": "graphopt-graph", "format_version": 1, "ir_version": 10, "opsets": {"": 21},
     "dims": ["batch", "seq", "seq + 1"],
     "graph": {"inputs": [{"name": "x", "type": "float32[batch, seq]"}],
               "outputs": [...], "initializers": [...], "value_info": [...],
               "nodes": [{"op": "Add", "inputs": ["x", "b"], "outputs": ["y"],
                          "attributes": {"axis": {"int": 1}}}]},
     "functions": [...], "layout": {...}, "extensions": {}}

- Symbolic dims are declared once in ``dims``; a type names them by their text (``seq + 1``
  is parsed back into an expression), also inside subgraph and function signatures.
- A type is a string such as ``float32[batch, 3]``, ``seq(int64[?])`` or ``float32[*]``
  (unknown rank); when a string cannot say it (a denotation, an opaque type, a dim whose
  name is not a plain word or expression) the type is an object with ``kind`` instead.
- Attributes name their kind: ``{"floats": [0.5, 1.0]}``; FLOAT values are written as the
  shortest text that reads back to the same float32, so they round-trip bit for bit.
- A tensor carries exactly one data field: ``data`` (nested lists, only when they read
  back to the same bytes), ``base64`` (raw little-endian bytes, as ONNX's raw_data),
  ``file`` (a sidecar .npy next to the JSON, for tensors above :data:`SIDECAR_THRESHOLD`
  bytes, named ``<json stem>.<n>.npy`` and memory-mapped on load), or the ONNX typed field it came in (``float_data``,
  ``int32_data``, ...), so a tensor written by ``make_tensor`` comes back the same way.
- ``layout`` is a layout problem for the unwind pass (schemas/unwind.schema.json); the
  IR keeps it as ``model.extensions["layout"]``.
- Fields equal to their default (empty strings, empty lists, zeros) are left out.

ONNX -> JSON -> ONNX is exact up to the normalizations of :mod:`graphopt.io.onnx_io`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from graphopt import ir
from graphopt.errors import InputError
from graphopt.io.builder import Annotate, NodeEntry, Scope, build_graph
from graphopt.io.external import external_file
from graphopt.io.json_text import parse_type_text
from graphopt.io.onnx_io import MAX_SUBGRAPH_NESTING
from graphopt.io.sources import ProtoSource, input_file
from graphopt.schemas import validate

__all__ = [
    "FORMAT_MARKER",
    "FORMAT_VERSION",
    "SIDECAR_THRESHOLD",
    "NpySource",
    "is_graph_file",
    "is_sidecar_of",
    "sidecar_locations",
    "load",
]

FORMAT_VERSION = 1
FORMAT_MARKER = "graphopt-graph"
# How much of a .json file is read to tell a graphopt graph from other JSON (configs, tokenizers).
_MARKER_WINDOW = 1 << 16
# Tensors larger than this many bytes go to a sidecar .npy file instead of the JSON text.
SIDECAR_THRESHOLD = 4096

DTYPE_NAMES: dict[ir.DataType, str] = {
    d: {ir.DataType.FLOAT: "float32", ir.DataType.DOUBLE: "float64"}.get(d, d.name.lower()) for d in ir.DataType
}
_DTYPES = {name: d for d, name in DTYPE_NAMES.items()}

# ONNX typed data fields and the element type each is stored as on the wire.
FIELDS: dict[str, np.dtype] = {
    "float_data": np.dtype("<f4"),
    "int32_data": np.dtype("<i4"),
    "int64_data": np.dtype("<i8"),
    "double_data": np.dtype("<f8"),
    "uint64_data": np.dtype("<u8"),
}
_DATA_KEYS = ("data", "base64", "file", "string_data", *FIELDS)
_NON_FINITE = {"nan": math.nan, "-nan": -math.nan, "inf": math.inf, "-inf": -math.inf}

ATTR_KEYS: dict[ir.AttrKind, str] = {kind: kind.name.lower() for kind in ir.AttrKind}
_ATTR_KINDS = {key: kind for kind, key in ATTR_KEYS.items()}
ELEMENT_KIND = {
    ir.AttrKind.TENSORS: ir.AttrKind.TENSOR,
    ir.AttrKind.GRAPHS: ir.AttrKind.GRAPH,
    ir.AttrKind.SPARSE_TENSORS: ir.AttrKind.SPARSE_TENSOR,
    ir.AttrKind.TYPE_PROTOS: ir.AttrKind.TYPE_PROTO,
}


# -- tensor storage -----------------------------------------------------------------------


def storage_dtype(dtype: ir.DataType) -> np.dtype | None:
    """The numpy dtype a sidecar stores ``dtype`` as: itself, or an unsigned int of its width
    for bfloat16 and the float8 types; None for strings and sub-byte types (kept inline)."""
    if dtype == ir.DataType.STRING:
        return None
    native = numpy_or_none(dtype)
    if native is not None and native.kind != "V":  # ml_dtypes' bfloat16 is a void kind to .npy
        return native
    bits = dtype.itemsize_bits
    return np.dtype(f"<u{bits // 8}") if bits in (8, 16) and dtype != ir.DataType.UNDEFINED else None


@dataclass
class NpySource:
    """Tensor values in a sidecar .npy file, memory-mapped when read."""

    path: Path
    dtype: ir.DataType
    shape: tuple[int, ...]

    def read(self) -> np.ndarray:
        array = np.load(self.path, mmap_mode="r")
        if storage_dtype(self.dtype) != numpy_or_none(self.dtype):
            # bfloat16 / float8 are stored as same-width uints; view them as onnx does.
            return array.view(helper.tensor_dtype_to_np_dtype(int(self.dtype)))
        return array


def numpy_or_none(dtype: ir.DataType) -> np.dtype | None:
    try:
        return dtype.numpy()
    except TypeError:
        return None


def typed_field(proto: onnx.TensorProto) -> str | None:
    """The ONNX typed field holding a parsed tensor's values, or None for raw_data."""
    if proto.HasField("raw_data"):
        return None
    for name in ("string_data", *FIELDS):
        if len(getattr(proto, name)):
            return name
    return "string_data" if proto.data_type == ir.DataType.STRING else None


def text_or_base64(data: bytes) -> str | dict[str, str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _number(x: float) -> float | str:
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "-nan" if math.copysign(1.0, x) < 0 else "nan"
    return "inf" if x > 0 else "-inf"


def short_floats(array: np.ndarray) -> list[float | str]:
    """Values of a float array as JSON numbers, in the shortest text that reads back exactly
    in the array's own precision (``0.1`` rather than ``0.10000000149011612`` for float32)."""
    if array.dtype.itemsize == 8:
        return [_number(x) for x in array.ravel().tolist()]
    values: list[float | str] = []
    for x in array.ravel():
        exact = float(x)
        short = float(str(x)) if math.isfinite(exact) else exact
        # Parsing goes through float64, so check the short text survives the second rounding.
        values.append(_number(short if array.dtype.type(short) == x else exact))
    return values


def nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


# -- writing -------------------------------------------------------------------------------


def is_sidecar_of(path: Path, candidate: Path, *, hashed: bool = False) -> bool:
    """Whether ``candidate`` is named as a sidecar of the JSON graph ``path`` is:
    content-addressed ``<stem>.<16 hex>.npy``, or (unless ``hashed``) ``<stem>.<n>.npy``."""
    name, prefix = candidate.name, path.stem + "."
    if candidate.parent != path.parent or not name.startswith(prefix) or not name.endswith(".npy"):
        return False
    middle = name[len(prefix) : -len(".npy")]
    if len(middle) == 16 and all(c in "0123456789abcdef" for c in middle):
        return True
    return not hashed and middle.isdigit()


def sidecar_locations(path: Path) -> set[str]:
    """The sidecar files the JSON graph at ``path`` names, its tensors not read; empty for a
    file that is not a readable graph."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return set()
    locations: set[str] = set()
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if isinstance(item.get("file"), str):
                locations.add(item["file"])
            pending += item.values()
        elif isinstance(item, list):
            pending += item
    return locations


def is_graph_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file carries graphopt's format marker near its start (writers put it first).

    A marker is enough: a damaged graph that has one is still reported as a bad graph, while
    the other JSON files of a model folder (config.json, tokenizer_config.json) are not graphs.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(_MARKER_WINDOW).decode("utf-8", errors="replace")
    except OSError:
        return False
    return re.search(r'"format"\s*:\s*"' + FORMAT_MARKER + '"', head) is not None


# -- reading -----------------------------------------------------------------------------------


def load(path: str | os.PathLike[str], *, independent_dims: bool = False) -> ir.Model:
    """Read a JSON model; sidecar tensors are memory-mapped on first use. Raises InputError."""
    path = input_file(Path(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    except RecursionError:
        raise InputError(f"{path}: nested deeper than Python's JSON parser reads") from None
    depth = _nesting(data)
    if depth > MAX_NESTING:
        raise InputError(
            f"{path}: JSON nested {depth} levels deep; a graph may nest at most {MAX_NESTING} levels,"
            f" {MAX_SUBGRAPH_NESTING} subgraphs inside one another, the most an ONNX file can hold"
            " (onnx and onnxruntime parse no deeper)"
        )
    validate(data, "graph", str(path))
    try:
        model = _Reader(path, independent_dims).model(data)
        for graph in model.all_graphs():
            graph.topological()
    except (InputError, ir.GraphError) as err:
        raise InputError(f"{path}: {err}") from None
    return model


# The deepest nesting of JSON arrays and objects a graph may have: a subgraph inside a node
# takes five levels (graph, nodes, node, attributes, attribute), so this is the JSON of
# MAX_SUBGRAPH_NESTING subgraphs inside one another, the most an ONNX file can hold.
MAX_NESTING = 5 * MAX_SUBGRAPH_NESTING + 5


def _nesting(data: Any) -> int:
    """How deeply arrays and objects nest in ``data`` (counted without recursion)."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(data, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending += [(child, depth + 1) for child in children]
    return deepest


class _Reader:
    def __init__(self, path: Path, independent_dims: bool) -> None:
        self.path = path
        self.independent_dims = independent_dims
        self.uids = itertools.count(1)
        self.dims: set[str] = set()

    def model(self, data: dict[str, Any]) -> ir.Model:
        version = data["format_version"]
        if version > FORMAT_VERSION:
            raise InputError(f"$.format_version: {version} is newer than this graphopt reads ({FORMAT_VERSION})")
        self.dims = set(data.get("dims", []))
        producer = data.get("producer", {})
        opaque: dict[str, list[bytes]] = {}
        for key, items in data.get("opaque_fields", {}).items():
            opaque[key] = [_b64(item, f"$.opaque_fields.{key}[{i}]") for i, item in enumerate(items)]
        return ir.Model(
            graph=self.graph(data["graph"], [], "$.graph"),
            opset_imports=dict(data["opsets"]),
            ir_version=data["ir_version"],
            producer_name=producer.get("name", ""),
            producer_version=producer.get("version", ""),
            domain=data.get("domain", ""),
            model_version=data.get("model_version", 0),
            doc_string=data.get("doc_string", ""),
            metadata_props=dict(data.get("metadata_props", {})),
            functions=[self.function(f, f"$.functions[{i}]") for i, f in enumerate(data.get("functions", []))],
            opaque_fields=opaque,
            extensions=dict(data.get("extensions", {})) | ({"layout": data["layout"]} if "layout" in data else {}),
        )

    # types
    def dim(self, text: int | str | None, at: str) -> ir.Dim:
        if text is None or isinstance(text, int):
            return text
        if text not in self.dims:
            raise InputError(f"{at}: dim {text!r} is not declared in $.dims")
        dim = ir.parse_dim(text)
        if self.independent_dims and isinstance(dim, ir.Sym):
            return ir.Sym(dim.name, next(self.uids))
        return dim

    def dtype(self, name: str, at: str) -> ir.DataType:
        try:
            return _DTYPES[name]
        except KeyError:
            raise InputError(f"{at}: unknown dtype {name!r}") from None

    def type(self, data: Any, at: str) -> ir.Type | None:
        if data is None:
            return None
        if isinstance(data, str):
            try:
                data = parse_type_text(data)
            except ValueError as err:
                raise InputError(f"{at}: {err}") from None
        kind, denotation = data.get("kind", "tensor"), data.get("denotation", "")
        if kind in ("tensor", "sparse_tensor"):
            dtype = self.dtype(data["dtype"], at)
            shape = data.get("shape")
            dims = None if shape is None else tuple(self.dim(d, at) for d in shape)
            return (ir.TensorType if kind == "tensor" else ir.SparseTensorType)(dtype, dims, denotation)
        if kind == "sequence":
            return ir.SequenceType(self.type(data.get("element"), at), denotation)
        if kind == "optional":
            return ir.OptionalType(self.type(data.get("element"), at), denotation)
        if kind == "map":
            return ir.MapType(self.dtype(data["key"], at), self.type(data.get("value"), at), denotation)
        if kind == "opaque":
            return ir.OpaqueType(data.get("domain", ""), data.get("name", ""), denotation)
        raise InputError(f"{at}: unknown type kind {kind!r}")

    # tensors
    def tensor(self, data: dict[str, Any], at: str, name: str | None = None) -> ir.Tensor:
        dtype = self.dtype(data["dtype"], f"{at}.dtype")
        shape = tuple(data.get("shape", []))
        name = data.get("name", "") if name is None else name
        keys = [k for k in _DATA_KEYS if k in data]
        if len(keys) != 1:
            raise InputError(f"{at}: a tensor needs exactly one of {', '.join(_DATA_KEYS)} (has {keys or 'none'})")
        (key,) = keys
        source: Any
        if key == "file":
            source = self._sidecar(data["file"], dtype, shape, f"{at}.file")
        else:
            proto = onnx.TensorProto(name=name, data_type=int(dtype), dims=shape)
            self._fill(proto, key, data[key], dtype, shape, f"{at}.{key}")
            source = ProtoSource(proto)
        return ir.Tensor(
            name,
            dtype,
            shape,
            source,
            doc_string=data.get("doc_string", ""),
            metadata_props=dict(data.get("metadata_props", {})),
        )

    def _fill(self, proto: onnx.TensorProto, key: str, value: Any, dtype: ir.DataType, shape: tuple[int, ...], at: str):
        if key == "string_data":
            proto.string_data.extend(_bytes(v, f"{at}[{i}]") for i, v in enumerate(value))
        elif key in FIELDS:
            element = FIELDS[key]
            if isinstance(value, str):
                raw = _b64(value, at)
                if len(raw) % element.itemsize:
                    raise InputError(f"{at}: {len(raw)} bytes is not a whole number of {element} values")
                array = np.frombuffer(raw, dtype=element)
            else:
                array = decode_numbers(value, element, at)
            getattr(proto, key).extend(array.tolist())
        elif key == "base64":
            proto.raw_data = _b64(value, at)
            expected = (math.prod(shape) * dtype.itemsize_bits + 7) // 8
            if len(proto.raw_data) != expected:
                raise InputError(f"{at}: {len(proto.raw_data)} bytes of data, a {list(shape)} tensor needs {expected}")
        else:
            native = numpy_or_none(dtype)
            if native is None or native.kind not in "biuf":
                raise InputError(f"{at}: {DTYPE_NAMES[dtype]} tensors cannot be given as a number list; use base64")
            array = decode_numbers(value, native, at)
            if array.shape != shape:
                raise InputError(f"{at}: data has shape {list(array.shape)}, the tensor {list(shape)}")
            proto.raw_data = array.tobytes()

    def _sidecar(self, name: str, dtype: ir.DataType, shape: tuple[int, ...], at: str) -> NpySource:
        storage = storage_dtype(dtype)
        if storage is None:
            raise InputError(f"{at}: {DTYPE_NAMES[dtype]} tensors cannot live in a .npy sidecar")
        file = external_file(self.path.parent, name, f"{at}: sidecar file")
        try:
            with file.open("rb") as handle:
                major, _ = np.lib.format.read_magic(handle)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                found_shape, _, found_dtype = read_header(handle)
                data_start = handle.tell()
            size = file.stat().st_size
        except (ValueError, OSError) as err:
            raise InputError(f"{at}: {str(file)!r} is not a .npy file ({err})") from None
        if tuple(found_shape) != shape or found_dtype != storage:
            raise InputError(
                f"{at}: {str(file)!r} holds {found_dtype}{list(found_shape)}, expected {storage}{list(shape)}"
            )
        needed = math.prod(shape) * storage.itemsize
        if size < data_start + needed:
            raise InputError(f"{at}: {str(file)!r} is too short ({size - data_start} of its {needed} bytes of data)")
        return NpySource(file, dtype, shape)

    def sparse(self, data: dict[str, Any], at: str, name: str | None = None) -> ir.SparseTensor:
        return ir.SparseTensor(
            self.tensor(data["values"], f"{at}.values", name),
            self.tensor(data["indices"], f"{at}.indices"),
            tuple(data.get("dims", [])),
        )

    # attributes
    def attribute(self, name: str, data: dict[str, Any], scope: Scope, at: str) -> ir.Attr:
        doc = data.get("doc_string", "")
        if "ref_attr_name" in data:
            kind = _ATTR_KINDS[data.get("kind", "undefined")]
            return ir.Attr(name, kind, None, data["ref_attr_name"], doc)
        keys = [k for k in data if k in _ATTR_KINDS]
        if len(keys) != 1:
            raise InputError(f"{at}: an attribute needs exactly one kind key such as 'int' or 'floats' (has {keys})")
        (key,) = keys
        kind, value, at = _ATTR_KINDS[key], data[key], f"{at}.{key}"
        return ir.Attr(name, kind, self._attr_value(kind, value, scope, at), "", doc)

    def _attr_value(self, kind: ir.AttrKind, value: Any, scope: Scope, at: str) -> Any:
        if kind == ir.AttrKind.FLOAT:
            return float(decode_numbers(value, np.dtype(np.float32), at))
        if kind == ir.AttrKind.FLOATS:
            return decode_numbers(value, np.dtype(np.float32), at).tolist()
        if kind in (ir.AttrKind.INT, ir.AttrKind.INTS, ir.AttrKind.UNDEFINED):
            return value
        if kind == ir.AttrKind.STRING:
            return _bytes(value, at)
        if kind == ir.AttrKind.STRINGS:
            return [_bytes(v, f"{at}[{i}]") for i, v in enumerate(value)]
        one: dict[ir.AttrKind, Callable[[Any, str], Any]] = {
            ir.AttrKind.TENSOR: self.tensor,
            ir.AttrKind.GRAPH: lambda data, where: self.graph(data, scope, where),
            ir.AttrKind.SPARSE_TENSOR: self.sparse,
            ir.AttrKind.TYPE_PROTO: self.type,
        }
        if kind in ELEMENT_KIND:
            return [one[ELEMENT_KIND[kind]](v, f"{at}[{i}]") for i, v in enumerate(value)]
        return one[kind](value, at)

    # graphs
    def graph(self, data: dict[str, Any], scope: Scope, at: str) -> ir.Graph:
        initializers = [
            self._initializer(e, f"{at}.initializers[{i}]") for i, e in enumerate(data.get("initializers", []))
        ]
        nodes = [self._node(d, f"{at}.nodes[{i}]") for i, d in enumerate(data.get("nodes", []))]
        annotations = {
            _name(e): functools.partial(self._annotate, entry=e, at=f"{at}.value_info[{i}]", declares=True)
            for i, e in enumerate(data.get("value_info", []))
        }
        graph, unused = build_graph(
            scope,
            name=data.get("name", ""),
            where=at,
            initializers=initializers,
            inputs=self._listed(data.get("inputs", []), f"{at}.inputs"),
            nodes=nodes,
            annotations=annotations,
            outputs=self._listed(data.get("outputs", []), f"{at}.outputs"),
        )
        for i, entry in enumerate(data.get("value_info", [])):
            if _name(entry) in unused:
                raise InputError(
                    f"{at}.value_info[{i}]: value_info names {_name(entry)!r}, which no node of this graph defines"
                )
        graph.doc_string = data.get("doc_string", "")
        graph.metadata_props = dict(data.get("metadata_props", {}))
        annotations_data = data.get("quantization_annotation", [])
        graph.quantization_annotation = [(q["tensor"], dict(q.get("params", {}))) for q in annotations_data]
        return graph

    def _initializer(self, entry: dict[str, Any], at: str) -> ir.Value:
        if "indices" in entry:
            sparse = self.sparse(entry, at, entry["name"])
            return ir.Value(entry["name"], ir.SparseTensorType(sparse.values.dtype, sparse.dims), sparse)
        tensor = self.tensor(entry, at)
        return ir.Value(tensor.name, ir.TensorType(tensor.dtype, tensor.shape), tensor)

    def _listed(self, entries: list[str | dict[str, Any]], at: str) -> list[tuple[str, Annotate]]:
        return [(_name(e), functools.partial(self._annotate, entry=e, at=f"{at}[{i}]")) for i, e in enumerate(entries)]

    def _node(self, data: dict[str, Any], at: str) -> NodeEntry:
        def attributes(scope: Scope) -> list[ir.Attr]:
            return [
                self.attribute(name, a, scope, f"{at}.attributes.{name}")
                for name, a in data.get("attributes", {}).items()
            ]

        return NodeEntry(
            data["op"],
            data.get("inputs", []),
            data.get("outputs", []),
            attributes,
            label=f"{at} ({data['op']} {data['name']!r})" if data.get("name") else at,
            domain=data.get("domain", ""),
            name=data.get("name", ""),
            overload=data.get("overload", ""),
            doc_string=data.get("doc_string", ""),
            metadata_props=dict(data.get("metadata_props", {})),
        )

    def _annotate(self, value: ir.Value, entry: str | dict[str, Any], at: str, declares: bool = False) -> None:
        if isinstance(entry, str):
            return
        found = self.type(entry.get("type"), f"{at}.type")
        value.type = found or value.type
        if declares:  # a value_info entry (see the ONNX reader's _annotate)
            value.declared = found
        value.doc_string = entry.get("doc_string", "") or value.doc_string
        value.metadata_props.update(entry.get("metadata_props", {}))

    def function(self, data: dict[str, Any], at: str) -> ir.Function:
        defaults = {
            n: self.attribute(n, a, [], f"{at}.attribute_defaults.{n}")
            for n, a in data.get("attribute_defaults", {}).items()
        }
        return ir.Function(
            domain=data.get("domain", ""),
            name=data["name"],
            body=self.graph(data, [], at),
            attributes=list(data.get("attributes", [])),
            attribute_defaults=defaults,
            opset_imports=dict(data.get("opsets", {})),
            overload=data.get("overload", ""),
            doc_string=data.get("doc_string", ""),
            metadata_props=dict(data.get("metadata_props", {})),
        )


def _name(entry: str | dict[str, Any]) -> str:
    return entry if isinstance(entry, str) else str(entry["name"])


def _b64(text: str, at: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as err:
        raise InputError(f"{at}: not valid base64 ({err})") from None


def _bytes(value: str | dict[str, str], at: str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else _b64(value["base64"], at)


def decode_numbers(values: Any, dtype: np.dtype, at: str) -> np.ndarray:
    """JSON numbers (nested lists; "nan", "inf" for floats) as an array of ``dtype``, exactly."""

    def walk(item: Any) -> Any:
        if isinstance(item, list):
            return [walk(x) for x in item]
        if dtype.kind == "f":
            if isinstance(item, str) and item in _NON_FINITE:
                return _NON_FINITE[item]
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                return item
        elif dtype.kind == "b":
            if isinstance(item, bool):
                return item
        elif isinstance(item, int) and not isinstance(item, bool):
            return item
        raise InputError(f"{at}: {item!r} is not a {dtype} value")

    try:
        return np.array(walk(values), dtype=dtype)
    except (OverflowError, ValueError) as err:
        raise InputError(f"{at}: cannot read the numbers as {dtype} ({err})") from None
