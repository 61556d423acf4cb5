"""Lowering family (shatter rules): fused ops a target opset lacks become primitives.

Why: ``--target-opset N`` below the model's opset runs onnx's version converter after the
rounds, and the converter has no way down for an op that does not exist at N: it stops,
and the model is bad input naming the op. These rules rewrite such ops into the primitives
they are defined by first, so a model fused at opset 23 (or exported there) still runs on
a runtime that only knows opset 17. Each rule fires only where the goal opset lacks its op
(``max_opset`` is the opset before the op's since-version); on a normal run it is not tried.

- ``LayerNormalization`` (opset 17): ``(x - mean) / Sqrt(var + eps) * scale + bias`` over the
  trailing axes from ``axis``, computed in ``stash_type``; its Mean / InvStdDev outputs are
  given when read.
- ``Gelu`` (opset 20): ``x * (1 + erf(x / sqrt 2)) * 0.5``, or the tanh form for
  ``approximate="tanh"``.
- ``RMSNormalization`` (opset 23): ``x / Sqrt(mean(x^2) + eps) * scale``, in ``stash_type``.
- ``GroupNormalization`` (opset 18 / 21): the channels reshaped to ``[N, G, -1]``, normalized
  over the last axis, reshaped back; scale and bias per channel (opset 21) or per group
  (opset 18, applied before the reshape back).
- ``Attention`` (opset 23), the forms the attention fuse rule emits and their 4-D kin: no
  past key / value, the Y output only, no softcap; a boolean or additive mask (padded to the
  keys when not provably as long), ``is_causal`` (upper-left band), ``scale``, 3-D inputs
  with ``q_num_heads`` / ``kv_num_heads`` and grouped-query attention (each KV head repeated
  for its group of query heads).

The primitives are written at the graph's current opset (``ReduceMean`` with an axes input
from opset 18); the version converter takes them down to the goal afterwards.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import float_info
from graphopt.passes.fuse.rules._helpers import NOT_FLOAT, is_float
from graphopt.passes.rewrite.engine import Build, Match, P, Plan, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import OpPattern, op, optional, var

FAMILY = "lower"

_x = var("x")


def _opset_now(site: Site) -> int:
    """The opset the graph's nodes are written at until the converter runs."""
    return site.model.opset_in(site.graph)


def _ints(b: Builder, values: Sequence[int], name: str) -> Value:
    return b.constant(np.asarray(values, dtype=np.int64), name)


def _scalar(b: Builder, value: float, dtype: DataType, name: str) -> Value:
    return b.constant(np.asarray(value, dtype=dtype.numpy()), name)


def _reduce_mean(b: Builder, x: Value, axes: Sequence[int], site: Site) -> Value:
    return b.listed("ReduceMean", x, "axes", axes, as_input=_opset_now(site) >= 18, keepdims=1).outputs[0]


def _stash(b: Builder, x: Value, node: Node, site: Site) -> tuple[Value, DataType]:
    """``x`` in the node's ``stash_type`` (the precision its statistics are computed in)."""
    dtype = site.dtype(x)
    assert dtype is not None
    stash = DataType(Site.int_attr(node, "stash_type", DataType.FLOAT))
    return (x, dtype) if stash == dtype else (b.op("Cast", x, to=stash), stash)


def _cast_back(b: Builder, y: Value, site: Site, x: Value) -> Value:
    dtype = site.dtype(x)
    return y if dtype is None or dtype == site.dtype(y) else b.op("Cast", y, to=dtype)


def _normalized_axes(axis: int, rank: int | None) -> list[int] | None:
    """The trailing axes from ``axis`` as negative indices (None: a positive axis of unknown rank)."""
    if axis < 0:
        return list(range(axis, 0))
    return None if rank is None else list(range(axis - rank, 0))


def _check_stash(node: Node) -> Refuse | None:
    stash = Site.int_attr(node, "stash_type", DataType.FLOAT)
    return (
        None
        if stash in (DataType.FLOAT, DataType.DOUBLE, DataType.FLOAT16)
        else Refuse(f"stash_type {stash} is not a float")
    )


