"""What the attention rules prove before they rewrite: the head splits and merges, the scale, the mask, and
the spellings of Q K^T the exporters write (the plans of the standard and the onnxruntime rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.facts.op import broadcast
from graphopt.ir import DataType, Node, Value
from graphopt.ir.dims import mul
from graphopt.passes.fuse.rules._helpers import attrs_of, float_array, is_float, scalar_factor
from graphopt.passes.fuse.rules.attention.spellings import HEADS
from graphopt.passes.rewrite.engine import Match, Site


def _source(m: Match, name: str) -> Value:
    """The 3-D projection the head split of ``name`` (q, k or v) reads."""
    found = m.node(f"{name}_split").inputs[0]
    assert found is not None
    return found


def _heads(m: Match, name: str, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of one split, from its Reshape's static last two dims."""
    shape = site.shape(m.node(f"{name}_split").outputs[0])
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    if site.rank(_source(m, name)) != 3:
        return None
    return int(shape[2]), int(shape[3])


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


def plan_attention(m: Match, site: Site) -> dict[str, object] | str:
    if not softmax_over_last_axis(m.node("softmax"), site):
        return "the Softmax is not over the last axis"
    found = [_heads(m, n, site) for n in ("q", "k", "v")]
    if any(f is None for f in found):
        return "the head split shapes are not provable (want static heads and head size on 3-D inputs)"
    (heads, size), (kv_heads, k_size), (v_heads, v_size) = found  # type: ignore[misc]
    if k_size != size or v_heads != kv_heads or heads % kv_heads:
        return "the heads of Q, K and V do not fit together"
    if not all(is_float(_source(m, n)) for n in ("q", "k", "v")):
        return "Q, K, V are not float tensors of known type"
    out = site.shape(m.root.outputs[0])
    if out is None or len(out) != 3 or out[2] != heads * v_size:
        return "the merge Reshape does not give (batch, seq, heads * head size)"
    scale = _scale(m, size)
    if scale is None:
        return "the scale is not a scalar constant"
    plan: dict[str, object] = {"heads": heads, "kv_heads": kv_heads, "scale": scale, "mask": None, "causal": 0}
    if "mask" in m.bindings:
        mask = m.value("mask")
        shape = site.shape(mask)
        if site.dtype(mask) != site.dtype(_source(m, "q")) or shape is None or len(shape) != 4:
            return "the mask's type or rank is not provable (want a 4-D mask of Q's type)"
        q_shape, k_shape = site.shape(_source(m, "q")), site.shape(_source(m, "k"))
        if shape[2] == 1 and (q_shape is None or k_shape is None or q_shape[1] != k_shape[1] or q_shape[1] is None):
            return "the mask broadcasts over queries and the query length is not provably the key length"
        plan["mask"] = mask
    elif "cond" in m.bindings:
        fill = float_array(m.value("fill"))
        if fill is None or fill.size != 1 or float(fill.ravel()[0]) > -1e30:
            return "the masked fill is not -inf"
        cond_readers = {id(n) for n in m.feeders}
        producer = m.value("cond").producer
        if _causal(m, site):
            plan["causal"] = 1
        elif producer is not None and id(producer) in cond_readers:
            return "the mask is computed from the attention's own tensors and is not the causal band"
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


def _scalar_steps(value: Value) -> tuple[Value, float]:
    """``value`` without Mul / Div by scalar constants in front of it, and their product."""
    factor = 1.0
    while value.producer is not None and value.producer.op_type in ("Mul", "Div"):
        node = value.producer
        found: tuple[Value, float] | None = None
        for index in (1, 0) if node.op_type == "Mul" else (1,):
            step = scalar_factor(node.inputs[index], divides=node.op_type == "Div")
            rest = node.inputs[1 - index]
            if step is not None and rest is not None:
                found = rest, step
                break
        if found is None:
            break
        value, factor = found[0], factor * found[1]
    return value, factor


@dataclass
class _Heads4:
    """A 4-D input of the layer: the value to pass, and the Transpose perm to apply first."""

    value: Value
    perm: list[int] | None = None


