"""The standard Attention rules (opset 23): the layer on 3-D projections, the exporters' 4-D scaled dot-product
attention, attention on merged heads, Attention's own head split and merge, and a KV cache; last, a float16
Attention computed in float32.

Why float32 (``attention-float32``, late: it wraps what the others wrote): onnxruntime's CPU provider has no float16
MatMul or Softmax kernel, so it runs the float16 chain an Attention replaces in float32 behind Casts it inserts,
while its float16 Attention kernel rounds to float16 inside. The fused float16 Attention so moved the float16
Llama exports further from their float32 models than the unfused chain (llama_kv_dynamo_fp16 at opset 23: 1.099 of
the chain's error to the float32 export; between Casts 1.029; llama_dynamo_fp16 1.031 -> 0.991), and was no faster
than between Casts on any float16 transformer export (ORT_ENABLE_ALL, 1 thread). A runtime with float16 kernels of
its own (a GPU) keeps the float16 op with ``--fuse-disable attention-float32``."""

from __future__ import annotations

from functools import partial
from typing import Any

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of
from graphopt.passes.fuse.rules.attention.builds import build_3d, build_4d, build_attention, build_cache
from graphopt.passes.fuse.rules.attention.plans import Plan4, plan_3d, plan_4d, plan_attention, plan_cache, plan_merged
from graphopt.passes.fuse.rules.attention.spellings import (
    ATTENTION,
    FAMILY,
    HEADS_3D,
    KV_CACHE,
    MERGED_HEADS,
    NAN_GUARD,
    SOFTMAX,
)
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import either, op, optional, var


def _plan_standard_4d(m: Match, site: Site) -> Plan4 | Refuse:
    return plan_4d(m, site, softcap=True)


def _float16(value: Value) -> bool:
    return Site.dtype(value) == DataType.FLOAT16


# Attention's inputs and outputs that are never float (a boolean mask, nonpad_kv_seqlen).
_NOT_FLOAT = frozenset({DataType.BOOL, DataType.INT64})


def _plan_float32(m: Match, site: Site) -> Refuse | None:
    node = m.root
    floats = [v for v in (*node.inputs, *node.outputs) if v is not None and site.dtype(v) not in _NOT_FLOAT]
    if any(site.dtype(v) != DataType.FLOAT16 for v in floats):
        return Refuse("a float input or output is not float16 (or its type is unknown)")
    return None


def _build_float32(b: Builder, m: Match, plan: None) -> list[Value]:
    node = m.root
    widened = [b.op("Cast", v, to=int(DataType.FLOAT)) if v is not None and _float16(v) else v for v in node.inputs]
    computed = b.node("Attention", *widened, outputs=len(node.outputs), **attrs_of(node))
    return [b.op("Cast", v, to=int(DataType.FLOAT16)) for v in computed.outputs]


# Every standard Attention rule: the op came in opset 23.
_attention = partial(Rule, family=FAMILY, min_opset=23, label="Attention")

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
    _attention(
        name="attention-float32",
        pattern=op.Attention(
            var("q", _float16), var("k"), var("v"), *(optional(var(f"_{i}")) for i in range(3, 7)), commute=False
        ),
        plan=_plan_float32,
        build=_build_float32,
        kind="late",
        label="float16 Attention",
        doc="Attention on float16 -> Cast to float32, Attention, Cast to float16: onnxruntime's CPU provider runs "
        "the float16 chain an Attention replaces in float32, its float16 Attention kernel does not",
    ),
)
