"""Normalization family: LayerNorm, RMSNorm, GroupNorm and Softmax decompositions become one op.

LayerNorm. ``mean = ReduceMean(x)``, ``d = x - mean``, ``var = ReduceMean(d^2)`` (``Pow(d, 2)``
or ``d * d``), ``y = d / Sqrt(var + eps)`` (or ``d * Reciprocal(...)``), then ``* gamma`` and
``+ beta`` -> ``LayerNormalization(x, gamma, beta, axis, epsilon)`` (opset 17), when both
means reduce the same trailing axes with keepdims, eps is a scalar constant and gamma /
beta are constants varying along the normalized axes only (missing ones become 1 / 0).

Keras' LayerNormalization through tf2onnx (tf.nn.moments, then tf.nn.batch_normalization):
``x * inv + (beta - mean * inv)`` with ``inv = gamma / Sqrt(var + eps)``, ``d = x - mean``
squared as ``d * d``. For a rank-3 x normalized over its last axis tf2onnx writes both means
as ``GlobalAveragePool`` (its global pool optimizer takes every ReduceMean over axes 2..);
any mean here may be either spelling, GlobalAveragePool standing for the axes from 2 on.

RMSNorm. ``x / Sqrt(ReduceMean(x^2) + eps) * gamma`` (or ``x * Reciprocal(...)``) ->
``RMSNormalization(x, gamma, axis, epsilon)`` (opset 23); on float16, computed in float32 between Casts
(``rmsnorm-float32``, late; see _float32.py), as is ``--target ort``'s SimplifiedLayerNormalization
(``ort-rmsnorm-float32``).

GroupNorm, as both PyTorch exporters write nn.GroupNorm (diffusers' UNets and VAEs): ``Reshape(x, [N, G, -1])``,
``InstanceNormalization`` (or the mean-variance spelling) over each group, ``Reshape`` back to x's shape, ``* gamma``
``+ beta`` per channel -> ``GroupNormalization(x, scale, bias, num_groups, epsilon)`` (opset 21, whose scale and
bias are per channel; opset 18's were per group), the InstanceNormalization's own scale and bias folded into them.
The split keeps x's batch (a 0, or the batch read from x) and G divides the channels; the merge is provably back
to x's shape (Shape(x), or a target whose entries are x's dims, a 0 copying the batch or the one -1), which holds
at dynamic batch and spatial dims; a SiLU after it is the activation rules'. At target opsets 18 to 20, opset 18's
GroupNormalization takes the scale and bias constant over each group's channels; a per-channel scale stays a Mul
after it (and then the bias an Add). Only where the user names the target opset (``--target-opset``): onnxruntime's
CPU provider has no GroupNormalization kernel and runs the op's function body, slower than the exporters' spelling
(the dynamo UNet fixture, opset 20, ran 1.33x the export at its default target with it, ORT_ENABLE_ALL, 1 thread),
so the default keeps the spelling. Not for ``--target ort``, see the rule.

Softmax. ``Exp(x - ReduceMax(x)) / ReduceSum(Exp(...))`` (with or without the max) over one
axis with keepdims -> ``Softmax(x, axis)`` (opset 13, where Softmax is per axis).

``--target ort``: RMSNorm (and its float16 round trip) -> ``SimplifiedLayerNormalization(x, gamma,
axis, epsilon)``, in the default domain where onnxruntime registers it; and com.microsoft ops
onnxruntime's CPU provider runs: ``LayerNormalization(a +
skip)`` and ``LayerNormalization(a + bias + skip)`` -> ``SkipLayerNormalization``, and RMSNorm
of such a sum (decomposed, or ``RMSNormalization``) -> ``SkipSimplifiedLayerNormalization``;
when the residual sum is read elsewhere too (pre-norm transformers carry it on), the fused
op's fourth output stands for it. SkipLayerNormalization is off by default (``--target ort``
users enable ``ort-skiplayernorm`` by name): measured at ORT_ENABLE_ALL (1 thread, seq 64) it
made bert_small x1.06 -> x0.945 without it and gpt2_small x1.003 -> x0.924 (BENCHMARKS.md), and
on the PyTorch bert exports (batch 2, seq 17) it measured 1.13x the output without it. The RMS
forms are on: on the llama, llama-with-cache and t5 encoder exports they measured 0.99-1.01x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import HALF_FLOAT_TYPES
from graphopt.passes.fuse.rules._float32 import in_float32
from graphopt.passes.fuse.rules._helpers import axes_of, float_array, is_float, new_const, trailing_axes
from graphopt.passes.fuse.rules._ort import MS, cpu_float
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, const, either, op, optional, var
from graphopt.passes.rewrite.proofs import reads_dim, reshaped_back, target_entries

FAMILY = "norm"

_x = var("x")


def _mean(of: Pattern, name: str) -> Pattern:
    """The mean of ``of`` over trailing axes: ReduceMean, or GlobalAveragePool (axes 2..)."""
    return either(op.ReduceMean(of, optional(const()), name=name), op.GlobalAveragePool(of, name=name))


def _std(square_of: Pattern) -> Pattern:
    squared = either(op.Pow(square_of, const(2.0)), op.Mul(square_of, square_of))
    return op.Sqrt(op.Add(_mean(squared, "var"), const(name="eps")))


def _inverse(std: Pattern) -> Pattern:
    return either(op.Reciprocal(std), op.Div(const(1.0), std))  # TorchScript writes rsqrt as 1 / Sqrt


def _normalized(centered: Pattern, square_of: Pattern) -> Pattern:
    """``centered / Sqrt(mean(square_of^2) + eps)``, in its spellings."""
    std = _std(square_of)
    return either(op.Div(centered, std), op.Mul(centered, _inverse(std)))


_MEAN = _mean(_x, "mean")
_D = op.Sub(_x, _MEAN, name="d")
_LN = _normalized(_D, _D)
# tf.nn.batch_normalization: x * inv + (beta - mean * inv), inv = gamma / Sqrt(var + eps); tf2onnx
# writes the shift as -mean * inv + beta.
_INV = op.Mul(_inverse(_std(_D)), var("gamma"), name="inv")
_SHIFT = either(op.Sub(var("beta"), op.Mul(_MEAN, _INV)), op.Add(op.Mul(op.Neg(_MEAN), _INV), var("beta")))
_LN_TF = op.Add(op.Mul(_x, _INV), _SHIFT)
_RMS = _normalized(_x, _x)
# Hugging Face's RMSNorm of a float16 / bfloat16 x: normalized in float32, cast back, then scaled.
_UP = op.Cast(_x, name="up")
_RMS_ROUND_TRIP = op.Mul(op.Cast(_normalized(_UP, _UP), name="down"), var("gamma"))


def _affine(inner: Pattern, gamma: bool, beta: bool) -> Pattern:
    out = op.Mul(inner, var("gamma")) if gamma else inner
    return op.Add(out, var("beta")) if beta else out


def _reduce_axis(node: Node, site: Site, rank: int) -> int | None:
    if node.op_type == "GlobalAveragePool":
        return 2 if rank >= 3 else None
    if not node.attr("keepdims", 1) or node.attr("noop_with_empty_axes", 0):
        return None
    return trailing_axes(axes_of(node, site), rank)


def _epsilon(m: Match) -> float | None:
    eps = float_array(m.value("eps"))
    return None if eps is None or eps.size != 1 else float(eps.ravel()[0])


def _param(m: Match, name: str, fill: float, normalized: tuple[int, ...]) -> np.ndarray | Refuse:
    """gamma or beta as an array of the normalized shape (``fill`` when the pattern has none)."""
    if name not in m.bindings:
        return np.full(normalized, fill)
    found = float_array(m.value(name))
    if found is None:
        return Refuse(f"{name} is not a constant")
    leading = found.ndim - len(normalized)
    if leading > 0:  # (1, 1, C) as Keras writes it: leading axes of 1 broadcast over the rest
        if any(d != 1 for d in found.shape[:leading]):
            return Refuse(f"{name} varies along axes that are not normalized")
        found = found.reshape(found.shape[leading:])
    try:
        return np.broadcast_to(found, normalized).astype(np.float64)
    except ValueError:
        return Refuse(f"{name} does not vary along the normalized axes only")


def _normalized_value(m: Match) -> Value:
    """What the norm normalizes: ``x``, or the residual sum of the skip rules."""
    return m.value("x") if "x" in m else m.node("sum").outputs[0]


def _norm_facts(
    m: Match, site: Site, reductions: tuple[str, ...]
) -> tuple[int, float, np.ndarray, np.ndarray] | Refuse:
    """(axis, epsilon, gamma, beta) for a matched LayerNorm / RMSNorm, or why not."""
    x = _normalized_value(m)
    shape = site.shape(x)
    if not is_float(x) or shape is None:
        return Refuse("x has no known float type and rank")
    axes = {_reduce_axis(m.node(r), site, len(shape)) for r in reductions}
    if len(axes) != 1 or None in axes:
        return Refuse("the means do not reduce the same trailing axes with keepdims")
    (axis,) = axes
    assert axis is not None
    eps = _epsilon(m)
    if eps is None:
        return Refuse("epsilon is not a scalar constant")
    normalized = shape[axis:]
    if not all(isinstance(d, int) for d in normalized):
        return Refuse("the normalized dims are not static")
    dims = tuple(int(d) for d in normalized)
    if any(n in m.bindings and (site.rank(m.value(n)) or 0) > len(shape) for n in ("gamma", "beta")):
        return Refuse("gamma or beta has more dims than x (it would grow the output's rank)")
    gamma, beta = _param(m, "gamma", 1.0, dims), _param(m, "beta", 0.0, dims)
    if isinstance(gamma, Refuse):
        return gamma
    if isinstance(beta, Refuse):
        return beta
    return axis - len(shape), eps, gamma, beta


_NormFacts = tuple[int, float, np.ndarray, np.ndarray]


def _layer_norm_facts(m: Match, site: Site) -> _NormFacts | Refuse:
    return _norm_facts(m, site, ("mean", "var"))


def _rms_norm_facts(m: Match, site: Site) -> _NormFacts | Refuse:
    return _norm_facts(m, site, ("var",))


def _layer_norm(b: Builder, m: Match, facts: _NormFacts) -> Value:
    x, (axis, eps, gamma, beta) = m.value("x"), facts
    scale, bias = new_const(b, gamma, x, "ln_scale"), new_const(b, beta, x, "ln_bias")
    return b.op("LayerNormalization", x, scale, bias, axis=axis, epsilon=eps)


def _round_trip_facts(m: Match, site: Site) -> _NormFacts | Refuse:
    x = m.value("x")
    if site.dtype(x) not in HALF_FLOAT_TYPES:
        return Refuse("x is not float16 or bfloat16 (a float32 x has no round trip to fold)")
    if site.int_attr(m.node("up"), "to", 0) != DataType.FLOAT or site.int_attr(m.node("down"), "to", 0) != site.dtype(
        x
    ):
        return Refuse("the Casts are not to float32 and back to x's type")
    return _rms_norm_facts(m, site)


def _rms_norm(op_type: str, b: Builder, m: Match, facts: _NormFacts) -> Value:
    """RMSNormalization, or for ``--target ort`` SimplifiedLayerNormalization; both normalize
    in float32 by default (stash_type 1), which is the round trip's Casts folded in."""
    x, (axis, eps, gamma, _) = m.value("x"), facts
    return b.op(op_type, x, new_const(b, gamma, x, "rms_scale"), axis=axis, epsilon=eps)


