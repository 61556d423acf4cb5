"""The standard Attention rules (opset 23): the layer on 3-D projections, the exporters' 4-D scaled dot-product
attention, attention on merged heads, Attention's own head split and merge, and a KV cache; last, a float16
Attention computed in float32 (``attention-float32``, late: it wraps what the others wrote; see _float32.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

from graphopt.passes.fuse.rules._float32 import in_float32
from graphopt.passes.fuse.rules.attention.builds import build_3d, build_4d, build_attention, build_cache
from graphopt.passes.fuse.rules.attention.plans import (
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
from graphopt.passes.rewrite.engine import Rule
from graphopt.passes.rewrite.patterns import either, op, var

# Every standard Attention rule: the op came in opset 23.
_attention = partial(Rule, family=FAMILY, min_opset=STANDARD_ATTENTION_OPSET, label="Attention")

RULES: tuple[Rule[Any], ...] = (
    _attention(
        name="attention",
        pattern=ATTENTION,
        plan=plan_attention,
        build=build_attention,
        doc="MatMul/scale/mask/Softmax/MatMul with head split and merge -> Attention (opset 23)",
    ),
    _attention(
        name="attention-4d",
        pattern=op.MatMul(either(NAN_GUARD, SOFTMAX), var("v"), name="pv"),
        plan=partial(plan_4d, softcap=True),
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
