"""Conv family: BatchNormalization and per-channel Mul / Add folded into the weights.

Conv + BatchNormalization. BN computes ``y = (c - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)`` per channel, and Conv is linear in its weight, so
``W' = W * s`` (over the output-channel axis: 0 for Conv, 1 for ConvTranspose, per group)
and ``B' = (B - mean) * s + beta`` give one Conv. Gemm / MatMul + BN scale B's columns.

Conv + per-channel Mul / Add. ``Conv(x, W, B) * c = Conv(x, W * c, B * c)`` and
``Conv(x, W, B) + c = Conv(x, W, B + c)`` when ``c`` varies along the channel axis only.
A Transpose between them (tf2onnx's NHWC wrappers) is seen through: ``c`` is read in the
Conv's layout through the inverse permutation.

Per-channel scale and shift into a Conv's input. ``Conv(x * c + d, W, B) = Conv(x, W', B')``
with ``W'[m, j] = W[m, j] * c[g(m) * C/group + j]`` (``g(m)`` the group of output channel m)
and ``B' = B + sum over j and the kernel of W[m, j] * d[g(m) * C/group + j]`` when ``c`` and
``d`` vary along the input-channel axis only (an affine GroupNorm before a 1x1 Conv, as
timm's PoolFormer writes it). The Conv pads with zeros, which the scale keeps zero only when
it is finite, and which the shift would not reach: a shift needs a Conv without padding.
``x`` must already have the channels (no broadcast widens it). A late rule: the scale may be
the last node of a pattern another rule fuses (a GELU's 0.5).

Gemm / MatMul + BatchNormalization. On a 2-D product BN's channels are the columns, so
``B' = B * s`` (rows of B when transB) and ``C' = beta_g * C * s + shift`` give one Gemm.

Pad into Conv and pooling. A constant-mode Pad of the spatial dims only goes into the
consumer's ``pads``: with 0 for Conv and FusedConv, with 0 for AveragePool (then
``count_include_pad=1``, which counts the padded zeros as the Pad did), with -inf for MaxPool,
or 0 when the padded value is never negative (a Relu's output: the zeros never win a max).
A Pad read by several such consumers goes into each (a copy stays for the ones not yet done).

``--target ort``: ``Act(Conv(x, W, B))`` and ``Act(Conv(x, W, B) + z)`` (a residual ``z`` of
the Conv's shape) -> ``FusedConv`` (com.microsoft) for the activations its CPU kernel applies
(Relu, Sigmoid, Tanh, LeakyRelu, Clip, HardSigmoid); onnxruntime fuses the first itself at
its extended level, not the second. At ORT_ENABLE_ALL onnxruntime's NCHWc layout transformer
rewrites Conv and FusedConv into blocked-layout kernels and fuses an Add of two blocked
outputs itself; it skips a FusedConv whose bias is ``""`` (so a Conv without one gets
zeros), and a FusedConv whose residual is not a blocked output stays in NCHW, measured 1.2x
slower than onnxruntime's own Conv + Add: the residual is fused only when it comes from a
Conv, FusedConv or pooling (through element-wise ops of those).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import (
    attrs_of,
    float_array,
    is_float,
    named_after,
    new_const,
    scaled_into,
    stored_float_array,
)
from graphopt.passes.fuse.rules._ort import MS, activated, check_activation, fused_activation
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import ANY_DOMAIN, Pattern, const, either, op, optional, var
from graphopt.passes.rewrite.proofs import awaits_a_gelu_half

FAMILY = "conv"


def _not_training(node: Node) -> bool:
    return not node.attr("training_mode", 0)


def _bn_scale_shift(m: Match) -> tuple[np.ndarray, np.ndarray] | None:
    found = [float_array(m.value(n)) for n in ("gamma", "beta", "mean", "var")]
    params = [p for p in found if p is not None and p.ndim == 1]
    if len(params) != len(found):
        return None
    gamma, beta, mean, variance = params
    scale = gamma / np.sqrt(variance + Site.float_attr(m.node("bn"), "epsilon", 1e-5))
    return scale, beta - mean * scale


def _bn(inner: Pattern) -> Pattern:
    return op.BatchNormalization(
        inner, var("gamma"), var("beta"), var("mean"), var("var"), name="bn", where=_not_training
    )


_CONV = op.any_of(("Conv", "ConvTranspose"), var("x"), var("w"), optional(var("b")), name="conv")


def _conv_weights(m: Match) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The Conv's weight in its own type (read at every round's match, scaled once) and its bias in float64."""
    w = stored_float_array(m.value("w"))
    bias = m.optional("b")
    b = None if bias is None else float_array(bias)
    if w is None or w.ndim < 3 or (bias is not None and b is None):
        return None
    return w, b


