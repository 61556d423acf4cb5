"""Fused float16 ops computed in float32 between Casts, for onnxruntime's CPU provider (late rules of the
attention and norm families: ``attention-float32``, ``rmsnorm-float32``).

onnxruntime's CPU provider has no float16 kernel for most arithmetic (MatMul, Softmax, Pow, ReduceMean, Mul): it
runs those float16 ops in float32 behind Casts it inserts, then drops the Cast pairs between them, so a float16 chain
of such ops never rounds to float16 inside (a user's Cast to float16 and back around one of them goes too). A fused
op that has a float16 kernel (Attention, RMSNormalization) rounds its result to float16 where the chain did not, and
Attention's kernel rounds inside as well. Computed between Casts, the op runs in float32 and onnxruntime drops those
Casts with its own next to it, so the values pass on in float32 as the chain's did. Measured (error to the float32
export over the variant's, 6 draws pooled, ``--target-opset 23``): llama_dynamo_fp16 1.037 -> 0.997 with both;
llama_kv_dynamo_fp16 1.099 -> 1.029 (one draw) with Attention's; no float16 transformer export slower at
ORT_ENABLE_ALL, 1 thread. A runtime with float16 kernels of its own (a GPU) keeps the float16 ops with
``--fuse-disable attention-float32 --fuse-disable rmsnorm-float32``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, optional, var

__all__ = ["in_float32"]

# Inputs and outputs of those ops that are never float (a boolean mask, sequence lengths).
_NOT_FLOAT = frozenset({DataType.BOOL, DataType.INT32, DataType.INT64})


def _float16(value: Value) -> bool:
    return Site.dtype(value) == DataType.FLOAT16


def _every_float_float16(m: Match, site: Site) -> Refuse | None:
    node = m.root
    floats = [v for v in (*node.inputs, *node.outputs) if v is not None and site.dtype(v) not in _NOT_FLOAT]
    if any(site.dtype(v) != DataType.FLOAT16 for v in floats):
        return Refuse("a float input or output is not float16 (or its type is unknown)")
    return None


def _computed_in_float32(b: Builder, m: Match, plan: None) -> list[Value]:
    node = m.root
    widened = [b.op("Cast", v, to=int(DataType.FLOAT)) if v is not None and _float16(v) else v for v in node.inputs]
    computed = b.node(node.op_type, *widened, outputs=len(node.outputs), **attrs_of(node))
    return [b.op("Cast", v, to=int(DataType.FLOAT16)) for v in computed.outputs]


def in_float32(name: str, family: str, op_type: str, inputs: int, **spec: Any) -> Rule[None]:
    """The late rule ``name`` writing a float16 ``op_type`` (at most ``inputs`` inputs, the first float16) in
    float32 between Casts; ``spec``: the rule's other fields (min_opset, label, doc)."""
    pattern = op.any_of(
        (op_type,), var("x", _float16), *(optional(var(f"_{i}")) for i in range(1, inputs)), commute=False
    )
    make = partial(Rule, kind="late", plan=_every_float_float16, build=_computed_in_float32)
    rule: Rule[None] = make(name=name, family=family, pattern=pattern, **spec)
    return rule