def _plan_norm(m: Match, site: Site) -> list[int] | Refuse:
    """The normalized axes (negative), or why the norm is not lowered."""
    x = m.value("x")
    if not is_float(x):
        return Refuse(NOT_FLOAT)
    axes = _normalized_axes(Site.int_attr(m.root, "axis", -1), site.rank(x))
    if axes is None:
        return Refuse("a positive axis on an input of unknown rank")
    return _check_stash(m.root) or axes


def _standardized(b: Builder, x: Value, axes: list[int], eps: float, dtype: DataType, site: Site) -> tuple[Value, ...]:
    """``(x - mean) / std`` over ``axes``: (result, mean, std)."""
    mean = _reduce_mean(b, x, axes, site)
    centered = b.op("Sub", x, mean)
    variance = _reduce_mean(b, b.op("Mul", centered, centered), axes, site)
    std = b.op("Sqrt", b.op("Add", variance, _scalar(b, eps, dtype, "epsilon")))
    return b.op("Div", centered, std), mean, std


def _lower_layer_norm(b: Builder, m: Match, axes: list[int]) -> list[Value]:
    ln, x, site = m.root, m.value("x"), m.site
    stashed, dtype = _stash(b, x, ln, site)
    normalized, mean, std = _standardized(b, stashed, axes, Site.float_attr(ln, "epsilon", 1e-5), dtype, site)
    y = b.op("Mul", _cast_back(b, normalized, site, x), m.value("scale"))
    if m.optional("bias") is not None:
        y = b.op("Add", y, m.value("bias"))
    read = [v.is_used() for v in ln.outputs]
    if not any(read[1:]):
        return [y]
    return [y, mean, b.op("Reciprocal", std)] if read[2:] and read[2] else [y, mean]


def _lower_rms_norm(b: Builder, m: Match, axes: list[int]) -> Value:
    node, x, site = m.root, m.value("x"), m.site
    stashed, dtype = _stash(b, x, node, site)
    mean_square = _reduce_mean(b, b.op("Mul", stashed, stashed), axes, site)
    eps = _scalar(b, Site.float_attr(node, "epsilon", 1e-5), dtype, "epsilon")
    normalized = b.op("Div", stashed, b.op("Sqrt", b.op("Add", mean_square, eps)))
    return b.op("Mul", _cast_back(b, normalized, site, x), m.value("scale"))


def _float_type(m: Match, site: Site) -> DataType | Refuse:
    """x's element type, a float one, or why not."""
    dtype = site.dtype(m.value("x"))
    return dtype if dtype is not None and is_float(m.value("x")) else Refuse(NOT_FLOAT)


def _lower_gelu(b: Builder, m: Match, dtype: DataType) -> Value:
    x = m.value("x")
    if m.root.attr("approximate", "none") in ("tanh", b"tanh"):
        cube = b.op("Mul", x, b.op("Mul", x, x))
        inner = b.op("Add", x, b.op("Mul", cube, _scalar(b, 0.044715, dtype, "gelu_cubic")))
        curve = b.op("Tanh", b.op("Mul", inner, _scalar(b, math.sqrt(2 / math.pi), dtype, "gelu_sqrt_2_pi")))
    else:
        curve = b.op("Erf", b.op("Div", x, _scalar(b, math.sqrt(2), dtype, "sqrt_2")))
    one_plus = b.op("Add", curve, _scalar(b, 1.0, dtype, "one"))
    return b.op("Mul", b.op("Mul", x, one_plus), _scalar(b, 0.5, dtype, "half"))


def _plan_group_norm(m: Match, site: Site) -> tuple[int, DataType] | Refuse:
    """(x's rank, x's element type), or why the norm is not lowered."""
    x = m.value("x")
    dtype = site.dtype(x)
    if not is_float(x) or dtype is None:
        return Refuse(NOT_FLOAT)
    rank = site.rank(x)
    if rank is None or rank < 3:
        return Refuse("x is not provably of rank 3 or more (N, C, spatial...)")
    if m.root.attr("num_groups") is None:
        return Refuse("num_groups is missing")
    if _opset_now(site) < 21:
        # opset 18's per-group GroupNormalization exists from 18 on: lower it below 18 only.
        return (rank, dtype) if site.opset < 18 else Refuse("the target opset has this (opset 18) GroupNormalization")
    return _check_stash(m.root) or (rank, dtype)


