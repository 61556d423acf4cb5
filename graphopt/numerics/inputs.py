"""What the check feeds both models: input specs read from the file, dim bindings, seeded data.

The specs come from the ONNX file itself (``load_external_data=False``, so a model of any size
parses in the time its graph takes), never from the IR: the check must judge the files exactly
as they were written. What the graph says about each dim and input (dims.py) decides the
bindings and the data.

Dynamic dims are bound by key: a named dim by its name, so ``batch`` has one value across
every input of a binding, an unnamed one as ``input[axis]`` (the form ``--dim`` takes). Each
binding draws a dim's value from its kind, and different names of one kind get different
values (the second "other" dim is larger than the first; height and width differ in the
non-square binding), so a rewrite that takes two dims for one (onnxscript #2577) computes on
the wrong shapes and is caught. Unnamed dims of one kind share a value: an exporter that left
the batch dim unnamed on two inputs still needs the two to agree. A total (the mask of a
KV-cache decoder) is past + sequence.

The first two bindings are the regimes the check exists for, each named in the report:

- realistic sizes: batch 3, sequence 16 (a cache of 8 before it), images 224 x 224, with
  masks padded (one row with trailing zeros, one with leading zeros) and floats at unit scale;
- batch 1 at a long sequence (128, or the position table's rows; a decode step of one token
  after a cache that fills it), images non-square (192 x 320), floats at scale 10.

A third, :func:`largest_binding`, goes to the sizes the model declares or a table bounds
(the position table's rows, images of 448 x 512, a batch of 5); check.py runs it where it is
cheap enough. Every size is fitted to what the model's ops accept (lengths.py): at least the
smallest length they take (a reflect Pad, a Conv kernel, a frame Slice), a multiple of the
factor a Reshape target bakes in.

Every binding spreads ids over the whole table they index and gives position ids that follow
the cache. Inputs that set a shape, count, axis or index get small valid values. A sequence
input holds three tensors of its element's shape (a vector where the file states none), an
optional input holds its value. The later
bindings are fallbacks for a model whose original rejects those: smaller sizes (a Reshape
that needs a multiple of 4), then shared values per kind (an exporter that gave one dim two
names), then all ones.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from google.protobuf.message import DecodeError

from graphopt.errors import InputError
from graphopt.io.sources import input_file
from graphopt.numerics.dims import GraphFacts, Role, graph_facts, held_tensor, unnamed_key
from graphopt.numerics.feeds import Feed, exotic
from graphopt.numerics.paths import OutputPath, has_opaque_ops, lowest, output_paths

__all__ = [
    "NPZ_BYTE_LIMIT",
    "Binding",
    "Feed",
    "InputSpec",
    "ModelSpec",
    "bind_dims",
    "candidate_count",
    "dim_keys",
    "input_elements",
    "largest_binding",
    "load_npz",
    "make_inputs",
    "read_spec",
    "run_cost",
    "unnamed_key",
]


@dataclass(frozen=True)
class _Candidate:
    batch: int
    seq: int | None  # None: the long sequence
    past: int | None  # None: long - seq (a decode step that fills the position table)
    spatial: tuple[int, int]  # height and width, rounded up to the stride; in strides when small
    other: int
    distinct: bool  # names of one kind get distinct values
    scale: float  # of float data
    padded: bool  # masks with padded rows
    largest: bool = False  # the long sequence is the position table's rows, past _LONG


_LONG = 128
# The largest binding: sequences up to the position table's rows (at most this many), images
# above 400 px, a batch above 4: where an embedding row, a crop or a batch that the first two
# bindings never reach is wrong.
_LARGEST_SEQUENCE = 4096
_LARGEST = _Candidate(5, None, None, (448, 512), 32, True, 1.0, True, largest=True)
_CANDIDATES = (
    _Candidate(3, 16, 8, (224, 224), 16, True, 1.0, True),
    _Candidate(1, None, None, (192, 320), 24, True, 10.0, False),
    _Candidate(2, 8, 4, (2, 3), 5, True, 1.0, True),
    _Candidate(1, 12, 4, (1, 2), 4, False, 1.0, False),
    _Candidate(1, 16, 2, (1, 1), 3, False, 1.0, False),
    _Candidate(1, 1, 1, (1, 1), 1, False, 1.0, False),
)
# Spatial sizes below this are counted in strides (the fallbacks' small images).
_IN_STRIDES = 8
# Integer data the graph says nothing about: small non-negative values.
_MAX_INT = 100
# The check does not generate an input larger than this (a declared dim of 2**40 is valid ONNX).
_MAX_INPUT_BYTES = 2**30
# The most bytes the arrays of an --inputs .npz may take once decompressed, read from the
# archive's stated sizes before any array is: a guard against a small file that inflates
# without bound. It is a second figure on purpose, not the check's memory budget
# (numerics/budget.py DEFAULT_MEMORY_BUDGET, 8 GB unless --check-memory): that one bounds the
# model run (its constants and the values its nodes make and read) and is only known once the model is
# loaded; 4 GiB of inputs leaves the default budget room for the rest.
NPZ_BYTE_LIMIT = 4 * 2**30
# The tensors a generated sequence input holds: more than one, so an op that reads only the
# first or the last of them differs from one that reads all.
SEQUENCE_LENGTH = 3

Dim = int | str | None


@dataclass(frozen=True)
class InputSpec:
    """One graph input the check must feed.

    ``dtype`` and ``shape`` are the tensor's, or for a sequence or optional input those of the
    tensor it holds (``containers``, outermost first: "seq", "optional"). ``dtype`` is None for
    a type the check cannot generate (maps, sparse tensors); ``shape`` is None when the rank is
    unknown. A str dim is a named dynamic dim, None an unnamed one. ``role`` is what the graph
    does with the input (dims.py), None for data.
    """

    name: str
    type_text: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None
    role: Role | None = None
    containers: tuple[str, ...] = ()

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

    def axis_keys(self) -> list[str | None]:
        """The binding key of each axis: a dim name, ``input[axis]`` for an unnamed dim, None for a static one."""
        return [
            d if isinstance(d, str) else unnamed_key(self.name, axis) if d is None else None
            for axis, d in enumerate(self.shape or ())
        ]


@dataclass(frozen=True)
class ModelSpec:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    paths: Mapping[str, OutputPath] = field(default_factory=dict)
    facts: GraphFacts = field(default_factory=GraphFacts)
    opaque: bool = True  # it calls ops outside the ONNX domains (paths.has_opaque_ops)

    def signature(self) -> dict[str, str]:
        return {spec.name: spec.type_text for spec in self.inputs}

    def compute_precision(self) -> str:
        """The least precise float type any output is computed in ("float32" where none is known): the rounding
        the check's own-rounding draws move the original's float data by."""
        return lowest(path.precision for path in self.paths.values()) or "float32"


@dataclass
class Binding:
    """A value for every dynamic dim, and the input regimes its data is drawn in."""

    dims: dict[str, int]
    regimes: list[str]
    scale: float = 1.0
    padded: bool = False
    past: int = 0


def read_spec(path: Path) -> ModelSpec:
    """The inputs (without initializer-backed ones), output names and output paths of the model at ``path``."""
    try:
        model = onnx.load(str(input_file(path)), load_external_data=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (DecodeError, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable ONNX model ({exc})") from None
    graph = model.graph
    initialized = {init.name for init in graph.initializer}
    facts = graph_facts(graph, {prop.key: prop.value for prop in model.metadata_props})
    inputs = tuple(
        _input_spec(value, facts.roles.get(value.name)) for value in graph.input if value.name not in initialized
    )
    outputs = tuple(value.name for value in graph.output)
    return ModelSpec(inputs, outputs, output_paths(graph), facts, has_opaque_ops(graph))


def _input_spec(value: onnx.ValueInfoProto, role: Role | None) -> InputSpec:
    type_text = _type_text(value.type)
    containers, inner = held_tensor(value.type)
    if inner.WhichOneof("value") != "tensor_type":
        return InputSpec(value.name, type_text, None, None)
    tensor_type = inner.tensor_type
    try:
        dtype: np.dtype | None = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    except (KeyError, TypeError, ValueError):
        dtype = None
    shape: tuple[Dim, ...] | None = None
    if tensor_type.HasField("shape"):
        shape = tuple(_dim(d) for d in tensor_type.shape.dim)
    elif "seq" in containers:  # exporters seldom state a sequence's tensor shapes: vectors
        shape = (None,)
    return InputSpec(value.name, type_text, dtype, shape, role, containers)


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


def dim_keys(spec: ModelSpec) -> list[str]:
    """Every dynamic dim's key, in the order the inputs declare them."""
    return list(dict.fromkeys(key for s in spec.inputs for key in s.axis_keys() if key is not None))