def _untransposed_key(kt: Value) -> _Heads4 | None:
    """K (B, H, S, d) from K^T (B, H, d, S) in the exporters' spellings."""
    node = kt.producer
    if node is None:
        return None
    source = node.inputs[0] if node.inputs else None
    if node.op_type == "Transpose" and source is not None:
        perm = list(node.attr("perm", []))
        if perm == [0, 1, 3, 2]:
            return _Heads4(source)
        if perm == [0, 2, 3, 1] and Site.rank(source) == 4:
            return _Heads4(source, HEADS)
        return None
    if node.op_type != "Reshape" or source is None or source.producer is None:
        return None
    swap = source.producer
    merged = swap.inputs[0] if swap.op_type == "Transpose" and swap.attr("perm") == [0, 2, 1] else None
    split = merged.producer if merged is not None else None
    if split is None or split.op_type != "Reshape" or split.inputs[0] is None:
        return None
    k, out, flat = Site.shape(split.inputs[0]), Site.shape(kt), Site.shape(merged)
    if k is None or out is None or flat is None or len(k) != 4 or len(flat) != 3 or tuple(flat[1:]) != k[2:]:
        return None
    if None in k:
        return None
    return _Heads4(split.inputs[0]) if out == (k[0], k[1], k[3], k[2]) else None


def ints_of(site: Site, value: Value | None) -> tuple[Any, ...] | None:
    """A small int tensor's entries (ints or symbolic dims), as the shape facts know them."""
    return None if value is None else site.ctx.facts(site.model).sym(value)