_LN_DOC = "ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add -> LayerNormalization (opset 17)"
_LN_TF_DOC = (
    "x * inv + (beta - mean * inv), inv = gamma / Sqrt(var + eps), means as ReduceMean or "
    "GlobalAveragePool (Keras through tf2onnx) -> LayerNormalization (opset 17)"
)
_RMS_DOC = "x / Sqrt(ReduceMean(x^2) + eps) * gamma -> RMSNormalization (opset 23)"
_ORT_RMS_DOC = "x / Sqrt(ReduceMean(x^2) + eps) [* gamma] -> SimplifiedLayerNormalization (target ort)"
_ROUND_TRIP_DOC = (
    "Cast(x16 / Sqrt(ReduceMean(x16^2) + eps) in float32 back to x16) * gamma -> {} ({}, stash_type float32)"
)


# -- GroupNorm -------------------------------------------------------------------------------------

_SPLIT = op.Reshape(var("x"), var("group_shape"), name="split")
_D_SPLIT = op.Sub(_SPLIT, op.ReduceMean(_SPLIT, optional(const()), name="mean"), name="d")
_GROUPED = either(
    op.InstanceNormalization(_SPLIT, var("in_scale"), var("in_bias"), name="instance"),
    _normalized(_D_SPLIT, _D_SPLIT),
)
# Shape(x) goes with the match when only the merge reads it (the dynamo exporter writes its start=0)
_X_SHAPE = op.Shape(var("x"), where=lambda n: n.attr("start", 0) == 0 and n.attr("end") is None)
_GROUP_NORM = op.Reshape(_GROUPED, either(_X_SHAPE, var("back_shape")), name="merge")


