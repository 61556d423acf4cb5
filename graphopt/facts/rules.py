"""Per-op type rules: a table from op_type (default domain) to a function of an :class:`Op`.

A rule returns one entry per output: a :class:`TensorType` whose dims may be ints, names
or expressions (``None`` where unknown), or ``None`` for an output it cannot type. Rules
never invent a concrete value for a symbolic dim; where the spec clamps an index to a
dim (Slice, Shape's start/end) and the dim is symbolic, the index is taken as in range,
as it must be for the model to compute what its exporter traced.

Control flow (If, Loop, Scan) is handled by the driver, which owns subgraph traversal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from graphopt.facts.op import (
    Op,
    Operands,
    Shape,
    broadcast,
    d_add,
    d_div,
    d_mul,
    d_prod,
    d_sub,
    merge_dims,
    norm_axis,
    registrar,
    tensor,
)
from graphopt.ir import DataType, Dim, Tensor, TensorType
from graphopt.ir.constness import constant_node_tensor
from graphopt.ir.ops import BITWISE, BROADCASTING_ARITHMETIC, COMPARISONS
from graphopt.ir.slicing import slice_of

__all__ = ["RULES", "Outputs", "Rule", "matmul_shape", "quantized_as", "slice_dim", "window_dims"]

Outputs = list[TensorType | None]
Rule = Callable[[Op], Outputs]
RULES: dict[str, Rule] = {}

# Slice ends at or beyond this mean "to the end" (exporters write INT64_MAX or INT32_MAX).
_TO_END = 2**31 - 1


rule = registrar(RULES)


def _t(dtype: DataType | None, shape: Shape | None) -> TensorType | None:
    found = tensor(dtype, shape)
    return found if isinstance(found, TensorType) else None


# -- elementwise -------------------------------------------------------------------------


# x -> x (SimplifiedLayerNormalization: onnxruntime's RMS norm, registered in the default domain)
@rule(
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Ceil", "Celu", "Clip", "Cos", "Cosh",
    "CumSum", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "Identity",
    "InstanceNormalization", "LeakyRelu", "Log", "LogSoftmax", "LpNormalization", "LRN", "MeanVarianceNormalization",
    "Mish", "Neg", "Not", "Reciprocal", "Relu", "ReverseSequence", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin",
    "Sinh", "Softmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Trilu", "GroupNormalization",
    "ScatterElements", "ScatterND", "Scatter", "RMSNormalization", "RotaryEmbedding", "SimplifiedLayerNormalization",
)  # fmt: skip
def same_as_first(op: Op) -> Outputs:
    return [op.type(0)]


# x -> bool[x]
@rule("IsNaN", "IsInf")
def predicate(op: Op) -> Outputs:
    return [_t(DataType.BOOL, op.shape(0))]


# (a, b, ...) -> broadcast(a, b, ...) with a's element type
@rule(*BROADCASTING_ARITHMETIC, *BITWISE)
def broadcasting(op: Op) -> Outputs:
    dtype = next((op.dtype(i) for i in range(op.n_inputs) if op.dtype(i) is not None), None)
    return [_t(dtype, broadcast([op.shape(i) for i in range(op.n_inputs)]))]


# (a, b) -> bool[broadcast(a, b)]
@rule(*COMPARISONS)
def comparison(op: Op) -> Outputs:
    return [_t(DataType.BOOL, broadcast([op.shape(0), op.shape(1)]))]


# (cond, x, y) -> broadcast(cond, x, y) with x's element type
@rule("Where")
def where(op: Op) -> Outputs:
    return [_t(op.dtype(1) or op.dtype(2), broadcast([op.shape(0), op.shape(1), op.shape(2)]))]


@rule("Cast")
def cast(op: Op) -> Outputs:
    return [_t(DataType(op.attr("to")), op.shape(0))]


@rule("CastLike")
def cast_like(op: Op) -> Outputs:
    return [_t(op.dtype(1), op.shape(0))]


@rule("Dropout")
def dropout(op: Op) -> Outputs:
    return [op.type(0), _t(DataType.BOOL, op.shape(0))]


@rule("DequantizeLinear")
def dequantize(op: Op) -> Outputs:
    to = op.attr("output_dtype", 0)
    return [_t(DataType(to) if to else op.dtype(1), op.shape(0))]


@rule("DynamicQuantizeLinear")
def dynamic_quantize(op: Op) -> Outputs:
    return [_t(DataType.UINT8, op.shape(0)), _t(DataType.FLOAT, ()), _t(DataType.UINT8, ())]


@rule("QuantizeLinear")
def quantize(op: Op) -> Outputs:
    to = op.attr("output_dtype", 0)
    dtype = DataType(to) if to else (op.dtype(2) if op.input(2) is not None else DataType.UINT8)
    return [_t(dtype, op.shape(0))]


def quantized_as(float_rule: Rule, at: tuple[int, ...], zero_point: int, unquantized: DataType | None = None) -> Rule:
    """The rule of a quantized op computing ``float_rule``'s op on its inputs ``at``: that shape, in the type of
    its output zero point (input ``zero_point``; without one, ``unquantized``, else the first operand's)."""

    def rule(op: Op) -> Outputs:
        found = float_rule(Operands(op.node, op.opset, op.facts, at))[0]
        dtype = op.dtype(zero_point) if op.input(zero_point) is not None else unquantized or op.dtype(at[0])
        return [_t(dtype, found.shape if found is not None else None)]

    return rule


# -- normalization ------------------------------------------------------------------------


@rule("BatchNormalization")
def batch_norm(op: Op) -> Outputs:
    # Training mode adds running mean and variance outputs of shape [C].
    channels = op.shape(1)
    return [op.type(0)] + [_t(op.dtype(3), channels) for _ in op.node.outputs[1:]]


@rule("LayerNormalization")
def layer_norm(op: Op) -> Outputs:
    shape = op.shape(0)
    stash = DataType(op.attr("stash_type", 1))
    if shape is None:
        return [op.type(0), _t(stash, None), _t(stash, None)]
    axis = norm_axis(op.attr("axis", -1), len(shape))
    reduced = None if axis is None else shape[:axis] + (1,) * (len(shape) - axis)
    return [op.type(0), _t(stash, reduced), _t(stash, reduced)]


@rule("Attention")
def attention(op: Op) -> Outputs:
    """Y of Attention-23: (batch, q heads, q seq, v head size) from 4-D inputs, or (batch, q
    seq, q heads * v head size) from 3-D ones, whose hidden sizes hold the heads."""
    q, v = op.shape(0), op.shape(2)
    if q is None or v is None or len(q) != len(v) or len(q) not in (3, 4):
        return [_t(op.dtype(0), None)]
    if len(q) == 4:
        return [_t(op.dtype(0), (q[0], q[1], q[2], v[3]))]
    q_heads, kv_heads = op.attr("q_num_heads"), op.attr("kv_num_heads")
    if not isinstance(q_heads, int) or not isinstance(kv_heads, int) or kv_heads <= 0:
        return [_t(op.dtype(0), (q[0], q[1], None))]
    return [_t(op.dtype(0), (q[0], q[1], d_mul(d_div(v[2], kv_heads), q_heads)))]


# -- linear algebra -----------------------------------------------------------------------


@rule("MatMul", "MatMulInteger")
def matmul(op: Op) -> Outputs:
    dtype = DataType.INT32 if op.node.op_type == "MatMulInteger" else op.dtype(0)
    return [_t(dtype, matmul_shape(op.shape(0), op.shape(1)))]


def matmul_shape(a: Shape | None, b: Shape | None) -> Shape | None:
    """numpy.matmul's result shape (1-D operands promoted and the added dim dropped)."""
    if a is None or b is None or not a or not b:
        return None
    a_mat = a if len(a) > 1 else (1, *a)
    b_mat = b if len(b) > 1 else (*b, 1)
    batch = broadcast([a_mat[:-2], b_mat[:-2]])
    if batch is None:
        return None
    return batch + ((a_mat[-2],) if len(a) > 1 else ()) + ((b_mat[-1],) if len(b) > 1 else ())


@rule("Gemm")
def gemm(op: Op) -> Outputs:
    a, b = op.shape(0), op.shape(1)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return [_t(op.dtype(0), None)]
    rows = a[1] if op.attr("transA", 0) else a[0]
    cols = b[0] if op.attr("transB", 0) else b[1]
    return [_t(op.dtype(0), (rows, cols))]


_EINSUM_TERM = re.compile(r"^(?:[A-Za-z]|\.\.\.)*$")


@rule("Einsum")
def einsum(op: Op) -> Outputs:
    equation = op.attr("equation", b"").decode().replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != op.n_inputs or not all(_EINSUM_TERM.match(t) for t in [*terms, rhs]):
        return [_t(op.dtype(0), None)]
    letters: dict[str, Dim] = {}
    ellipses: list[Shape | None] = []
    for index, term in enumerate(terms):
        shape = op.shape(index)
        named = term.replace("...", "")
        if shape is None:
            ellipses.append(None)
            continue
        n_ellipsis = len(shape) - len(named)
        if n_ellipsis < 0 or ("..." not in term and n_ellipsis):
            return [_t(op.dtype(0), None)]
        head = term.split("...")[0] if "..." in term else term
        ellipses.append(shape[len(head) : len(head) + n_ellipsis] if "..." in term else ())
        for letter, dim in zip(named, shape[: len(head)] + shape[len(head) + n_ellipsis :], strict=False):
            letters[letter] = merge_dims(letters[letter], dim) if letter in letters else dim
    if not arrow:
        counts = {c: lhs.count(c) for c in set(lhs) if c.isalpha()}
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c, n in counts.items() if n == 1))
    ellipsis = broadcast([e for e in ellipses if e != ()] or [()])
    out: list[Dim] = []
    for part in re.findall(r"\.\.\.|[A-Za-z]", rhs):
        if part == "...":
            if ellipsis is None:
                return [_t(op.dtype(0), None)]
            out.extend(ellipsis)
        else:
            out.append(letters.get(part))
    return [_t(op.dtype(0), tuple(out))]