def _lower_group_norm(b: Builder, m: Match, plan: tuple[int, DataType]) -> Value:
    node, x, site = m.root, m.value("x"), m.site
    rank, dtype = plan
    groups = Site.int_attr(node, "num_groups", 0)
    per_channel = _opset_now(site) >= 21  # opset 18's scale and bias are per group
    stashed, dtype = _stash(b, x, node, site) if per_channel else (x, dtype)
    grouped = b.op("Reshape", stashed, _ints(b, [0, groups, -1], "group_shape"))
    y, _, _ = _standardized(b, grouped, [-1], Site.float_attr(node, "epsilon", 1e-5), dtype, site)
    scale, bias = m.value("scale"), m.value("bias")
    if not per_channel:
        column = _ints(b, [-1, 1], "per_group")
        y = b.op("Add", b.op("Mul", y, b.op("Reshape", scale, column)), b.op("Reshape", bias, column))
    y = _cast_back(b, b.op("Reshape", y, b.op("Shape", x)), site, x)
    if per_channel:
        column = _ints(b, [-1] + [1] * (rank - 2), "per_channel")
        y = b.op("Add", b.op("Mul", y, b.op("Reshape", scale, column)), b.op("Reshape", bias, column))
    return y


# -- Attention -----------------------------------------------------------------------------------


class _Layout(NamedTuple):
    """A lowerable Attention: Q's rank, its heads (0 for 4-D) and the scale, in Q's type."""

    rank: int
    heads: int
    kv_heads: int
    scale: float
    dtype: DataType


def _attention_layout(m: Match, site: Site) -> _Layout | Refuse:
    """How to lower the Attention, or why it is not lowered."""
    node = m.root
    q, k, v = (m.value(n) for n in "qkv")
    rank = site.rank(q)
    if rank not in (3, 4) or site.rank(k) != rank or site.rank(v) != rank:
        return Refuse("Q, K, V are not provably all 3-D or all 4-D")
    if not all(is_float(t) for t in (q, k, v)):
        return Refuse("Q, K, V are not float tensors of known type")
    if any(i < len(node.inputs) and node.inputs[i] is not None for i in (4, 5, 6)):
        return Refuse("past key / value (or nonpad_kv_seqlen) inputs are not lowered")
    if any(out.is_used() for out in node.outputs[1:]):
        return Refuse("the present key / value or QK outputs are read")
    if Site.float_attr(node, "softcap", 0.0) != 0.0 or node.attr("softmax_precision") is not None:
        return Refuse("softcap / softmax_precision are not lowered")
    if any(int(node.attr(side, -1)) >= 0 for side in ("left_window_size", "right_window_size")):
        return Refuse("a sliding window (left_window_size / right_window_size) is not lowered")
    if rank == 4:
        heads, kv_heads = (site.shape(t)[1] for t in (q, k))  # type: ignore[index]
        if heads is None or heads != kv_heads:
            return Refuse("Q and K do not provably have as many heads (grouped-query 4-D attention is not lowered)")
        heads = kv_heads = 0
    else:
        heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
        if not heads or not kv_heads or heads % kv_heads:
            return Refuse("q_num_heads / kv_num_heads are missing or do not divide")
    scale = node.attr("scale")
    if scale is None:
        size = _head_size(site, q, int(heads))
        if size is None:
            return Refuse("no scale and the head size is not static")
        scale = 1 / math.sqrt(size)
    dtype = site.dtype(q)
    assert dtype is not None  # q is float
    return _Layout(rank, int(heads), int(kv_heads), float(scale), dtype)


def _head_size(site: Site, q: Value, heads: int) -> int | None:
    width = (site.shape(q) or (None,))[-1]
    if heads == 0:
        return width if isinstance(width, int) else None
    return width // heads if isinstance(width, int) and width % heads == 0 else None


