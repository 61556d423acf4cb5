"""What the check feeds both models: input specs read from the file, dim bindings, seeded data.

The specs come from the ONNX file itself (``load_external_data=False``, so a model of any size
parses in the time its graph takes), never from the IR: the check must judge the files exactly
as they were written.

Dynamic dims are bound by name, so ``batch`` has one value across every input of a binding.
Each binding draws its value for a dim from the dim's class (batch-like, sequence-like, other,
unnamed), and different names of one class get different values (the second "other" dim is
one more than the first), so a rewrite that takes two unknown dims for one (onnxscript #2577)
computes on the wrong shapes and is caught. The first two candidates differ in every class, so
two bindings exercise two shapes; the later ones are fallbacks for models whose original
rejects a binding: other values (a Reshape that needs a multiple of 4, a position table shorter
than the sequence), then shared values per class (an exporter that gave one dim two names),
then all ones. Unnamed dims (no ``dim_param``) all share one value per binding: an exporter
that left the batch dim unnamed on two inputs still needs the two to agree, and 1 broadcasts
against anything.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from graphopt.check.paths import OutputPath, output_paths
from graphopt.errors import InputError

__all__ = [
    "NPZ_BYTE_LIMIT",
    "InputSpec",
    "ModelSpec",
    "bind_dims",
    "candidate_count",
    "load_npz",
    "make_inputs",
    "read_spec",
    "unnamed_key",
]

# Base values by dim class, one column each ...
_DIM_TABLE: dict[str, tuple[int, ...]] = {
    "batch": (1, 3, 2, 1, 1),
    "seq": (8, 17, 12, 16, 1),
    "other": (2, 5, 3, 4, 1),
    "unnamed": (1, 2, 3, 1, 1),
}
# ... and the candidate bindings: (column, whether names of one class get distinct values).
_CANDIDATES: tuple[tuple[int, bool], ...] = ((0, True), (1, True), (2, True), (1, False), (3, False), (4, False))
_SEQ_WORDS = ("seq", "len", "sequence", "token", "time", "step")
# Integer inputs are ids drawn from [0, _MAX_ID) unless the graph shows a smaller table.
_MAX_ID = 100
# Ops that pass ids through unchanged on the way to the Gather that uses them.
# The check does not generate an input larger than this (a declared dim of 2**40 is valid ONNX).
_MAX_INPUT_BYTES = 2**30
# The most bytes the arrays of an --inputs .npz may take once decompressed.
NPZ_BYTE_LIMIT = 4 * 2**30
_ID_PASSTHROUGH = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})

Dim = int | str | None


@dataclass(frozen=True)
class InputSpec:
    """One graph input the check must feed.

    ``dtype`` is None for a type the check cannot generate (sequences, maps, optionals);
    ``shape`` is None when the rank is unknown. A str dim is a named dynamic dim, None an
    unnamed one.
    """

    name: str
    type_text: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None
    id_bound: int | None = None

    def unsupported(self) -> str | None:
        """Why this input cannot be generated, or None."""
        if self.dtype is None:
            return f"input {self.name!r} has type {self.type_text}, which the check cannot generate"
        if self.shape is None:
            return f"input {self.name!r} has no known rank"
        static = math.prod(d for d in self.shape if isinstance(d, int)) * self.dtype.itemsize
        if static > _MAX_INPUT_BYTES:
            return f"input {self.name!r} would take {static} bytes or more ({self.type_text}{list(self.shape)})"
        return None


@dataclass(frozen=True)
class ModelSpec:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    paths: Mapping[str, OutputPath] = field(default_factory=dict)

    def signature(self) -> dict[str, str]:
        return {spec.name: spec.type_text for spec in self.inputs}


def read_spec(path: Path) -> ModelSpec:
    """The inputs (without initializer-backed ones), output names and output paths of the model at ``path``."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (DecodeError, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable ONNX model ({exc})") from None
    graph = model.graph
    initialized = {init.name for init in graph.initializer}
    bounds = _id_bounds(graph)
    inputs = tuple(_input_spec(value, bounds.get(value.name)) for value in graph.input if value.name not in initialized)
    return ModelSpec(inputs, tuple(value.name for value in graph.output), output_paths(graph))


def _input_spec(value: onnx.ValueInfoProto, id_bound: int | None) -> InputSpec:
    type_text = _type_text(value.type)
    if value.type.WhichOneof("value") != "tensor_type":
        return InputSpec(value.name, type_text, None, None)
    tensor_type = value.type.tensor_type
    try:
        dtype: np.dtype | None = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    except (KeyError, TypeError, ValueError):
        dtype = None
    shape: tuple[Dim, ...] | None = None
    if tensor_type.HasField("shape"):
        shape = tuple(_dim(d) for d in tensor_type.shape.dim)
    return InputSpec(value.name, type_text, dtype, shape, id_bound)


def _dim(dim: onnx.TensorShapeProto.Dimension) -> Dim:
    if dim.HasField("dim_value") and dim.dim_value >= 0:
        return int(dim.dim_value)
    if dim.HasField("dim_param") and dim.dim_param:
        return dim.dim_param
    return None


def _type_text(type_proto: onnx.TypeProto) -> str:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({onnx.TensorProto.DataType.Name(type_proto.tensor_type.elem_type).lower()})"
    if kind == "sequence_type":
        return f"seq({_type_text(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_type_text(type_proto.optional_type.elem_type)})"
    return kind or "undefined"


