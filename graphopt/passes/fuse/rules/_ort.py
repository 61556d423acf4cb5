"""What the rules emitting onnxruntime's contrib ops (``--target ort``) share: the domain and
the activations its fused CPU kernels (FusedConv, FusedGemm) apply."""

from __future__ import annotations

import numpy as np

from graphopt.ir import CONTRIB_DOMAIN, DataType, Node, Value
from graphopt.passes.rewrite.engine import Match, Site
from graphopt.passes.rewrite.patterns import Pattern, op, optional, var

__all__ = [
    "CPU_FLOATS",
    "FUSABLE_ACTIVATIONS",
    "MS",
    "activated",
    "activation_params",
    "check_activation",
    "cpu_float",
    "fused_activation",
]

MS = CONTRIB_DOMAIN
# Activations onnxruntime's CPU FusedConv / FusedGemm apply in the kernel.
FUSABLE_ACTIVATIONS = ("Relu", "Sigmoid", "Tanh", "LeakyRelu", "Clip", "HardSigmoid")
# The element types onnxruntime's CPU kernels of MultiHeadAttention, SkipLayerNormalization,
# SkipSimplifiedLayerNormalization, FastGelu, BiasGelu and QuickGelu take (each run in a session on
# onnxruntime 1.32; float16 models exported for deployment need them as much as float32 ones).
CPU_FLOATS = frozenset({DataType.FLOAT, DataType.FLOAT16})


def cpu_float(site: Site, value: Value, contrib: str) -> str | None:
    """Why ``contrib`` cannot take ``value`` on onnxruntime's CPU (None: its kernel takes the type)."""
    dtype = site.dtype(value)
    if dtype in CPU_FLOATS:
        return None
    found = "an unknown type" if dtype is None else dtype.name.lower()
    return f"onnxruntime's CPU {contrib} takes float32 or float16, not {found}"


def activation_params(node: Node) -> list[float] | None:
    """The parameters onnxruntime's fused kernels take for activation ``node`` (None: not
    provable, such as a Clip bound that is not a constant)."""
    if node.op_type == "LeakyRelu":
        return [Site.float_attr(node, "alpha", 0.01)]
    if node.op_type == "HardSigmoid":
        return [Site.float_attr(node, "alpha", 0.2), Site.float_attr(node, "beta", 0.5)]
    if node.op_type != "Clip":
        return []
    lowest, highest = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
    if len(node.inputs) == 1:  # bounds as attributes (opset < 11), or none at all
        return [Site.float_attr(node, "min", lowest), Site.float_attr(node, "max", highest)]
    bounds = []
    for index, default in ((1, lowest), (2, highest)):
        value = node.inputs[index] if len(node.inputs) > index else None
        array = None if value is None else Site.array(value)
        if value is not None and (array is None or array.size != 1):
            return None
        bounds.append(default if array is None else float(array.ravel()[0]))
    return bounds


def activated(inner: Pattern) -> Pattern:
    """``Act(inner)`` for the activations onnxruntime's fused kernels apply."""
    return op.any_of(FUSABLE_ACTIVATIONS, inner, optional(var("lo")), optional(var("hi")), name="act")


def check_activation(m: Match, site: Site) -> str | None:
    """A plan's part: the matched activation (``act``) is one a fused kernel applies."""
    if site.dtype(m.root.outputs[0]) != DataType.FLOAT:
        return "onnxruntime's fused kernels are float32 only"
    return None if activation_params(m.node("act")) is not None else "the Clip bounds are not constants"


def fused_activation(m: Match) -> dict[str, object]:
    """FusedConv's / FusedGemm's activation attributes for the matched activation."""
    params = activation_params(m.node("act"))
    found: dict[str, object] = {"activation": m.node("act").op_type}
    if params:
        found["activation_params"] = params
    return found