# -- convolution and pooling --------------------------------------------------------------


def window_dims(op: Op, spatial: Shape, kernel: list[int]) -> Shape:
    """Output spatial dims of a sliding window (Conv and the pools)."""
    n = len(spatial)
    strides = op.attr("strides") or [1] * n
    dilations = op.attr("dilations") or [1] * n
    pads = op.attr("pads") or [0] * (2 * n)
    auto_pad = op.attr("auto_pad", b"NOTSET")
    ceil_mode = op.attr("ceil_mode", 0)
    out: list[Dim] = []
    for i, size in enumerate(spatial):
        stride = strides[i]
        if auto_pad in (b"SAME_UPPER", b"SAME_LOWER"):
            out.append(d_div(d_add(size, stride - 1), stride))
            continue
        extent = dilations[i] * (kernel[i] - 1) + 1
        total_pad = 0 if auto_pad == b"VALID" else pads[i] + pads[i + n]
        span = d_sub(d_add(size, total_pad), extent)
        if ceil_mode:
            span = d_add(span, stride - 1)
        steps = d_add(d_div(span, stride), 1)
        # With ceil_mode the last window must still start inside the input or the left padding.
        if ceil_mode and isinstance(steps, int) and isinstance(size, int) and (steps - 1) * stride >= size + pads[i]:
            steps -= 1
        out.append(steps)
    return tuple(out)


