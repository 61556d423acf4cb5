"""The standard Attention rules (opset 23): the layer on 3-D projections, the exporters' 4-D scaled dot-product
attention, attention on merged heads, Attention's own head split and merge, and a KV cache; last, a float16
Attention computed in float32 (``attention-float32``, late: it wraps what the others wrote; see _float32.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

from graphopt.passes.fuse.rules._float32 import in_float32
from graphopt.passes.fuse.rules.attention.builds import build_3d, build_4d, build_attention, build_cache
from graphopt.passes.fuse.rules.attention.plans import (
    BIASED_PAIRS_LIMIT,
    Plan4,
    biased_pairs,
    plan_3d,
    plan_4d,
    plan_attention,
    plan_cache,
    plan_merged,
)
from graphopt.passes.fuse.rules.attention.spellings import (
    ATTENTION,
    FAMILY,
    HEADS_3D,
    KV_CACHE,
    MERGED_HEADS,
    NAN_GUARD,
    SOFTMAX,
    STANDARD_ATTENTION_OPSET,
)
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import either, op, var
from graphopt.passes.rewrite.qdq import quantized


def _plan_standard(m: Match, site: Site) -> dict[str, object] | Refuse:
    plan = plan_attention(m, site)
    if isinstance(plan, Refuse) or plan["mask"] is None:
        return plan
    heads, batch = plan["heads"], (site.shape(m.root.outputs[0]) or (None,))[0]
    assert isinstance(heads, int)
    return _biased_pairs_through_qdq(m, site, batch, heads) or plan


def _plan_standard_4d(m: Match, site: Site) -> Plan4 | Refuse:
    plan = plan_4d(m, site, softcap=True)
    if isinstance(plan, Refuse) or (plan.mask is None and plan.bias is None and plan.fill is None):
        return plan
    return _biased_pairs_through_qdq(m, site, (site.shape(plan.q) or (None,))[0], plan.heads) or plan


def _biased_pairs_through_qdq(m: Match, site: Site, batch: Any, heads: int) -> Refuse | None:
    """Why an attention with a mask or bias, read through Q/DQ pairs over many (batch, head) pairs,
    stays as written: onnxruntime runs its scores and weighted sum as integer QLinearMatMuls, and
    a float Attention over windowed batches ran slower. Swin's QDQ exports at opset 23, 64 windows
    x 2 heads (30 rounds, 3 sessions, ORT_ENABLE_ALL, 1 thread): with it 1.004 and 0.813 of the
    variant's time, without it 0.941 and 0.739 (dynamo, TorchScript); in float32 it is 0.901
    against 0.984 without (the threshold, BIASED_PAIRS_LIMIT, is onnxruntime's MultiHeadAttention's).
    A batch that is a symbolic dim counts once per sample (TorchScript's windows: the fusion is made)."""
    # The scores' and the weighted sum's operands: a dequantized constant elsewhere (a scale) runs no integer kernel.
    operands = (value for node in m.nodes if node.op_type == "MatMul" for value in node.inputs)
    if not any(value is not None and quantized(value, site) for value in operands):
        return None
    pairs = biased_pairs(batch, heads)
    if pairs is None:
        return None
    return Refuse(
        f"through Q/DQ, {pairs} (batch, head) pairs per sample with a mask or bias: onnxruntime runs the "
        f"quantized form's integer MatMuls faster than a float Attention from {BIASED_PAIRS_LIMIT}"
    )


# Every standard Attention rule: the op came in opset 23.
_attention = partial(Rule, family=FAMILY, min_opset=STANDARD_ATTENTION_OPSET, label="Attention")

RULES: tuple[Rule[Any], ...] = (
    _attention(
        name="attention",
        pattern=ATTENTION,
        plan=_plan_standard,
        build=build_attention,
        doc="MatMul/scale/mask/Softmax/MatMul with head split and merge -> Attention (opset 23)",
    ),
    _attention(
        name="attention-4d",
        pattern=op.MatMul(either(NAN_GUARD, SOFTMAX), var("v"), name="pv"),
        plan=_plan_standard_4d,
        build=build_4d,
        doc="scaled dot-product attention on 4-D heads as the PyTorch exporters write it (scale on the scores "
        "or on Q and K, GQA head repeat, additive or boolean mask, IsNaN guard, tanh softcap) -> Attention (opset 23)",
    ),
    _attention(
        name="attention-merged-heads",
        pattern=MERGED_HEADS,
        plan=partial(plan_merged, softcap=True),
        build=build_4d,
        doc="attention on merged (batch * heads) 3-D tensors as older torch code writes it (bmm / baddbmm with a "
        "merged bias such as BLOOM's ALiBi, split by heads for the mask and Softmax) -> Attention on 4-D heads",
    ),
    _attention(
        name="attention-heads-3d",
        pattern=HEADS_3D,
        plan=plan_3d,
        build=build_3d,
        doc="Attention on head splits of 3-D projections, its output merged back -> Attention on the projections",
    ),
    _attention(
        name="attention-kv-cache",
        pattern=KV_CACHE,
        plan=plan_cache,
        build=build_cache,
        exports=("key_cache", "value_cache"),
        doc="Attention on a KV cache's Concat(past, new) keys and values -> Attention with past_key / past_value "
        "in and present_key / present_value out",
    ),
    in_float32(
        "attention-float32",
        FAMILY,
        "Attention",
        7,
        cache=(4, 5),  # past_key, past_value
        masks=(3,),  # attn_mask
        min_opset=STANDARD_ATTENTION_OPSET,
        label="float16 Attention",
        doc="Attention on float16 -> Cast to float32, Attention, Cast to float16: onnxruntime's CPU provider runs "
        "the float16 chain an Attention replaces in float32, its float16 Attention kernel does not",
    ),
)