@dataclass
class _GroupPlan:
    groups: int
    eps: float
    scale: np.ndarray  # per channel
    bias: np.ndarray


def _per_channel(m: Match, name: str, fill: float, rank: int, channels: int) -> np.ndarray | Refuse:
    """gamma or beta as a vector over the channels (axis 1 of a rank-``rank`` x), or why not."""
    if name not in m.bindings:
        return np.full(channels, fill)
    found = float_array(m.value(name))
    if found is None:
        return Refuse(f"{name} is not a constant")
    channel_axis = found.ndim - (rank - 1)  # where axis 1 of x falls among found's axes
    if found.ndim > rank or any(d != 1 for i, d in enumerate(found.shape) if i != channel_axis):
        return Refuse(f"{name} is not per channel")
    try:
        return np.broadcast_to(found.reshape(-1), (channels,)).astype(np.float64)
    except ValueError:
        return Refuse(f"{name} is not per channel")


def _group_count(m: Match, site: Site, full: tuple[Any, ...]) -> int | Refuse:
    """G of the split Reshape(x, [N, G, -1]): N a 0 (a copy of x's batch), x's batch as the facts know it or read
    from x, or -1 with the group's size given; or why not."""
    x, target = m.value("x"), m.value("group_shape")
    entries = target_entries(site, target, 3)
    if entries is None or m.node("split").attr("allowzero", 0):
        return Refuse("the group Reshape is not to a provable [N, G, -1]")
    batch, groups, rest = entries
    channels, spatial = full[1], full[2:]
    if not isinstance(groups, int) or groups <= 0 or channels % groups:
        return Refuse("the group Reshape is not to [N, G, -1] with G dividing the channels")
    size = channels // groups * int(np.prod(spatial)) if all(isinstance(d, int) for d in spatial) else None
    kept = batch == 0 or (batch is not None and batch == full[0]) or reads_dim(target, 0, x, 3)
    if not ((kept and rest in (-1, size)) or (batch == -1 and size is not None and rest == size)):
        return Refuse("the group Reshape is not to [N, G, -1] with G dividing the channels")
    return groups


