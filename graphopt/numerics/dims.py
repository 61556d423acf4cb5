"""What the graph says about the check's inputs: the kind of each dynamic dim and the role of each input.

Read from the ONNX graph before anything runs, so the bindings are ones the model runs at
and the data reaches where a wrong rewrite would show:

- Each dynamic dim has a kind. Names are hints ("batch", "N" -> batch; "seq", "len", "token",
  "time" -> sequence; "past" -> past; "total" -> total; "height", "width" -> spatial); where
  the name says nothing (unnamed, "unk__0", "p2o.DynamicDimension.1", "s53") the graph does:
  axis 0 is a batch, the axes of an input that reaches a Conv or pooling op are spatial, the
  second axis of an integer id or mask input is a sequence. In a model with a KV cache, the
  mask's non-batch dim is the total (past + sequence) whatever its name.
- Spatial dims take sizes every stride divides: the product of the strides of the Conv and
  pooling ops on the longest path, so feature maps of a detector's pyramid still concatenate.
- Sequences are capped by the position table: the rows of a table that a Gather reads with
  positions (from a Range, a slice of a stored position buffer, or a position-id input), or
  the limit the model's metadata names (max_position_embeddings, n_positions, ...).
- Each input has a role: ids (a Gather on a stored table reads them: spread over the table),
  indices into another input (bounded by its static dim: a Gather's, a MaxUnpool's into its
  output, a TensorScatter's write position, which leaves room for the update), lengths of
  another input's sequence (an RNN's sequence_lens, an Attention's nonpad_kv_seqlen), mask,
  a GroupQueryAttention's total_sequence_length and seqlens_k (past plus new keys, within its
  rotary cache),
  position ids, or an operand that sets a shape, count or axis (Tile repeats, Reshape shape,
  Expand shape, TopK k, Range limits, Slice starts, ...), which takes small valid values: the
  largest value in such an input multiplies what the model allocates. Sizes that other
  inputs constrain are solved from those inputs' static dims: split sizes add up to the
  axis, a Resize keeps the batch and channels, an AffineGrid's N is theta's, a MaxUnpool's
  output shape is the one its attributes give, a Col2Im's image_shape has as many blocks
  as its input holds, an integer vector a Split takes apart into its elements is a shape
  (N the inputs' batch, then 1 and small sizes: an expanded AffineGrid's size). Reads inside
  If, Loop and Scan bodies count as the outer value's.
- Each group of equal dims may have a smallest size and a factor its ops need (lengths.py:
  a reflect Pad, a Conv kernel, a frame Slice; a Reshape target's baked constants), and a
  model that multiplies two computed values (attention) runs in time that grows with a
  sequence squared.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import onnx

from graphopt.ir.node import STANDARD_DOMAINS
from graphopt.ir.ops import BROADCASTING
from graphopt.numerics.lengths import size_rules
from graphopt.numerics.paths import bodies, inline_array, is_qdq

__all__ = ["GraphFacts", "Role", "graph_facts", "held_tensor"]

# Roles, most constraining first: an input read in two ways takes the first role of the two.
_ROLE_ORDER = (
    "index",
    "ids",
    "length",
    "split",
    "sizes",
    "reshape",
    "axes",
    "zero",
    "one",
    "count",
    "end",
    "position",
    "mask",
)

# (op, input index) -> the role of an operand that sets a shape, count, axis or index.
_OPERAND_ROLES: dict[tuple[str, int], str] = {
    ("Tile", 1): "count",
    ("ConstantOfShape", 0): "count",
    ("OneHot", 1): "count",
    ("Range", 1): "count",
    ("Resize", 3): "count",
    ("NonMaxSuppression", 2): "count",
    ("Loop", 0): "count",
    ("STFT", 1): "count",  # frame_step: 0 divides by zero in onnxruntime (SIGFPE)
    ("STFT", 3): "count",
    ("Col2Im", 2): "one",  # block_shape: blocks of one element, image_shape then follows the input
    ("TopK", 1): "one",
    ("Expand", 1): "one",
    ("Slice", 4): "one",
    ("Range", 2): "one",
    ("Resize", 2): "one",
    ("Upsample", 1): "one",
    ("Range", 0): "zero",
    ("Dropout", 1): "zero",
    ("Slice", 1): "zero",
    ("Pad", 1): "zero",
    ("CumSum", 1): "zero",
    ("CumProd", 1): "zero",
    ("SequenceInsert", 2): "zero",  # a position in the sequence: 0 is one in any sequence
    ("SequenceAt", 1): "zero",
    ("SequenceErase", 1): "zero",
    ("DFT", 2): "one",  # the axis: 1, the first after the batch
    ("Slice", 2): "end",
    ("Slice", 3): "axes",
    ("Pad", 3): "axes",
    ("Unsqueeze", 1): "axes",
    ("Squeeze", 1): "axes",
    ("Reshape", 1): "reshape",
}
# (op, indices input) -> the data input those indices address and the axis (a name: the
# attribute that holds it, 0 by default).
_INDEXING: dict[tuple[str, int], tuple[int, int | str]] = {
    ("Gather", 1): (0, "axis"),
    ("GatherElements", 1): (0, "axis"),
    ("GatherND", 1): (0, "axis"),
    ("ScatterElements", 1): (0, "axis"),
    ("Scatter", 1): (0, "axis"),
    ("ScatterND", 1): (0, "axis"),
    ("NegativeLogLikelihoodLoss", 1): (0, 1),  # class labels
    ("SoftmaxCrossEntropyLoss", 1): (0, 1),
    ("ArrayFeatureExtractor", 1): (0, -1),
}
# (com.microsoft op, ids input) -> the stored table those ids read rows of: onnxruntime's fused
# embedding reads input ids from its word table, segment ids from its segment table, position
# ids from its position table.
_EMBEDDING_TABLES: dict[tuple[str, int], int] = {
    ("EmbedLayerNormalization", 0): 2,
    ("EmbedLayerNormalization", 1): 4,
    ("EmbedLayerNormalization", 8): 3,
}
# (op, lengths input) -> the input whose sequence they measure and its axis, as in _INDEXING.
_LENGTHS: dict[tuple[str, int], tuple[int, int | str]] = {
    ("ReverseSequence", 1): (0, "time_axis"),
    ("LSTM", 4): (0, 0),
    ("GRU", 4): (0, 0),
    ("RNN", 4): (0, 0),
    ("Attention", 6): (1, -2),  # nonpad_kv_seqlen: the keys, [batch, (heads,) kv_sequence, size]
}
# The values a size operand takes on the axes no other input fixes: small, distinct, non-square.
_FREE_SIZES = (3, 4, 5, 6)
# Ops that hand an input on with its values (ids, positions, shapes) unchanged, by the inputs that do.
_PASSTHROUGH: dict[str, tuple[int, ...]] = {
    "Cast": (0,),
    "Identity": (0,),
    "Reshape": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Flatten": (0,),
    "Where": (1, 2),
}
# Ops an image passes through on its way to the first Conv (normalization, layout, padding).
_TO_CONV: dict[str, tuple[int, ...]] = {
    "Cast": (0,),
    "Identity": (0,),
    "Transpose": (0,),
    "Mul": (0, 1),
    "Add": (0, 1),
    "Sub": (0, 1),
    "Div": (0,),
    "Pad": (0,),
    "Unsqueeze": (0,),
    "Reshape": (0,),
}
_CONV_OPS = frozenset(
    {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool", "DeformConv"}
)
_STRIDED = frozenset({"Conv", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool", "DeformConv"})
# The largest stride product a spatial size is rounded to (deeper pyramids are rare and
# every such size stays a multiple of it anyway).
_MAX_STRIDE = 64
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})
# Kinds by how much they tell: of two dims the graph shows equal, both take the earlier kind.
_KIND_ORDER = ("past", "total", "batch", "seq", "spatial", "other")
# Metadata keys exporters write the longest sequence under.
_LIMIT_KEYS = frozenset({"max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx"})
_SEQ_WORDS = ("seq", "len", "token", "time", "step", "frame", "sample")
_SPATIAL_NAMES = frozenset({"h", "w", "height", "width", "img_h", "img_w", "image_height", "image_width"})


@dataclass(frozen=True)
class Role:
    kind: str  # one of _ROLE_ORDER
    bound: int | None = None  # ids and index: values lie in [0, bound); length: in [1, bound]; split: their sum
    values: tuple[int, ...] = ()  # sizes: exactly these


@dataclass(frozen=True)
class GraphFacts:
    roles: dict[str, Role] = field(default_factory=dict)  # by input name; absent: plain data
    kinds: dict[str, str] = field(default_factory=dict)  # by dim key: batch, seq, past, total, spatial, other
    stride: int = 1  # spatial sizes are multiples of this
    seq_limit: int | None = None  # the rows of the position table
    cache: bool = False  # the model takes a KV cache (a past dim)
    same: dict[str, str] = field(default_factory=dict)  # dim key -> the key the graph shows it equal to
    # By the key of a group of equal dims (``same``): the least value its ops accept, and a
    # factor its value must have (lengths.py).
    smallest: dict[str, int] = field(default_factory=dict)
    multiple: dict[str, int] = field(default_factory=dict)
    attends: bool = False  # it multiplies two computed values (attention): time grows with a sequence squared

    def group(self, key: str) -> str:
        """The key that stands for every dim the graph shows equal to ``key``."""
        return self.same.get(key, key)


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """The (node, input index) reads of every value, those of nodes inside If, Loop and Scan
    bodies included: a body reads the outer scope's values by name."""
    found: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    pending = [graph]
    while pending:
        for node in pending.pop().node:
            for index, name in enumerate(node.input):
                if name:
                    found.setdefault(name, []).append((node, index))
            pending.extend(body for attribute in node.attribute for body in bodies(attribute))
    return found