@dataclass
class _ChannelPlan:
    """The Conv's weight (in its own type) and bias (float64), and what its output channels are scaled and
    shifted by."""

    w: np.ndarray
    bias: np.ndarray | None
    scale: np.ndarray
    shift: np.ndarray


def _scaled_conv(b: Builder, m: Match, plan: _ChannelPlan) -> Value:
    """The matched Conv with its output channels scaled by ``scale`` and shifted by ``shift``."""
    conv = m.node("conv")
    w, bias, scale, shift = plan.w, plan.bias, plan.scale, plan.shift
    channels = _channels(conv, w)
    if conv.op_type == "Conv":
        w = scaled_into(w, scale.reshape((-1,) + (1,) * (w.ndim - 1)), m.value("w"))
    else:  # ConvTranspose: W is (C_in, C_out / group, k...); output channel = g * C_out/group + j
        group = Site.int_attr(conv, "group", 1)
        per = w.shape[1]
        grouped = w.reshape((group, -1, per, *w.shape[2:]))
        w = scaled_into(grouped, scale.reshape((group, 1, per) + (1,) * (w.ndim - 2)), m.value("w")).reshape(w.shape)
    new_bias = (bias if bias is not None else np.zeros(channels)) * scale + shift
    node = b.node(
        conv.op_type,
        conv.inputs[0],
        new_const(b, w, m.value("w"), named_after(m.value("w"), "fused")),
        new_const(b, new_bias, m.value("w"), _folded_bias_name(conv, m.value("w"))),
        **attrs_of(conv),
    )
    return node.outputs[0]


def _folded_bias_name(node: Node, weight: Value | None) -> str:
    """A folded bias is named after the bias it replaces (a Conv's or Gemm's third input), or its weight."""
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return named_after(bias, "fused") if bias is not None else named_after(weight, "bias_fused")


def _channels(conv: Node, w: np.ndarray) -> int:
    return int(w.shape[0]) if conv.op_type == "Conv" else int(w.shape[1] * Site.int_attr(conv, "group", 1))


def _plan_conv_bn(m: Match, site: Site) -> _ChannelPlan | Refuse:
    found = _conv_weights(m)
    if found is None:
        return Refuse("the weight or bias is not a float constant")
    ss = _bn_scale_shift(m)
    if ss is None:
        return Refuse("a BatchNormalization parameter is not a constant vector")
    if ss[0].shape[0] != _channels(m.node("conv"), found[0]):
        return Refuse("BatchNormalization's channels differ from the Conv's")
    return _ChannelPlan(found[0], found[1], ss[0], ss[1])


def _channel_vector(m: Match, site: Site) -> np.ndarray | Refuse:
    """The per-channel constant ``c`` in the Conv's layout, as a vector over channels."""
    c = float_array(m.value("c"))
    found = _conv_weights(m)
    if c is None or found is None:
        return Refuse("the weight or the operand is not a float constant")
    channels = _channels(m.node("conv"), found[0])
    rank = site.rank(m.node("conv").outputs[0])
    if rank is None or c.ndim > rank:
        return Refuse("the Conv's output rank is unknown")
    c = c.reshape((1,) * (rank - c.ndim) + c.shape)
    if "t" in m.bindings:
        perm = list(m.node("t").attr("perm", list(range(rank - 1, -1, -1))))
        c = np.transpose(c, np.argsort(perm))
    if any(d != 1 for i, d in enumerate(c.shape) if i != 1) or c.shape[1] not in (1, channels):
        return Refuse("the operand is not per-channel")
    return np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float64)


def _plan_channel(m: Match, site: Site) -> _ChannelPlan | Refuse:
    if not is_float(m.node("conv").outputs[0]):
        return Refuse("not a float Conv")
    vector = _channel_vector(m, site)
    if isinstance(vector, Refuse):
        return vector
    w, bias = _conv_weights(m)  # type: ignore[misc]  # _channel_vector read them
    if m.root.op_type == "Mul":
        return _ChannelPlan(w, bias, vector, np.zeros_like(vector))
    if m.root.op_type == "Add":
        return _ChannelPlan(w, bias, np.ones_like(vector), vector)
    return _ChannelPlan(w, bias, np.ones_like(vector), -vector)  # Sub with the Conv first