def _group_plan(m: Match, site: Site) -> _GroupPlan | Refuse:
    x = m.value("x")
    full = site.shape(x)
    if not is_float(x) or full is None or len(full) < 3:
        return Refuse("x has no known float type and rank >= 3")
    channels = full[1]
    if not isinstance(channels, int):
        return Refuse("the channel dim is not static")
    groups = _group_count(m, site, full)
    if isinstance(groups, Refuse):
        return groups
    # the groups keep x's batch (axis 0), and its channels (axis 1) when each group is one channel
    if not reshaped_back(m.node("merge"), x, site, (0, 1) if groups == channels else (0,)):
        return Refuse("the merge Reshape is not provably back to x's shape")
    if "instance" in m:
        eps = Site.float_attr(m.node("instance"), "epsilon", 1e-5)
        inner_scale, inner_bias = float_array(m.value("in_scale")), float_array(m.value("in_bias"))
        if inner_scale is None or inner_bias is None or inner_scale.shape != (groups,) or inner_bias.shape != (groups,):
            return Refuse("the InstanceNormalization scale / bias are not constants over the groups")
    else:
        if {_reduce_axis(m.node(r), site, 3) for r in ("mean", "var")} != {2}:
            return Refuse("the means do not reduce the last axis of the groups with keepdims")
        found = _epsilon(m)
        if found is None:
            return Refuse("epsilon is not a scalar constant")
        eps, inner_scale, inner_bias = found, np.ones(groups), np.zeros(groups)
    gamma = _per_channel(m, "gamma", 1.0, len(full), channels)
    beta = _per_channel(m, "beta", 0.0, len(full), channels)
    if isinstance(gamma, Refuse):
        return gamma
    if isinstance(beta, Refuse):
        return beta
    if not site.ctx.settings.target_opset:  # 0: the model's own
        return Refuse(
            "GroupNormalization is written at an explicit --target-opset only: onnxruntime's CPU provider runs it as "
            "its function body, slower than the exporters' spelling (the dynamo UNet's default output ran 1.33x the "
            "export at ORT_ENABLE_ALL, 1 thread)"
        )
    per_group = channels // groups
    # gamma * (s_g * n + b_g) + beta, with g the group of each channel
    scale = gamma * np.repeat(inner_scale, per_group)
    return _GroupPlan(groups, eps, scale, gamma * np.repeat(inner_bias, per_group) + beta)