def _standard(node: onnx.NodeProto) -> bool:
    return node.domain in STANDARD_DOMAINS


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _static_dims(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Every value whose shape the file states: initializers and declared inputs, values, outputs."""
    dims: dict[str, list[int | None]] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.WhichOneof("value") == "tensor_type" and info.type.tensor_type.HasField("shape"):
            dims[info.name] = [
                d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim
            ]
    for init in graph.initializer:
        dims[init.name] = list(init.dims)
    return dims


def _reach(
    start: str, consumers: dict[str, list[tuple[onnx.NodeProto, int]]], through: dict[str, tuple[int, ...]]
) -> Iterator[tuple[onnx.NodeProto, int]]:
    """The (node, input index) uses of ``start`` and of what ``through`` ops make of it as their data."""
    frontier, seen = [start], set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        for node, index in consumers.get(name, []):
            if _standard(node) and index in through.get(node.op_type, ()):
                frontier.extend(n for n in node.output if n)
            else:
                yield node, index


def _role(
    node: onnx.NodeProto, index: int, stored: dict[str, list[int]], static: dict[str, list[int | None]]
) -> Role | None:
    op = node.op_type
    if node.domain == "com.microsoft" and (op, index) in _EMBEDDING_TABLES:
        table = stored.get(node.input[_EMBEDDING_TABLES[op, index]]) if len(node.input) > 2 else None
        return Role("ids", table[0]) if table else None
    if index == 1 and (rows := _table_rows(node, stored)) is not None:
        return Role("ids", rows)
    if node.domain == "com.microsoft" and op == "GroupQueryAttention" and index in (5, 6):
        total = _gqa_total_length(node, static)
        return Role("sizes", values=(total - 1 if index == 5 else total,)) if total else None
    if not _standard(node) and node.domain != "ai.onnx.ml":
        return None
    if (op, index) in _INDEXING or (op, index) in _LENGTHS:
        data_index, where = _INDEXING.get((op, index)) or _LENGTHS[op, index]
        data = node.input[data_index]
        attribute = _attribute(node, where) if isinstance(where, str) else None
        axis = where if isinstance(where, int) else attribute.i if attribute is not None else 0
        data_dims = static.get(data) or []
        if op in ("GatherND", "ScatterND"):
            known = [d for d in data_dims if d]
            return Role("index", min(known) if known else 1)
        return Role("length" if (op, index) in _LENGTHS else "index", _axis_size(data_dims, axis) or 1)
    if op.startswith("Reduce") and index == 1:  # every Reduce* takes its axes there
        return Role("axes")
    if op in ("Split", "SplitToSequence") and index == 1:  # sizes that add up to the axis
        attribute = _attribute(node, "axis")
        size = _axis_size(static.get(node.input[0]) or [], attribute.i if attribute is not None else 0)
        return Role("split", size) if size is not None else None
    solved = _solved(node, index, static)
    if solved is not None:
        return solved
    kind = _OPERAND_ROLES.get((op, index))
    return Role(kind) if kind is not None else None


def _table_rows(node: onnx.NodeProto, stored: dict[str, list[int]]) -> int | None:
    """The rows along its gathered axis of the stored table a Gather reads, or onnxruntime's GatherBlockQuantized
    (the 4-bit quantizer's embeddings); None for any other node."""
    standard = _standard(node) and node.op_type == "Gather"
    quantized = node.domain == "com.microsoft" and node.op_type == "GatherBlockQuantized"
    table = stored.get(node.input[0]) if (standard or quantized) and len(node.input) > 1 else None
    attribute = _attribute(node, "axis" if standard else "gather_axis")
    axis = attribute.i if attribute is not None else 0
    return table[axis % len(table)] if table and -len(table) <= axis < len(table) else None


def _gqa_total_length(node: onnx.NodeProto, static: dict[str, list[int | None]]) -> int | None:
    """The total_sequence_length onnxruntime's GroupQueryAttention accepts (each row of seqlens_k
    is that less one): the past keys plus the new ones (a cache that grows), or, where its rotary
    cache has fewer rows than that or several new keys follow a past at a batch above one (which
    onnxruntime refuses), a cache the new keys are written into: a prompt (several new keys)
    starts it, a decoding step fills it. None where the static dims do not say."""

    def dim(index: int, axis: int) -> int | None:
        name = node.input[index] if len(node.input) > index else ""
        return _axis_size(static.get(name) or [], axis) if name else 0

    batch, new, past, rows = dim(0, 0), dim(0, 1), dim(3, 2), dim(7, 0)
    if not new or past is None or rows is None:
        return None
    within_rotary = not rows or past + new <= rows
    if within_rotary and (not past or new == 1 or batch == 1):
        return past + new
    room = min(past, rows) if rows else past
    if new > room:
        return None
    return new if new > 1 else room


def _solved(node: onnx.NodeProto, index: int, static: dict[str, list[int | None]]) -> Role | None:
    """The role of an operand whose valid values the op's other inputs decide, when their
    static dims are known (None otherwise: the table's role applies)."""
    op = node.op_type
    first = static.get(node.input[0]) or [] if node.input else []
    shape = [d for d in first if d is not None] if first and None not in first else None
    if op == "Resize" and index == 3 and shape:  # sizes: the batch and channels kept, the image resized
        listed = _attribute(node, "axes")
        axes = [a % len(shape) for a in listed.ints] if listed is not None else range(len(shape))
        return Role("sizes", values=tuple(shape[a] if a < len(shape) - 2 else shape[a] + 1 for a in axes))
    if op == "AffineGrid" and index == 1 and first and first[0] is not None:  # size: N, C, then the grid
        rank = (static.get(node.input[1]) or [4])[0] or 4
        return Role("sizes", values=(first[0], 1, *_FREE_SIZES[: rank - 2]))
    if op == "MaxUnpool" and index in (1, 2) and shape:
        out = _unpooled(node, shape)
        if index == 1:  # indices into each image of the output
            return Role("index", math.prod(out[2:]))
        return Role("sizes", values=tuple(out))
    if op == "TensorScatter" and index == 2 and len(node.input) > 1:  # a write that leaves room for the update
        attribute = _attribute(node, "axis")
        axis = attribute.i if attribute is not None else -2
        cache, update = _axis_size(first, axis), _axis_size(static.get(node.input[1]) or [], axis)
        return Role("index", cache - update + 1) if cache is not None and update is not None else None
    if op == "Col2Im" and index == 1 and shape and len(shape) == 3:
        image = _col2im_image(node, shape[2], (static.get(node.input[1]) or [0])[0] or 0)
        return Role("sizes", values=image) if image else None
    return None


def _ints(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    attribute = _attribute(node, name)
    return list(attribute.ints) if attribute is not None and attribute.ints else default


def _unpooled(node: onnx.NodeProto, shape: list[int]) -> list[int]:
    """The output shape of a MaxUnpool over ``shape`` as its attributes give it."""
    spatial = len(shape) - 2
    kernel = _ints(node, "kernel_shape", [1] * spatial)
    strides = _ints(node, "strides", [1] * spatial)
    pads = _ints(node, "pads", [0] * 2 * spatial)
    return shape[:2] + [
        (size - 1) * strides[i] + kernel[i] - pads[i] - pads[i + spatial] for i, size in enumerate(shape[2:])
    ]


def _col2im_image(node: onnx.NodeProto, blocks: int, rank: int) -> tuple[int, ...] | None:
    """An image_shape whose blocks of one element (block_shape is all ones) number ``blocks``:
    one block along every axis but the first (as the pads allow), the rest along the first."""
    if rank < 1:
        return None
    strides = _ints(node, "strides", [1] * rank)
    pads = _ints(node, "pads", [0] * 2 * rank)
    padding = [pads[i] + pads[i + rank] for i in range(rank)]
    along = [padding[i] // strides[i] + 1 for i in range(1, rank)]  # blocks of an image one element wide
    first, left = divmod(blocks, math.prod(along))
    height = (first - 1) * strides[0] + 1 - padding[0]
    return (height, *([1] * (rank - 1))) if left == 0 and first >= 1 and height >= 1 else None


def _axis_size(dims: list[int | None], axis: int) -> int | None:
    return dims[axis % len(dims)] if dims and -len(dims) <= axis < len(dims) else None


def _stored(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The dims of every stored tensor, and of what a Cast, Identity or DequantizeLinear makes of one (a float16
    or quantized table read as float)."""
    stored = {init.name: list(init.dims) for init in graph.initializer}
    for node in graph.node:
        kept = ("Cast", "Identity", "DequantizeLinear")
        read = is_qdq(node, "DequantizeLinear") or (_standard(node) and node.op_type in kept)  # 16-bit QDQ's DQ too
        if read and node.input and node.input[0] in stored:
            stored[node.output[0]] = stored[node.input[0]]
    return stored


def _split_into_dims(node: onnx.NodeProto, index: int, length: int | None, batch: int) -> Role | None:
    """An integer vector a Split cuts into its elements is a shape taken apart into its dims (an
    expanded AffineGrid's size: N, C, then the grid): N the inputs' batch, the rest small."""
    equal = len(node.input) < 2 or not node.input[1]
    if node.op_type != "Split" or index != 0 or not equal or _attribute(node, "split") is not None:
        return None
    if length is None or length < 2 or len(node.output) != length:
        return None
    return Role("sizes", values=(batch, 1, *_FREE_SIZES[: length - 2]))


def _batch(inputs: list[onnx.ValueInfoProto], static: dict[str, list[int | None]]) -> int:
    """The static first dim the inputs of rank two and more share, else 1."""
    firsts = {dims[0] for value in inputs if len(dims := static.get(value.name) or []) >= 2}
    shared = firsts.pop() if len(firsts) == 1 else None
    return shared or 1


def _input_roles(graph: onnx.GraphProto, inputs: list[onnx.ValueInfoProto]) -> dict[str, Role]:
    consumers = _consumers(graph)
    stored = _stored(graph)
    static = _static_dims(graph)
    batch = _batch(inputs, static)
    roles: dict[str, Role] = {}
    for value in inputs:
        integer = value.type.tensor_type.elem_type in _INTEGER_TYPES
        dims = static.get(value.name) or []
        length = dims[0] if len(dims) == 1 else None
        found = [
            r
            for node, index in _reach(value.name, consumers, _PASSTHROUGH)
            if (r := _role(node, index, stored, static))
            or (integer and _standard(node) and (r := _split_into_dims(node, index, length, batch)))
        ]
        lowered = value.name.lower()
        if "mask" in lowered:
            found.append(Role("mask"))
        if "position" in lowered and integer and all(r.kind in ("ids", "mask") for r in found):
            found = [Role("position", min((r.bound for r in found if r.bound), default=None))]
        if not found:
            continue
        best = min(found, key=lambda r: (_ROLE_ORDER.index(r.kind), r.bound or 0))
        if best.kind in ("ids", "index", "length"):
            best = Role(best.kind, min(r.bound or 1 for r in found if r.kind == best.kind))
        roles[value.name] = best
    return roles


def _to_conv(name: str, consumers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> bool:
    return any(
        _standard(node) and node.op_type in _CONV_OPS and index == 0
        for node, index in _reach(name, consumers, _TO_CONV)
    )


def _stride(graph: onnx.GraphProto) -> int:
    """The largest product of strides along any path (values not on a strided path count 1)."""
    stride: dict[str, int] = {}
    for node in graph.node:
        before = max((stride.get(n, 1) for n in node.input if n), default=1)
        step = 1
        if _standard(node) and node.op_type in _STRIDED:
            attribute = _attribute(node, "strides")
            step = max(attribute.ints) if attribute is not None and attribute.ints else 1
        for name in node.output:
            stride[name] = min(before * max(step, 1), _MAX_STRIDE)
    return max(stride.values(), default=1)


def _seq_limit(graph: onnx.GraphProto, position_inputs: set[str]) -> int | None:
    """The rows of the smallest table a Gather reads with positions, or None."""
    stored = _stored(graph)
    producers = {name: node for node in graph.node for name in node.output if name}
    limits: list[int] = []

    def positional(name: str, depth: int = 0) -> int | None:
        """Whether ``name`` holds positions: 0 (unbounded) or a buffer's length, or None if not."""
        if name in position_inputs:
            return 0
        node = producers.get(name)
        if node is None or depth > 8 or not _standard(node):
            return None
        if node.op_type == "Range":
            return 0
        if node.op_type == "Slice" and node.input[0] in stored and stored[node.input[0]]:
            return stored[node.input[0]][-1]
        if node.op_type in ("Add", "Expand", "Cast", "Unsqueeze", "Reshape", "Slice", "Identity", "Squeeze"):
            return next((f for n in node.input[:1] if (f := positional(n, depth + 1)) is not None), None)
        return None

    for node in graph.node:
        rows = _table_rows(node, stored)
        buffer = positional(node.input[1]) if rows is not None else None
        if rows is not None and buffer is not None:
            limits.append(rows)
            if buffer:
                limits.append(buffer)
    return min(limits) if limits else None


_SAME_SHAPE = frozenset(
    {
        "Cast",
        "Identity",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Neg",
        "Abs",
        "Exp",
        "Log",
        "Sqrt",
        "Erf",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "Dropout",
        "Clip",
        "LeakyRelu",
        "Gelu",
        "Not",
        "IsNaN",
        "Floor",
        "Ceil",
        "Round",
        "Reciprocal",
        "Sign",
        "HardSigmoid",
        "Softplus",
        "Elu",
        "Selu",
        "CumSum",
    }
)
# BitwiseAnd / BitwiseOr / BitwiseXor were never on this list: adding them would tie more dims
# for a model that has them and so change the inputs the check generates; kept as it was.
_BROADCAST = BROADCASTING - {"BitwiseAnd", "BitwiseOr", "BitwiseXor"}
_RNN = frozenset({"LSTM", "GRU", "RNN"})

Axes = list[str | None]


class _Union:
    """Dim keys the graph makes equal (union-find)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        while self.parent.get(key, key) != key:
            key = self.parent[key]
        return key

    def join(self, a: str | None, b: str | None) -> str | None:
        if a is None or b is None:
            return a or b
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
        return ra


def _constant_ints(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The stored int64 scalars and vectors (axes lists)."""
    vectors = {
        init.name: inline_array(init)
        for init in graph.initializer
        if init.data_type == onnx.TensorProto.INT64 and len(init.dims) <= 1
    }
    return {name: [int(v) for v in array.ravel()] for name, array in vectors.items() if array is not None}


def _same_dims(graph: onnx.GraphProto, axes: dict[str, Axes]) -> dict[str, str]:
    """Each dim key the graph shows equal to an earlier one (broadcasting, Concat, MatMul, an RNN's
    state and input, ...), mapped to the first: an unnamed batch dim on a state input and on the audio."""
    union = _Union()
    known: dict[str, Axes] = dict(axes)
    for init in graph.initializer:
        known[init.name] = [None] * len(init.dims)
    ints = _constant_ints(graph)
    for node in graph.node:
        if not _standard(node) or not node.output:
            continue
        shapes = [known.get(n) if n else None for n in node.input]
        out = _propagate(node, shapes, ints, union)
        if out is not None:
            known[node.output[0]] = out
    return {key: union.find(key) for key in union.parent}


def _propagate(
    node: onnx.NodeProto, shapes: list[Axes | None], ints: dict[str, list[int]], union: _Union
) -> Axes | None:
    op, first = node.op_type, shapes[0] if shapes else None
    if op in _SAME_SHAPE:
        return first
    if op in _BROADCAST:
        if any(s is None for s in shapes):
            return None
        rank = max(len(s) for s in shapes if s is not None)
        out: Axes = [None] * rank
        for shape in shapes:
            assert shape is not None
            for i, key in enumerate(shape):
                slot = rank - len(shape) + i
                out[slot] = union.join(out[slot], key)
        return out
    if not first:  # unknown, or a scalar: nothing to carry
        return None
    attribute = _attribute(node, "axis")
    if op == "Concat" and attribute is not None and all(s is not None and len(s) == len(first) for s in shapes):
        axis = attribute.i % len(first)
        out = list(first)
        for shape in shapes[1:]:
            assert shape is not None
            for i, key in enumerate(shape):
                if i != axis:
                    out[i] = union.join(out[i], key)
        out[axis] = None
        return out
    if op == "Gather" and len(shapes) > 1 and shapes[1] is not None and first:
        axis = (attribute.i if attribute is not None else 0) % len(first)
        return first[:axis] + list(shapes[1]) + first[axis + 1 :]
    if op == "Transpose":
        perm = _attribute(node, "perm")
        if perm is None:
            return first[::-1]
        return [first[i] for i in perm.ints] if sorted(perm.ints) == list(range(len(first))) else None
    if op in ("Unsqueeze", "Squeeze") or op.startswith("Reduce"):
        listed = _attribute(node, "axes")
        axes = list(listed.ints) if listed is not None else ints.get(node.input[1]) if len(node.input) > 1 else None
        if axes is None:
            return None
        if op == "Unsqueeze":
            out = list(first)
            for axis in sorted(a % (len(first) + len(axes)) for a in axes):
                out.insert(axis, None)
            return out
        keep = _attribute(node, "keepdims")
        dropped = {a % len(first) for a in axes} if first else set()
        if op != "Squeeze" and (keep is None or keep.i):
            return [None if i in dropped else key for i, key in enumerate(first)]
        return [key for i, key in enumerate(first) if i not in dropped]
    if op == "MatMul" and len(shapes) > 1 and shapes[1] is not None and len(first) >= 2 and len(shapes[1]) >= 2:
        other = shapes[1]
        union.join(first[-1], other[-2])
        batch = first[:-2] if len(first) >= len(other) else other[:-2]
        return [*batch, first[-2], other[-1]]
    if op in _CONV_OPS:
        return [first[0]] + [None] * (len(first) - 1)
    state = shapes[5] if len(shapes) > 5 else None
    if op in _RNN and state is not None and len(state) == 3 and len(first) == 3:
        union.join(first[1], state[1])
    return None


def _name_kind(name: str) -> str | None:
    lowered = name.lower()
    if "batch" in lowered or lowered == "n":
        return "batch"
    if "past" in lowered or "cache" in lowered:
        return "past"
    if "total" in lowered:
        return "total"
    if lowered in _SPATIAL_NAMES or "height" in lowered or "width" in lowered:
        return "spatial"
    if any(word in lowered for word in _SEQ_WORDS):
        return "seq"
    return None


def unnamed_key(input_name: str, axis: int) -> str:
    """How an unnamed dim is recorded in a binding's dims (and named in ``--dim``)."""
    return f"{input_name}[{axis}]"


def held_tensor(type_proto: onnx.TypeProto) -> tuple[tuple[str, ...], onnx.TypeProto]:
    """The containers around a value's tensor, outermost first ("seq", "optional"), and the type
    inside them: the tensor's, or a map or sparse tensor."""
    containers: list[str] = []
    while (kind := type_proto.WhichOneof("value")) in ("sequence_type", "optional_type"):
        containers.append("seq" if kind == "sequence_type" else "optional")
        type_proto = (
            type_proto.sequence_type.elem_type if kind == "sequence_type" else type_proto.optional_type.elem_type
        )
    return tuple(containers), type_proto


def _place_kind(elem_type: int, axis: int, rank: int, conv: bool, role: Role | None) -> str:
    """The kind a dim's place implies when its name says nothing."""
    if axis == 0 and rank > 1:
        return "batch"
    if conv:
        return "spatial"
    integer = elem_type in _INTEGER_TYPES
    if axis == rank - 1 and rank == 2 and (integer or (role is not None and role.kind == "mask")):
        return "seq"
    return "other"


def graph_facts(graph: onnx.GraphProto, metadata: Mapping[str, str] | None = None) -> GraphFacts:
    """What ``graph`` says about its inputs; ``metadata`` (the model's metadata_props) may name a
    position limit the graph does not show (a rotary embedding computes its positions)."""
    initialized = {init.name for init in graph.initializer}
    inputs = [value for value in graph.input if value.name not in initialized]
    roles = _input_roles(graph, inputs)
    consumers = _consumers(graph)
    kinds: dict[str, str] = {}
    for value in inputs:
        _, held = held_tensor(value.type)  # a sequence's or optional's tensors bind dims as a tensor does
        if held.WhichOneof("value") != "tensor_type" or not held.tensor_type.HasField("shape"):
            continue
        shape = held.tensor_type.shape.dim
        conv = _to_conv(value.name, consumers)
        channels_last = len(shape) == 4 and shape[3].HasField("dim_value") and not shape[1].HasField("dim_value")
        for axis, dim in enumerate(shape):
            if dim.HasField("dim_value") and dim.dim_value >= 0:
                continue
            named = dim.HasField("dim_param") and bool(dim.dim_param)
            key = dim.dim_param if named else unnamed_key(value.name, axis)
            if key in kinds:
                continue
            spatial_axis = conv and axis > 0 and not (channels_last and axis == 3)
            place = _place_kind(held.tensor_type.elem_type, axis, len(shape), spatial_axis, roles.get(value.name))
            hinted = _name_kind(dim.dim_param) if named else None
            kinds[key] = hinted or place
    same = _same_dims(graph, {value.name: _axis_keys(value) for value in inputs})
    for key, first in same.items():
        if key in kinds and first in kinds:  # one dim: the more telling kind of the two
            better = min(kinds[key], kinds[first], key=_KIND_ORDER.index)
            kinds[key] = kinds[first] = better
    cache = "past" in kinds.values()
    if cache:
        for value in inputs:
            role = roles.get(value.name)
            if role is None or role.kind != "mask" or not value.type.tensor_type.HasField("shape"):
                continue
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                key = dim.dim_param if dim.dim_param else unnamed_key(value.name, axis)
                if axis > 0 and kinds.get(key) in ("seq", "other"):
                    kinds[key] = "total"
    positions = {name for name, role in roles.items() if role.kind == "position"}
    stride = _stride(graph) if "spatial" in kinds.values() else 1
    limits = [n for n in (_seq_limit(graph, positions), _metadata_limit(metadata or {})) if n]
    facts = GraphFacts(roles, kinds, stride, min(limits, default=None), cache, same, attends=_attends(graph))
    rules = size_rules(graph, {value.name: axes for value in inputs if (axes := _input_axes(value)) is not None})
    for key, smallest in rules.smallest.items():
        facts.smallest[facts.group(key)] = max(smallest, facts.smallest.get(facts.group(key), 1))
    for keys, factor in rules.factors:  # on a dim other than the batch where there is one
        key = facts.group(next((k for k in reversed(keys) if kinds.get(k) != "batch"), keys[-1]))
        facts.multiple[key] = math.lcm(factor, facts.multiple.get(key, 1))
    return facts


# Ops that compare every position with every other.
_ATTENTION = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"})


def _attends(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` multiplies two computed values (scores of queries by keys) or calls an attention op."""
    stored = set(_stored(graph)) | {name for node in graph.node if node.op_type == "Constant" for name in node.output}
    return any(
        node.op_type in _ATTENTION
        or (_standard(node) and node.op_type in ("MatMul", "Einsum") and not stored & set(node.input))
        for node in graph.node
    )


def _metadata_limit(metadata: Mapping[str, str]) -> int | None:
    values = [v.strip() for k, v in metadata.items() if k.lower() in _LIMIT_KEYS]
    return min((int(v) for v in values if v.isdigit() and int(v) > 0), default=None)


def _input_axes(value: onnx.ValueInfoProto) -> list[int | str] | None:
    """Each axis of a tensor input: its static size, or its dim key."""
    if value.type.WhichOneof("value") != "tensor_type" or not value.type.tensor_type.HasField("shape"):
        return None
    keys = _axis_keys(value)
    return [key if key is not None else dim.dim_value for key, dim in zip(keys, value.type.tensor_type.shape.dim)]


def _axis_keys(value: onnx.ValueInfoProto) -> Axes:
    if value.type.WhichOneof("value") != "tensor_type" or not value.type.tensor_type.HasField("shape"):
        return []
    return [
        None if dim.HasField("dim_value") and dim.dim_value >= 0 else dim.dim_param or unnamed_key(value.name, axis)
        for axis, dim in enumerate(value.type.tensor_type.shape.dim)
    ]