def _without_repeat(value: Value, site: Site) -> Value:
    """``value`` without grouped-query attention's repeat of its heads:
    Reshape(Expand(Unsqueeze(kv, [2]), (B, Hkv, n, S, d)), (B, Hkv * n, S, d))."""
    reshape = value.producer
    if reshape is None or reshape.op_type != "Reshape" or reshape.inputs[0] is None:
        return value
    expand = reshape.inputs[0].producer
    if expand is None or expand.op_type != "Expand" or expand.inputs[0] is None:
        return value
    unsqueeze = expand.inputs[0].producer
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.inputs[0] is None:
        return value
    axes = ints_of(site, unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else tuple(unsqueeze.attr("axes", ()))
    kv, wide, target = (
        Site.shape(unsqueeze.inputs[0]),
        ints_of(site, expand.inputs[1]),
        ints_of(site, reshape.inputs[1]),
    )
    if axes != (2,) or kv is None or len(kv) != 4 or wide is None or len(wide) != 5 or target is None:
        return value
    repeats, heads, size = wide[2], kv[1], kv[3]
    if not all(isinstance(d, int) for d in (repeats, heads, size)):
        return value
    if len(target) != 4 or target[1] != heads * repeats or target[3] != size or wide[1] not in (1, heads):
        return value
    batch = (target[0] == 0 and not reshape.attr("allowzero", 0)) or target[0] == kv[0]
    # The merge keeps the element count: with batch and seq both provably kept, the Expand cannot
    # have broadcast either (a dim it grows from 1 would not fit), so its unknown entries are fine.
    both = batch and target[2] == kv[2]
    if any(not (w in (1, d) or (w is None and both)) for w, d in zip((wide[0], wide[3], wide[4]), kv[::2] + kv[3:])):
        return value
    # With the heads and head size fixed, one of batch and seq provably right fixes the other.
    if batch or target[2] == kv[2]:
        return unsqueeze.inputs[0]
    return value


def head_count(value: Value, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of a 4-D (batch, heads, seq, head size) value: from its shape, or from the
    head split Transpose(Reshape(x, (B, S, H or -1, d)), [0, 2, 1, 3]) that made it."""
    return _counts(value, site, heads_axis=1)


def split_count(split: Value, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of a head split (batch, seq, heads, head size): from its shape, or from its
    Reshape's target with the heads given or -1 (then the hidden size of x fixes them)."""
    return _counts(split, site, heads_axis=2)


def _counts(value: Value, site: Site, heads_axis: int) -> tuple[int, int] | None:
    shape = Site.shape(value)
    if shape is None or len(shape) != 4:
        return None
    if isinstance(shape[heads_axis], int) and isinstance(shape[3], int):
        return shape[heads_axis], shape[3]
    node = value.producer
    if node is None or node.inputs[0] is None:
        return None
    if heads_axis == 1:  # the Transpose of a head split
        return split_count(node.inputs[0], site) if node.op_type == "Transpose" and node.attr("perm") == HEADS else None
    if node.op_type != "Reshape":
        return None
    target, source = ints_of(site, node.inputs[1]), Site.shape(node.inputs[0])
    if target is None or len(target) != 4 or not isinstance(target[3], int) or target[3] <= 0:
        return None
    heads, size = target[2], target[3]
    if isinstance(heads, int) and heads > 0:
        return heads, size
    width = source[-1] if source is not None and len(source) == 3 else None
    if heads != -1 or not isinstance(width, int) or width % size or source is None:
        return None
    zero_copies = not node.attr("allowzero", 0)
    leading = all((t == 0 and zero_copies) or t == d for t, d in zip(target[:2], source[:2], strict=True))
    return (width // size, size) if leading else None


@dataclass
class Plan4:
    q: Value
    k: _Heads4
    v: Value
    heads: int
    kv_heads: int
    scale: float
    mask: Value | None
    bias: Value | None  # the additive float mask as written (onnxruntime's attention_bias)
    repeated: tuple[_Heads4, Value]  # K and V with the heads repeated to Q's, as written
    softcap: float = 0.0
    widen: bool = False  # float16 Q, K, V, all cast to float32 (the written attention is from Q K^T on)
    # An additive bias on the scores with batch and heads merged, (batch * heads, 1 or S, T): BLOOM's ALiBi.
    merged_bias: Value | None = None
    fill: MaskedFill | None = None  # the scores (plus ``bias``) masked_fill'ed with a finite lowest value


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


def _masked_fill(where: Node) -> tuple[Value, Value | None, MaskedFill] | str:
    """(scores, bias or None, the fill) of ``Where(cond, fill, scores [+ bias])``, or why not."""
    cond, fill, scores = where.inputs
    if cond is None or fill is None or scores is None:
        return "the masked fill's Where has an empty input"
    scores, bias = _bias_off(scores)
    shapes = [Site.shape(v) for v in (cond, bias) if v is not None]
    return scores, bias, MaskedFill(cond, fill, broadcast(shapes))


def _mask_of(bias: Value) -> Value:
    """The mask to pass for an added ``bias``: the boolean ``cond`` of Where(cond, 0, -inf)."""
    node = bias.producer
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


def plan_4d(m: Match, site: Site, *, softcap: bool = False) -> Plan4 | str:
    """The plan for ``attention-4d``'s match; a tanh softcap on the scores is a refusal unless the caller
    writes it (``softcap``)."""
    if not softmax_over_last_axis(m.node("softmax"), site):
        return "the Softmax is not over the last axis"
    scores, mask, added, filled = m.value("scores"), None, None, None
    node = scores.producer
    if node is not None and node.op_type == "Add":
        for core, bias in (node.inputs, reversed(node.inputs)):
            if core is not None and bias is not None and _scores(core) is not None:
                scores, mask, added = core, _mask_of(bias), bias
                break
    elif node is not None and node.op_type == "Where" and _finite_fill(node.inputs[1]) is not None:
        masked = _masked_fill(node)
        if isinstance(masked, str):
            return masked
        scores, added, filled = masked
    elif node is not None and node.op_type == "Where":
        fill = float_array(node.inputs[2])
        if fill is None or fill.size != 1 or float(fill.ravel()[0]) > -1e30 or node.inputs[1] is None:
            return "the Where before Softmax is not Where(m, scores, -inf) or Where(m, c, scores), c finite <= -1e30"
        scores, mask = node.inputs[1], node.inputs[0]
    assert scores is not None
    parts = _scores(scores)
    if parts is None or parts.qk.inputs[0] is None or parts.qk.inputs[1] is None:
        return "the scores are not MatMul(Q, K^T) scaled by constants"
    if parts.refusal is not None:
        return parts.refusal
    if parts.softcap and not softcap:
        return "the scores have a tanh softcap, which this fused op has no attribute for"
    written_v, widen = m.value("v"), parts.upcast
    if widen:
        # From Q K^T on in float32, V cast up to it (TorchScript's SDPA in float16): all of it in float32.
        up = written_v.producer
        if up is None or up.op_type != "Cast" or up.attr("to") != DataType.FLOAT or up.inputs[0] is None:
            return "the scores are cast to float32 and V is not"
        written_v = up.inputs[0]
    q, q_scale = _scalar_steps(parts.qk.inputs[0])
    kt, k_scale = _scalar_steps(parts.qk.inputs[1])
    k = _untransposed_key(kt)
    if k is None:
        return "K^T is not a transpose of a 4-D K in a spelling the rule knows"
    repeated = (k, m.value("v"))
    v = _without_repeat(written_v, site)
    if k.perm is None:
        k = _Heads4(_without_repeat(k.value, site))
    k_value = k.value if k.perm is None else None
    found = [head_count(q, site), head_count(k_value, site) if k_value is not None else None, head_count(v, site)]
    if k.perm is not None:
        found[1] = split_count(k.value, site)
    if any(f is None for f in found):
        return "the head counts and head size of Q, K, V are not static"
    (heads, size), (kv_heads, k_size), (v_heads, _) = found  # type: ignore[misc]
    if k_size != size or v_heads != kv_heads or heads % kv_heads:
        return "the heads of Q, K and V do not fit together"
    dtype = site.dtype(q)
    if not is_float(q) or site.dtype(k.value) != dtype or site.dtype(v) != dtype:
        return "Q, K, V are not float tensors of one known type"
    if widen and dtype != DataType.FLOAT16:
        return "the scores are cast to float32 from another type than Q's"
    if filled is not None:
        fill_type = DataType.FLOAT if widen else dtype
        if site.dtype(filled.cond) != DataType.BOOL or (added is not None and site.dtype(added) != fill_type):
            return "the masked fill's mask is not boolean or its bias not of the scores' type"
        if site.dtype(filled.fill) != fill_type or filled.shape is None or len(filled.shape) != 4:
            return "the masked fill is not of the scores' type, or its mask and bias do not provably make 4-D"
    elif mask is not None:
        shape = site.shape(mask)
        typed = site.dtype(mask) in (DataType.FLOAT if widen else dtype, DataType.BOOL)
        if not typed or shape is None or not 2 <= len(shape) <= 4:
            return "the mask is not a 2-D to 4-D tensor of Q's type or boolean"
        if len(shape) > 2 and isinstance(shape[-3], int) and shape[-3] not in (1, heads):
            return "the mask's head axis is neither 1 nor the heads"
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


def _merge_source(merged: Value, heads: int | None) -> Value | None:
    """x (batch, heads, X, Y) when ``merged`` is Reshape(x) to (batch * heads, X, Y) (with ``heads`` when given)."""
    node = merged.producer
    x = node.inputs[0] if node is not None and node.op_type == "Reshape" else None
    source, out = Site.shape(x), Site.shape(merged)
    if x is None or source is None or out is None or len(source) != 4 or len(out) != 3:
        return None
    if not isinstance(source[1], int) or (heads is not None and source[1] != heads) or None in source[:2]:
        return None
    kept = (out[1] is not None and out[1] == source[2]) or (out[2] is not None and out[2] == source[3])
    return x if out[0] is not None and out[0] == mul(source[0], source[1]) and kept else None


def _is_split(node: Node, heads: int) -> bool:
    """Whether ``node`` is a Reshape of (batch * heads, X, Y) to (batch, heads, X, Y)."""
    source, out = Site.shape(node.inputs[0]), Site.shape(node.outputs[0])
    if node.op_type != "Reshape" or source is None or out is None or len(source) != 3 or len(out) != 4:
        return False
    if out[1] != heads or None in out[:2] or source[0] is None or source[0] != mul(out[0], out[1]):
        return False
    return (out[2] is not None and out[2] == source[1]) or (out[3] is not None and out[3] == source[2])


def _split_scores(scores: Value, heads: int) -> tuple[Value, Value | None] | None:
    """(the merged 3-D scores, the 4-D additive mask or None) for Softmax's input."""
    node = scores.producer
    if node is not None and _is_split(node, heads) and node.inputs[0] is not None:
        return node.inputs[0], None
    if node is None or node.op_type != "Add":
        return None
    for split, mask in (node.inputs, reversed(node.inputs)):
        inner = split.producer if split is not None else None
        if inner is not None and mask is not None and _is_split(inner, heads) and inner.inputs[0] is not None:
            return inner.inputs[0], mask
    return None


def _merged_key(kt: Value, heads: int) -> _Heads4 | None:
    """K (batch, heads, T, d) from the merged K^T: Transpose(merge(K), [0, 2, 1]) or merge(K^T)."""
    node = kt.producer
    if node is not None and node.op_type == "Transpose" and node.attr("perm") == [0, 2, 1] and node.inputs[0]:
        k = _merge_source(node.inputs[0], heads)
        return _Heads4(k) if k is not None else None
    k_t = _merge_source(kt, heads)
    return _untransposed_key(k_t) if k_t is not None else None


def plan_merged(m: Match, site: Site, *, softcap: bool = False) -> Plan4 | str:
    """The plan for attention on merged (batch * heads) 3-D tensors, read as the 4-D attention it is."""
    if not softmax_over_last_axis(m.node("softmax"), site):
        return "the Softmax is not over the last axis"
    heads = (site.shape(m.node("heads_split").outputs[0]) or (0, 0))[1]
    if not isinstance(heads, int) or not _is_split(m.node("heads_split"), heads):
        return "P V is not provably split back to (batch, heads, seq, head size) by a static head count"
    v = _merge_source(m.value("v3"), heads)
    found: tuple[Value, Value | None] | None
    if "probs_merge" in m:  # Softmax on (batch, heads, S, T), merged for the product with V (BLOOM)
        merged = _merge_source(m.node("probs_merge").outputs[0], heads)
        found = None if merged is None else _split_scores(m.value("scores"), heads)
    else:  # Softmax on the merged scores, split by heads for the mask and merged again (fairseq)
        scores = m.value("scores")
        split = _merge_source(scores, heads)
        found = (scores, None) if split is None else _split_scores(split, heads)
        found = found if site.rank(scores) == 3 else None
    if v is None or found is None:
        return "V or the scores are not provably merged from (batch, heads, ...) with P V's heads"
    scores, mask = found
    scores, bias = _bias_off(scores)
    parts = _scores(scores)
    if parts is None or parts.qk.inputs[0] is None or parts.qk.inputs[1] is None:
        return "the merged scores are not MatMul(Q, K^T) scaled by constants (plus a bias)"
    if parts.refusal is not None or parts.upcast:
        return parts.refusal or "the merged scores are cast to float32"
    if parts.softcap and not softcap:
        return "the scores have a tanh softcap, which this fused op has no attribute for"
    q_merged, q_scale = _scalar_steps(parts.qk.inputs[0])
    kt, k_scale = _scalar_steps(parts.qk.inputs[1])
    q, k = _merge_source(q_merged, heads), _merged_key(kt, heads)
    if q is None or k is None:
        return "Q or K^T is not provably merged from (batch, heads, ...) with P V's heads"
    dtype, sizes = site.dtype(q), [(site.shape(x) or (None,) * 4)[3] for x in (q, v)]
    if not is_float(q) or site.dtype(k.value) != dtype or site.dtype(v) != dtype or not isinstance(sizes[0], int):
        return "Q, K, V are not float tensors of one known type with a static head size"
    for added, want in ((bias, 3), (mask, 4)):
        if added is not None and (site.dtype(added) != dtype or site.rank(added) != want):
            return "a bias on the scores is not an additive mask of Q's type (the merged bias 3-D, the mask 4-D)"
    if bias is not None and (site.shape(bias) or (None,))[0] not in (1, (site.shape(q_merged) or (0,))[0]):
        return "the merged bias is not provably one per (batch, head) or one for all (its first dim)"
    scale = parts.scale * q_scale * k_scale
    return Plan4(
        q, k, v, heads, heads, scale, mask=mask, bias=mask, repeated=(k, v), softcap=parts.softcap, merged_bias=bias
    )


def merge_refusal(m: Match, site: Site, width: int, batch: object, seq: object) -> str | None:
    """Why the merge Reshape is not provably to (batch, seq, width), or None."""
    target = ints_of(site, m.value("merge_shape"))
    copies = not m.node("merge").attr("allowzero", 0)  # a 0 entry copies the input's dim
    wrong = "the merge Reshape is not provably back to (batch, seq, heads * head size)"
    if target is None or len(target) != 3 or target[2] not in (width, -1) or (0 in target and not copies):
        return wrong
    kept_batch, kept_seq = (_kept(m, target, axis, dim) for axis, dim in ((0, batch), (1, seq)))
    # With the width fixed, one of batch and seq provably kept fixes the other.
    if not (kept_batch and kept_seq) and not ((kept_batch or kept_seq) and target[2] == width):
        return wrong
    return None


def read_dim(entry: Value | None, source: Value) -> int | None:
    """i when ``entry`` is the i-th dim of ``source`` as a 1-element shape read from it:
    Shape(source, start=i, end=i + 1), or Unsqueeze(Gather(Shape(source), i))."""
    node = entry.producer if entry is not None else None
    if node is not None and node.op_type == "Shape" and node.inputs[0] is source:
        start, end = node.attr("start", 0), node.attr("end")
        return int(start) if end is not None and int(end) == int(start) + 1 and start >= 0 else None
    gather = node.inputs[0].producer if node is not None and node.op_type == "Unsqueeze" and node.inputs[0] else None
    if gather is None or gather.op_type != "Gather" or gather.inputs[0] is None or gather.attr("axis", 0) != 0:
        return None
    shape = gather.inputs[0].producer
    index = Site.array(gather.inputs[1]) if len(gather.inputs) > 1 else None
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not source or shape.attributes:
        return None
    return int(index) if index is not None and index.size == 1 and index.ndim == 0 else None


def _kept(m: Match, target: tuple[Any, ...], axis: int, dim: object) -> bool:
    """Whether the merge's target keeps ``axis`` of its (batch, seq, heads, head size) input: a 0 (a copy),
    the dim ``dim`` the facts know, or that dim read from the merge's own input (TorchScript's
    Shape / Gather / Unsqueeze, whose value the facts may not know)."""
    if target[axis] == 0 or (target[axis] is not None and target[axis] == dim):
        return True
    merged, concat = m.node("merge").inputs[0], m.value("merge_shape").producer
    if merged is None or concat is None or concat.op_type != "Concat" or len(concat.inputs) != len(target):
        return False
    return read_dim(concat.inputs[axis], merged) == axis


def plan_3d(m: Match, site: Site) -> dict[str, Any] | str:
    attention = m.node("attention")
    if len(attention.outputs) > 1 and any(v.is_used() for v in attention.outputs[1:]):
        return "the Attention's other outputs are read"
    counts, sizes = {}, {}
    for name in ("q", "k", "v"):
        found = split_count(m.node(f"{name}_split").outputs[0], site)
        source = site.shape(m.value(name))
        if found is None or source is None or len(source) != 3:
            return f"the head split of {name.upper()} is not provable"
        counts[name], sizes[name] = found
    if counts["k"] != counts["v"] or counts["q"] % counts["k"]:
        return "the head splits of Q, K and V do not fit together"
    split = site.shape(m.value("q")) or (None, None)
    reason = merge_refusal(m, site, counts["q"] * sizes["v"], split[0], split[1])
    if reason is not None:
        return reason
    return attrs_of(attention, q_num_heads=counts["q"], kv_num_heads=counts["k"])


def plan_cache(m: Match, site: Site) -> dict[str, Any] | str:
    attention = m.node("attention")
    if len(attention.outputs) > 1 and any(v.is_used() for v in attention.outputs[1:]):
        return "the Attention's other outputs are read"
    if site.int_attr(attention, "is_causal", 0):
        return "the Attention is_causal on the joined keys (a past given apart would move the diagonal)"
    for name in ("key", "value"):
        if cache_parts(m.node(f"{name}_cache").outputs[0]) is None:
            return f"the {name} Concat is not a 4-D cache joined along the sequence axis"
        if site.dtype(m.value(f"past_{name}")) != site.dtype(m.value(name)):
            return f"the past and new {name}s differ in type"
    mask = m.optional("mask")
    caches = {id(m.node("key_cache")), id(m.node("value_cache"))}
    if mask is not None and _reads_any(mask, caches):
        return "the mask is computed from the cache's Concat (the Attention would wait for itself)"
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