def _group_norm(b: Builder, m: Match, plan: _GroupPlan) -> Value:
    x = m.value("x")
    scale, bias = new_const(b, plan.scale, x, "gn_scale"), new_const(b, plan.bias, x, "gn_bias")
    return b.op("GroupNormalization", x, scale, bias, num_groups=plan.groups, epsilon=plan.eps)


def _group_norm_18(b: Builder, m: Match, plan: _GroupPlan) -> Value:
    """Opset 18's GroupNormalization, whose scale and bias are per group: the plan's where constant over each group's
    channels; a per-channel scale stays a Mul after it, and then the bias an Add (the Mul would scale it too)."""
    x, groups = m.value("x"), plan.groups
    scale, bias = (values.reshape(groups, -1) for values in (plan.scale, plan.bias))
    scale_inside = bool((scale == scale[:, :1]).all())
    bias_inside = scale_inside and bool((bias == bias[:, :1]).all())
    inside = (scale[:, 0] if scale_inside else np.ones(groups), bias[:, 0] if bias_inside else np.zeros(groups))
    out = b.op(
        "GroupNormalization",
        x,
        *(new_const(b, values, x, name) for values, name in zip(inside, ("gn_scale", "gn_bias"), strict=True)),
        num_groups=groups,
        epsilon=plan.eps,
    )
    per_channel = (-1,) + (1,) * (len(Site.shape(x) or ()) - 2)  # (C, 1, ..., 1) against x (N, C, ...)
    if not scale_inside:
        out = b.op("Mul", out, new_const(b, plan.scale.reshape(per_channel), x, "gn_gamma"))
    if not bias_inside and (plan.bias != 0).any():
        out = b.op("Add", out, new_const(b, plan.bias.reshape(per_channel), x, "gn_beta"))
    return out


_GN_DOC = (
    "Reshape [N, G, -1] / InstanceNormalization or mean-variance / Reshape back / Mul / Add -> "
    "GroupNormalization (opset 21, per-channel scale and bias; at an explicit --target-opset, not for --target ort)"
)
_GN_18_DOC = (
    "Reshape [N, G, -1] / InstanceNormalization or mean-variance / Reshape back / Mul / Add -> "
    "GroupNormalization (opset 18 to 20: its scale and bias are per group; a per-channel scale and bias stay a Mul "
    "and an Add after it; at an explicit --target-opset, not for --target ort)"
)


