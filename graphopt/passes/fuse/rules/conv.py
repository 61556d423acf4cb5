"""Conv family: BatchNormalization and per-channel Mul / Add folded into the weights.

Conv + BatchNormalization. BN computes ``y = (c - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)`` per channel, and Conv is linear in its weight, so
``W' = W * s`` (over the output-channel axis: 0 for Conv, 1 for ConvTranspose, per group)
and ``B' = (B - mean) * s + beta`` give one Conv. Gemm / MatMul + BN scale B's columns.

Conv + per-channel Mul / Add. ``Conv(x, W, B) * c = Conv(x, W * c, B * c)`` and
``Conv(x, W, B) + c = Conv(x, W, B + c)`` when ``c`` varies along the channel axis only.
A Transpose between them (tf2onnx's NHWC wrappers) is seen through: ``c`` is read in the
Conv's layout through the inverse permutation.

``--target ort``: ``Act(Conv(x, W, B))`` and ``Act(Conv(x, W, B) + z)`` (a residual ``z`` of
the Conv's shape) -> ``FusedConv`` (com.microsoft) for the activations its CPU kernel applies
(Relu, Sigmoid, Tanh, LeakyRelu, Clip, HardSigmoid); onnxruntime fuses the first itself at
its extended level, not the second.
"""

from __future__ import annotations

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import Pattern, const, either, op, optional, var
from graphopt.passes.fuse.rules._helpers import (
    FUSABLE_ACTIVATIONS,
    MS,
    activation_params,
    attrs_of,
    float_array,
    is_float,
    new_const,
)

FAMILY = "conv"


def _not_training(node: Node) -> bool:
    return not node.attr("training_mode", 0)


def _bn_scale_shift(m: Match) -> tuple[np.ndarray, np.ndarray] | None:
    params = [float_array(m.value(n)) for n in ("gamma", "beta", "mean", "var")]
    if any(p is None or p.ndim != 1 for p in params):
        return None
    gamma, beta, mean, variance = params  # type: ignore[misc]
    scale = gamma / np.sqrt(variance + m.node("bn").attr("epsilon", 1e-5))
    return scale, beta - mean * scale


def _bn(inner: Pattern) -> Pattern:
    return op.BatchNormalization(
        inner, var("gamma"), var("beta"), var("mean"), var("var"), name="bn", where=_not_training
    )


_CONV = op.any_of(("Conv", "ConvTranspose"), var("x"), var("w"), optional(var("b")), name="conv")


def _conv_weights(m: Match) -> tuple[np.ndarray, np.ndarray | None] | None:
    w = float_array(m.value("w"))
    bias = m.optional("b")
    b = None if bias is None else float_array(bias)
    if w is None or w.ndim < 3 or (bias is not None and b is None):
        return None
    return w, b


def _scaled_conv(b: Builder, m: Match, scale: np.ndarray, shift: np.ndarray) -> Value:
    """The matched Conv with its output channels scaled by ``scale`` and shifted by ``shift``."""
    conv = m.node("conv")
    w, bias = _conv_weights(m)  # type: ignore[misc]
    channels = _channels(conv, w)
    if conv.op_type == "Conv":
        w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    else:  # ConvTranspose: W is (C_in, C_out / group, k...); output channel = g * C_out/group + j
        group = int(conv.attr("group", 1))
        per = w.shape[1]
        grouped = w.reshape((group, -1, per, *w.shape[2:]))
        w = (grouped * scale.reshape((group, 1, per) + (1,) * (w.ndim - 2))).reshape(w.shape)
    new_bias = (bias if bias is not None else np.zeros(channels)) * scale + shift
    node = b.node(
        conv.op_type,
        conv.inputs[0],
        new_const(b, w, m.value("w"), "fused_weight"),
        new_const(b, new_bias, m.value("w"), "fused_bias"),
        **attrs_of(conv),
    )
    return node.outputs[0]


def _channels(conv: Node, w: np.ndarray) -> int:
    return int(w.shape[0]) if conv.op_type == "Conv" else int(w.shape[1] * conv.attr("group", 1))


def _check_conv_bn(m: Match, site: Site) -> str | None:
    found = _conv_weights(m)
    if found is None:
        return "the weight or bias is not a float constant"
    ss = _bn_scale_shift(m)
    if ss is None:
        return "a BatchNormalization parameter is not a constant vector"
    if ss[0].shape[0] != _channels(m.node("conv"), found[0]):
        return "BatchNormalization's channels differ from the Conv's"
    return None


def _rewrite_conv_bn(b: Builder, m: Match, site: Site) -> Value:
    scale, shift = _bn_scale_shift(m)  # type: ignore[misc]
    return _scaled_conv(b, m, scale, shift)