@rule("Conv", "ConvInteger")
def conv(op: Op) -> Outputs:
    x, w = op.shape(0), op.shape(1)
    dtype = DataType.INT32 if op.node.op_type == "ConvInteger" else op.dtype(0)
    if x is None or len(x) < 3:
        return [_t(dtype, None)]
    kernel = op.attr("kernel_shape") or (list(w[2:]) if w is not None else None)
    channels = w[0] if w is not None else None
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        return [_t(dtype, (x[0], channels) + (None,) * (len(x) - 2))]
    return [_t(dtype, (x[0], channels, *window_dims(op, x[2:], kernel)))]


@rule("ConvTranspose")
def conv_transpose(op: Op) -> Outputs:
    x, w = op.shape(0), op.shape(1)
    if x is None or len(x) < 3:
        return [_t(op.dtype(0), None)]
    n = len(x) - 2
    group = op.attr("group", 1)
    channels = d_mul(w[1], group) if w is not None else None
    kernel = op.attr("kernel_shape") or (list(w[2:]) if w is not None else None)
    output_shape = op.attr("output_shape")
    if output_shape:
        return [_t(op.dtype(0), (x[0], channels, *output_shape[-n:]))]
    if kernel is None:
        return [_t(op.dtype(0), (x[0], channels) + (None,) * n)]
    strides = op.attr("strides") or [1] * n
    dilations = op.attr("dilations") or [1] * n
    pads = op.attr("pads") or [0] * (2 * n)
    output_padding = op.attr("output_padding") or [0] * n
    auto_pad = op.attr("auto_pad", b"NOTSET")
    out: list[Dim] = []
    for i, size in enumerate(x[2:]):
        if auto_pad in (b"SAME_UPPER", b"SAME_LOWER"):
            out.append(d_mul(size, strides[i]))
            continue
        total_pad = 0 if auto_pad == b"VALID" else pads[i] + pads[i + n]
        extent = (kernel[i] - 1) * dilations[i] + 1
        out.append(d_add(d_mul(strides[i], d_sub(size, 1)), output_padding[i] + extent - total_pad))
    return [_t(op.dtype(0), (x[0], channels, *out))]