def _softmax_axis(m: Match, site: Site) -> int | Refuse:
    rank = site.rank(m.value("x"))
    if rank is None or not is_float(m.value("x")):
        return Refuse("x has no known float type and rank")
    found = set()
    for name in ("sum", "max"):
        if name in m.bindings:
            node = m.node(name)
            axes = axes_of(node, site, 13 if name == "sum" else 18)
            if not node.attr("keepdims", 1) or axes is None or len(axes) != 1:
                return Refuse("the reductions are not over one axis with keepdims")
            found.add(axes[0] + rank if axes[0] < 0 else axes[0])
    if len(found) != 1:
        return Refuse("the reductions disagree on the axis")
    return found.pop()


def _softmax(stable: bool) -> Pattern:
    inner: Pattern = op.Sub(_x, op.ReduceMax(_x, optional(const()), name="max")) if stable else _x
    e = op.Exp(inner, name="exp")
    return op.Div(e, op.ReduceSum(e, optional(const()), name="sum"))


_SOFTMAX_DOC = "Exp(x - max) / ReduceSum(Exp(x - max)) -> Softmax(x, axis) (opset 13)"


# -- target ort: the residual Add goes into the norm ----------------------------------------------

_SUM = either(
    op.Add(op.Add(var("a"), const(name="bias", rank=1), name="biased"), var("skip"), name="sum"),
    op.Add(var("a"), var("skip"), name="sum"),
)


def _check_skip(m: Match, site: Site) -> Refuse | None:
    a, skip = m.value("a"), m.value("skip")
    shape = site.shape(a)
    unsupported = cpu_float(site, a, "SkipLayerNormalization")
    if unsupported is not None:
        return Refuse(unsupported)
    if shape is None or len(shape) not in (2, 3) or None in shape or shape != site.shape(skip):
        return Refuse("the residual's operands do not provably have one 2-D or 3-D shape")
    hidden = shape[-1]
    if not isinstance(hidden, int):
        return Refuse("the hidden size is not static")
    for name in ("bias", "gamma", "beta") if "ln" in m else ("bias",):
        if name in m and site.shape(m.value(name)) != (hidden,):
            return Refuse(f"{name} is not a vector over the hidden size")
        if name in m and site.dtype(m.value(name)) != site.dtype(a):
            return Refuse(f"{name} is not of the residual's element type")
    if "ln" in m:
        ln = m.node("ln")
        if Site.int_attr(ln, "axis", -1) not in (-1, len(shape) - 1):
            return Refuse("the norm is not over the last axis")
        if any(v.is_used() for v in ln.outputs[1:]):
            return Refuse("the norm's statistics are read")
    return None


def _build_skip(op_type: str, b: Builder, m: Match, facts: _NormFacts | None) -> Value:
    """The com.microsoft skip norm ``op_type``; ``facts`` of a decomposed RMSNorm (else None)."""
    inputs: list[Value | None] = [m.value("a"), m.value("skip")]
    if facts is None:
        ln = m.node("ln")
        inputs.append(m.value("gamma"))
        if len(ln.inputs) > 2:  # LayerNormalization's beta
            inputs.append(m.optional("beta"))
        eps = Site.float_attr(ln, "epsilon", 1e-5)
    else:
        _, eps, gamma, _ = facts
        inputs.append(new_const(b, gamma, m.value("a"), "rms_scale"))
    if op_type == "SkipLayerNormalization" and len(inputs) == 3:
        inputs.append(None)  # no beta
    inputs.append(m.optional("bias"))
    while inputs[-1] is None:
        inputs.pop()
    total = m.node("sum").outputs[0]
    exported = total.is_graph_output or len(total.uses()) > 1
    node = b.node(op_type, *inputs, domain=MS, outputs=4 if exported else 1, epsilon=eps)
    if exported:
        m.export("sum", node.outputs[3])
    return node.outputs[0]


