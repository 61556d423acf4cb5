"""Normalization family: LayerNorm, RMSNorm and Softmax decompositions become one op.

LayerNorm. ``mean = ReduceMean(x)``, ``d = x - mean``, ``var = ReduceMean(d^2)`` (``Pow(d, 2)``
or ``d * d``), ``y = d / Sqrt(var + eps)`` (or ``d * Reciprocal(...)``), then ``* gamma`` and
``+ beta`` -> ``LayerNormalization(x, gamma, beta, axis, epsilon)`` (opset 17), when both
means reduce the same trailing axes with keepdims, eps is a scalar constant and gamma /
beta are constants varying along the normalized axes only (missing ones become 1 / 0).

RMSNorm. ``x / Sqrt(ReduceMean(x^2) + eps) * gamma`` (or ``x * Reciprocal(...)``) ->
``RMSNormalization(x, gamma, axis, epsilon)`` (opset 23).

Softmax. ``Exp(x - ReduceMax(x)) / ReduceSum(Exp(...))`` (with or without the max) over one
axis with keepdims -> ``Softmax(x, axis)`` (opset 13, where Softmax is per axis).

With ``--target ort``, ``LayerNorm(x + skip)`` becomes ``SkipLayerNormalization``
(com.microsoft) where the residual Add is not otherwise read.
"""

from __future__ import annotations

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import Pattern, const, either, op, optional, var
from graphopt.passes.fuse.rules._helpers import axes_of, float_array, is_float, new_const, trailing_axes

FAMILY = "norm"
MS = "com.microsoft"

_x = var("x")


def _normalized(centered: Pattern, square_of: Pattern) -> Pattern:
    """``centered / Sqrt(ReduceMean(square_of^2) + eps)``, in its spellings."""
    squared = either(op.Pow(square_of, const(2.0)), op.Mul(square_of, square_of))
    std = op.Sqrt(op.Add(op.ReduceMean(squared, optional(const()), name="var"), const(name="eps")))
    return either(op.Div(centered, std), op.Mul(centered, op.Reciprocal(std)))


_D = op.Sub(_x, op.ReduceMean(_x, optional(const()), name="mean"), name="d")
_LN = _normalized(_D, _D)
_RMS = _normalized(_x, _x)


def _affine(inner: Pattern, gamma: bool, beta: bool) -> Pattern:
    out = op.Mul(inner, var("gamma")) if gamma else inner
    return op.Add(out, var("beta")) if beta else out


def _reduce_axis(node: Node, site: Site, rank: int) -> int | None:
    if not node.attr("keepdims", 1) or node.attr("noop_with_empty_axes", 0):
        return None
    return trailing_axes(axes_of(node, site), rank)


def _epsilon(m: Match) -> float | None:
    eps = float_array(m.value("eps"))
    return None if eps is None or eps.size != 1 else float(eps.ravel()[0])


def _param(m: Match, name: str, fill: float, normalized: tuple[int, ...]) -> np.ndarray | str:
    """gamma or beta as an array of the normalized shape (``fill`` when the pattern has none)."""
    if name not in m.bindings:
        return np.full(normalized, fill)
    found = float_array(m.value(name))
    if found is None:
        return f"{name} is not a constant"
    if found.ndim > len(normalized):
        return f"{name} has more dims than the normalized axes"
    try:
        return np.broadcast_to(found, normalized).astype(np.float64)
    except ValueError:
        return f"{name} does not vary along the normalized axes only"


def _norm_facts(m: Match, site: Site, reductions: tuple[str, ...]) -> tuple[int, float, np.ndarray, np.ndarray] | str:
    """(axis, epsilon, gamma, beta) for a matched LayerNorm / RMSNorm, or why not."""
    x = m.value("x")
    shape = site.shape(x)
    if not is_float(x) or shape is None:
        return "x has no known float type and rank"
    axes = {_reduce_axis(m.node(r), site, len(shape)) for r in reductions}
    if len(axes) != 1 or None in axes:
        return "the means do not reduce the same trailing axes with keepdims"
    (axis,) = axes
    assert axis is not None
    eps = _epsilon(m)
    if eps is None:
        return "epsilon is not a scalar constant"
    normalized = shape[axis:]
    if not all(isinstance(d, int) for d in normalized):
        return "the normalized dims are not static"
    dims = tuple(int(d) for d in normalized)
    gamma, beta = _param(m, "gamma", 1.0, dims), _param(m, "beta", 0.0, dims)
    if isinstance(gamma, str):
        return gamma
    if isinstance(beta, str):
        return beta
    return axis - len(shape), eps, gamma, beta