@rule("MaxPool", "AveragePool", "LpPool")
def pool(op: Op) -> Outputs:
    x = op.shape(0)
    kernel = op.attr("kernel_shape")
    if x is None or len(x) < 3 or not kernel:
        return [op.type(0), _t(DataType.INT64, None)]
    shape = (x[0], x[1], *window_dims(op, x[2:], kernel))
    return [_t(op.dtype(0), shape), _t(DataType.INT64, shape)]


@rule("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool(op: Op) -> Outputs:
    x = op.shape(0)
    return [_t(op.dtype(0), None if x is None or len(x) < 2 else (x[0], x[1]) + (1,) * (len(x) - 2))]


@rule("DepthToSpace", "SpaceToDepth")
def depth_space(op: Op) -> Outputs:
    x = op.shape(0)
    block = op.attr("blocksize", 1)
    if x is None or len(x) != 4:
        return [_t(op.dtype(0), None)]
    if op.node.op_type == "DepthToSpace":
        shape = (x[0], d_div(x[1], block * block), d_mul(x[2], block), d_mul(x[3], block))
    else:
        shape = (x[0], d_mul(x[1], block * block), d_div(x[2], block), d_div(x[3], block))
    return [_t(op.dtype(0), shape)]


# The QOperator format (quantize_static's QuantFormat.QOperator): MatMul and Conv on the operands at 0 and 3, the
# output's zero point last.
RULES["QLinearMatMul"] = quantized_as(matmul, (0, 3), 7)
RULES["QLinearConv"] = quantized_as(conv, (0, 3), 7)


# -- shape manipulation ------------------------------------------------------------------


def _unknown_dims_of_length(target_shape: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
    """A shape whose values are unknown still tells the rank: its own length."""
    length = target_shape[0] if target_shape is not None and len(target_shape) == 1 else None
    return (None,) * length if isinstance(length, int) else None


@rule("Reshape")
def reshape(op: Op) -> Outputs:
    target = op.sym(1)
    if target is None:
        return [_t(op.dtype(0), _unknown_dims_of_length(op.shape(1)))]
    source = op.shape(0)
    allow_zero = op.attr("allowzero", 0)
    out: list[Dim] = []
    for i, dim in enumerate(target):
        if dim == 0 and not allow_zero:
            out.append(source[i] if source is not None and i < len(source) else None)
        else:
            out.append(None if dim == -1 else dim)
    if -1 in target:
        known = [d for i, d in enumerate(out) if target[i] != -1]
        total = d_prod(source) if source is not None else None
        out[target.index(-1)] = d_div(total, d_prod(known))
    return [_t(op.dtype(0), tuple(out))]


@rule("Flatten")
def flatten(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), (None, None))]
    axis = op.attr("axis", 1)
    axis = axis + len(x) if axis < 0 else axis
    return [_t(op.dtype(0), (d_prod(x[:axis]), d_prod(x[axis:])))]


@rule("Transpose")
def transpose(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), None)]
    perm = op.attr("perm") or list(reversed(range(len(x))))
    if sorted(perm) != list(range(len(x))):
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), tuple(x[p] for p in perm))]


@rule("Concat")
def concat(op: Op) -> Outputs:
    shapes = [op.shape(i) for i in range(op.n_inputs)]
    dtype = next((op.dtype(i) for i in range(op.n_inputs) if op.dtype(i) is not None), None)
    if any(s is None for s in shapes) or not shapes:
        rank = next((len(s) for s in shapes if s is not None), None)
        return [_t(dtype, None if rank is None else (None,) * rank)]
    known = [s for s in shapes if s is not None]
    rank = len(known[0])
    axis = norm_axis(op.attr("axis", 0), rank)
    if axis is None or any(len(s) != rank for s in known):
        return [_t(dtype, None)]
    out: list[Dim] = []
    for i in range(rank):
        if i == axis:
            out.append(_sum([s[i] for s in known]))
        else:
            column = [s[i] for s in known]
            out.append(next((d for d in column if d is not None), None))
    return [_t(dtype, tuple(out))]