def _check_skip_rms(m: Match, site: Site) -> Refuse | None:
    """SkipSimplifiedLayerNormalization's own refusals, then the skip norms'."""
    if site.dtype(m.value("a")) == DataType.FLOAT16:
        # Measured on the float16 copies of the Llama exports (both exporters, with and without a KV cache):
        # onnxruntime's float16 kernel took the output 1.2 to 1.4 times as far from the float32 model as the
        # float16 model itself is, where the RMSNorm it replaces computes in float32.
        return Refuse("onnxruntime's float16 SkipSimplifiedLayerNormalization rounds more than the norm it replaces")
    return _check_skip(m, site)


def _plan_skip_rms(m: Match, site: Site) -> _NormFacts | Refuse:
    found = _rms_norm_facts(m, site)
    if isinstance(found, Refuse):
        return found
    if found[0] != -1:
        return Refuse("the norm is not over the last axis")
    return _check_skip_rms(m, site) or found


# The affine variants of a norm: (name suffix, whether gamma scales, whether beta shifts).
_WITH_BIAS = ("", True, True)
_NO_BIAS = ("-no-bias", True, False)
_SCALED = ("", True, False)
_PLAIN = ("-plain", False, False)

RuleOf = Callable[..., Rule[Any]]


def _affine_rules(rule: RuleOf, name: str, core: Pattern, *variants: tuple[str, bool, bool]) -> list[Rule[Any]]:
    """One ``rule`` per affine variant of ``core``."""
    return [rule(name=name + suffix, pattern=_affine(core, gamma, beta)) for suffix, gamma, beta in variants]


_LAYER_NORM = partial(
    Rule, family=FAMILY, plan=_layer_norm_facts, build=_layer_norm, min_opset=17, label="LayerNorm", doc=_LN_DOC
)
_RMS_NORM = partial(
    Rule,
    family=FAMILY,
    plan=_rms_norm_facts,
    build=partial(_rms_norm, "RMSNormalization"),
    min_opset=23,
    label="RMSNorm",
    doc=_RMS_DOC,
)
# onnxruntime registers SimplifiedLayerNormalization in the default domain (since version 1, any
# opset) and runs it on CPU for float, double and float16; for --target ort it is written at every
# opset, 23 and up included (tried before RMSNormalization, which needs 23).
_ORT_RMS_NORM = partial(
    Rule,
    family=FAMILY,
    plan=_rms_norm_facts,
    build=partial(_rms_norm, "SimplifiedLayerNormalization"),
    targets=frozenset({"ort"}),
    label="RMSNorm",
    doc=_ORT_RMS_DOC,
)
# Not for --target ort: onnxruntime 1.32 has no CPU kernel for GroupNormalization (it runs the onnx function body,
# 29 nodes; 2.3x the decomposition's time on (2, 64, 32, 32), 1 thread) and its com.microsoft GroupNorm is CUDA
# only (NOT_IMPLEMENTED on CPU), where the decomposition's InstanceNormalization has a CPU kernel.
_GROUP_NORM_RULE = partial(
    Rule,
    family=FAMILY,
    plan=_group_plan,
    build=_group_norm,
    min_opset=21,
    targets=frozenset({"onnx"}),
    label="GroupNorm",
    doc=_GN_DOC,
)
# Opset 18's GroupNormalization (deprecated by 21, whose scale and bias are per channel) for targets 18 to 20.
_GROUP_NORM_18_RULE = partial(
    Rule,
    family=FAMILY,
    plan=_group_plan,
    build=_group_norm_18,
    min_opset=18,
    max_opset=20,
    targets=frozenset({"onnx"}),
    label="GroupNorm",
    doc=_GN_18_DOC,
)
_ORT_SKIP = partial(Rule, family=FAMILY, targets=frozenset({"ort"}), label="skip norm", exports=("sum",), default=False)
_SKIP_RMS_DOC = "norm(a [+ bias] + skip) -> com.microsoft SkipSimplifiedLayerNormalization (target ort)"