def _build_channel(b: Builder, m: Match, plan: _ChannelPlan) -> Value:
    out = _scaled_conv(b, m, plan)
    if "t" in m:
        transpose = m.node("t")
        out = b.op("Transpose", out, **attrs_of(transpose))
    return out


_CONV_MAYBE_T = either(_CONV, op.Transpose(_CONV, name="t"))


@dataclass
class _InputAffinePlan:
    """The Conv's weight (in its own type), what scales each of its entries (float64, of the weight's rank), its
    bias (float64) and what shifts each input channel of each output channel (float64, (M, C/group); None: no
    shift)."""

    w: np.ndarray
    scale: np.ndarray
    bias: np.ndarray | None
    shift: np.ndarray | None


def _per_input_channel(m: Match, name: str, shape: tuple[object, ...], channels: int) -> np.ndarray | Refuse:
    """The constant bound to ``name`` as a vector over the Conv's input channels, or why not."""
    c = float_array(m.value(name))
    if c is None or c.ndim > len(shape):
        return Refuse("the scale or shift is not a float constant of at most the input's rank")
    if not np.all(np.isfinite(c)):
        return Refuse("the scale or shift is not finite (the Conv's zero padding would become NaN)")
    laid: tuple[int, ...] = (1,) * (len(shape) - c.ndim) + tuple(c.shape)
    if any(d != 1 for i, d in enumerate(laid) if i != 1) or laid[1] not in (1, channels):
        return Refuse("the scale or shift is not per input channel")
    if laid[1] != 1 and shape[1] != channels:
        return Refuse("the input's channels are not provably the Conv's (the constant may broadcast them)")
    return np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float64)


def _unpadded(conv: Node) -> bool:
    auto_pad = conv.attr("auto_pad", "NOTSET") or "NOTSET"
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    return auto_pad in ("NOTSET", "VALID") and not any(conv.attr("pads", []) or [])


