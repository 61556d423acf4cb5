"""Attention for ``--target ort``: onnxruntime's MultiHeadAttention (4-D scaled dot-product
attention with its head merge) and its Attention with the Q, K and V projections packed into
one weight. The standard Attention (opset 23) is in standard.py; the patterns, plans and builds both read are
in spellings.py, plans.py and builds.py, the shape proofs in graphopt/passes/rewrite/proofs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._float32 import cached_in_float32
from graphopt.passes.fuse.rules._helpers import float_array, new_const, shared_reader
from graphopt.passes.fuse.rules._ort import MS, cpu_float
from graphopt.passes.fuse.rules.attention.builds import (
    additive_mask,
    rows_spelled_out,
    spelled_out,
    with_merged_bias,
)
from graphopt.passes.fuse.rules.attention.plans import (
    BIASED_PAIRS_LIMIT,
    Plan4,
    biased_pairs,
    cache_parts,
    plan_4d,
    plan_attention,
    plan_merged,
)
from graphopt.passes.fuse.rules.attention.spellings import (
    FAMILY,
    MERGED_HEADS,
    NAN_GUARD,
    SOFTMAX,
    STANDARD_ATTENTION_OPSET,
    core,
)
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, chain, const, either, match, op, optional, var
from graphopt.passes.rewrite.proofs import (
    HEADS,
    head_count,
    ints_of,
    merge_refusal,
    reshaped_to_itself,
    split_source,
    unrepeated,
    unsplit,
)
from graphopt.passes.rewrite.qdq import quantized

# -- target ort: onnxruntime's MultiHeadAttention ------------------------------------------------
#
# The 4-D attention (plans.py's plan_4d) with its head merge, Reshape(Transpose(P V, [0, 2, 1, 3]), (B, S, H*d)),
# becomes com.microsoft MultiHeadAttention(Q (B, S, H*d), K, V (B, H, T, d), attention_bias): Q is
# taken before its head split where it has one (else transposed and reshaped back), K and V keep their
# heads (grouped-query attention's repeat stays: MultiHeadAttention has no kv heads), the additive
# float mask is the attention bias, spelled out over queries and keys.
#
# The attention bias must be 4-D, (batch or 1, heads or 1, S, T); one that would grow the scores (a dim
# neither 1 nor theirs) is refused. A bias of lower rank that broadcasts to that (LeViT's learned (heads,
# S, T) per-head position bias, gathered from a table) is ort-multihead-attention-broadcast-bias's, off by
# default: it gets its leading 1s (by value where it is a constant read only here, else by one Unsqueeze its
# readers share), but onnxruntime's CPU kernel adds a bias slower than its own fusions of the written form
# do (levit_128s: 1.8% slower than without the rule; one 4-head layer of 196 tokens, head size 16: 1.08x).
# With an attention bias of any shape the CPU kernel runs each (batch, head) pair's scores on their own,
# slower than onnxruntime runs the written form in float32 once there are many pairs: windowed attention,
# whose batch is the windows of every image, is left unfused from BIASED_PAIRS_LIMIT pairs per image where its
# products are float32 MatMuls (and so is onnxruntime's Attention below, the same CPU code) (kernel times,
# 1 thread, 2 layers: 128 pairs 1.05-1.29x the written form's, Swin's 64 windows x 2 heads of 49 tokens
# 1.05-1.08x; 64 pairs 1.03-1.04x; 1 to 16 pairs 0.80-1.01x; without a bias 1.00x at 128 pairs; Swin's float32
# and dynamic int8 TorchScript exports on an AMD EPYC, 30 rounds: 1.026 and 1.002 of the variant's time fused,
# 0.962 and 0.949 as written). Written with float16 or quantized products it runs slower than the fused kernel:
# those fuse.
# With 4-D K and V onnxruntime wants one shape for both, so where V's head size is not Q's and K's (LeViT's
# V is twice as wide) K and V go in 3-D, (batch, T, heads * head size), which takes any v_hidden_size.
#
# GroupQueryAttention (for a KV cache) is written from this MultiHeadAttention by ort-group-query-attention
# (gqa.py), where it is exact; elsewhere MultiHeadAttention stays: without a past its kernel measured 0.98x at seq 17
# and 1.2x at seq 128 against this form (benchmarks/ort_gqa_probe.py, 8 query / 2 kv heads of 32, 1 thread).

_PV = op.MatMul(either(NAN_GUARD, SOFTMAX), var("v"), name="pv")
# The TorchScript exporter reshapes SDPA's output to its own shape (read from it) before the merge.
_PV_KEPT = either(_PV, op.Reshape(_PV, var("same_shape"), name="same"))
_MHA = op.Reshape(op.Transpose(_PV_KEPT, perm=HEADS, name="merge_t"), var("merge_shape"), name="merge")


@dataclass
class _MhaPlan:
    plan: Plan4
    query: Value | None  # Q before its head split, when it has one
    key_value: tuple[Value, Value] | None  # K and V before their head splits, when both have one
    rows: bool  # the merge flattens batch and seq into rows: (B * S, H * d)
    flat_kv: bool  # V's head size is not K's: K and V go in 3-D


_BROADCAST_BIAS = "ort-multihead-attention-broadcast-bias"


def _products_in_float32(m: Match, site: Site) -> bool:
    """Whether the written attention's products are float32 MatMuls of unquantized values, which onnxruntime runs
    faster than its fused kernel over many biased pairs. In float16, or read through Q/DQ pairs, the fused kernel
    is the faster (Swin's float16 exports: 0.832 and 0.790 of the variant's time fused, 0.841 and 0.831 as written;
    its QDQ exports 0.633 and 0.793 fused, 0.714 and 0.922 as written; 30 rounds, 1 thread, an AMD EPYC)."""
    products = [node for node in m.nodes if node.op_type == "MatMul"]
    return all(
        site.dtype(node.outputs[0]) == DataType.FLOAT
        and not any(value is not None and quantized(value, site) for value in node.inputs)
        for node in products
    )


def _many_biased_pairs(m: Match, site: Site, batch: Any, heads: int) -> str | None:
    """Why an attention with a mask or bias over ``batch`` x ``heads`` pairs stays as written, or None."""
    pairs = biased_pairs(batch, heads)
    if pairs is None or not _products_in_float32(m, site):
        return None
    return (
        f"{pairs} (batch, head) pairs per sample with a mask or bias (onnxruntime's CPU kernel "
        f"runs them slower than the written form from {BIASED_PAIRS_LIMIT})"
    )


def _plan_mha(
    m: Match, site: Site, read: Callable[[Match, Site], Plan4 | Refuse] = plan_4d, *, broadcast: bool = False
) -> _MhaPlan | Refuse:
    """The plan for ``ort-multihead-attention`` (``read`` says how the attention is spelled); with
    ``broadcast``, for the rule that takes an attention bias of rank below 4 (and only that)."""
    plan = read(m, site)
    if isinstance(plan, Refuse):
        return plan
    same = m.node("same") if "same" in m else None
    allowzero = same is not None and bool(site.int_attr(same, "allowzero", 0))
    if same is not None and not reshaped_to_itself(
        m.node("pv").outputs[0], m.value("same_shape"), site, plan.q, allowzero=allowzero
    ):
        return Refuse("the Reshape after the attention is not provably to its own shape")
    unsupported = cpu_float(site, plan.q, "MultiHeadAttention")
    if unsupported is not None:
        return Refuse(unsupported)
    if plan.mask is not None and plan.bias is None:
        return Refuse("the mask is not an additive float bias (MultiHeadAttention's attention_bias)")
    q_dims = site.shape(plan.q) or (None,) * 4
    size = head_count(plan.repeated[1], site)
    if size is None or size[0] != plan.heads:
        return Refuse("V does not provably have Q's heads and a static head size")
    # a masked fill is written as one 4-D float mask (attention.additive_mask); else the bias as written
    added = plan.fill.fill if plan.fill is not None else plan.bias
    added_shape = plan.fill.shape if plan.fill is not None else site.shape(plan.bias) if plan.bias else None
    below_4d = plan.fill is None and plan.bias is not None and site.rank(plan.bias) != 4
    if broadcast and not below_4d:
        return Refuse("no attention bias of rank below 4 (ort-multihead-attention's case)")
    if below_4d and not broadcast:
        return Refuse(f"the attention bias is not 4-D ({_BROADCAST_BIAS} takes it: off by default, measured slower)")
    if added is not None:
        if site.dtype(added) != site.dtype(plan.q):
            return Refuse("the attention bias is not of Q's element type")
        scores = (q_dims[0], plan.heads, q_dims[2], (site.shape(plan.repeated[1]) or (None,) * 4)[2])
        if not _broadcasts_to(added_shape, scores):
            return Refuse("the attention bias does not broadcast to (batch or 1, heads or 1, S, T)")
        many = _many_biased_pairs(m, site, q_dims[0], plan.heads)
        if many is not None:
            return Refuse(many)
    width = plan.heads * size[1]
    target = ints_of(site, m.value("merge_shape"))
    rows = target is not None and len(target) == 2 and target[1] == width and target[0] == -1
    reason = None if rows else merge_refusal(m.node("merge"), site, width, q_dims[0], q_dims[2])
    if reason is not None:
        return Refuse(reason)
    query = unsplit(plan.q, plan.heads, site)
    k_heads, v = plan.repeated
    key = unsplit(k_heads.value, plan.heads, site) if k_heads.perm is None else split_source(k_heads.value, site)
    value = unsplit(v, plan.heads, site)
    if key is None or value is None:
        key = value = None
    qk_size = head_count(plan.q, site)
    assert qk_size is not None  # plan_4d read it
    flat_kv = qk_size[1] != size[1]
    standard = _standard_attention_is_faster(plan, site, rows or flat_kv)
    if standard is not None:
        return Refuse(standard)
    return _MhaPlan(plan, query, (key, value) if key is not None and value is not None else None, rows, flat_kv)


def _standard_attention_is_faster(plan: Plan4, site: Site, reshaped: bool) -> str | None:
    """Why the standard Attention takes this attention at this opset rather than MultiHeadAttention, or None.

    onnxruntime 1.32 ran opset 23's Attention as fast as MultiHeadAttention or faster on float32 attention
    without a cache (--target ort --target-opset 23, 1 thread, interleaved). Not taken from it: a KV cache
    (GroupQueryAttention is built from the MultiHeadAttention, and it is the faster kernel on long decode steps),
    float16 (MultiHeadAttention takes float16 itself, where the standard Attention runs between Casts to float32,
    attention-float32; the two not measured against each other), and the merges only MultiHeadAttention's plan
    writes (rows of batch * seq, a V wider than K: the standard head merge leaves them as Transposes)."""
    if site.opset < STANDARD_ATTENTION_OPSET or reshaped or site.dtype(plan.q) != DataType.FLOAT:
        return None
    if cache_parts(unrepeated(plan.repeated[0].value, site)) is not None:
        return None
    return (
        f"opset {site.opset} has Attention, which the standard rules write: onnxruntime 1.32 runs it as fast as "
        "MultiHeadAttention or faster on float32 without a cache (1 thread: the outputs 0.93 to 0.98 of the time on "
        "ten BERT, Llama, T5, ViT and Whisper exports; 0.89 on dynamic int8 BERT)"
    )


def _broadcasts_to(shape: tuple[Any, ...] | None, scores: tuple[Any, ...]) -> bool:
    """Whether a bias of ``shape`` (rank 4 at most) adds to ``scores`` (batch, heads, S, T) without growing them:
    each dim 1 or the scores' own. A dim read at run time passes unless the scores' is 1 (onnxruntime checks it
    against the scores' then); a static one must be the scores'."""
    if shape is None or len(shape) > 4:
        return False
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    return all(d == 1 or (d == s if isinstance(d, int) else s != 1) for d, s in zip(padded, scores))


def merged_heads(b: Builder, x: Value, perm: list[int] | None = HEADS) -> Value:
    """(batch, seq, heads * head size) from ``x``, (batch, heads, seq, head size) once ``perm`` is applied."""
    width = b.constant(np.array([0, 0, -1], np.int64), "width")
    return b.op("Reshape", x if perm is None else b.op("Transpose", x, perm=perm), width)


def _build_mha(b: Builder, m: Match, found: _MhaPlan) -> Value:
    plan = found.plan
    query = found.query if found.query is not None else merged_heads(b, plan.q)
    k_heads, v_heads = plan.repeated
    if found.key_value is not None:
        k, v = found.key_value
    elif found.flat_kv:
        # perm HEADS takes K to (batch, heads, T, d): undone, K is (batch, T, heads, d) already
        k = merged_heads(b, k_heads.value, None if k_heads.perm == HEADS else HEADS)
        v = merged_heads(b, v_heads)
    else:
        k = k_heads.value if k_heads.perm is None else b.op("Transpose", k_heads.value, perm=k_heads.perm)
        v = v_heads
    # the rank is read from the plan's own bias: the merged-heads split built here has no shape yet
    added = additive_mask(b, plan) if plan.fill is not None else plan.bias
    bias = with_merged_bias(b, plan, None if added is None else _four_d(b, added, m.site.opset))
    bias = None if bias is None else spelled_out(b, bias, plan.q, v_heads)
    inputs: list[Value | None] = [query, k, v, None, None, bias]
    while inputs[-1] is None:
        inputs.pop()
    out = b.op("MultiHeadAttention", *inputs, domain=MS, num_heads=plan.heads, scale=plan.scale)
    if "nan_guard" in m:
        # The export zeroes the weights of a query whose keys are all masked (a left-padded
        # row); MultiHeadAttention gives NaN there, which later layers spread along the row.
        out = b.op("Where", b.op("IsNaN", out), new_const(b, np.array(0.0), query, "zero"), out)
    return b.op("Reshape", out, m.value("merge_shape")) if found.rows else out


_BIAS_4D = "attention_bias_4d"


def _four_d(b: Builder, bias: Value, opset: int) -> Value:
    """``bias`` with 1s in front up to rank 4: a constant read only here reshaped by value, another bias
    unsqueezed once for all the layers that read it."""
    shape = Site.shape(bias) or ()
    missing = 4 - len(shape)
    if not missing:
        return bias
    values = Site.array(bias)
    if values is not None and len(bias.uses()) == 1:
        return b.constant(values.reshape((1,) * missing + values.shape), "attention_bias")
    axes = list(range(missing))

    def unsqueeze() -> Value:
        return b.listed("Unsqueeze", bias, "axes", axes, as_input=opset >= 13, name=_BIAS_4D).outputs[0]

    return shared_reader(bias, _BIAS_4D, unsqueeze)


# -- target ort: onnxruntime's Attention with packed projections --------------------------------


def _weight(name: str) -> Pattern:
    return either(const(name=name), op.Cast(const(name=name), name=f"{name}_cast"))


def _projection(name: str) -> Pattern:
    matmul = op.MatMul(var("x"), _weight(f"w{name}"), name=f"{name}_mm")
    return op.Add(matmul, const(name=f"b{name}", rank=1), name=f"{name}_add")


_PACKED = _projection("")
_SPLIT_QKV = [op.Split(_PACKED, optional(const(name="sizes")), name="qkv", output=i) for i in range(3)]
_PARTS = ("q", "k", "v")


def _packed_weights(m: Match, site: Site) -> tuple[np.ndarray, np.ndarray] | Refuse:
    """The packed ``[Wq Wk Wv]`` (in the stored type) and ``[bq bk bv]``, or why not."""
    names = ("w",) if "qkv" in m.bindings else tuple(f"w{p}" for p in _PARTS)
    weights, biases = [], []
    for name in names:
        weight, bias = Site.array(m.value(name)), Site.array(m.value("b" + name[1:]))
        if weight is None or weight.ndim != 2 or bias is None:
            return Refuse("a projection weight or bias is not a readable constant matrix / vector")
        weights.append(weight)
        biases.append(bias)
    casts = {f"{n}_cast" in m.bindings for n in names}
    if len(casts) != 1 or len({w.dtype for w in weights}) != 1:
        return Refuse("the projection weights are stored in different types")
    if casts == {True} and any(m.node(f"{n}_cast").attr("to") != DataType.FLOAT for n in names):
        return Refuse("a weight Cast is not to float32")
    packed = np.concatenate(weights, axis=1)
    bias = np.concatenate(biases)
    if bias.dtype != np.float32 or bias.shape != (packed.shape[1],):
        return Refuse("the projection biases are not float32 vectors over the outputs")
    return packed, bias


def _even_split(m: Match, site: Site) -> bool:
    split = m.node("qkv")
    rank = site.rank(split.inputs[0])
    if rank is None or split.attr("axis", 0) not in (-1, rank - 1):
        return False
    sizes = Site.array(m.value("sizes")) if "sizes" in m.bindings else split.attr("split")
    return sizes is None or len(set(int(s) for s in np.asarray(sizes).ravel())) == 1


def _raw_mask(mask: Value) -> tuple[Value, float, Node] | None:
    """For BERT's ``(1 - float(m[:, None, None, :])) * c``: the 2-D mask ``m``, ``c`` and the
    chain's first node (None: another mask)."""
    scaled = mask.producer
    if scaled is None or scaled.op_type != "Mul":
        return None
    for inverted, factor in (scaled.inputs, reversed(scaled.inputs)):
        c = float_array(factor)
        sub = inverted.producer if inverted is not None else None
        if c is None or c.size != 1 or sub is None or sub.op_type != "Sub":
            continue
        one = float_array(sub.inputs[0])
        if one is None or one.size != 1 or float(one.ravel()[0]) != 1.0 or sub.inputs[1] is None:
            continue
        found = _unsqueezed_cast(sub.inputs[1])
        if found is not None:
            return found[0], float(c.ravel()[0]), found[1]
    return None


# BERT's mask m[:, None, None, :] as float: the 2-D ``m`` behind a run of Unsqueezes and Casts.
_MASK_CHAIN = chain(("Cast", "Unsqueeze"), var("m"), name="chain")


def _unsqueezed_cast(value: Value) -> tuple[Value, Node] | None:
    """Unsqueezes and one Cast to float taking a 2-D ``m`` (B, S) to ``value`` (B, 1, 1, S): (m, the chain's first
    node)."""
    bound = next(match(_MASK_CHAIN, value))  # the longest run: the chain always matches, with no node at least
    run = [node for key, node in bound.items() if isinstance(key, tuple) and isinstance(node, Node)]
    source = bound["m"]
    if sum(node.op_type == "Cast" for node in run) != 1 or not isinstance(source, Value):
        return None
    shape, wanted = Site.shape(source), Site.shape(value)
    if shape is None:
        return None
    if len(shape) != 2 or None in shape or Site.dtype(value) != DataType.FLOAT or wanted != (shape[0], 1, 1, shape[1]):
        return None
    return source, run[-1]


@dataclass
class _OrtPlan:
    plan: dict[str, object]
    weight: np.ndarray
    bias: np.ndarray
    raw: tuple[Value, float, Node] | None


def _ort_plan(m: Match, site: Site) -> _OrtPlan | Refuse:
    plan = plan_attention(m, site)
    if isinstance(plan, Refuse):
        return plan
    if plan["heads"] != plan["kv_heads"]:
        return Refuse("grouped-query attention has no onnxruntime Attention")
    x = m.value("x")
    if site.dtype(x) != DataType.FLOAT or site.rank(x) != 3:
        return Refuse("the layer input is not a 3-D float32 tensor")
    if "qkv" in m.bindings and not _even_split(m, site):
        return Refuse("the packed projection is not split in three equal parts along the last axis")
    mask = plan["mask"]
    if isinstance(mask, Value):
        heads = plan["heads"]
        assert isinstance(heads, int)  # plan_attention read it
        many = _many_biased_pairs(m, site, (site.shape(x) or (None,))[0], heads)
        if many is not None:
            return Refuse(many)
    raw = _raw_mask(mask) if isinstance(mask, Value) else None
    if isinstance(mask, Value) and raw is None and site.dtype(mask) != DataType.FLOAT:
        return Refuse("a boolean mask that is not the causal band")
    weights = _packed_weights(m, site)
    if isinstance(weights, Refuse):
        return weights
    width = (site.shape(m.root.outputs[0]) or (None,))[-1]
    if not isinstance(width, int) or weights[0].shape[1] != 3 * width:
        return Refuse("the projections are not all of the output's width")
    return _OrtPlan(plan, weights[0], weights[1], raw)


def _build_ort(b: Builder, m: Match, found: _OrtPlan) -> Value:
    site, plan = m.site, found.plan
    weight = b.constant(found.weight, "qkv_weight")
    if found.weight.dtype != np.float32:
        weight = b.op("Cast", weight, to=DataType.FLOAT)
    mask_index: Value | None = None
    attention_bias: Value | None = None
    extra: dict[str, Any] = {}
    if found.raw is not None:
        source, fill, first = found.raw
        mask_index = _int32_mask(site, source, first)
        extra["mask_filter_value"] = fill
    elif isinstance(plan["mask"], Value):
        attention_bias = plan["mask"]
        if (site.shape(attention_bias) or (0, 0, 0))[2] == 1:
            attention_bias = rows_spelled_out(b, attention_bias)
    bias = b.constant(found.bias, "qkv_bias")
    inputs: list[Value | None] = [m.value("x"), weight, bias, mask_index, None, attention_bias]
    while inputs[-1] is None:
        inputs.pop()
    node = b.node(
        "Attention",
        *inputs,
        domain=MS,
        num_heads=plan["heads"],
        scale=plan["scale"],
        unidirectional=plan["causal"],
        **extra,
    )
    return node.outputs[0]


_INT32_MASK = "attention_mask_int32"


def _int32_mask(site: Site, source: Value, first: Node) -> Value:
    """``source`` as int32, made once before the mask chain (every layer reads it)."""

    def cast() -> Value:
        builder = site.ctx.builder(site.model, site.graph, before=first, tag="ort-attention")
        return builder.op("Cast", source, to=DataType.INT32, name=_INT32_MASK)

    return shared_reader(source, _INT32_MASK, cast)


_ORT_DOC = "projections, MatMul/scale/mask/Softmax/MatMul, head split and merge -> com.microsoft Attention (target ort)"
_ORT_ATTENTION = partial(
    Rule, family=FAMILY, plan=_ort_plan, build=_build_ort, targets=frozenset({"ort"}), label="Attention", doc=_ORT_DOC
)

_MHA_RULE = partial(
    Rule, family=FAMILY, pattern=_MHA, build=_build_mha, targets=frozenset({"ort"}), label="MultiHeadAttention"
)

RULES: tuple[Rule[Any], ...] = (
    _MHA_RULE(
        name="ort-multihead-attention",
        plan=_plan_mha,
        doc="4-D scaled dot-product attention with its head merge -> com.microsoft MultiHeadAttention (target ort)",
    ),
    _MHA_RULE(
        name="ort-multihead-attention-merged",
        pattern=op.Reshape(op.Transpose(MERGED_HEADS, perm=HEADS, name="merge_t"), var("merge_shape"), name="merge"),
        plan=partial(_plan_mha, read=plan_merged),
        doc="attention on merged (batch * heads) 3-D tensors with its head merge (a merged bias such as BLOOM's "
        "ALiBi split by heads into the attention_bias) -> com.microsoft MultiHeadAttention (target ort)",
    ),
    _MHA_RULE(
        name=_BROADCAST_BIAS,
        plan=partial(_plan_mha, broadcast=True),
        default=False,
        doc="4-D scaled dot-product attention with its head merge and an attention bias of rank below 4 that "
        "broadcasts to (batch or 1, heads or 1, S, T), given its leading 1s (LeViT's per-head position bias) -> "
        "com.microsoft MultiHeadAttention (target ort; measured slower)",
    ),
    _ORT_ATTENTION(name="ort-attention", pattern=core(_projection("q"), _projection("k"), _projection("v"))),
    _ORT_ATTENTION(name="ort-attention-packed", pattern=core(*_SPLIT_QKV)),
    # the inputs past_key, past_value and attention_bias
    cached_in_float32("mha-float32", FAMILY, "MultiHeadAttention", 10, cache=(6, 7), mask=5),
)
