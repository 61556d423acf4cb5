"""What the attention rules prove before they rewrite: the scale, the mask, the spellings of Q K^T the exporters
write, and the heads (through the head split and merge proofs of graphopt/passes/rewrite/proofs.py); the plans of
the standard and the onnxruntime rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.facts.op import broadcast
from graphopt.ir import DataType, Node, Value
from graphopt.ir.dims import Expr
from graphopt.ir.dims import Sym as DimVar
from graphopt.passes.fuse.rules._helpers import attrs_of, cast_source, float_array, is_float, scalar_factor
from graphopt.passes.rewrite.engine import Match, Refuse, Site
from graphopt.passes.rewrite.patterns import chain, match, var
from graphopt.passes.rewrite.proofs import (
    Key,
    head_count,
    merge_refusal,
    merged_key,
    merged_source,
    split_count,
    splits_merged_heads,
    static_split,
    unrepeated,
    untransposed_key,
)
from graphopt.passes.rewrite.qdq import quantized


def _source(m: Match, name: str) -> Value:
    """The 3-D projection the head split of ``name`` (q, k or v) reads."""
    found = m.node(f"{name}_split").inputs[0]
    assert found is not None
    return found


def _scale(m: Match, head_size: int) -> float | None:
    if "scale" not in m.bindings:
        return 1.0
    return scalar_factor(m.value("scale"), divides=m.node("scaling").op_type == "Div")


def _causal(m: Match, site: Site) -> bool:
    """Whether ``cond`` is ``tril[..., klen-qlen:klen, :klen]`` with qlen = klen (the causal band)."""
    rows = m.value("cond").producer
    if rows is None or rows.op_type != "Slice" or not rows.inputs[0] or rows.inputs[0].producer is None:
        return False
    cols = rows
    rows = rows.inputs[0].producer
    if rows.op_type != "Slice" or len(rows.inputs) < 4 or len(cols.inputs) < 4:
        return False
    table = Site.array(rows.inputs[0], limit=1 << 24)
    if table is None or table.ndim != 4 or table.shape[2] != table.shape[3]:
        return False
    if not np.array_equal(table[0, 0], np.tril(np.ones(table.shape[2:], dtype=table.dtype))):
        return False
    facts = site.ctx.facts(site.model)
    start, end = rows.inputs[1], rows.inputs[2]
    axes_rows, axes_cols = Site.array(rows.inputs[3]), Site.array(cols.inputs[3])
    if start is None or end is None or axes_rows is None or axes_cols is None:
        return False
    if axes_rows.tolist() != [2] or axes_cols.tolist() != [3]:
        return False
    col_start, col_end = cols.inputs[1], cols.inputs[2]
    q_len = site.shape(m.node("q_t").outputs[0])
    k_len = site.shape(m.node("v_t").outputs[0])
    if q_len is None or k_len is None or q_len[2] is None or q_len[2] != k_len[2]:
        return False
    starts = facts.sym(start)
    ends, col_starts, col_ends = facts.sym(end), facts.sym(col_start) if col_start else None, None
    col_ends = facts.sym(col_end) if col_end is not None else None
    return starts == (0,) and ends == (q_len[2],) and col_starts == (0,) and col_ends == (q_len[2],)


def plan_attention(m: Match, site: Site) -> dict[str, object] | Refuse:
    if not softmax_over_last_axis(m.node("softmax"), site):
        return Refuse("the Softmax is not over the last axis")
    found = [static_split(m.node(f"{n}_split")) for n in ("q", "k", "v")]
    if any(f is None for f in found):
        return Refuse("the head split shapes are not provable (want static heads and head size on 3-D inputs)")
    (heads, size), (kv_heads, k_size), (v_heads, v_size) = found  # type: ignore[misc]
    if k_size != size or v_heads != kv_heads or heads % kv_heads:
        return Refuse("the heads of Q, K and V do not fit together")
    if not all(is_float(_source(m, n)) for n in ("q", "k", "v")):
        return Refuse("Q, K, V are not float tensors of known type")
    out = site.shape(m.root.outputs[0])
    if out is None or len(out) != 3 or out[2] != heads * v_size:
        return Refuse("the merge Reshape does not give (batch, seq, heads * head size)")
    scale = _scale(m, size)
    if scale is None:
        return Refuse("the scale is not a scalar constant")
    plan: dict[str, object] = {"heads": heads, "kv_heads": kv_heads, "scale": scale, "mask": None, "causal": 0}
    if "mask" in m.bindings:
        mask = m.value("mask")
        shape = site.shape(mask)
        if site.dtype(mask) != site.dtype(_source(m, "q")) or shape is None or len(shape) != 4:
            return Refuse("the mask's type or rank is not provable (want a 4-D mask of Q's type)")
        q_shape, k_shape = site.shape(_source(m, "q")), site.shape(_source(m, "k"))
        if shape[2] == 1 and (q_shape is None or k_shape is None or q_shape[1] != k_shape[1] or q_shape[1] is None):
            return Refuse("the mask broadcasts over queries and the query length is not provably the key length")
        plan["mask"] = mask
    elif "cond" in m.bindings:
        fill = float_array(m.value("fill"))
        if fill is None or fill.size != 1 or float(fill.ravel()[0]) > -1e30:
            return Refuse("the masked fill is not -inf")
        cond_readers = {id(n) for n in m.feeders}
        producer = m.value("cond").producer
        if _causal(m, site):
            plan["causal"] = 1
        elif producer is not None and id(producer) in cond_readers:
            return Refuse("the mask is computed from the attention's own tensors and is not the causal band")
        else:
            plan["mask"] = m.value("cond")
    return plan


# -- the 4-D form: what torch's scaled_dot_product_attention exports to -----------------------------
#
# Both PyTorch exporters write SDPA on (batch, heads, seq, head size) tensors, with the head split
# before it (often with rotary embeddings in between), so the layer is matched from the
# probabilities times V backwards and the 4-D Q, K, V become Attention's inputs:
#   - the scale as Mul / Div by a scalar on the scores, or sqrt(scale) on Q and on K^T (both
#     exporters), or none (T5); a tanh softcap c * Tanh(scores / c) after it (Gemma 2) becomes
#     Attention's softcap (onnxruntime's MultiHeadAttention has none: there it is a near miss, as is
#     any other op on the scores);
#   - K^T as Transpose(k, [0, 1, 3, 2]), Transpose(Reshape(K), [0, 2, 3, 1]), or the dynamo
#     exporter's Reshape(Transpose(Reshape(k, (B*H, S, d)), [0, 2, 1]), (B, H, d, S));
#   - grouped-query attention's repeat of the K / V heads, Reshape(Expand(Unsqueeze(kv, 2))),
#     goes: Attention repeats them itself (kv_num_heads);
#   - the mask as Add of a float bias (Where(cond, 0, -inf) becomes the boolean cond, whose fully
#     masked rows Attention zeroes as the exporters' IsNaN guard after Softmax does), or
#     Where(cond, scores, -inf) directly, or masked_fill(cond, finfo.min) of the scores plus a bias
#     (MPT's ALiBi), Where(cond, fill, scores + bias), which becomes the float mask Where(cond, fill, bias)
#     (the scores added to the fill round back to it, so fully masked rows stay uniform); a KV cache's
#     Concat with the past stays K / V here and goes into the Attention afterwards (``attention-kv-cache``).


def _scalar_step(node: Node) -> tuple[Value, float] | None:
    """What a Mul / Div by a scalar constant scales (a Mul's scalar may be either operand), and its factor."""
    for index in (1, 0) if node.op_type == "Mul" else (1,):
        step = scalar_factor(node.inputs[index], divides=node.op_type == "Div")
        rest = node.inputs[1 - index]
        if step is not None and rest is not None:
            return rest, step
    return None


def _scaled(node: Node) -> Value | None:
    found = _scalar_step(node)
    return found[0] if found is not None else None


_SCALAR_STEPS = chain(("Mul", "Div"), var("scaled"), name="step", most=64, via=_scaled)


def _scalar_steps(value: Value) -> tuple[Value, float]:
    """``value`` without Mul / Div by scalar constants in front of it, and their product."""
    steps = next(match(_SCALAR_STEPS, value))
    factor = 1.0
    for key, node in steps.items():
        if key != "scaled" and isinstance(node, Node):
            found = _scalar_step(node)
            assert found is not None  # the chain went through it
            factor *= found[1]
    scaled = steps["scaled"]
    assert isinstance(scaled, Value)
    return scaled, factor


@dataclass
class Plan4:
    q: Value
    k: Key
    v: Value
    heads: int
    kv_heads: int
    scale: float
    mask: Value | None
    bias: Value | None  # the additive float mask as written (onnxruntime's attention_bias)
    repeated: tuple[Key, Value]  # K and V with the heads repeated to Q's, as written
    softcap: float = 0.0
    widen: bool = False  # float16 Q, K, V, all cast to float32 (the written attention is from Q K^T on)
    # An additive bias on the scores with batch and heads merged, (batch * heads, 1 or S, T): BLOOM's ALiBi.
    merged_bias: Value | None = None
    fill: MaskedFill | None = None  # the scores (plus ``bias``) masked_fill'ed with a finite lowest value


# From this many (batch, head) pairs per sample, an attention with a mask or bias stays as written where
# onnxruntime would run it slower fused (ort.py's MultiHeadAttention).
BIASED_PAIRS_LIMIT = 64


def _per_sample(dim: Any) -> int | None:
    """How much of a batch dim one sample makes: the dim when static, 1 for a dim variable,
    ``c`` for ``c`` times a product of dim variables (Swin's windows: 64 * batch); else None."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, DimVar):
        return 1
    if isinstance(dim, Expr) and len(dim.terms) == 1 and all(isinstance(a, DimVar) for a in dim.terms[0][0]):
        return dim.terms[0][1]
    return None


def biased_pairs(batch: Any, heads: int) -> int | None:
    """The (batch, head) pairs per sample of an attention over ``batch`` x ``heads``, where they are
    BIASED_PAIRS_LIMIT or more (else None)."""
    per_sample = _per_sample(batch)
    return None if per_sample is None or per_sample * heads < BIASED_PAIRS_LIMIT else per_sample * heads


@dataclass
class MaskedFill:
    """``Where(cond, fill, scores + bias)`` before the Softmax: a boolean mask filling a finite value at or
    below -1e30 (masked_fill with finfo.min, as MPT and other models building a float mask write). ``shape``:
    the 4-D broadcast of ``cond`` and the bias, or None where it is not provable."""

    cond: Value
    fill: Value
    shape: tuple[Any, ...] | None


def _finite_fill(value: Value | None) -> float | None:
    """The scalar of a finite float constant at or below -1e30, or None."""
    found = float_array(value) if value is not None else None
    if found is None or found.size != 1 or not np.isfinite(found.ravel()[0]) or float(found.ravel()[0]) > -1e30:
        return None
    return float(found.ravel()[0])


def _bias_off(scores: Value) -> tuple[Value, Value | None]:
    """``(core, bias)`` when ``scores`` is ``core + bias`` (either order) with ``core`` the scaled Q K^T, else
    ``(scores, None)``."""
    node = scores.producer
    if node is not None and node.op_type == "Add":
        for core, added in (node.inputs, reversed(node.inputs)):
            if core is not None and added is not None and _scores(core) is not None:
                return core, added
    return scores, None


def _masked_fill(where: Node) -> tuple[Value, Value | None, MaskedFill] | Refuse:
    """(scores, bias or None, the fill) of ``Where(cond, fill, scores [+ bias])``, or why not."""
    cond, fill, scores = where.inputs
    if cond is None or fill is None or scores is None:
        return Refuse("the masked fill's Where has an empty input")
    scores, bias = _bias_off(scores)
    shapes = [Site.shape(v) for v in (cond, bias) if v is not None]
    return scores, bias, MaskedFill(cond, fill, broadcast(shapes))


def _mask_of(bias: Value, site: Site) -> Value:
    """The mask to pass for an added ``bias``: the boolean ``cond`` of Where(cond, 0, -inf), unless ``bias`` is
    quantized (the Attention reads the dequantized mask, as the original's Add did)."""
    node = bias.producer
    if quantized(bias, site):
        return bias
    if node is None or node.op_type != "Where" or Site.dtype(node.inputs[0]) != DataType.BOOL:
        return bias
    zero, fill = float_array(node.inputs[1]), float_array(node.inputs[2])
    if zero is None or fill is None or zero.size != 1 or fill.size != 1:
        return bias
    if float(zero.ravel()[0]) != 0.0 or not np.isneginf(fill.ravel()[0]):
        return bias
    cond = node.inputs[0]
    assert cond is not None
    return cond


@dataclass
class _Scores:
    """Scores as ``softcap(scale * MatMul(Q, K^T))`` (softcap 0: none), or, with ``refusal``, scaled Q K^T
    through a score mod Attention cannot express. ``upcast``: Q K^T was float16, cast to float32 for the
    rest of the attention (TorchScript's SDPA in float16)."""

    qk: Node
    scale: float
    softcap: float = 0.0
    refusal: str | None = None
    upcast: bool = False


def _scores(value: Value) -> _Scores | None:
    """``value`` read as scaled Q K^T, with a tanh softcap ``c * Tanh(s * x / c)`` (Gemma 2's), a Cast of
    float16 scores to float32, or another one-input op in between; None when no MatMul is that close."""
    core, factor = _scalar_steps(value)
    mod = core.producer
    if mod is None or mod.op_type == "MatMul":
        return _Scores(mod, factor) if mod is not None else None
    if not mod.inputs or mod.inputs[0] is None:
        return None
    inner, inner_factor = _scalar_steps(mod.inputs[0])
    qk = inner.producer
    if qk is None or qk.op_type != "MatMul":
        return None
    if mod.op_type == "Cast" and mod.attr("to") == DataType.FLOAT and Site.dtype(mod.inputs[0]) == DataType.FLOAT16:
        return _Scores(qk, inner_factor * factor, upcast=True)
    if mod.op_type != "Tanh":
        reason = f"the scores go through {mod.op_type} after MatMul(Q, K^T): a score mod Attention cannot express"
        return _Scores(qk, 0.0, refusal=reason)
    if factor <= 0:
        return _Scores(qk, 0.0, refusal="the tanh softcap's cap is not positive")
    return _Scores(qk, inner_factor * factor, factor)


def softmax_over_last_axis(softmax: Node, site: Site) -> bool:
    """Whether ``softmax`` normalizes over its input's last axis alone. Its axis defaults to -1 from opset 13
    and to 1 below it, where the input is also flattened to 2-D at the axis: the same only at the last axis."""
    rank = site.rank(softmax.outputs[0])
    axis = softmax.attr("axis", -1 if site.opset >= 13 else 1)
    return rank is not None and axis in (-1, rank - 1)


def plan_4d(m: Match, site: Site, *, softcap: bool = False) -> Plan4 | Refuse:
    """The plan for ``attention-4d``'s match; a tanh softcap on the scores is a refusal unless the caller
    writes it (``softcap``)."""
    if not softmax_over_last_axis(m.node("softmax"), site):
        return Refuse("the Softmax is not over the last axis")
    scores, mask, added, filled = m.value("scores"), None, None, None
    node = scores.producer
    if node is not None and node.op_type == "Add":
        for core, bias in (node.inputs, reversed(node.inputs)):
            if core is not None and bias is not None and _scores(core) is not None:
                scores, mask, added = core, _mask_of(bias, site), bias
                break
    elif node is not None and node.op_type == "Where" and _finite_fill(node.inputs[1]) is not None:
        masked = _masked_fill(node)
        if isinstance(masked, Refuse):
            return masked
        scores, added, filled = masked
    elif node is not None and node.op_type == "Where":
        fill = float_array(node.inputs[2])
        if fill is None or fill.size != 1 or float(fill.ravel()[0]) > -1e30 or node.inputs[1] is None:
            return Refuse(
                "the Where before Softmax is not Where(m, scores, -inf) or Where(m, c, scores), c finite <= -1e30"
            )
        scores, mask = node.inputs[1], node.inputs[0]
    assert scores is not None
    parts = _scores(scores)
    if parts is None or parts.qk.inputs[0] is None or parts.qk.inputs[1] is None:
        return Refuse("the scores are not MatMul(Q, K^T) scaled by constants")
    if parts.refusal is not None:
        return Refuse(parts.refusal)
    if parts.softcap and not softcap:
        return Refuse("the scores have a tanh softcap, which this fused op has no attribute for")
    written_v, widen = m.value("v"), parts.upcast
    if widen:
        # From Q K^T on in float32, V cast up to it (TorchScript's SDPA in float16): all of it in float32.
        uncast = cast_source(written_v, DataType.FLOAT)
        if uncast is None:
            return Refuse("the scores are cast to float32 and V is not")
        written_v = uncast
    q, q_scale = _scalar_steps(parts.qk.inputs[0])
    kt, k_scale = _scalar_steps(parts.qk.inputs[1])
    k = untransposed_key(kt)
    if k is None:
        return Refuse("K^T is not a transpose of a 4-D K in a spelling the rule knows")
    repeated = (k, m.value("v"))
    v = unrepeated(written_v, site)
    if k.perm is None:
        k = Key(unrepeated(k.value, site))
    k_value = k.value if k.perm is None else None
    found = [head_count(q, site), head_count(k_value, site) if k_value is not None else None, head_count(v, site)]
    if k.perm is not None:
        found[1] = split_count(k.value, site)
    if any(f is None for f in found):
        return Refuse("the head counts and head size of Q, K, V are not static")
    (heads, size), (kv_heads, k_size), (v_heads, _) = found  # type: ignore[misc]
    if k_size != size or v_heads != kv_heads or heads % kv_heads:
        return Refuse("the heads of Q, K and V do not fit together")
    dtype = site.dtype(q)
    if not is_float(q) or site.dtype(k.value) != dtype or site.dtype(v) != dtype:
        return Refuse("Q, K, V are not float tensors of one known type")
    if widen and dtype != DataType.FLOAT16:
        return Refuse("the scores are cast to float32 from another type than Q's")
    if filled is not None:
        fill_type = DataType.FLOAT if widen else dtype
        if site.dtype(filled.cond) != DataType.BOOL or (added is not None and site.dtype(added) != fill_type):
            return Refuse("the masked fill's mask is not boolean or its bias not of the scores' type")
        if site.dtype(filled.fill) != fill_type or filled.shape is None or len(filled.shape) != 4:
            return Refuse("the masked fill is not of the scores' type, or its mask and bias do not provably make 4-D")
    elif mask is not None:
        shape = site.shape(mask)
        typed = site.dtype(mask) in (DataType.FLOAT if widen else dtype, DataType.BOOL)
        if not typed or shape is None or not 2 <= len(shape) <= 4:
            return Refuse("the mask is not a 2-D to 4-D tensor of Q's type or boolean")
        if len(shape) > 2 and isinstance(shape[-3], int) and shape[-3] not in (1, heads):
            return Refuse("the mask's head axis is neither 1 nor the heads")
    scale = parts.scale * q_scale * k_scale
    return Plan4(
        q,
        k,
        v,
        heads,
        kv_heads,
        scale,
        mask=mask,
        bias=added,
        repeated=repeated,
        softcap=parts.softcap,
        widen=widen,
        fill=filled,
    )


def cache_parts(x: Value) -> tuple[Value, Value] | None:
    """(past, new) where ``x`` is a 4-D KV cache ``Concat(past, new)`` along the sequence axis."""
    node = x.producer
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2 or Site.rank(x) != 4:
        return None
    past, new = node.inputs
    if past is None or new is None or node.attr("axis") not in (2, -2):
        return None
    return past, new


# -- attention on merged heads: what older torch code writes -------------------------------------------
#
# BLOOM, and fairseq-style attention (OPT, BART, Marian before SDPA), compute attention in 3-D with batch and
# heads merged: Q, K, V (batch, heads, seq, d) reshaped to (batch * heads, seq, d), the scores by a 3-D MatMul
# (torch's bmm / baddbmm) scaled by a constant, plus an additive bias of the merged shape (BLOOM's ALiBi,
# (batch * heads, 1, T)), reshaped to (batch, heads, S, T) for the mask Add and the Softmax, back to 3-D for the
# MatMul with V and back to 4-D. That is the 4-D attention on the un-merged Q, K, V with the bias split back by
# heads and added to the mask. Every merge and split is proven from the shapes: the (batch, heads) pair and
# batch * heads with the same static heads, the trailing dims kept (the element count fixes the rest).


def _split_scores(scores: Value, heads: int) -> tuple[Value, Value | None] | None:
    """(the merged 3-D scores, the 4-D additive mask or None) for Softmax's input."""
    node = scores.producer
    if node is not None and splits_merged_heads(node, heads) and node.inputs[0] is not None:
        return node.inputs[0], None
    if node is None or node.op_type != "Add":
        return None
    for split, mask in (node.inputs, reversed(node.inputs)):
        inner = split.producer if split is not None else None
        if inner is not None and mask is not None and splits_merged_heads(inner, heads) and inner.inputs[0] is not None:
            return inner.inputs[0], mask
    return None


def plan_merged(m: Match, site: Site, *, softcap: bool = False) -> Plan4 | Refuse:
    """The plan for attention on merged (batch * heads) 3-D tensors, read as the 4-D attention it is."""
    if not softmax_over_last_axis(m.node("softmax"), site):
        return Refuse("the Softmax is not over the last axis")
    heads = (site.shape(m.node("heads_split").outputs[0]) or (0, 0))[1]
    if not isinstance(heads, int) or not splits_merged_heads(m.node("heads_split"), heads):
        return Refuse("P V is not provably split back to (batch, heads, seq, head size) by a static head count")
    v = merged_source(m.value("v3"), heads)
    found: tuple[Value, Value | None] | None
    if "probs_merge" in m:  # Softmax on (batch, heads, S, T), merged for the product with V (BLOOM)
        merged = merged_source(m.node("probs_merge").outputs[0], heads)
        found = None if merged is None else _split_scores(m.value("scores"), heads)
    else:  # Softmax on the merged scores, split by heads for the mask and merged again (fairseq)
        scores = m.value("scores")
        split = merged_source(scores, heads)
        found = (scores, None) if split is None else _split_scores(split, heads)
        found = found if site.rank(scores) == 3 else None
    if v is None or found is None:
        return Refuse("V or the scores are not provably merged from (batch, heads, ...) with P V's heads")
    scores, mask = found
    scores, bias = _bias_off(scores)
    parts = _scores(scores)
    if parts is None or parts.qk.inputs[0] is None or parts.qk.inputs[1] is None:
        return Refuse("the merged scores are not MatMul(Q, K^T) scaled by constants (plus a bias)")
    if parts.refusal is not None or parts.upcast:
        return Refuse(parts.refusal or "the merged scores are cast to float32")
    if parts.softcap and not softcap:
        return Refuse("the scores have a tanh softcap, which this fused op has no attribute for")
    q_merged, q_scale = _scalar_steps(parts.qk.inputs[0])
    kt, k_scale = _scalar_steps(parts.qk.inputs[1])
    q, k = merged_source(q_merged, heads), merged_key(kt, heads)
    if q is None or k is None:
        return Refuse("Q or K^T is not provably merged from (batch, heads, ...) with P V's heads")
    dtype, sizes = site.dtype(q), [(site.shape(x) or (None,) * 4)[3] for x in (q, v)]
    if not is_float(q) or site.dtype(k.value) != dtype or site.dtype(v) != dtype or not isinstance(sizes[0], int):
        return Refuse("Q, K, V are not float tensors of one known type with a static head size")
    for added, want in ((bias, 3), (mask, 4)):
        if added is not None and (site.dtype(added) != dtype or site.rank(added) != want):
            return Refuse(
                "a bias on the scores is not an additive mask of Q's type (the merged bias 3-D, the mask 4-D)"
            )
    if bias is not None and (site.shape(bias) or (None,))[0] not in (1, (site.shape(q_merged) or (0,))[0]):
        return Refuse("the merged bias is not provably one per (batch, head) or one for all (its first dim)")
    scale = parts.scale * q_scale * k_scale
    return Plan4(
        q, k, v, heads, heads, scale, mask=mask, bias=mask, repeated=(k, v), softcap=parts.softcap, merged_bias=bias
    )


def plan_3d(m: Match, site: Site) -> dict[str, Any] | Refuse:
    attention = m.node("attention")
    if len(attention.outputs) > 1 and any(v.is_used() for v in attention.outputs[1:]):
        return Refuse("the Attention's other outputs are read")
    counts, sizes = {}, {}
    for name in ("q", "k", "v"):
        found = split_count(m.node(f"{name}_split").outputs[0], site)
        source = site.shape(m.value(name))
        if found is None or source is None or len(source) != 3:
            return Refuse(f"the head split of {name.upper()} is not provable")
        counts[name], sizes[name] = found
    if counts["k"] != counts["v"] or counts["q"] % counts["k"]:
        return Refuse("the head splits of Q, K and V do not fit together")
    split = site.shape(m.value("q")) or (None, None)
    reason = merge_refusal(m.node("merge"), site, counts["q"] * sizes["v"], split[0], split[1])
    if reason is not None:
        return Refuse(reason)
    return attrs_of(attention, q_num_heads=counts["q"], kv_num_heads=counts["k"])


def plan_cache(m: Match, site: Site) -> dict[str, Any] | Refuse:
    attention = m.node("attention")
    if len(attention.outputs) > 1 and any(v.is_used() for v in attention.outputs[1:]):
        return Refuse("the Attention's other outputs are read")
    if site.int_attr(attention, "is_causal", 0):
        return Refuse("the Attention is_causal on the joined keys (a past given apart would move the diagonal)")
    for name in ("key", "value"):
        if cache_parts(m.node(f"{name}_cache").outputs[0]) is None:
            return Refuse(f"the {name} Concat is not a 4-D cache joined along the sequence axis")
        if site.dtype(m.value(f"past_{name}")) != site.dtype(m.value(name)):
            return Refuse(f"the past and new {name}s differ in type")
    mask = m.optional("mask")
    caches = {id(m.node("key_cache")), id(m.node("value_cache"))}
    if mask is not None and _reads_any(mask, caches):
        return Refuse("the mask is computed from the cache's Concat (the Attention would wait for itself)")
    return attrs_of(attention)


def _reads_any(value: Value, nodes: set[int], limit: int = 256) -> bool:
    """Whether ``value`` is computed from the output of one of ``nodes`` (True when the search
    gives up after ``limit`` nodes: unproven counts as read)."""
    pending: list[Node | None] = [value.producer]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in nodes or len(seen) >= limit:
            return True
        seen.add(id(node))
        pending.extend(v.producer for v in node.inputs if v is not None)
    return False