def candidate_count() -> int:
    return len(_CANDIDATES)


def bind_dims(spec: ModelSpec, k: int, fixed: Mapping[str, int]) -> Binding:
    """Candidate binding ``k``: a value for every dynamic dim, with the regimes it draws its data in.

    ``fixed`` (the user's ``--dim KEY=VALUE``, KEY a name or ``input[axis]``) wins in every binding.
    """
    return _bind(spec, _CANDIDATES[k % len(_CANDIDATES)], fixed)


def largest_binding(spec: ModelSpec, fixed: Mapping[str, int]) -> Binding:
    """The binding at the largest sizes the model declares or a table bounds: sequences up to
    the position table's rows (a prompt over the second half of them after a cache of the
    first), images of 448 x 512, a batch of 5. ``fixed`` wins, as in :func:`bind_dims`."""
    return _bind(spec, _LARGEST, fixed)


def _bind(spec: ModelSpec, candidate: _Candidate, fixed: Mapping[str, int]) -> Binding:
    facts = spec.facts
    if candidate.largest:
        limit = min(_LARGEST_SEQUENCE, facts.seq_limit or _LONG)
    else:
        limit = min(_LONG, facts.seq_limit or _LONG)
    long = candidate.seq is None
    seq = min(limit, candidate.seq or limit)
    if facts.cache and candidate.largest:
        seq, past = limit - limit // 2, limit // 2
    elif facts.cache:
        seq, past = (1, max(limit - 1, 0)) if long else (seq, min(candidate.past or 0, limit - seq))
    else:
        past = 0
    stride = facts.stride
    spatial = [_spatial(size, stride) for size in candidate.spatial]
    values = {"batch": candidate.batch, "seq": seq, "past": past, "other": candidate.other}
    dims: dict[str, int] = {}
    seen: dict[str, int] = {}
    for key in dim_keys(spec):
        first = next((k for k in dims if facts.group(k) == facts.group(key)), None)
        if first is not None:  # the graph shows this dim equal to one bound already
            dims[key] = fixed.get(key, dims[first])
            continue
        kind = facts.kinds.get(key, "other")
        offset = seen.get(kind, 0)
        seen[kind] = offset + 1
        named = not key.endswith("]")
        if kind == "spatial":
            value = _fitted(spatial[offset % 2] + (stride * (offset // 2) if candidate.distinct else 0), key, spec)
        elif kind == "total":
            value = -1  # past + sequence, once both are known
        else:
            apart = offset if candidate.distinct and named and kind != "past" else 0
            value = _fitted(values[kind] + apart, key, spec)
        dims[key] = fixed.get(key, value)
    sequence = next((v for key, v in dims.items() if facts.kinds.get(key) == "seq"), seq)
    cache = next((v for key, v in dims.items() if facts.kinds.get(key) == "past"), past)
    dims = {key: sequence + cache if value == -1 else value for key, value in dims.items()}
    binding = Binding(dims, [], candidate.scale, candidate.padded, cache)
    binding.regimes = _regimes(spec, binding, sequence, long, candidate.largest)
    return binding


def _fitted(value: int, key: str, spec: ModelSpec) -> int:
    """``value`` as the model's ops accept it (lengths.py): raised past the smallest size they
    take, by what it lacked (so the bindings keep different sizes), then rounded up to the
    factor a Reshape bakes in (down where that passes the position table and still fits)."""
    facts = spec.facts
    group, kind = facts.group(key), facts.kinds.get(key, "other")
    smallest = facts.smallest.get(group, 1)
    if value < smallest:
        value += smallest - 1
    step = math.lcm(facts.multiple.get(group, 1), facts.stride if kind == "spatial" else 1)
    fitted = -(-value // step) * step
    limit = facts.seq_limit
    if kind == "seq" and limit and fitted > limit >= smallest and limit // step * step >= smallest:
        fitted = limit // step * step
    return fitted


def input_elements(spec: ModelSpec, dims: Mapping[str, int]) -> int:
    """How many elements the generated inputs hold at ``dims`` (what making and comparing data costs)."""
    count = 0
    for input_spec in spec.inputs:
        axes = zip(input_spec.axis_keys(), input_spec.shape or (), strict=True)
        size = math.prod(dims.get(key, 1) if key is not None else int(d or 1) for key, d in axes)
        count += size * (SEQUENCE_LENGTH if "seq" in input_spec.containers else 1)
    return count


def run_cost(spec: ModelSpec, dims: Mapping[str, int]) -> int:
    """How a run's time grows with its dims: their product over the groups of equal dims, a
    sequence's squared where the model attends (compares every position with every other)."""
    groups = {spec.facts.group(key): value for key, value in dims.items()}
    sequences = ("seq", "past", "total") if spec.facts.attends else ()
    return math.prod(v ** (2 if spec.facts.kinds.get(k) in sequences else 1) for k, v in groups.items())


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


def _spatial(size: int, stride: int) -> int:
    if size < _IN_STRIDES:
        return size * stride
    return -(-size // stride) * stride


def _regimes(spec: ModelSpec, binding: Binding, seq: int, long: bool, largest: bool) -> list[str]:
    kinds = {spec.facts.kinds.get(key) for key in binding.dims}
    roles = {s.role.kind for s in spec.inputs if s.role is not None}
    names: list[str] = ["largest sizes"] if largest else []
    batch = next((v for key, v in binding.dims.items() if spec.facts.kinds.get(key) == "batch"), 1)
    if spec.facts.cache:
        names.append(f"{'long ' if long else ''}sequence {binding.past + seq}: a cache of {binding.past} + {seq} new")
    elif "seq" in kinds:
        names.append(f"{'long ' if long else ''}sequence {seq}")
    spatial = [v for key, v in binding.dims.items() if spec.facts.kinds.get(key) == "spatial"]
    if spatial:
        names.append("images " + " x ".join(map(str, spatial[:2])))
    if "mask" in roles:
        names.append("padded masks" if binding.padded and batch > 1 else "full masks")
    if "ids" in roles:
        names.append("ids over the whole table")
    if "position" in roles:
        names.append("positions after the cache" if spec.facts.cache else "positions from 0")
    if any(s.dtype is not None and _floating(s.dtype) and s.role is None for s in spec.inputs):
        names.append("floats at unit scale" if binding.scale == 1.0 else f"floats at scale {binding.scale:g}")
    if roles & {"index", "length", "split", "sizes", "reshape", "axes", "zero", "one", "count", "end"}:
        names.append("small shape, count and index operands")
    return names


def make_inputs(spec: ModelSpec, binding: Binding, rng: np.random.Generator) -> dict[str, Feed]:
    """Seeded data for every input at ``binding`` (see the module docstring)."""
    feeds: dict[str, Feed] = {}
    for input_spec in spec.inputs:
        assert input_spec.dtype is not None and input_spec.shape is not None, input_spec.unsupported()
        shape = tuple(
            binding.dims[key] if key is not None else int(d)  # type: ignore[arg-type]
            for key, d in zip(input_spec.axis_keys(), input_spec.shape, strict=True)
        )
        if "seq" in input_spec.containers:
            feeds[input_spec.name] = [_data(input_spec, shape, binding, rng) for _ in range(SEQUENCE_LENGTH)]
        else:
            feeds[input_spec.name] = _data(input_spec, shape, binding, rng)
    return feeds


def _floating(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or (exotic(dtype) and not dtype.name.startswith(("int", "uint")))


def _data(spec: InputSpec, shape: tuple[int, ...], binding: Binding, rng: np.random.Generator) -> np.ndarray:
    dtype = spec.dtype
    assert dtype is not None
    role = spec.role
    if dtype.kind in "OUS":
        words = np.array(["a", "b", "graphopt", ""], dtype=object)
        return np.asarray(words[rng.integers(0, len(words), size=shape)], dtype=object)
    if role is not None and role.kind == "mask":
        return _mask(shape, binding.padded).astype(dtype)
    if dtype.kind == "b":  # a comparison of a rank-0 draw is a numpy scalar, which onnxruntime refuses
        return np.asarray(rng.random(shape) < 0.5)
    if role is not None:
        return _operand(role, shape, binding, rng).astype(dtype)
    if _floating(dtype):
        if dtype.name == "float8_e8m0fnu":  # powers of two only
            return np.exp2(rng.integers(-4, 5, size=shape)).astype(dtype)
        values = rng.standard_normal(shape) * binding.scale
        if dtype.kind == "c":
            values = values + 1j * rng.standard_normal(shape) * binding.scale
        return np.asarray(values).astype(dtype)
    info = ml_dtypes.iinfo(dtype) if exotic(dtype) else np.iinfo(dtype)
    return rng.integers(max(int(info.min), 0), min(int(info.max), _MAX_INT - 1) + 1, size=shape).astype(dtype)


def _mask(shape: tuple[int, ...], padded: bool) -> np.ndarray:
    """Ones; padded: along the last axis, the first row ends in zeros and the second starts with them."""
    mask = np.ones(shape, dtype=np.int64)
    if padded and len(shape) >= 2 and shape[0] >= 2 and shape[-1] >= 2:
        pad = max(1, shape[-1] // 4)
        mask[0, ..., shape[-1] - pad :] = 0
        mask[1, ..., :pad] = 0
    return mask


def _operand(role: Role, shape: tuple[int, ...], binding: Binding, rng: np.random.Generator) -> np.ndarray:
    return np.asarray(_operand_values(role, shape, binding, rng))


def _operand_values(role: Role, shape: tuple[int, ...], binding: Binding, rng: np.random.Generator) -> np.ndarray:
    size = math.prod(shape)
    if role.kind in ("ids", "index"):
        values = rng.integers(0, max(role.bound or 1, 1), size=size)
        if role.kind == "ids" and size >= 2:  # both ends of the table, whatever the draw
            values[0], values[-1] = 0, max((role.bound or 1) - 1, 0)
        return values.reshape(shape)
    if role.kind == "position":
        positions = binding.past + np.arange(shape[-1] if shape else 1)
        if role.bound:
            positions = np.minimum(positions, role.bound - 1)
        return np.broadcast_to(positions, shape).copy() if shape else positions[:1].reshape(())
    if role.kind == "length":  # one full length, the others anywhere in [1, bound]
        lengths = rng.integers(1, max(role.bound or 1, 1) + 1, size=size)
        lengths[:1] = role.bound or 1
        return lengths.reshape(shape)
    if role.kind == "sizes":
        return np.resize(np.asarray(role.values, np.int64), size).reshape(shape)
    if role.kind == "split":  # equal parts, the remainder in the last
        total, parts = size if role.bound is None else role.bound, max(size, 1)
        sizes = np.full(parts, total // parts)
        sizes[-1] += total - sizes.sum()
        return sizes[:size].reshape(shape)
    if role.kind == "reshape":  # [-1, 1, 1, ...] fits any element count
        return np.concatenate([[-1], np.ones(max(size - 1, 0), np.int64)])[:size].reshape(shape)
    if role.kind == "axes":
        return np.arange(size).reshape(shape)
    if role.kind == "count":
        return rng.integers(1, 3, size=shape)
    if role.kind == "end":
        return np.full(shape, np.iinfo(np.int32).max)
    return np.full(shape, 0 if role.kind == "zero" else 1)


def load_npz(path: Path, specs: tuple[InputSpec, ...]) -> tuple[dict[str, Feed], dict[str, int]]:
    """The user's arrays and the dims they bind; an array that cannot be fed is an InputError."""
    try:
        arrays = _read_npz(input_file(path))
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
    return dict[str, Feed](arrays), dims
