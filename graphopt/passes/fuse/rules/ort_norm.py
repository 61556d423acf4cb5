"""RMSNorm for ``--target ort``: onnxruntime's SimplifiedLayerNormalization.

``x / Sqrt(ReduceMean(x^2) + eps) * gamma`` (or ``x * Reciprocal(...)``, or TorchScript's
``x * (1 / Sqrt(...))``), and Hugging Face's float16 / bfloat16 spelling normalized in float32
and cast back, become ``SimplifiedLayerNormalization(x, gamma, axis, epsilon)``: onnxruntime
registers it in the default domain (since version 1, any opset) and runs it on its CPU provider
for float, double and float16, so it stands in for RMSNormalization below opset 23. The residual
forms (SkipSimplifiedLayerNormalization) are norm.py's ``ort-skip`` rules.
"""

from __future__ import annotations

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import new_const
from graphopt.passes.fuse.rules.norm import (
    FAMILY,
    RMS,
    RMS_ROUND_TRIP,
    NormFacts,
    affine,
    rms_norm_facts,
    round_trip_facts,
)
from graphopt.passes.rewrite.engine import Match, Plan, Rule
from graphopt.passes.rewrite.patterns import Pattern

_DOC = "x / Sqrt(ReduceMean(x^2) + eps) [* gamma] -> SimplifiedLayerNormalization (target ort)"


def _simplified(b: Builder, m: Match, facts: NormFacts) -> Value:
    x, (axis, eps, gamma, _) = m.value("x"), facts
    scale = new_const(b, gamma, x, "rms_scale")
    # stash_type 1 (the default) normalizes in float32: the round trip's Casts, folded in.
    return b.op("SimplifiedLayerNormalization", x, scale, axis=axis, epsilon=eps)


def _rule(name: str, pattern: Pattern, plan: Plan, doc: str = _DOC) -> Rule:
    return Rule(
        name=name,
        family=FAMILY,
        pattern=pattern,
        plan=plan,
        build=_simplified,
        targets=frozenset({"ort"}),
        label="RMSNorm",
        doc=doc,
    )


RULES: tuple[Rule, ...] = (
    _rule("ort-rmsnorm", affine(RMS, True, False), rms_norm_facts),
    _rule(
        "ort-rmsnorm-round-trip",
        RMS_ROUND_TRIP,
        round_trip_facts,
        "Cast(x16 / Sqrt(ReduceMean(x16^2) + eps) in float32 back to x16) * gamma -> SimplifiedLayerNormalization "
        "(target ort, stash_type float32)",
    ),
    _rule("ort-rmsnorm-plain", affine(RMS, False, False), rms_norm_facts),
)
