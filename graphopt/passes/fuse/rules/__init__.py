"""The built-in rule families, one module each, composed into the library the fuse pass runs.

Each family module exports its rules as ``RULES``; :data:`LIBRARY` lists them in priority
order: where two rules rooted at the same op cover as many nodes, the earlier one wins.
The noop family is not in the library (the ``noop`` pass sweeps it); the shape family
shares two of its rules. The fusions that compute in float (activations, attention, norms,
rotary embeddings, with their onnxruntime forms) match through a quantized model's Q/DQ pairs
(:func:`through_qdq`); the residual sum before a LayerNormalization does not: its result is no fused op, so
through a pair it would only drop a quantization the original computes.
"""

import dataclasses
from typing import Any

from graphopt.passes.fuse.rules import (
    activation,
    arith,
    attention,
    conv,
    conv_branches,
    embed,
    expose,
    gather,
    islands,
    kronecker,
    lower,
    matmul,
    norm,
    qdq,
    rotary,
    shape,
)
from graphopt.passes.rewrite.engine import Rule, RuleSet

__all__ = ["LIBRARY", "through_qdq"]


def through_qdq(rules: tuple[Rule[Any], ...]) -> tuple[Rule[Any], ...]:
    """``rules`` marked to match through Q/DQ pairs (see graphopt/passes/rewrite/qdq.py)."""
    return tuple(dataclasses.replace(rule, through_qdq=True) for rule in rules)


LIBRARY = RuleSet(
    through_qdq(activation.RULES)
    + arith.RULES
    + through_qdq(attention.RULES)
    + conv.RULES
    + conv_branches.RULES
    + embed.RULES
    + expose.RULES
    + gather.RULES
    + islands.RULES
    + kronecker.RULES
    + lower.RULES
    + matmul.standard.RULES
    + matmul.quantized.RULES
    # the skip norms first: they win the tie with the residual sum; a Sum for an Add is no fused op, so the
    # quantization between the Add and its norm stays (norm/residual.py)
    + through_qdq(norm.standard.RULES)
    + norm.residual.RULES
    + qdq.RULES
    + through_qdq(rotary.RULES)
    + shape.RULES
    + matmul.tied.RULES
)