def _split_heads(b: Builder, t: Value, heads: int, group: int, perm: list[int]) -> Value:
    """A 3-D ``[B, S, heads * d]`` tensor as ``[B, heads * group, S, d]`` (permuted by ``perm``),
    each head repeated ``group`` times in a row (grouped-query attention)."""
    if group == 1:
        split = b.op("Reshape", t, _ints(b, [0, 0, heads, -1], "heads_shape"))
    else:
        single = b.op("Reshape", t, _ints(b, [0, 0, heads, 1, -1], "kv_heads_shape"))
        repeated = b.op("Expand", single, _ints(b, [1, 1, 1, group, 1], "kv_repeat"))
        split = b.op("Reshape", repeated, _ints(b, [0, 0, heads * group, -1], "heads_shape"))
    return b.op("Transpose", split, perm=perm)


def _length(b: Builder, t: Value, axis: int) -> Value:
    """The scalar length of ``t``'s ``axis`` (a static axis of the sequence)."""
    return b.op("Gather", b.op("Shape", t), b.constant(np.asarray(axis, dtype=np.int64), "seq_axis"), axis=0)


def _lowest(b: Builder, dtype: DataType) -> Value:
    """The fill of masked scores: the lowest finite value, as the exporters write it (a row
    masked whole stays finite)."""
    return _scalar(b, float(float_info(dtype.numpy()).min), dtype, "masked")


def _padded(b: Builder, mask: Value, keys: Value, axis: int, dtype: DataType, site: Site) -> Value:
    """``mask`` as long as the keys (``keys``' ``axis``).

    Attention pads a mask shorter than the keys with False / -inf; a mask provably shorter
    is padded so. One whose length is not provable is taken to span the keys, as
    onnxruntime requires of every mask it runs (it refuses a shorter one).
    """
    mask_shape, key_shape = site.shape(mask), site.shape(keys)
    length = mask_shape[-1] if mask_shape else None
    key_length = key_shape[axis] if key_shape else None
    if not (isinstance(length, int) and isinstance(key_length, int) and length < key_length):
        return mask
    # Concat a filler, not Pad: the version converter cannot take Pad below opset 18.
    leading = b.op("Slice", b.op("Shape", mask), _ints(b, [0], "start"), _ints(b, [-1], "end"))
    filler_shape = b.op("Concat", leading, _ints(b, [key_length - length], "missing"), axis=0)
    fill = b.constant(np.asarray(False), "pad") if site.dtype(mask) == DataType.BOOL else _lowest(b, dtype)
    return b.op("Concat", mask, b.op("Expand", fill, filler_shape), axis=-1)


def _causal(b: Builder, scores: Value, q: Value, k: Value, axis: int, dtype: DataType) -> Value:
    """``scores`` with the keys after each query masked (the upper-left causal band)."""
    zero, one = (b.constant(np.asarray(i, dtype=np.int64), "index") for i in (0, 1))
    rows = b.op("Range", zero, _length(b, q, axis), one)
    cols = b.op("Range", zero, _length(b, k, axis), one)
    band = b.op("LessOrEqual", cols, b.op("Reshape", rows, _ints(b, [-1, 1], "column")))
    return b.op("Where", band, scores, _lowest(b, dtype))


