"""The check's memory budget: what running the original model would take, estimated from the
file, and a limit on the check's process that stops what the estimate misses.

onnxruntime holds every constant tensor of a model (initializers and Constant nodes, in
subgraphs too) while it runs, and two copies of them while it loads the model (measured: a
model of 600 MB of weights peaks at 1.2 GB while its session is made, inside the file or as
external data alike). Running, it holds the inputs and whatever the graph computed that is
still to be read. The estimate is the larger of the load (twice the constants) and the run:
the constants plus the peak, over the stored node order, of the values alive at once (a
value lives from the node that makes it to the last node that reads it; graph outputs to the
end), with shapes from onnx's shape inference and the binding's dims. Values whose size the
file does not tell (data-dependent shapes) count as nothing: the estimate is a floor, and
:func:`confine` stops what it misses.

The estimate cannot explode itself. onnx's data propagation (which finds the shapes that
Shape, Concat and Gather compute for a Reshape) holds each element of every vector it follows
as a dimension message, about 115 bytes, values known or not: Concat doublings of a 4 MiB
constant took it to 3.6 GB. So shape inference runs without it first, and with it only when
no vector of the model is longer than ``_PROPAGATED_ELEMENTS``; and in the check's process it
may take at most ``INFERENCE_MEMORY`` more than the process holds, past which it fails and the
declared shapes remain.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The command line reads DEFAULT_MEMORY_BUDGET for its help: nothing heavy at import.
if TYPE_CHECKING:
    import onnx

__all__ = ["DEFAULT_MEMORY_BUDGET", "Footprint", "confine", "footprint", "gigabytes"]

# Bytes the check may use unless --check-memory says otherwise: a model with 3.5 GB of
# weights, on a 16 GB CI runner.
DEFAULT_MEMORY_BUDGET = 8 * 10**9
# Shape inference may need the values of small constants (a Reshape's shape); the rest of
# the weights are hidden from it, so estimating never copies a model's weights.
_KEPT_FOR_INFERENCE = 4096
# Bytes onnx's shape inference may take beyond what the process holds, when the estimate is bounded.
INFERENCE_MEMORY = 1 << 30
# The longest vector (rank 0 or 1) with which data propagation runs: shape vectors are short.
_PROPAGATED_ELEMENTS = 1 << 16

Dim = int | str | None


def gigabytes(count: float) -> str:
    """``count`` bytes in GB, as the budget is given on the command line (1 GB = 1e9 bytes)."""
    return f"{count / 1e9:.3g} GB"


@dataclass(frozen=True)
class Footprint:
    """What the model at hand needs: its constants, and the values its nodes make and read."""

    constant_bytes: int
    sizes: Mapping[str, tuple[float, tuple[Dim, ...]]]  # value -> (bytes per element, shape)
    lifetimes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # per node: (made, last read here)

    @property
    def load_bytes(self) -> int:
        """What onnxruntime holds at the peak of loading the model: its constants, twice."""
        return 2 * self.constant_bytes

    def peak(self, dims: Mapping[str, int], feeds: Mapping[str, object]) -> int:
        """Estimated bytes at the busiest moment of loading, or of a run at the binding ``dims``
        on ``feeds``."""
        live = sum(_nbytes(value) for value in feeds.values())
        highest = live
        for made, freed in self.lifetimes:
            live += sum(self._bytes(name, dims) for name in made)
            highest = max(highest, live)
            live -= sum(_nbytes(feeds[name]) if name in feeds else self._bytes(name, dims) for name in freed)
        return max(self.load_bytes, self.constant_bytes + highest)

    def _bytes(self, name: str, dims: Mapping[str, int]) -> int:
        known = self.sizes.get(name)
        if known is None:
            return 0
        itemsize, shape = known
        values = [d if isinstance(d, int) else dims.get(d) if isinstance(d, str) else None for d in shape]
        if any(v is None for v in values):
            return 0
        return int(itemsize * math.prod(v for v in values if v is not None))


def _nbytes(value: object) -> int:
    """A feed's bytes: an array, a sequence's arrays, or a scalar (a rank-0 string input is fed as a str)."""
    import numpy as np

    if isinstance(value, list):
        return sum(_nbytes(item) for item in value)
    return int(np.asarray(value).nbytes)


def confine(budget: int) -> None:
    """Let this process take at most ``budget`` bytes (and a quarter more: the allocators' own
    overhead, and onnxruntime parsing a model whose weights are inside the file, which the
    estimate leaves out) more private memory than it holds now (RLIMIT_DATA: the heap and
    anonymous mappings, where onnxruntime and numpy allocate; a memory-mapped file does not
    count). Past it an allocation fails: MemoryError in Python, an error from onnxruntime.
    Linux only; elsewhere the estimate alone guards the budget."""
    import resource

    held = _held()
    if held is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    wanted = held + budget + budget // 4
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard))


def _held() -> int | None:
    """The private memory this process holds now (Linux), as RLIMIT_DATA counts it."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return None


