"""Fused float16 ops computed in float32 between Casts, for onnxruntime's CPU provider (late rules of the
attention, norm, rotary and activation families: ``attention-float32``, ``rmsnorm-float32``,
``rotary-embedding-float32``, ``gelu-float32``,
``softmax-float32``, ``logsoftmax-float32``, and at ``--target ort`` ``ort-rmsnorm-float32`` for onnxruntime's
SimplifiedLayerNormalization, ``mha-float32``, ``gqa-float32`` for com.microsoft MultiHeadAttention and
GroupQueryAttention, ``ort-gelu-float32``, ``ort-fastgelu-float32`` for com.microsoft Gelu and FastGelu).

The GELUs are a matter of speed: onnxruntime 1.32's CPU provider has no float16 kernel for Gelu (opset 20),
com.microsoft Gelu or FastGelu, so it runs the standard op's function body (Div, Erf, Add, Mul; Pow and Tanh for
the tanh form) and the contrib ones decomposed, each primitive in float32 behind Casts: on 12.8M float16 values,
1 thread, 1.9x and 3.3x the float32 Gelu kernel's time, 2.3x and 3.2x for the contrib ones. Between Casts the
float32 kernel runs. So it is for Softmax and LogSoftmax from opset 13, where they have a function body: onnxruntime
runs it (ReduceMax, Sub, Exp, ReduceSum, Div) instead of a float16 kernel, 2.7x to 3.3x and 2.4x to 2.8x the float32
kernel's time on 4.2M float16 values; below opset 13 it runs the float32 kernel behind Casts of its own, as fast as
between Casts, so those rules start at 13. A float16 BiasGelu or QuickGelu needs no rule: onnxruntime runs their
float32 kernels behind Casts of its own, as it does HardSigmoid, HardSwish, Softsign, Swish, Sigmoid, Tanh and Relu
(each as fast as between Casts, measured alike).

onnxruntime's CPU provider has no float16 kernel for most arithmetic (MatMul, Softmax, Pow, ReduceMean, Mul): it
runs those float16 ops in float32 behind Casts it inserts, then drops the Cast pairs between them, so a float16 chain
of such ops never rounds to float16 inside (a user's Cast to float16 and back around one of them goes too). A fused
op that has a float16 kernel (Attention, RMSNormalization) rounds its result to float16 where the chain did not, and
Attention's kernel rounds inside as well. Computed between Casts, the op runs in float32 and onnxruntime drops those
Casts with its own next to it, so the values pass on in float32 as the chain's did. Measured (error to the float32
export over the variant's, 6 draws pooled, ``--target-opset 23``): llama_dynamo_fp16 and llama_ts_fp16 1.042 ->
0.997 with both rules; no float16 transformer export slower at ORT_ENABLE_ALL, 1 thread.

The Casts these rules write carry the islands family's names (islands.py): between two ops computed in float32 a
Cast to float16 and back that they wrote is dropped, where a model's own stays.

A KV cache (an Attention's past_key / past_value) is read in float32 only where the model casts it to float16 from
float32 (a float16 model with float32 inputs and outputs, as onnxruntime's converter writes it with keep_io_types):
the Attention reads the float32 value itself, so no conversion of the cache is added (the model's own Cast to float16
goes; llama_kv_dynamo_fp16 at opset 23: 1.098 -> 0.955 of the variant's error, 0.754 -> 0.688 of its latency). A
cache that is float16 itself is refused: it would be converted whole at every decode step (one step's Attention at a
4096-token cache, 8 heads of 128, 1 thread: 3.70 ms in float16, 9.88 ms between Casts). A runtime with float16
kernels of its own (a GPU) keeps the float16 ops with ``--fuse-disable attention-float32 --fuse-disable
rmsnorm-float32``.

At ``--target ort`` onnxruntime's float16 MultiHeadAttention and GroupQueryAttention kernels round their result
once, as the Casts would (the float16 transformer exports' error to the float32 export the same to three decimals
with them in float32 between Casts, by hand), but a float16 KV cache is the float32 cache rounded: where the model
casts it from float32, ``mha-float32`` and ``gqa-float32`` read the float32 cache itself, and only there.
llama_kv_ts_fp16's output (a GroupQueryAttention and a MultiHeadAttention per block, in the two branches of an If)
moved from 1.012 of the variant's error to 0.926 (6 draws pooled; its GroupQueryAttention has the cache, the
MultiHeadAttention of the other branch none), and ran 0.829 of the variant's time against 0.843 (ORT_ENABLE_ALL,
1 thread, 40 paired rounds); without a cache the Casts bought nothing and cost vit_ts_fp16 0.841 -> 0.865.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphopt.ir import CONTRIB_DOMAIN, DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of, cast_source, is_float
from graphopt.passes.fuse.rules.islands import NARROWED, WIDENED
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, optional, var

__all__ = ["cached_in_float32", "in_float32", "ort_in_float32"]

_FLOAT16_LOWEST = float(np.finfo(np.float16).min)


def _float16(value: Value) -> bool:
    return Site.dtype(value) == DataType.FLOAT16


def _plan(cache: tuple[int, ...], cached_only: bool) -> Callable[[Match, Site], Refuse | None]:
    def plan(m: Match, site: Site) -> Refuse | None:
        node = m.root
        if not any(v.is_used() for v in node.outputs):
            return Refuse("nothing reads its outputs (dce removes it)")
        given = [v for v in (node.inputs[i] for i in cache if i < len(node.inputs)) if v is not None]
        if any(cast_source(v, DataType.FLOAT16, DataType.FLOAT) is None for v in given):
            return Refuse("a float16 KV cache: in float32 it would be converted whole at every step")
        if cached_only and not given:
            return Refuse("no KV cache: its float16 kernel rounds the result once, as the Casts would")
        for value in (v for v in node.inputs if v is not None):
            if site.dtype(value) is None:
                return Refuse(f"the type of input {value.name!r} is unknown")
            if is_float(value) and not _float16(value):
                return Refuse(f"input {value.name!r} is float but not float16")
        if any(v.is_used() and not _float16(v) for v in node.outputs):
            return Refuse("an output read is not float16 (or its type is unknown)")
        return None

    return plan


def _widened_mask(b: Builder, mask: Value) -> Value:
    """An additive float16 mask in float32, its float16 lowest entries float32's lowest: onnxruntime's Attention
    reads a mask entry equal to its type's lowest value as -inf (a fully masked query gets zeros), which the float16
    op so did."""
    wide = b.op("Cast", mask, to=int(DataType.FLOAT))
    lowest = b.op("Equal", wide, b.constant(np.array(_FLOAT16_LOWEST, np.float32), "float16_lowest"))
    return b.op("Where", lowest, b.constant(np.array(np.finfo(np.float32).min, np.float32), "float32_lowest"), wide)


def _widened(b: Builder, value: Value | None, cached: bool, mask: bool) -> Value | None:
    """``value`` as the float32 op reads it: a float16 input cast up (a mask as _widened_mask has it), a KV
    cache's from the float32 value it was cast from."""
    if value is None or not _float16(value):
        return value
    if cached:
        return cast_source(value, DataType.FLOAT16, DataType.FLOAT)
    return _widened_mask(b, value) if mask else b.op("Cast", value, to=int(DataType.FLOAT), name=WIDENED)