def _sum(values: list[Dim]) -> Dim:
    total: Dim = 0
    for value in values:
        total = d_add(total, value)
    return total


@rule("Split")
def split(op: Op) -> Outputs:
    x = op.shape(0)
    count = len(op.node.outputs)
    if x is None:
        return [_t(op.dtype(0), None)] * count
    axis = norm_axis(op.attr("axis", 0), len(x))
    if axis is None:
        return [_t(op.dtype(0), None)] * count
    sizes: list[Dim] | None = op.attr("split") if op.opset < 13 else None
    if op.opset >= 13 and op.input(1) is not None:
        given = op.sym(1)
        sizes = list(given) if given is not None else [None] * count
    dim = x[axis]
    if sizes is None:
        num = op.attr("num_outputs")
        if num is not None and not (isinstance(dim, int) and dim % count == 0):
            # Uneven split (opset 18): ceil-sized chunks, the last one takes the rest.
            chunk = d_div(d_add(dim, count - 1), count)
            sizes = [chunk] * (count - 1) + [d_sub(dim, d_mul(chunk, count - 1))]
        else:
            sizes = [d_div(dim, count)] * count
    return [_t(op.dtype(0), (*x[:axis], size, *x[axis + 1 :])) for size in sizes]


def slice_dim(dim: Dim, start: Dim, end: Dim, step: int) -> Dim:
    """The length of ``dim[start:end:step]``; symbolic bounds are taken as in range.

    A fixed-size window of a symbolic dim (``x[:, :8]``, ``x[:, -2:]``) has a concrete
    length only if the dim is large enough, so it stays unknown; the first or last
    element alone is kept (dims are at least 1).
    """
    if isinstance(dim, int) and isinstance(start, int) and isinstance(end, int):
        return len(range(*slice_of(start, end, step, dim).indices(dim)))
    if step < 0:
        return None
    first_or_last = (start == 0 and end == 1) or (start == -1 and isinstance(end, int) and end >= _TO_END)
    if isinstance(start, int):
        start = d_add(dim, start) if start < 0 else start
        if isinstance(dim, int) and isinstance(start, int):
            start = min(start, dim)
    if isinstance(end, int):
        if end >= _TO_END:
            end = dim
        elif end < 0:
            end = d_add(dim, end)
        elif isinstance(dim, int):
            end = min(end, dim)
    length = d_sub(end, start)
    if isinstance(length, int):
        if length <= 0:
            return 0
        if not isinstance(dim, int) and not first_or_last:
            return None
    return length if step == 1 else d_div(d_add(length, step - 1), step)


@rule("Slice")
def slice_(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), None)]
    if op.opset < 10:
        starts: tuple[Dim, ...] | None = tuple(op.attr("starts", []))
        ends: tuple[Dim, ...] | None = tuple(op.attr("ends", []))
        axes: list[int] | None = op.attr("axes")
        steps: list[int] | None = None
    else:
        starts, ends = op.sym(1), op.sym(2)
        axes = op.ints(3) if op.input(3) is not None else None
        steps = op.ints(4) if op.input(4) is not None else None
        if (op.input(3) is not None and axes is None) or (op.input(4) is not None and steps is None):
            return [_t(op.dtype(0), (None,) * len(x))]
    if starts is None or ends is None:
        # Which axes are sliced is known from `axes`; the others keep their dims.
        if axes is None:
            return [_t(op.dtype(0), (None,) * len(x))]
        touched = {norm_axis(a, len(x)) for a in axes}
        return [_t(op.dtype(0), tuple(None if i in touched else d for i, d in enumerate(x)))]
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    out = list(x)
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=False):
        index = norm_axis(axis, len(x))
        if index is None:
            return [_t(op.dtype(0), None)]
        out[index] = slice_dim(x[index], start, end, step)
    return [_t(op.dtype(0), tuple(out))]


@rule("Gather")
def gather(op: Op) -> Outputs:
    data, indices = op.shape(0), op.shape(1)
    if data is None or indices is None:
        return [_t(op.dtype(0), None)]
    axis = norm_axis(op.attr("axis", 0), len(data))
    if axis is None:
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), data[:axis] + indices + data[axis + 1 :])]


