"""Fused float16 ops computed in float32 between Casts, for onnxruntime's CPU provider (late rules of the
attention and norm families: ``attention-float32``, ``rmsnorm-float32``).

onnxruntime's CPU provider has no float16 kernel for most arithmetic (MatMul, Softmax, Pow, ReduceMean, Mul): it
runs those float16 ops in float32 behind Casts it inserts, then drops the Cast pairs between them, so a float16 chain
of such ops never rounds to float16 inside (a user's Cast to float16 and back around one of them goes too). A fused
op that has a float16 kernel (Attention, RMSNormalization) rounds its result to float16 where the chain did not, and
Attention's kernel rounds inside as well. Computed between Casts, the op runs in float32 and onnxruntime drops those
Casts with its own next to it, so the values pass on in float32 as the chain's did. Measured (error to the float32
export over the variant's, 6 draws pooled, ``--target-opset 23``): llama_dynamo_fp16 and llama_ts_fp16 1.042 ->
0.997 with both rules; no float16 transformer export slower at ORT_ENABLE_ALL, 1 thread.

Not on a KV cache (an Attention with past_key / past_value): the cache would be converted whole at every decode
step (one step's Attention at a 4096-token cache, 8 heads of 128, 1 thread: 3.70 ms in float16, 9.88 ms between
Casts). A runtime with float16 kernels of its own (a GPU) keeps the float16 ops with
``--fuse-disable attention-float32 --fuse-disable rmsnorm-float32``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of, is_float
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, optional, var

__all__ = ["in_float32"]

_FLOAT16_LOWEST = float(np.finfo(np.float16).min)


def _float16(value: Value) -> bool:
    return Site.dtype(value) == DataType.FLOAT16


def _given(values: Sequence[Value | None], indices: tuple[int, ...]) -> bool:
    return any(i < len(values) and values[i] is not None for i in indices)


def _read(value: Value) -> bool:
    return value.is_used() or value.is_graph_output


def _plan(cache: tuple[int, ...]) -> Callable[[Match, Site], Refuse | None]:
    def plan(m: Match, site: Site) -> Refuse | None:
        node = m.root
        if _given(node.inputs, cache):
            return Refuse("a KV cache: in float32 it would be converted whole at every step")
        for value in (v for v in node.inputs if v is not None):
            if site.dtype(value) is None:
                return Refuse(f"the type of input {value.name!r} is unknown")
            if is_float(value) and not _float16(value):
                return Refuse(f"input {value.name!r} is float but not float16")
        if any(_read(v) and not _float16(v) for v in node.outputs):
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


def _build(masks: tuple[int, ...]) -> Callable[[Builder, Match, None], list[Value]]:
    def build(b: Builder, m: Match, plan: None) -> list[Value]:
        node = m.root
        widened = [
            v
            if v is None or not _float16(v)
            else _widened_mask(b, v)
            if index in masks
            else b.op("Cast", v, to=int(DataType.FLOAT))
            for index, v in enumerate(node.inputs)
        ]
        read = [index for index, v in enumerate(node.outputs) if _read(v)]
        computed = b.node(node.op_type, *widened, outputs=read[-1] + 1, **attrs_of(node))
        return [
            b.op("Cast", wide, to=int(DataType.FLOAT16)) if index in read else wide
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
) -> Rule[None]:
    """The late rule ``name`` writing a float16 ``op_type`` (at most ``inputs`` inputs, the first float16) in
    float32 between Casts; not where any input of ``cache`` is given; the inputs ``masks`` are additive masks
    (see _widened_mask)."""
    pattern = op.any_of((op_type,), var("x", _float16), *(optional(var(f"_{i}")) for i in range(1, inputs)))
    return Rule(
        name=name,
        family=family,
        pattern=pattern,
        plan=_plan(cache),
        build=_build(masks),
        kind="late",
        min_opset=min_opset,
        label=label,
        doc=doc,
    )
