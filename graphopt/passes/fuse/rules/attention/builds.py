"""What the attention rules write: Attention (or the plan's parts of it) with the mask spelled out as
onnxruntime wants it, a masked fill as one float mask, and a merged-heads bias split back by heads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, TensorType, Value
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import FLOAT_ARRAYS, float_info
from graphopt.passes.fuse.rules._helpers import new_const, shared_reader
from graphopt.passes.fuse.rules.attention.plans import Plan4, cache_parts
from graphopt.passes.rewrite.engine import Match, Site
from graphopt.passes.rewrite.qdq import may_dequantize_to_nan, quantized


def build_attention(b: Builder, m: Match, plan: dict[str, object]) -> Value:
    mask = plan["mask"]
    if isinstance(mask, Value) and (m.site.shape(mask) or (0, 0, 0))[2] == 1:
        mask = rows_spelled_out(b, mask)
    node: Node = b.node(
        "Attention",
        m.value("q"),
        m.value("k"),
        m.value("v"),
        mask if isinstance(mask, Value) else None,
        q_num_heads=plan["heads"],
        kv_num_heads=plan["kv_heads"],
        scale=plan["scale"],
        is_causal=plan["causal"],
    )
    return node.outputs[0]


_EXPANDED = "attention_mask_rows"


def rows_spelled_out(b: Builder, mask: Value) -> Value:
    """``mask`` (B, 1, 1, S) as (B, 1, S, S): onnxruntime's Attention wants the query dim
    spelled out (q length = key length = S here). One expansion per mask, shared by layers."""

    def expand() -> Value:
        length = b.shape(mask, -1)
        ones = b.constant(np.ones(2, np.int64), "ones")
        shape = b.op("Concat", ones, length, b.constant(np.ones(1, np.int64), "one"), axis=0)
        return b.op("Expand", mask, shape, name=_EXPANDED)

    return shared_reader(mask, _EXPANDED, expand)


def additive_mask(b: Builder, plan: Plan4) -> Value | None:
    """The float mask to add to the scaled scores: the masked fill's ``Where(cond, fill, bias or 0)``
    (or the plan's additive bias). The scores added to the fill round back to it, so a query whose keys are
    all masked weighs them alike, as the export does; a fill of the lowest float moves one step up, as
    onnxruntime's Attention reads that one as -inf (see off_lowest)."""
    filled = plan.fill
    if filled is None:
        return plan.bias
    fill = Site.array(filled.fill)
    assert fill is not None
    if fill.ravel()[0] == float_info(fill.dtype).min:
        fill = np.nextafter(fill, np.zeros_like(fill))
    rest = plan.bias if plan.bias is not None else new_const(b, np.zeros((), fill.dtype), filled.fill, "zero")
    node = b.node("Where", filled.cond, b.constant(fill, "mask_fill"), rest)
    dtype = Site.dtype(filled.fill)
    if dtype is not None and filled.shape is not None:
        node.outputs[0].type = TensorType(dtype, filled.shape)
    return node.outputs[0]


def _length(b: Builder, x: Value) -> Value:
    """x's axis 2 (its sequence) as a 1-element shape.

    A KV cache's ``Concat(past, new)`` is measured as past plus new, not read: that Concat moves
    into the Attention (``attention-kv-cache``), which a mask computed from it would wait for."""
    cache = cache_parts(x)
    if cache is not None:
        return b.op("Add", *(b.shape(part, 2, 3) for part in cache))
    return b.shape(x, 2, 3)


def spelled_out(b: Builder, mask: Value, q: Value, k: Value) -> Value:
    """``mask`` with its query and key axes provably Q's and K's lengths, as onnxruntime's
    Attention wants (a mask broadcasting over queries is expanded). Not shared between layers:
    the lengths are read from this layer's Q and K, which later layers' masks cannot wait for."""
    q_len, k_len = ((Site.shape(x) or (None,) * 4)[2] for x in (q, k))
    return expanded_to(b, mask, (q_len, lambda: _length(b, q)), (k_len, lambda: _length(b, k)))


Length = tuple[Any, Callable[[], Value]]  # a length (static or symbolic) and how to read it as a 1-element shape


def expanded_to(b: Builder, mask: Value, rows: Length, keys: Length) -> Value:
    """``mask`` expanded to ``rows`` queries and ``keys`` keys where its last two axes are not provably those."""
    shape = Site.shape(mask) or ()
    known = [length is not None and shape[axis] == length for axis, (length, _) in ((-2, rows), (-1, keys))]
    if all(known):
        return mask
    ones = b.constant(np.ones(len(shape) - 2, np.int64), "ones")
    sizes = [
        b.constant(np.ones(1, np.int64), "one") if kept else read() for kept, (_, read) in zip(known, (rows, keys))
    ]
    expanded = b.node("Expand", mask, b.op("Concat", ones, *sizes, axis=0), name="attention_mask_spelled")
    dtype = Site.dtype(mask)
    if dtype is not None:
        expanded.outputs[0].type = TensorType(dtype, (*shape[:-2], rows[0], keys[0]))
    return expanded.outputs[0]


def off_lowest(b: Builder, mask: Value, site: Site) -> Value:
    """``mask`` with a fill of the float type's lowest value moved one step up.

    onnxruntime's Attention and GroupQueryAttention read a mask entry equal to that lowest value as -inf, so a query
    whose keys all carry it (a left-padded row of a causal decoder) gets zeros, where the
    export, adding the finite fill, weighs every key alike. One step up is the same fill to
    the export's arithmetic (the scores vanish next to it) and an ordinary number to onnxruntime.

    A quantized mask is read dequantized (graphopt/passes/rewrite/qdq.py), not rebuilt: its grid's lowest step
    dequantizes to the fill (GPT-2's and the Llama's dynamo exports: 255 steps of finfo.max / 127.5), so its
    entries at or below the lowest value are raised, by a Max."""
    node = mask.producer
    if node is None or node.op_type != "Where":
        return mask
    fill = Site.array(node.inputs[2])
    if fill is None or fill.size != 1 or fill.dtype not in FLOAT_ARRAYS:
        return mask
    if fill.ravel()[0] != float_info(fill.dtype).min:
        return mask
    raised = np.nextafter(fill, np.zeros_like(fill))
    if quantized(mask, site):
        return b.op("Max", mask, b.constant(raised, "mask_floor"))
    return b.op("Where", node.inputs[0], node.inputs[1], b.constant(raised, "mask_fill"))


def build_4d(b: Builder, m: Match, plan: Plan4) -> Value:
    q, k, v = plan.q, plan.k.value, plan.v
    if plan.widen:
        q, k, v = (b.op("Cast", x, to=int(DataType.FLOAT)) for x in (q, k, v))
    k = k if plan.k.perm is None else b.op("Transpose", k, perm=plan.k.perm)
    written = additive_mask(b, plan) if plan.fill is not None else plan.mask
    mask = with_merged_bias(b, plan, None if written is None else off_lowest(b, written, m.site))
    mask = None if mask is None else spelled_out(b, mask, plan.q, plan.v)
    # 4-D inputs carry their heads (ONNX's inference refuses q_num_heads / kv_num_heads with them).
    softcap = {"softcap": plan.softcap} if plan.softcap else {}
    out = b.op("Attention", q, k, v, mask, scale=plan.scale, **softcap)
    if "nan_guard" in m and plan.mask is not None and may_dequantize_to_nan(plan.mask, m.site):
        # Attention zeroes a query whose keys are all masked by a boolean or a -inf fill, as the export's
        # IsNaN guard does; a dequantized mask may hold NaN (a grid of infinite scale: 0 x inf), which the guard
        # zeroed after the Softmax and stays for.
        out = b.op("Where", b.op("IsNaN", out), new_const(b, np.array(0.0), plan.q, "zero"), out)
    return out


def with_merged_bias(b: Builder, plan: Plan4, mask: Value | None) -> Value | None:
    """``mask`` plus the plan's merged-heads bias split back to (batch, heads, 1 or S, T), or to (1, 1, S, T)
    when one bias serves every (batch, head) (fairseq's causal mask, unsqueezed at 0)."""
    if plan.merged_bias is None:
        return mask
    bias = plan.merged_bias
    lead = [1, 1] if (Site.shape(bias) or (None,))[0] == 1 else [-1, plan.heads]
    rest = b.shape(bias, 1)
    split = b.op("Reshape", bias, b.op("Concat", b.constant(np.array(lead, np.int64)), rest, axis=0))
    return split if mask is None else b.op("Add", split, mask)


def build_3d(b: Builder, m: Match, attrs: dict[str, Any]) -> Value:
    return b.op("Attention", m.value("q"), m.value("k"), m.value("v"), m.optional("mask"), **attrs)


def build_cache(b: Builder, m: Match, attrs: dict[str, Any]) -> Value:
    inputs = (m.value("q"), m.value("key"), m.value("value"), m.optional("mask"))
    node = b.node("Attention", *inputs, m.value("past_key"), m.value("past_value"), outputs=3, **attrs)
    m.export("key_cache", node.outputs[1])
    m.export("value_cache", node.outputs[2])
    return node.outputs[0]