@rule("GatherElements")
def gather_elements(op: Op) -> Outputs:
    return [_t(op.dtype(0), op.shape(1))]


@rule("GatherND")
def gather_nd(op: Op) -> Outputs:
    data, indices = op.shape(0), op.shape(1)
    batch_dims = op.attr("batch_dims", 0)
    if data is None or indices is None or not indices or not isinstance(indices[-1], int):
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), indices[:-1] + data[batch_dims + indices[-1] :])]


@rule("Squeeze")
def squeeze(op: Op) -> Outputs:
    x = op.shape(0)
    axes = op.axes(13)
    if x is None or axes is None:
        return [_t(op.dtype(0), None)]
    if not axes:
        if not all(isinstance(d, int) for d in x):
            return [_t(op.dtype(0), None)]
        return [_t(op.dtype(0), tuple(d for d in x if d != 1))]
    drop = {norm_axis(a, len(x)) for a in axes}
    if None in drop:
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), tuple(d for i, d in enumerate(x) if i not in drop))]


@rule("Unsqueeze")
def unsqueeze(op: Op) -> Outputs:
    x = op.shape(0)
    axes = op.axes(13)
    if x is None or axes is None:
        return [_t(op.dtype(0), None)]
    rank = len(x) + len(axes)
    inserted = {norm_axis(a, rank) for a in axes}
    if None in inserted or len(inserted) != len(axes):  # an axis out of range or repeated
        return [_t(op.dtype(0), None)]
    rest = iter(x)
    return [_t(op.dtype(0), tuple(1 if i in inserted else next(rest) for i in range(rank)))]


@rule("Expand")
def expand(op: Op) -> Outputs:
    target = op.sym(1)
    if target is None:
        return [_t(op.dtype(0), _unknown_dims_of_length(op.shape(1)))]
    return [_t(op.dtype(0), broadcast([op.shape(0), target]))]


@rule("Tile")
def tile(op: Op) -> Outputs:
    x, repeats = op.shape(0), op.sym(1)
    if x is None:
        return [_t(op.dtype(0), None)]
    if repeats is None or len(repeats) != len(x):
        return [_t(op.dtype(0), (None,) * len(x))]
    return [_t(op.dtype(0), tuple(d_mul(d, r) for d, r in zip(x, repeats, strict=False)))]


@rule("Pad")
def pad(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), None)]
    if op.opset < 11:
        pads: tuple[Dim, ...] | None = tuple(op.attr("pads", op.attr("paddings", [])))
    else:
        pads = op.sym(1)
    axes = op.ints(3) if op.opset >= 18 and op.input(3) is not None else list(range(len(x)))
    if pads is None or axes is None or len(pads) != 2 * len(axes):
        return [_t(op.dtype(0), (None,) * len(x))]
    out = list(x)
    for i, axis in enumerate(axes):
        index = norm_axis(axis, len(x))
        if index is None:
            return [_t(op.dtype(0), None)]
        out[index] = d_add(d_add(x[index], pads[i]), pads[i + len(axes)])
    return [_t(op.dtype(0), tuple(out))]


@rule("Resize", "Upsample")
def resize(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), None)]
    if op.node.op_type == "Upsample":
        scales_in = op.attr("scales") if op.opset < 9 else None
        scales = np.array(scales_in) if scales_in is not None else op.const(1)
        sizes: tuple[Dim, ...] | None = None
    elif op.opset < 11:
        scales, sizes = op.const(1), None
    else:
        scales = op.const(2) if op.input(2) is not None else None
        sizes = op.sym(3) if op.input(3) is not None else None
    axes = op.attr("axes") or list(range(len(x)))
    out: list[Dim] = list(x)
    if sizes is not None and len(sizes) == len(axes):
        for axis, size in zip(axes, sizes, strict=False):
            out[axis] = size
    elif scales is not None and scales.size == len(axes):
        for axis, scale in zip(axes, scales.tolist(), strict=False):
            dim = x[axis]
            if isinstance(dim, int):
                out[axis] = math.floor(dim * scale)
            else:
                out[axis] = d_mul(dim, int(scale)) if float(scale).is_integer() else None
    else:
        out = [None] * len(x)
    return [_t(op.dtype(0), tuple(out))]


# -- shapes as data ----------------------------------------------------------------------