def _lower_attention(b: Builder, m: Match, layout: _Layout) -> Value:
    node, site = m.root, m.site
    rank, heads, kv_heads, scale, dtype = layout
    q, k, v, mask = m.value("q"), m.value("k"), m.value("v"), m.optional("mask")
    if rank == 3:
        queries = _split_heads(b, q, heads, 1, [0, 2, 1, 3])
        keys = _split_heads(b, k, kv_heads, heads // kv_heads, [0, 2, 3, 1])
        values = _split_heads(b, v, kv_heads, heads // kv_heads, [0, 2, 1, 3])
        seq_axis = 1
    else:
        queries, keys, values = q, b.op("Transpose", k, perm=[0, 1, 3, 2]), v
        seq_axis = 2
    scores = b.op("Mul", b.op("MatMul", queries, keys), _scalar(b, scale, dtype, "scale"))
    boolean = mask is not None and site.dtype(mask) == DataType.BOOL
    if mask is not None:
        mask = _padded(b, mask, k, seq_axis, dtype, site)
        scores = b.op("Where", mask, scores, _lowest(b, dtype)) if boolean else b.op("Add", scores, mask)
    if node.attr("is_causal", 0):
        scores = _causal(b, scores, q, k, seq_axis, dtype)
    probs = b.op("Softmax", scores, axis=-1)
    if boolean:
        # A row masked whole attends to nothing: zeros, as Attention defines it.
        probs = b.op("Where", mask, probs, _scalar(b, 0.0, dtype, "zero"))
    out = b.op("MatMul", probs, values)
    if rank == 4:
        return out
    merged = b.op("Transpose", out, perm=[0, 2, 1, 3])
    return b.op("Reshape", merged, _ints(b, [0, 0, -1], "merge_shape"))


# -- Split (opset 18) -----------------------------------------------------------------------------


def _split_sizes(m: Match, site: Site) -> list[int] | Refuse:
    node = m.root
    x = m.value("x")
    shape = site.shape(x)
    if shape is None:
        return Refuse("the input's rank is unknown")
    axis = Site.int_attr(node, "axis", 0)
    if "split" in m:
        sizes = site.array(m.value("split"))
        return Refuse("the split sizes are not constant") if sizes is None else [int(s) for s in sizes.ravel()]
    dim = shape[axis]
    count = len(node.outputs)
    if not isinstance(dim, int):
        return Refuse("the split axis is not static")
    step = -(-dim // count)  # num_outputs: equal parts, the last one smaller
    return [min(step, dim - i * step) for i in range(count)]


def _plan_split(m: Match, site: Site) -> list[int] | Refuse:
    if _opset_now(site) < 18:
        return Refuse("an opset-13 Split converts as it is")
    return _split_sizes(m, site)


def _lower_split(b: Builder, m: Match, sizes: list[int]) -> list[Value]:
    axis = _ints(b, [Site.int_attr(m.root, "axis", 0)], "axis")
    bounds = np.cumsum([0, *sizes]).tolist()
    return [
        b.op("Slice", m.value("x"), _ints(b, [start], "start"), _ints(b, [end], "end"), axis)
        for start, end in itertools.pairwise(bounds)
    ]


def _lowering(name: str, pattern: OpPattern, plan: Plan[P], build: Build[P], max_opset: int) -> Rule[P]:
    """A shatter rule taking ``pattern``'s op to primitives where the target opset is past ``max_opset``."""
    (op_type,) = pattern.op_types
    return Rule(
        name=name,
        family=FAMILY,
        pattern=pattern,
        plan=plan,
        build=build,
        kind="shatter",
        max_opset=max_opset,
        label=op_type,
        doc=f"{op_type} -> primitives where the target opset is below {max_opset + 1} (--target-opset)",
    )


_ATTENTION = op.Attention(
    var("q"), var("k"), var("v"), optional(var("mask")), *(optional(var(f"extra{i}")) for i in range(3))
)

RULES: tuple[Rule[Any], ...] = (
    _lowering(
        "lower-layernorm",
        op.LayerNormalization(_x, var("scale"), optional(var("bias"))),
        _plan_norm,
        _lower_layer_norm,
        16,
    ),
    _lowering("lower-gelu", op.Gelu(_x), _float_type, _lower_gelu, 19),
    _lowering("lower-rmsnorm", op.RMSNormalization(_x, var("scale")), _plan_norm, _lower_rms_norm, 22),
    _lowering(
        "lower-groupnorm", op.GroupNormalization(_x, var("scale"), var("bias")), _plan_group_norm, _lower_group_norm, 20
    ),
    _lowering("lower-attention", _ATTENTION, _attention_layout, _lower_attention, 22),
    # Split exists at 17, but the version converter has no way from opset 18's Split down to it.
    _lowering("lower-split", op.Split(_x, optional(var("split"))), _plan_split, _lower_split, 17),
)
