"""Attention family: scaled dot-product attention with head split / merge -> Attention (opset 23).

The exporters write one attention layer as::

    q = Transpose(Reshape(Q, [B, S, H, d]), [0, 2, 1, 3])       # (B, H, S, d)
    k = Transpose(Reshape(K, [B, S, Hkv, d]), [0, 2, 3, 1])     # (B, Hkv, d, S), or k^T later
    v = Transpose(Reshape(V, [B, S, Hkv, d]), [0, 2, 1, 3])
    p = Softmax(mask(MatMul(q, k) / sqrt(d)), axis=-1)           # additive mask or Where(cond, s, -inf)
    y = Reshape(Transpose(MatMul(p, v), [0, 2, 1, 3]), [B, S, H*d])

which is ``Attention(Q, K, V, mask, q_num_heads=H, kv_num_heads=Hkv, scale=...)`` on the 3-D
projections (ONNX splits and merges the heads itself; Hkv < H is grouped-query attention).
The mask: an additive float mask is passed as is; ``Where(cond, s, c)`` with ``c`` at or
below -1e30 is a boolean mask; when ``cond`` is the causal band a GPT-2 export slices from
its ``tril`` buffer (``buf[:, :, klen-qlen:klen, :klen]`` with qlen = klen provably), the
plumbing goes and ``is_causal=1`` stands for it.
"""

from __future__ import annotations

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import Pattern, const, either, op, var
from graphopt.passes.fuse.rules._helpers import float_array, is_float

FAMILY = "attention"
_HEADS = [0, 2, 1, 3]


def _split(name: str, perm: list[int]) -> Pattern:
    return op.Transpose(op.Reshape(var(name), var(f"{name}_shape"), name=f"{name}_split"), perm=perm, name=f"{name}_t")


_K_T = either(
    _split("k", [0, 2, 3, 1]),
    op.Transpose(_split("k", _HEADS), perm=[0, 1, 3, 2], name="k_tt"),
)
_SCORES = op.MatMul(_split("q", _HEADS), _K_T, name="qk")
_SCALED = either(
    op.Div(_SCORES, const(name="scale"), name="scaling"), op.Mul(_SCORES, const(name="scale"), name="scaling"), _SCORES
)
_MASKED = either(
    op.Add(_SCALED, var("mask"), name="masking"),
    op.Where(var("cond"), _SCALED, const(name="fill"), name="masking"),
    _SCALED,
)
_PROBS = op.Softmax(_MASKED, name="softmax", where=lambda n: n.attr("axis", -1) in (-1, 3))
_ATTENTION = op.Reshape(
    op.Transpose(op.MatMul(_PROBS, _split("v", _HEADS), name="pv"), perm=_HEADS, name="merge_t"),
    var("merge_shape"),
    name="merge",
)


def _heads(m: Match, name: str, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of one split, from its Reshape's static last two dims."""
    shape = site.shape(m.node(f"{name}_split").outputs[0])
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    if site.rank(m.value(name)) != 3:
        return None
    return int(shape[2]), int(shape[3])


def _scale(m: Match, head_size: int) -> float | None:
    if "scale" not in m.bindings:
        return 1.0
    found = float_array(m.value("scale"))
    if found is None or found.size != 1:
        return None
    value = float(found.ravel()[0])
    return value if m.node("scaling").op_type == "Mul" else (1.0 / value if value else None)


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


def _plan(m: Match, site: Site) -> dict[str, object] | str:
    found = [_heads(m, n, site) for n in ("q", "k", "v")]
    if any(f is None for f in found):
        return "the head split shapes are not provable (want static heads and head size on 3-D inputs)"
    (heads, size), (kv_heads, k_size), (v_heads, v_size) = found  # type: ignore[misc]
    if k_size != size or v_heads != kv_heads or heads % kv_heads:
        return "the heads of Q, K and V do not fit together"
    if not all(is_float(m.value(n)) for n in ("q", "k", "v")):
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
        if site.dtype(mask) != site.dtype(m.value("q")) or shape is None or len(shape) != 4:
            return "the mask's type or rank is not provable (want a 4-D mask of Q's type)"
        q_shape, k_shape = site.shape(m.value("q")), site.shape(m.value("k"))
        if shape[2] == 1 and (q_shape is None or k_shape is None or q_shape[1] != k_shape[1] or q_shape[1] is None):
            return "the mask broadcasts over queries and the query length is not provably the key length"
        plan["mask"] = mask
    elif "cond" in m.bindings:
        fill = float_array(m.value("fill"))
        if fill is None or fill.size != 1 or float(fill.ravel()[0]) > -1e30:
            return "the masked fill is not -inf"
        cond_readers = {id(n) for n in m.feeders}
        producer = m.value("cond").producer
        if producer is not None and id(producer) in cond_readers:
            if not _causal(m, site):
                return "the mask is computed from the attention's own tensors and is not the causal band"
            plan["causal"] = 1
        else:
            plan["mask"] = m.value("cond")
    return plan


def _rewrite(b: Builder, m: Match, site: Site) -> Value:
    plan = _plan(m, site)
    assert isinstance(plan, dict)
    mask = plan["mask"]
    if isinstance(mask, Value) and (site.shape(mask) or (0, 0, 0))[2] == 1:
        mask = _rows_spelled_out(b, mask)
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


def _rows_spelled_out(b: Builder, mask: Value) -> Value:
    """``mask`` (B, 1, 1, S) as (B, 1, S, S): onnxruntime's Attention wants the query dim
    spelled out (q length = key length = S here). One expansion per mask, shared by layers."""
    for use in mask.uses():
        if use.node.op_type == "Expand" and use.node.name.startswith(_EXPANDED):
            return use.node.outputs[0]
    length = b.op("Shape", mask, start=-1)
    ones = b.constant(np.ones(2, np.int64), "ones")
    shape = b.op("Concat", ones, length, b.constant(np.ones(1, np.int64), "one"), axis=0)
    return b.op("Expand", mask, shape, name=_EXPANDED)


add_rule(
    Rule(
        "attention",
        FAMILY,
        _ATTENTION,
        _rewrite,
        lambda m, site: found if isinstance(found := _plan(m, site), str) else None,
        min_opset=23,
        label="Attention",
        doc="MatMul/scale/mask/Softmax/MatMul with head split and merge -> Attention (opset 23)",
    )
)