def _build(cache: tuple[int, ...], masks: tuple[int, ...]) -> Callable[[Builder, Match, None], list[Value]]:
    def build(b: Builder, m: Match, plan: None) -> list[Value]:
        node = m.root
        widened = [_widened(b, v, index in cache, index in masks) for index, v in enumerate(node.inputs)]
        read = [index for index, v in enumerate(node.outputs) if v.is_used()]  # graph outputs too
        computed = b.node(node.op_type, *widened, domain=node.domain, outputs=read[-1] + 1, **attrs_of(node))
        return [
            b.op("Cast", wide, to=int(DataType.FLOAT16), name=NARROWED) if index in read else wide
            for index, wide in enumerate(computed.outputs)
        ]

    return build


def in_float32(
    name: str,
    family: str,
    op_type: str,
    inputs: int,
    *,
    min_opset: int,
    label: str,
    doc: str,
    cache: tuple[int, ...] = (),
    masks: tuple[int, ...] = (),
    domain: str = "",
    targets: frozenset[str] = frozenset({"onnx", "ort"}),
    cached_only: bool = False,
) -> Rule[None]:
    """The late rule ``name`` writing a float16 ``op_type`` of ``domain`` (at most ``inputs`` inputs, the first
    float16) in float32 between Casts; the inputs ``cache`` are a KV cache, read from the float32 value they are cast
    from (refused where they are not; with ``cached_only``, also where there is none), the inputs ``masks`` additive
    masks (see _widened_mask)."""
    pattern = op.any_of(
        (op_type,), var("x", _float16), *(optional(var(f"_{i}")) for i in range(1, inputs)), domain=domain
    )
    return Rule(
        name=name,
        family=family,
        pattern=pattern,
        plan=_plan(cache, cached_only),
        build=_build(cache, masks),
        kind="late",
        targets=targets,
        min_opset=min_opset,
        label=label,
        doc=doc,
    )


def ort_in_float32(
    name: str,
    family: str,
    op_type: str,
    inputs: int,
    *,
    doc: str,
    cache: tuple[int, ...] = (),
    masks: tuple[int, ...] = (),
) -> Rule[None]:
    """The late ``--target ort`` rule ``name`` writing a float16 com.microsoft ``op_type`` in float32 between Casts;
    with a ``cache``, only where that KV cache is cast to float16 from float32, reading it itself."""
    return in_float32(
        name,
        family,
        op_type,
        inputs,
        cache=cache,
        masks=masks,
        domain=CONTRIB_DOMAIN,
        targets=frozenset({"ort"}),
        cached_only=bool(cache),
        min_opset=1,
        label=f"float16 {op_type}",
        doc=doc,
    )


def cached_in_float32(
    name: str, family: str, op_type: str, inputs: int, *, cache: tuple[int, int], mask: int
) -> Rule[None]:
    """``ort_in_float32`` for an attention op with a KV cache (inputs ``cache``); ``mask``: its additive
    attention bias."""
    return ort_in_float32(
        name,
        family,
        op_type,
        inputs,
        cache=cache,
        masks=(mask,),
        doc=f"com.microsoft {op_type} on float16 with a KV cache cast from float32 -> Cast to float32, {op_type} "
        "reading the float32 cache, Cast to float16 (target ort)",
    )