def _id_bounds(graph: onnx.GraphProto) -> dict[str, int]:
    """For inputs that index an embedding table (Gather on an initializer), the table's size.

    Follows the ids through shape-only ops (Reshape, Unsqueeze, Cast, ...) so that exports
    which flatten input_ids before the lookup are covered too.
    """
    tables = {init.name: list(init.dims) for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    bounds: dict[str, int] = {}
    for value in graph.input:
        frontier, seen = [value.name], set()
        while frontier:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            for node in consumers.get(name, []):
                if node.domain in ("", "ai.onnx") and node.op_type in _ID_PASSTHROUGH and node.input[0] == name:
                    frontier.extend(node.output)
                elif node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    dims = tables.get(node.input[0])
                    if dims and -len(dims) <= axis < len(dims):
                        bound = dims[axis]
                        bounds[value.name] = min(bounds.get(value.name, bound), bound)
    return bounds


def _dim_class(name: str) -> str:
    lowered = name.lower()
    # "N" is the batch dim of NCHW exports.
    if "batch" in lowered or lowered == "n":
        return "batch"
    if any(word in lowered for word in _SEQ_WORDS):
        return "seq"
    return "other"


def unnamed_key(input_name: str, axis: int) -> str:
    """How an unnamed dim is recorded in a binding's dims."""
    return f"{input_name}[{axis}]"


def candidate_count() -> int:
    return len(_CANDIDATES)


def bind_dims(specs: tuple[InputSpec, ...], k: int, fixed: Mapping[str, int]) -> dict[str, int]:
    """Candidate binding ``k``: a value for every dynamic dim, named ones by name.

    ``fixed`` (the user's ``--dim NAME=VALUE``) wins in every binding.
    """
    column, distinct = _CANDIDATES[k % len(_CANDIDATES)]
    dims: dict[str, int] = {}
    seen_in_class: dict[str, int] = {}
    for spec in specs:
        for axis, dim in enumerate(spec.shape or ()):
            if isinstance(dim, str) and dim not in dims:
                kind = _dim_class(dim)
                offset = seen_in_class.get(kind, 0)
                seen_in_class[kind] = offset + 1
                dims[dim] = fixed.get(dim, _DIM_TABLE[kind][column] + (offset if distinct else 0))
            elif dim is None:
                dims[unnamed_key(spec.name, axis)] = _DIM_TABLE["unnamed"][column]
    return dims


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, sizes checked before anything is decompressed: the zip's
    stated sizes against :data:`NPZ_BYTE_LIMIT`, and each array's header against the size
    the zip states for it (a few MB of zip can inflate to gigabytes)."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        stated = sum(member.file_size for member in members)
        if stated > NPZ_BYTE_LIMIT:
            raise InputError(
                f"{path}: its arrays would take {stated} bytes decompressed, over the {NPZ_BYTE_LIMIT} bytes "
                "graphopt reads from --inputs"
            )
        arrays: dict[str, np.ndarray] = {}
        for member in members:
            name = member.filename.removesuffix(".npy")
            if name == member.filename:
                raise InputError(f"{path}: {member.filename!r} is not a .npy array")
            with archive.open(member) as stream:
                version = np.lib.format.read_magic(stream)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(stream)
                needed = math.prod(shape) * dtype.itemsize
                if dtype.hasobject or needed > member.file_size:
                    what = "Python objects" if dtype.hasobject else f"{needed} bytes"
                    raise InputError(
                        f"{path}: array {name!r} declares {what} ({dtype}, shape {shape}) and the zip "
                        f"holds {member.file_size} bytes for it"
                    )
            with archive.open(member) as stream:
                arrays[name] = np.lib.format.read_array(stream, allow_pickle=False)
    return arrays


def make_inputs(
    specs: tuple[InputSpec, ...], dims: Mapping[str, int], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Seeded data for every input at the binding ``dims`` (see the module docstring)."""
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        assert spec.dtype is not None and spec.shape is not None, spec.unsupported()
        shape = tuple(
            d if isinstance(d, int) else dims[d] if isinstance(d, str) else dims[unnamed_key(spec.name, axis)]
            for axis, d in enumerate(spec.shape)
        )
        feeds[spec.name] = _data(spec, shape, rng)
    return feeds


def _data(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = spec.dtype
    assert dtype is not None
    if "mask" in spec.name.lower() and dtype.kind in "biuf":
        return np.ones(shape, dtype=dtype)
    if dtype.kind == "b":  # a comparison of a rank-0 draw is a numpy scalar, which onnxruntime refuses
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu":
        high = min(_MAX_ID, spec.id_bound or _MAX_ID, int(np.iinfo(dtype).max))
        return rng.integers(0, max(high, 1), size=shape).astype(dtype)
    if dtype.kind in "fc":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "OUS":
        words = np.array(["a", "b", "graphopt", ""], dtype=object)
        return words[rng.integers(0, len(words), size=shape)]
    raise AssertionError(f"no generator for {dtype}")


def load_npz(path: Path, specs: tuple[InputSpec, ...]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The user's arrays and the dims they bind; an array that cannot be fed is an InputError."""
    try:
        arrays = _read_npz(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{path}: not a readable .npz file ({exc})") from None
    expected = {spec.name: spec for spec in specs}
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"no model input named {', '.join(extra)}"] if extra else []
        raise InputError(f"{path}: {'; '.join(parts)}")
    dims: dict[str, int] = {}
    for name, array in arrays.items():
        spec = expected[name]
        if spec.dtype is not None and array.dtype != spec.dtype:
            raise InputError(f"{path}: array {name!r} has dtype {array.dtype}, the model expects {spec.dtype}")
        if spec.shape is not None and array.ndim != len(spec.shape):
            raise InputError(f"{path}: array {name!r} has rank {array.ndim}, the model expects {len(spec.shape)}")
        for axis, (dim, size) in enumerate(zip(spec.shape or (), array.shape, strict=True)):
            if isinstance(dim, str):
                dims.setdefault(dim, int(size))
            elif dim is None:
                dims[unnamed_key(name, axis)] = int(size)
    return arrays, dims
