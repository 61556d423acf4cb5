"""Expose family (a shatter rule): a bias-free Gemm beside MatMul siblings becomes a
MatMul, for fold.

Why: the fold pass joins the MatMuls that read one activation with constant weights into
one MatMul over the concatenated weights (projections, parallel heads), but it groups by
op type and attributes: a ``Gemm(a, B, transB=1)`` among them (a converter's bias-free dense
layer) stands apart. ``Gemm(a, B)`` with a constant ``B`` and no bias (or an all-zero one)
-> ``MatMul(a, alpha * B^T)`` (B transposed once, now) joins them.

It fires only where ``a`` has a *bare* MatMul sibling: one with a constant 2-D weight of
``a``'s depth and no Add reading its product (which fold groups; the fuse rule MatMul + Add
-> Gemm leaves it alone). The rewrite emits no Add, so no fuse rule turns it back into a
Gemm: a round shatters, the next changes nothing.

A Gemm with a bias is a near miss, as measured: ``MatMul + Add`` for it beside a bare
MatMul makes a group whose bias Adds cover some slices only; fold's cost model refuses
that chain (a Gather of the biased slices; 2-D input of 256 features, symbolic rows), so
the model would end with a MatMul and an Add more than it started with. Besides, the fuse
rule MatMul + Add -> Gemm (2-D) would make it a Gemm again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.constness import is_constant
from graphopt.ir.rewrite import Builder
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, optional, var

FAMILY = "expose"


def _bare_matmul_sibling(node: Node) -> bool:
    """Whether another MatMul reads ``node``'s input 0 as its own input 0, with a constant
    2-D weight of that input's depth and type, and no Add reading its product (so no fuse
    rule makes it a Gemm): fold would group ``node`` with it if ``node`` were a MatMul."""
    a = node.input(0)
    depth = (Site.shape(a) or (None,))[-1]
    if a is None or depth is None:
        return False
    for use in a.uses():
        other = use.node
        if other is node or use.index != 0 or other.op_type != "MatMul" or not other.in_standard_domain:
            continue
        weight = other.input(1)
        shape = Site.shape(weight)
        if not is_constant(weight) or shape is None or len(shape) != 2 or shape[0] != depth:
            continue
        if Site.dtype(weight) == Site.dtype(a) and not any(u.node.op_type == "Add" for u in other.outputs[0].uses()):
            return True
    return False


def _zero(value: Value | None) -> bool:
    bias = Site.array(value)
    return bias is not None and not np.any(bias)


def _plan(m: Match, site: Site) -> np.ndarray | Refuse:
    """B as a constant matrix, or why the Gemm stays."""
    gemm = m.root
    if gemm.attr("transA", 0):
        return Refuse("A is transposed (transA=1): the MatMul would not read the shared activation")
    weight = site.array(m.value("b"))
    if weight is None or weight.ndim != 2:
        return Refuse("B is not a constant matrix")
    if m.optional("c") is not None and not _zero(m.optional("c")):
        return Refuse("it has a bias: fold refuses a group whose bias Adds cover some members only")
    return weight


def _build(b: Builder, m: Match, weight: np.ndarray) -> Value:
    gemm = m.root
    alpha = Site.float_attr(gemm, "alpha", 1.0)
    matrix = weight.T if gemm.attr("transB", 0) else weight
    if alpha != 1.0:
        matrix = matrix * np.asarray(alpha, dtype=matrix.dtype)
    return b.op("MatMul", m.value("a"), b.constant(np.ascontiguousarray(matrix), "weight"))


RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="gemm-as-matmul",
        family=FAMILY,
        pattern=op.Gemm(var("a"), var("b"), optional(var("c")), where=_bare_matmul_sibling),
        plan=_plan,
        build=_build,
        kind="shatter",
        label="Gemm beside MatMuls",
        doc="Gemm(a, B) with a constant B, no bias and a bare MatMul sibling on a -> MatMul(a, alpha * B^T), for fold",
    ),
)