@rule("Shape")
def shape_(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(DataType.INT64, (None,))]
    start, end = op.attr("start", 0), op.attr("end")
    return [_t(DataType.INT64, (len(x[slice(start, end)]),))]


@rule("Size")
def size(op: Op) -> Outputs:
    return [_t(DataType.INT64, ())]


@rule("Constant")
def constant(op: Op) -> Outputs:
    tensor = constant_node_tensor(op.node)
    if tensor is not None:
        return [_t(tensor.dtype, tensor.shape)]
    sparse = op.attr("sparse_value")
    if sparse is not None and len(op.node.attributes) == 1:
        return [_t(sparse.values.dtype, sparse.dims)]
    return [None]


@rule("ConstantOfShape")
def constant_of_shape(op: Op) -> Outputs:
    fill = op.attr("value")
    dtype = fill.dtype if isinstance(fill, Tensor) else DataType.FLOAT
    shape = op.sym(0)
    if shape is None:
        given = op.shape(0)
        length = given[0] if given is not None and len(given) == 1 else None
        return [_t(dtype, (None,) * length if isinstance(length, int) else None)]
    return [_t(dtype, shape)]


@rule("Range")
def range_(op: Op) -> Outputs:
    start, limit, delta = op.sym(0), op.sym(1), op.sym(2)
    dtype = op.dtype(0) or op.dtype(1)
    if start is None or limit is None or delta is None:
        return [_t(dtype, (None,))]
    (first,), (last,), (step,) = start, limit, delta
    if isinstance(first, int) and isinstance(last, int) and isinstance(step, int) and step:
        return [_t(dtype, (max(-(-(last - first) // step), 0),))]
    if isinstance(step, int) and step > 0:
        return [_t(dtype, (d_div(d_add(d_sub(last, first), step - 1), step),))]
    return [_t(dtype, (None,))]


@rule("NonZero")
def non_zero(op: Op) -> Outputs:
    x = op.shape(0)
    return [_t(DataType.INT64, None if x is None else (len(x), None))]


@rule("OneHot")
def one_hot(op: Op) -> Outputs:
    indices, depth = op.shape(0), op.sym(1)
    if indices is None:
        return [_t(op.dtype(2), None)]
    rank = len(indices) + 1
    axis = norm_axis(op.attr("axis", -1), rank)
    if axis is None:
        return [_t(op.dtype(2), None)]
    out = list(indices)
    out.insert(axis, depth[0] if depth is not None and len(depth) == 1 else None)
    return [_t(op.dtype(2), tuple(out))]


# -- reductions --------------------------------------------------------------------------


def _reduce(op: Op, axes: list[int] | None, dtype: DataType | None) -> TensorType | None:
    x = op.shape(0)
    if x is None:
        return _t(dtype, None)
    keep = op.attr("keepdims", 1)
    if axes is None:
        return _t(dtype, (None,) * len(x) if keep else None)
    if not axes:
        if op.attr("noop_with_empty_axes", 0):
            return _t(dtype, x)
        axes = list(range(len(x)))
    reduced = {norm_axis(a, len(x)) for a in axes}
    if keep:
        return _t(dtype, tuple(1 if i in reduced else d for i, d in enumerate(x)))
    return _t(dtype, tuple(d for i, d in enumerate(x) if i not in reduced))


@rule(
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip
def reduce(op: Op) -> Outputs:
    # ReduceSum took its axes as an input from opset 13, the others from opset 18.
    return [_reduce(op, op.axes(13 if op.node.op_type == "ReduceSum" else 18), op.dtype(0))]


@rule("ArgMax", "ArgMin")
def arg_reduce(op: Op) -> Outputs:
    return [_reduce(op, [op.attr("axis", 0)], DataType.INT64)]


@rule("TopK")
def top_k(op: Op) -> Outputs:
    x = op.shape(0)
    if x is None:
        return [_t(op.dtype(0), None), _t(DataType.INT64, None)]
    axis = norm_axis(op.attr("axis", -1), len(x))
    k_value = op.sym(1) if op.opset >= 10 else (op.attr("k"),)
    k = k_value[0] if k_value is not None and len(k_value) == 1 else None
    if axis is None:
        return [_t(op.dtype(0), None), _t(DataType.INT64, None)]
    shape = (*x[:axis], k, *x[axis + 1 :])
    return [_t(op.dtype(0), shape), _t(DataType.INT64, shape)]