@contextlib.contextmanager
def _at_most(extra: int) -> Iterator[None]:
    """Within the block, this process may take at most ``extra`` more bytes (and never more than
    its limit before); the limit before is restored after it."""
    import resource

    held = _held()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if held is None:
        yield
        return
    wanted = held + extra
    resource.setrlimit(resource.RLIMIT_DATA, (wanted if soft == resource.RLIM_INFINITY else min(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def footprint(path: Path, *, bounded: bool = False) -> Footprint:
    """The footprint of the model at ``path`` (its weights are not read); ``bounded``: shape
    inference may take at most INFERENCE_MEMORY (in the check's process: it lowers the limit
    of the whole process for a while)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    constant_bytes = sum(_tensor_bytes(t) for t in _constants(model.graph))
    lifetimes = _lifetimes(model.graph)
    for tensor in _constants(model.graph):
        if _tensor_bytes(tensor) > _KEPT_FOR_INFERENCE:
            _hide_data(tensor)
    try:
        with _at_most(INFERENCE_MEMORY) if bounded else contextlib.nullcontext():
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            if _longest_vector(inferred.graph) <= _PROPAGATED_ELEMENTS:
                inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # onnx's inference raises on models it does not understand (or out of memory)
        inferred = model
    graph = inferred.graph
    sizes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        known = _size(value.type)
        if known is not None:
            sizes[value.name] = known
    return Footprint(constant_bytes, sizes, lifetimes)


def _longest_vector(graph: onnx.GraphProto) -> int:
    """The most elements of a value of rank 0 or 1 whose length ``graph`` tells (0: none)."""
    lengths = [math.prod(tensor.dims) for tensor in graph.initializer if len(tensor.dims) <= 1]
    for value in [*graph.input, *graph.value_info, *graph.output]:
        known = _size(value.type)
        if known is not None and len(known[1]) <= 1 and all(isinstance(d, int) for d in known[1]):
            lengths.append(math.prod(d for d in known[1] if isinstance(d, int)))
    return max(lengths, default=0)


def _lifetimes(graph: onnx.GraphProto) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Per node of ``graph``: the values it makes, and those it is the last to read."""
    initialized = {t.name for t in graph.initializer}
    outputs = {v.name for v in graph.output}
    last_read: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in _reads(node):
            last_read[name] = index
    lifetimes = []
    for index, node in enumerate(graph.node):
        # A Constant's output is counted with the constants.
        made = () if node.op_type == "Constant" else tuple(name for name in node.output if name)
        freed = tuple(
            name
            for name in dict.fromkeys(_reads(node))
            if last_read[name] == index and name not in initialized and name not in outputs
        )
        lifetimes.append((made, freed))
    return tuple(lifetimes)


def _reads(node: onnx.NodeProto) -> Iterator[str]:
    """The values ``node`` reads, those its subgraphs read from the outer scope included."""
    yield from (name for name in node.input if name)
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            for inner in graph.node:
                yield from _reads(inner)


def _constants(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    yield from (sparse.values for sparse in graph.sparse_initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            if attribute.HasField("sparse_tensor"):
                yield attribute.sparse_tensor.values
            for inner in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _constants(inner)


def _itemsize(elem_type: int) -> float | None:
    import numpy as np
    import onnx

    if elem_type == onnx.TensorProto.STRING:
        return None
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None
    name = onnx.TensorProto.DataType.Name(elem_type)
    # 4-bit and 2-bit types are packed; numpy's stand-ins for them take a byte each.
    return 0.5 if name.endswith("4") or name.endswith("E2M1") else 0.25 if name.endswith("2") else dtype.itemsize


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    import onnx

    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    itemsize = _itemsize(tensor.data_type) or 0
    return int(itemsize * math.prod(tensor.dims))


def _hide_data(tensor: onnx.TensorProto) -> None:
    """Keep the tensor's type and dims, drop its bytes: shape inference reads no values from it."""
    import onnx

    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(name)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "hidden-from-the-estimate"


def _size(type_proto: onnx.TypeProto) -> tuple[float, tuple[Dim, ...]] | None:
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    itemsize = _itemsize(type_proto.tensor_type.elem_type)
    if itemsize is None:
        return None
    shape: list[Dim] = []
    for dim in type_proto.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        else:
            shape.append(dim.dim_param or None)
    return itemsize, tuple(shape)