def _plan_input_affine(m: Match, site: Site) -> _InputAffinePlan | Refuse:
    conv = m.node("conv")
    w = stored_float_array(m.value("w"))
    bias = m.optional("b")
    b = None if bias is None else float_array(bias)
    if not is_float(conv.outputs[0]) or w is None or w.ndim < 3 or (bias is not None and b is None):
        return Refuse("the weight or bias is not a float constant")
    shape = site.shape(m.value("x"))
    if shape is None:
        return Refuse("the input's rank is unknown")
    if awaits_a_gelu_half(m.value("x")):
        # onnxruntime's Gelu fusion reads the closing 0.5: without it the GELU runs decomposed
        # (convnext_atto_ts measured slower than the original at ORT_ENABLE_ALL)
        return Refuse("the scale is a decomposed GELU's closing 0.5")
    group = Site.int_attr(conv, "group", 1)
    scale = _per_input_channel(m, "c", shape, w.shape[1] * group)
    if isinstance(scale, Refuse):
        return scale
    # W[m, j] reads input channel g(m) * C/group + j
    index = (np.arange(w.shape[0]) // (w.shape[0] // group))[:, None] * w.shape[1] + np.arange(w.shape[1])[None, :]
    shift: np.ndarray | None = None
    if "d" in m.bindings:
        found = _per_input_channel(m, "d", shape, w.shape[1] * group)
        if isinstance(found, Refuse):
            return found
        shift = found
        # the shift reaches the bias only where no padded zero is summed with it
        if not _unpadded(conv):
            return Refuse("the Conv pads its input, and the shift would reach the padded zeros")
    spread = (1,) * (w.ndim - 2)
    return _InputAffinePlan(w, scale[index].reshape(index.shape + spread), b, None if shift is None else shift[index])


def _build_input_affine(b: Builder, m: Match, plan: _InputAffinePlan) -> Value:
    conv, like = m.node("conv"), m.value("w")
    scaled = scaled_into(plan.w, plan.scale, like)
    bias = plan.bias
    if plan.shift is not None:
        # summed over the kernel first, in float64 without a float64 copy of the weight
        kernel_sums = plan.w.sum(axis=tuple(range(2, plan.w.ndim)), dtype=np.float64)
        shifted = (kernel_sums * plan.shift).sum(axis=1)
        bias = shifted if bias is None else bias + shifted
    inputs: list[Value | None] = [m.value("x"), new_const(b, scaled, like, "scaled_weight"), *conv.inputs[2:]]
    if bias is not None:
        inputs[2:3] = [new_const(b, bias, like, "shifted_bias")]
    return b.op(conv.op_type, *inputs, domain=conv.domain, **attrs_of(conv))


# What onnxruntime's NCHWc transformer lays out in blocks: these ops' outputs, and element-wise
# results of blocked values only.
_BLOCKED = frozenset({"Conv", "FusedConv", "MaxPool", "AveragePool"})
_BLOCKED_ELEMENTWISE = frozenset({"Add", "Sum", "Relu", "Sigmoid", "Tanh"})


def _blocked(value: Value, depth: int = 8) -> bool:
    """Whether ``value`` is (provably) an output the NCHWc transformer lays out in blocks."""
    node = value.producer
    if node is None or depth == 0:
        return False
    if node.op_type in _BLOCKED:
        return True
    return node.op_type in _BLOCKED_ELEMENTWISE and all(v is not None and _blocked(v, depth - 1) for v in node.inputs)


def _check_fused_conv(m: Match, site: Site) -> Refuse | int | None:
    """Why not, or the output channels of the zero bias a residual FusedConv needs (None: none)."""
    if "z" not in m.bindings:
        return _activation_or(m, site, None)
    shape = site.shape(m.value("z"))
    if shape is None or None in shape or shape != site.shape(m.node("conv").outputs[0]):
        return Refuse("the residual's shape is not provably the Conv's")
    if not _blocked(m.value("z")):
        return Refuse("the residual is not the output of a Conv or pooling (onnxruntime's own Conv + Add is faster)")
    if m.optional("b") is not None:
        return _activation_or(m, site, None)
    channels = (site.shape(m.value("w")) or (None,))[0]
    if not isinstance(channels, int):
        return Refuse("the Conv has no bias and its output channels are unknown")
    return _activation_or(m, site, channels)


def _activation_or(m: Match, site: Site, zero_bias: int | None) -> Refuse | int | None:
    """``zero_bias``, unless FusedConv cannot take the match's activation."""
    reason = check_activation(m, site)
    return zero_bias if reason is None else Refuse(reason)


def _build_fused_conv(b: Builder, m: Match, zero_bias: int | None) -> Value:
    conv = m.node("conv")
    inputs: list[Value | None] = [m.value("x"), m.value("w"), m.optional("b")]
    if zero_bias is not None:
        inputs[2] = new_const(b, np.zeros(zero_bias), m.value("w"), "zero_bias")
    if "z" in m.bindings:
        inputs.append(m.value("z"))
    return b.op("FusedConv", *inputs, domain=MS, **attrs_of(conv), **fused_activation(m))


_PLAIN_CONV = op.Conv(var("x"), var("w"), optional(var("b")), name="conv")


# -- Gemm / MatMul + BatchNormalization -------------------------------------------------------


def _gemm_bn_facts(m: Match, site: Site) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | Refuse:
    """(B', C', scale, transB) for BN(Gemm / MatMul), or why not."""
    node = m.node("gemm")
    if site.rank(node.outputs[0]) != 2 or site.rank(node.inputs[0]) != 2:
        return Refuse("the product is not 2-D (BatchNormalization's channels are not its columns)")
    weight = float_array(node.inputs[1])
    ss = _bn_scale_shift(m)
    if weight is None or weight.ndim != 2 or ss is None:
        return Refuse("the weight or a BatchNormalization parameter is not a float constant")
    scale, shift = ss
    trans_b = Site.int_attr(node, "transB", 0) if node.op_type == "Gemm" else 0
    if scale.shape[0] != weight.shape[0 if trans_b else 1]:
        return Refuse("BatchNormalization's channels differ from the product's columns")
    alpha = Site.float_attr(node, "alpha", 1.0) if node.op_type == "Gemm" else 1.0
    c_value = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
    c = np.zeros(1) if c_value is None else float_array(c_value)
    if c is None:
        return Refuse("the Gemm's C is not a float constant")
    beta = Site.float_attr(node, "beta", 1.0) if node.op_type == "Gemm" else 0.0
    weight = alpha * (weight * (scale[:, None] if trans_b else scale[None, :]))
    try:
        bias = np.broadcast_to(beta * c, np.broadcast_shapes(c.shape, scale.shape)) * scale + shift
    except ValueError:
        return Refuse("the Gemm's C does not broadcast over the columns")
    return weight, bias, scale, trans_b


def _build_gemm_bn(b: Builder, m: Match, found: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> Value:
    weight, bias, _, trans_b = found
    node = m.node("gemm")
    like = node.inputs[1]
    trans_a = Site.int_attr(node, "transA", 0) if node.op_type == "Gemm" else 0
    w = new_const(b, weight, like, named_after(like, "fused"))
    c = new_const(b, bias, like, _folded_bias_name(node, like))
    return b.op("Gemm", node.inputs[0], w, c, transA=trans_a, transB=trans_b)


# -- Pad into Conv and pooling ----------------------------------------------------------------


def _pad_amounts(m: Match, site: Site) -> list[int] | Refuse:
    """The spatial pads the matched Pad adds, in the consumer's ``pads`` layout, or why not."""
    pad, consumer = m.node("pad"), m.root
    if (reason := _other_readers(pad)) is not None:
        return reason
    rank = site.rank(pad.outputs[0])
    if rank is None or rank < 3:
        return Refuse("the padded rank is unknown")
    if (pad.attr("mode", "constant") or "constant") not in ("constant", b"constant"):
        return Refuse("not a constant-mode Pad")
    if site.opset < 11:
        pads, fill = pad.attr("pads"), Site.float_attr(pad, "value", 0.0)
    else:
        pads = Site.array(pad.inputs[1]) if len(pad.inputs) > 1 else None
        value = pad.inputs[2] if len(pad.inputs) > 2 else None
        fill_array = np.zeros(1) if value is None else float_array(value)
        if fill_array is None or fill_array.size != 1 or (len(pad.inputs) > 3 and pad.inputs[3] is not None):
            return Refuse("the pad value is not a scalar constant, or the Pad names its axes")
        fill = float(fill_array.ravel()[0])
    if pads is None:
        return Refuse("the pads are not constant")
    pads = [int(p) for p in np.asarray(pads).ravel()]
    begins, ends = pads[:rank], pads[rank:]
    if any(p < 0 for p in pads) or any(begins[:2]) or any(ends[:2]):
        return Refuse("the Pad crops, or pads the batch or channel dims")
    wanted = -np.inf if consumer.op_type == "MaxPool" else 0.0
    if fill != wanted and not (fill == 0.0 and consumer.op_type == "MaxPool" and _never_negative(m.value("x"))):
        return Refuse(f"the pad value is {fill}, not {wanted}")
    if (consumer.attr("auto_pad", "NOTSET") or "NOTSET") not in ("NOTSET", b"NOTSET"):
        return Refuse("the consumer pads automatically")
    own = [int(p) for p in consumer.attr("pads", [0] * (2 * (rank - 2)))]
    if consumer.op_type == "AveragePool" and any(own) and not consumer.attr("count_include_pad", 0):
        return Refuse("the AveragePool's own pads are not counted")
    return [a + b for a, b in zip(own, begins[2:] + ends[2:], strict=True)]


# Activations whose output is never negative, so a zero pad of it is a -inf pad to a max.
_NON_NEGATIVE = frozenset({"Relu", "Sigmoid", "Softplus", "Abs", "Exp", "HardSigmoid"})


def _never_negative(value: Value) -> bool:
    node = value.producer
    if node is None:
        return False
    if node.op_type == "FusedConv":
        activation = node.attr("activation")
        activation = activation.decode() if isinstance(activation, bytes) else activation
        return activation in _NON_NEGATIVE
    if node.op_type == "Clip":
        low = Site.array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        return low is not None and low.size == 1 and float(low.ravel()[0]) >= 0
    return node.in_standard_domain and node.op_type in _NON_NEGATIVE


def _build_pad(b: Builder, m: Match, pads: list[int]) -> Value:
    consumer, pad = m.root, m.node("pad")
    extra = {"count_include_pad": 1} if consumer.op_type == "AveragePool" else {}
    inputs = [m.value("x"), *consumer.inputs[1:]]
    if len(pad.outputs[0].uses()) > 1:
        # Other consumers read the Pad: a copy stands for it until they take it in too.
        m.export("pad", b.op("Pad", *pad.inputs, **attrs_of(pad)))
    return b.op(consumer.op_type, *inputs, domain=consumer.domain, **attrs_of(consumer, pads=pads, **extra))


_PAD_CONSUMERS = frozenset({"Conv", "AveragePool", "MaxPool", "FusedConv"})


def _pad_consumer(node: Node) -> bool:
    """A consumer the Pad may go into: standard, or onnxruntime's FusedConv; one output used."""
    domain = node.domain == MS if node.op_type == "FusedConv" else node.in_standard_domain
    return domain and (len(node.outputs) == 1 or not any(v.is_used() for v in node.outputs[1:]))


def _other_readers(pad: Node) -> Refuse | None:
    """Why the Pad must stay: a graph output, or a reader other than a Conv or pooling's input."""
    value = pad.outputs[0]
    if value.is_graph_output:
        return Refuse(f"{value.name!r} is a graph output")
    for use in value.uses():
        if use.index != 0 or use.node.op_type not in _PAD_CONSUMERS or not _pad_consumer(use.node):
            return Refuse(f"{value.name!r} is also read by {use.node.name or use.node.op_type}, not a Conv or pooling")
    return None


_PAD_CONSUMER = op.any_of(
    tuple(sorted(_PAD_CONSUMERS)),
    op.Pad(
        var("x"),
        optional(var("_pads")),
        optional(var("_value")),
        optional(var("_axes")),
        name="pad",
    ),
    optional(var("_w")),
    optional(var("_b")),
    optional(var("_z")),
    name="consumer",
    domain=ANY_DOMAIN,
    where=_pad_consumer,
)


_SCALED = op.Mul(var("x"), const(name="c"), name="mul")
_INPUT_AFFINE = op.any_of(
    ("Conv", "FusedConv"),
    either(op.Add(_SCALED, const(name="d"), name="add"), _SCALED),
    var("w"),
    optional(var("b")),
    optional(var("_z")),
    name="conv",
    domain=ANY_DOMAIN,
    where=_pad_consumer,
)


def _channel_rule(root: str) -> Rule[Any]:
    return Rule(
        name=f"conv-{root.lower()}",
        family=FAMILY,
        pattern=getattr(op, root)(_CONV_MAYBE_T, const(name="c"), commute=root != "Sub"),
        plan=_plan_channel,
        build=_build_channel,
        label=f"Conv+{root}",
        doc=f"{root}(Conv(x, W, B), c[C,1,1]) -> Conv(x, W', B'), also through a Transpose",
    )


_FUSED_CONV = partial(
    Rule,
    family=FAMILY,
    plan=_check_fused_conv,
    build=_build_fused_conv,
    targets=frozenset({"ort"}),
    label="Conv+activation",
)

RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="conv-bn",
        family=FAMILY,
        pattern=_bn(_CONV),
        plan=_plan_conv_bn,
        build=_scaled_conv,
        label="Conv+BatchNormalization",
        doc="BatchNormalization(Conv(x, W, B)) -> Conv(x, W*s, (B-mean)*s+beta)",
    ),
    _channel_rule("Mul"),
    Rule(
        name="mul-conv",
        family=FAMILY,
        pattern=_INPUT_AFFINE,
        plan=_plan_input_affine,
        build=_build_input_affine,
        kind="late",  # the norms' scale and shift fusions read such a Mul first
        label="Mul+Conv",
        doc="Conv|FusedConv(x * c[C,1,1] + d[C,1,1], W, B) -> Conv(x, W * c over its input channels, B + W.d); "
        "d: no padding; not a decomposed GELU's closing 0.5",
    ),
    _channel_rule("Add"),
    _channel_rule("Sub"),
    _FUSED_CONV(
        name="ort-fusedconv",
        pattern=activated(_PLAIN_CONV),
        doc="Act(Conv(x, W, B)) -> com.microsoft FusedConv (target ort)",
    ),
    _FUSED_CONV(
        name="ort-fusedconv-sum",
        pattern=activated(op.Add(_PLAIN_CONV, var("z"), name="sum")),
        doc="Act(Conv(x, W, B) + z) -> com.microsoft FusedConv (target ort)",
    ),
    Rule(
        name="gemm-bn",
        family=FAMILY,
        pattern=_bn(op.any_of(("Gemm", "MatMul"), var("a"), const(name="gw"), optional(var("c")), name="gemm")),
        plan=_gemm_bn_facts,
        build=_build_gemm_bn,
        label="Gemm+BatchNormalization",
        doc="BatchNormalization(Gemm|MatMul(a, B, C)) on a 2-D product -> Gemm(a, B*s, C*s+shift)",
    ),
    Rule(
        name="pad-into-consumer",
        family=FAMILY,
        pattern=_PAD_CONSUMER,
        plan=_pad_amounts,
        build=_build_pad,
        label="Pad",
        doc="Conv|FusedConv|AveragePool|MaxPool(Pad(x, constant 0 / -inf)) -> each consumer with the pads added",
        exports=("pad",),
    ),
)