RULES: tuple[Rule[Any], ...] = (
    *_affine_rules(_ORT_RMS_NORM, "ort-rmsnorm", _RMS, _SCALED),
    _ORT_RMS_NORM(
        name="ort-rmsnorm-round-trip",
        pattern=_RMS_ROUND_TRIP,
        plan=_round_trip_facts,
        doc=_ROUND_TRIP_DOC.format("SimplifiedLayerNormalization", "target ort"),
    ),
    *_affine_rules(_ORT_RMS_NORM, "ort-rmsnorm", _RMS, _PLAIN),
    *_affine_rules(_LAYER_NORM, "layernorm", _LN, _WITH_BIAS, _NO_BIAS, _PLAIN),
    _LAYER_NORM(name="layernorm-tf", pattern=_LN_TF, doc=_LN_TF_DOC),
    *_affine_rules(_RMS_NORM, "rmsnorm", _RMS, _SCALED),
    _RMS_NORM(
        name="rmsnorm-round-trip",
        pattern=_RMS_ROUND_TRIP,
        plan=_round_trip_facts,
        doc=_ROUND_TRIP_DOC.format("RMSNormalization", "opset 23"),
    ),
    *_affine_rules(_RMS_NORM, "rmsnorm", _RMS, _PLAIN),
    in_float32(
        "rmsnorm-float32",
        FAMILY,
        "RMSNormalization",
        2,
        min_opset=23,
        label="float16 RMSNorm",
        doc="RMSNormalization on float16 -> Cast to float32, RMSNormalization, Cast to float16: onnxruntime's CPU "
        "provider runs the float16 chain it replaces in float32 and rounds its result to float16 only here",
    ),
    in_float32(
        "ort-rmsnorm-float32",
        FAMILY,
        "SimplifiedLayerNormalization",
        2,
        min_opset=1,
        targets=frozenset({"ort"}),
        label="float16 SimplifiedLayerNormalization",
        doc="SimplifiedLayerNormalization on float16 -> Cast to float32, SimplifiedLayerNormalization, Cast to "
        "float16 (target ort): as rmsnorm-float32, its float16 kernel rounds its input and result where the chain "
        "it replaced passed float32 on",
    ),
    *_affine_rules(_GROUP_NORM_RULE, "groupnorm", _GROUP_NORM, _WITH_BIAS, _NO_BIAS, _PLAIN),
    *_affine_rules(_GROUP_NORM_18_RULE, "groupnorm-18", _GROUP_NORM, _WITH_BIAS, _NO_BIAS, _PLAIN),
    *(
        Rule(
            name=name,
            family=FAMILY,
            pattern=_softmax(stable),
            plan=_softmax_axis,
            build=lambda b, m, axis: b.op("Softmax", m.value("x"), axis=axis),
            min_opset=13,
            label="Softmax",
            doc=_SOFTMAX_DOC,
        )
        for name, stable in (("softmax", True), ("softmax-unstable", False))
    ),
    _ORT_SKIP(
        name="ort-skiplayernorm",
        pattern=op.LayerNormalization(_SUM, const(name="gamma"), optional(const(name="beta")), name="ln"),
        plan=_check_skip,
        build=partial(_build_skip, "SkipLayerNormalization"),
        doc="norm(a [+ bias] + skip) -> com.microsoft SkipLayerNormalization (target ort)",
    ),
    _ORT_SKIP(
        name="ort-skiprmsnorm",
        pattern=op.RMSNormalization(_SUM, const(name="gamma"), name="ln"),
        plan=_check_skip_rms,
        build=partial(_build_skip, "SkipSimplifiedLayerNormalization"),
        doc=_SKIP_RMS_DOC,
        default=True,  # measured no slower on the llama and t5 exports (unlike SkipLayerNormalization)
    ),
    _ORT_SKIP(
        name="ort-skiprmsnorm-decomposed",
        pattern=_affine(_normalized(_SUM, _SUM), True, False),
        plan=_plan_skip_rms,
        build=partial(_build_skip, "SkipSimplifiedLayerNormalization"),
        doc=_SKIP_RMS_DOC,
        default=True,  # measured no slower on the llama and t5 exports (unlike SkipLayerNormalization)
    ),
)