def _layer_norm_rule(gamma: bool, beta: bool) -> Rule:
    suffix = "" if gamma and beta else ("-no-bias" if gamma else "-plain")

    def check(m: Match, site: Site) -> str | None:
        found = _norm_facts(m, site, ("mean", "var"))
        return found if isinstance(found, str) else None

    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        found = _norm_facts(m, site, ("mean", "var"))
        assert not isinstance(found, str)
        axis, eps, g, bias = found
        x = m.value("x")
        return b.op(
            "LayerNormalization",
            x,
            new_const(b, g, x, "ln_scale"),
            new_const(b, bias, x, "ln_bias"),
            axis=axis,
            epsilon=eps,
        )

    return Rule(
        f"layernorm{suffix}",
        FAMILY,
        _affine(_LN, gamma, beta),
        rewrite,
        check,
        min_opset=17,
        label="LayerNorm",
        doc="ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add -> LayerNormalization (opset 17)",
    )


for _gamma, _beta in ((True, True), (True, False), (False, False)):
    add_rule(_layer_norm_rule(_gamma, _beta))


def _rms_rule(gamma: bool) -> Rule:
    def check(m: Match, site: Site) -> str | None:
        found = _norm_facts(m, site, ("var",))
        return found if isinstance(found, str) else None

    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        found = _norm_facts(m, site, ("var",))
        assert not isinstance(found, str)
        axis, eps, g, _ = found
        x = m.value("x")
        return b.op("RMSNormalization", x, new_const(b, g, x, "rms_scale"), axis=axis, epsilon=eps)

    return Rule(
        "rmsnorm" if gamma else "rmsnorm-plain",
        FAMILY,
        _affine(_RMS, gamma, False),
        rewrite,
        check,
        min_opset=23,
        label="RMSNorm",
        doc="x / Sqrt(ReduceMean(x^2) + eps) * gamma -> RMSNormalization (opset 23)",
    )


add_rule(_rms_rule(True))
add_rule(_rms_rule(False))


def _softmax_axis(m: Match, site: Site) -> int | str:
    rank = site.rank(m.value("x"))
    if rank is None or not is_float(m.value("x")):
        return "x has no known float type and rank"
    found = set()
    for name in ("sum", "max"):
        if name in m.bindings:
            node = m.node(name)
            axes = axes_of(node, site, 13 if name == "sum" else 18)
            if not node.attr("keepdims", 1) or axes is None or len(axes) != 1:
                return "the reductions are not over one axis with keepdims"
            found.add(axes[0] + rank if axes[0] < 0 else axes[0])
    if len(found) != 1:
        return "the reductions disagree on the axis"
    return found.pop()


def _softmax_rule(stable: bool) -> Rule:
    inner: Pattern = op.Sub(_x, op.ReduceMax(_x, optional(const()), name="max")) if stable else _x
    e = op.Exp(inner, name="exp")
    return Rule(
        "softmax" if stable else "softmax-unstable",
        FAMILY,
        op.Div(e, op.ReduceSum(e, optional(const()), name="sum")),
        lambda b, m, site: b.op("Softmax", m.value("x"), axis=_softmax_axis(m, site)),
        lambda m, site: found if isinstance(found := _softmax_axis(m, site), str) else None,
        min_opset=13,
        label="Softmax",
        doc="Exp(x - max) / ReduceSum(Exp(x - max)) -> Softmax(x, axis) (opset 13)",
    )


add_rule(_softmax_rule(True))
add_rule(_softmax_rule(False))