add_rule(
    Rule(
        "conv-bn",
        FAMILY,
        _bn(_CONV),
        _rewrite_conv_bn,
        _check_conv_bn,
        label="Conv+BatchNormalization",
        doc="BatchNormalization(Conv(x, W, B)) -> Conv(x, W*s, (B-mean)*s+beta)",
    )
)


def _channel_vector(m: Match, site: Site) -> np.ndarray | str:
    """The per-channel constant ``c`` in the Conv's layout, as a vector over channels."""
    c = float_array(m.value("c"))
    found = _conv_weights(m)
    if c is None or found is None:
        return "the weight or the operand is not a float constant"
    channels = _channels(m.node("conv"), found[0])
    rank = site.rank(m.node("conv").outputs[0])
    if rank is None or c.ndim > rank:
        return "the Conv's output rank is unknown"
    c = c.reshape((1,) * (rank - c.ndim) + c.shape)
    if "t" in m.bindings:
        perm = list(m.node("t").attr("perm", list(range(rank - 1, -1, -1))))
        c = np.transpose(c, np.argsort(perm))
    if any(d != 1 for i, d in enumerate(c.shape) if i != 1) or c.shape[1] not in (1, channels):
        return "the operand is not per-channel"
    return np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float64)


def _check_channel(m: Match, site: Site) -> str | None:
    if not is_float(m.node("conv").outputs[0]):
        return "not a float Conv"
    found = _channel_vector(m, site)
    return found if isinstance(found, str) else None


def _rewrite_channel(b: Builder, m: Match, site: Site) -> Value:
    vector = _channel_vector(m, site)
    assert not isinstance(vector, str)
    if m.root.op_type == "Mul":
        out = _scaled_conv(b, m, vector, np.zeros_like(vector))
    elif m.root.op_type == "Add":
        out = _scaled_conv(b, m, np.ones_like(vector), vector)
    else:  # Sub with the Conv first
        out = _scaled_conv(b, m, np.ones_like(vector), -vector)
    if "t" in m.bindings:
        transpose = m.node("t")
        out = b.op("Transpose", out, **attrs_of(transpose))
    return out


_CONV_MAYBE_T = either(_CONV, op.Transpose(_CONV, name="t"))

for _root in ("Mul", "Add", "Sub"):
    add_rule(
        Rule(
            f"conv-{_root.lower()}",
            FAMILY,
            getattr(op, _root)(_CONV_MAYBE_T, const(name="c"), commute=_root != "Sub"),
            _rewrite_channel,
            _check_channel,
            label=f"Conv+{_root}",
            doc=f"{_root}(Conv(x, W, B), c[C,1,1]) -> Conv(x, W', B'), also through a Transpose",
        )
    )


def activated(inner: Pattern) -> Pattern:
    """``Act(inner)`` for the activations onnxruntime's fused kernels apply."""
    return op.any_of(FUSABLE_ACTIVATIONS, inner, optional(var("lo")), optional(var("hi")), name="act")


def check_activation(m: Match, site: Site) -> str | None:
    if site.dtype(m.root.outputs[0]) != DataType.FLOAT:
        return "onnxruntime's fused kernels are float32 only"
    return None if activation_params(m.node("act")) is not None else "the Clip bounds are not constants"


def fused_activation(m: Match) -> dict[str, object]:
    """FusedConv's activation attributes for the matched activation."""
    params = activation_params(m.node("act"))
    found: dict[str, object] = {"activation": m.node("act").op_type}
    if params:
        found["activation_params"] = params
    return found


def _check_fused_conv(m: Match, site: Site) -> str | None:
    if "z" in m.bindings:
        shape = site.shape(m.value("z"))
        if shape is None or None in shape or shape != site.shape(m.node("conv").outputs[0]):
            return "the residual's shape is not provably the Conv's"
    return check_activation(m, site)


def _rewrite_fused_conv(b: Builder, m: Match, site: Site) -> Value:
    conv = m.node("conv")
    inputs = [*conv.inputs, *([None] * (3 - len(conv.inputs)))][:3]
    if "z" in m.bindings:
        inputs.append(m.value("z"))
    return b.op("FusedConv", *inputs, domain=MS, **attrs_of(conv), **fused_activation(m))


_PLAIN_CONV = op.Conv(var("x"), var("w"), optional(var("b")), name="conv")

for _suffix, _inner in (("", _PLAIN_CONV), ("-sum", op.Add(_PLAIN_CONV, var("z"), name="sum"))):
    add_rule(
        Rule(
            f"ort-fusedconv{_suffix}",
            FAMILY,
            activated(_inner),
            _rewrite_fused_conv,
            _check_fused_conv,
            targets=frozenset({"ort"}),
            label="Conv+activation",
            doc=f"Act(Conv(x, W, B){' + z' if _suffix else ''}) -> com.microsoft FusedConv (target ort)",
        )
    )
