"""Parallel conv branches summed into one Conv (conv family): structural reparameterization.

``Add(Conv(x, W1, B1), Conv(x, W2, B2))`` -> ``Conv(x, W1 + W2', B1 + B2)`` and the same with a
``BatchNormalization(x)`` branch, the identity kernel scaled by BN's ``s`` and shifted by its shift;
``Sub`` subtracts the second branch. Both branches read the same ``x`` with one group count,
stride and dilation, and a kernel smaller than the other's on an axis is centered in the larger
one: zero taps at each end, which reach what its own taps reach exactly when its pads are the
larger kernel's less the dilated taps added (an odd difference of sizes has no center). The
identity branch is a 1x1 kernel without pads, so the Conv it joins pads a kernel of 2k + 1 taps by
k at each end (the output keeps x's size) and has stride 1 and as many output channels as inputs.

MobileOne, FastViT and RepVGG-style blocks export their training-time branches this way (a k x k
conv-BN, a 1x1 conv-BN and a BN skip, summed; FastViT's RepMixer subtracts a BN from a depthwise
conv-BN): once conv-bn has folded the conv-BNs, the branches of a block become one Conv (what those
models' own ``reparameterize`` does for inference), and each of its Adds and BNs goes with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import attrs_of, float_array, named_after, new_const
from graphopt.passes.fuse.rules.conv import FAMILY
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, either, op, optional, var


def _branch(tag: str) -> Pattern:
    conv = op.Conv(var("x"), var(f"w_{tag}"), optional(var(f"b_{tag}")), name=f"conv_{tag}")
    bn = op.BatchNormalization(
        var("x"),
        var(f"gamma_{tag}"),
        var(f"beta_{tag}"),
        var(f"mean_{tag}"),
        var(f"var_{tag}"),
        name=f"bn_{tag}",
        where=lambda node: not node.attr("training_mode", 0),
    )
    return either(conv, bn)


@dataclass
class _Kernel:
    """One branch as a Conv: its weight and bias (float64), pads and the attributes both must share."""

    w: np.ndarray
    bias: np.ndarray
    pads: tuple[int, ...]  # begins then ends, as Conv's ``pads``
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int


def _conv_kernel(m: Match, node: Node, tag: str) -> _Kernel | Refuse:
    w = float_array(m.value(f"w_{tag}"))
    b_value = m.optional(f"b_{tag}")
    bias = None if b_value is None else float_array(b_value)
    if w is None or w.ndim < 3 or (b_value is not None and bias is None):
        return Refuse("a Conv's weight or bias is not a float constant")
    if (node.attr("auto_pad", "NOTSET") or "NOTSET") not in ("NOTSET", b"NOTSET"):
        return Refuse("a Conv pads automatically (auto_pad)")
    spatial = w.ndim - 2
    kernel = tuple(node.attr("kernel_shape", list(w.shape[2:])))
    if kernel != tuple(w.shape[2:]):
        return Refuse("a Conv's kernel_shape is not its weight's")
    return _Kernel(
        w,
        bias if bias is not None else np.zeros(w.shape[0]),
        tuple(node.attr("pads", [0] * 2 * spatial)),
        tuple(node.attr("strides", [1] * spatial)),
        tuple(node.attr("dilations", [1] * spatial)),
        int(node.attr("group", 1)),
    )


def _identity_kernel(m: Match, node: Node, tag: str, like: _Kernel) -> _Kernel | Refuse:
    """BN(x) as a 1x1 Conv of ``like``'s groups: channel c reads input c, scaled by BN's s."""
    found = [float_array(m.value(f"{n}_{tag}")) for n in ("gamma", "beta", "mean", "var")]
    if any(p is None or p.ndim != 1 for p in found):
        return Refuse("the BatchNormalization's parameters are not 1-D float constants")
    gamma, beta, mean, variance = (p for p in found if p is not None)
    scale = gamma / np.sqrt(variance + Site.float_attr(node, "epsilon", 1e-5))
    channels, per_group = like.w.shape[0], like.w.shape[1]
    if len(scale) != channels or channels != per_group * like.group:
        return Refuse("the Conv's output channels are not its input channels (no identity branch fits)")
    if any(s != 1 for s in like.strides):
        return Refuse("the Conv has a stride (the identity branch keeps x's size)")
    spatial = like.w.ndim - 2
    w = np.zeros((channels, per_group) + (1,) * spatial)
    w[np.arange(channels), np.arange(channels) % per_group] = scale.reshape(-1, *(1,) * spatial)
    return _Kernel(w, beta - mean * scale, (0,) * 2 * spatial, like.strides, like.dilations, like.group)


def _merged(a: _Kernel, b: _Kernel, sign: float) -> _Kernel | Refuse:
    """``a`` plus ``sign`` times ``b`` as one kernel, or why they do not add up."""
    if (a.strides, a.dilations, a.group) != (b.strides, b.dilations, b.group) or a.w.shape[:2] != b.w.shape[:2]:
        return Refuse("the branches differ in stride, dilation, groups or channels")
    spatial = a.w.ndim - 2
    size = tuple(max(ka, kb) for ka, kb in zip(a.w.shape[2:], b.w.shape[2:], strict=True))
    pads: list[int] = []
    placed = []
    for kernel in (a, b):
        offsets = []
        for k, full in zip(kernel.w.shape[2:], size, strict=True):
            if (full - k) % 2:
                return Refuse("the kernels' sizes differ by an odd number of taps (no center)")
            offsets.append((full - k) // 2)
        grown = tuple(kernel.pads[i] + offsets[i % spatial] * kernel.dilations[i % spatial] for i in range(2 * spatial))
        if pads and tuple(pads) != grown:
            return Refuse("the branches' pads do not center the smaller kernel in the larger")
        pads = list(grown)
        w = np.zeros(kernel.w.shape[:2] + size)
        taps = tuple(slice(o, o + k) for o, k in zip(offsets, kernel.w.shape[2:], strict=True))
        index = (slice(None), slice(None), *taps)
        w[index] = kernel.w
        placed.append(w)
    return _Kernel(placed[0] + sign * placed[1], a.bias + sign * b.bias, tuple(pads), a.strides, a.dilations, a.group)


@dataclass
class _Plan:
    kernel: _Kernel
    conv: Node  # a Conv of the branches: the new one takes its attributes and weight's type


def _plan(m: Match, site: Site) -> _Plan | Refuse:
    total = m.node("sum")
    convs = [m.node(f"conv_{t}") if f"conv_{t}" in m.bindings else None for t in "ab"]
    first = next((c for c in convs if c is not None), None)
    if first is None:
        return Refuse("no branch is a Conv")
    like = _conv_kernel(m, first, "a" if convs[0] is not None else "b")
    if isinstance(like, Refuse):
        return like
    kernels: list[_Kernel] = []
    for tag, conv in zip("ab", convs, strict=True):
        kernel = _conv_kernel(m, conv, tag) if conv is not None else _identity_kernel(m, m.node(f"bn_{tag}"), tag, like)
        if isinstance(kernel, Refuse):
            return kernel
        kernels.append(kernel)
    if site.shape(total.inputs[0]) != site.shape(total.inputs[1]) or site.shape(total.inputs[0]) is None:
        return Refuse("the branches' outputs do not provably have one shape")
    merged = _merged(kernels[0], kernels[1], -1.0 if total.op_type == "Sub" else 1.0)
    if isinstance(merged, Refuse):
        return merged
    return _Plan(merged, first)


def _build(b: Builder, m: Match, plan: _Plan) -> Value:
    conv, kernel = plan.conv, plan.kernel
    weight = conv.inputs[1]
    node = b.node(
        "Conv",
        m.value("x"),
        new_const(b, kernel.w, weight, named_after(weight, "branches")),
        new_const(b, kernel.bias, weight, named_after(weight, "branches_bias")),
        **attrs_of(conv, pads=list(kernel.pads), kernel_shape=list(kernel.w.shape[2:])),
    )
    return node.outputs[0]


RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="conv-branches",
        family=FAMILY,
        pattern=op.any_of(("Add", "Sub"), _branch("a"), _branch("b"), name="sum"),
        plan=_plan,
        build=_build,
        label="Conv branches",
        doc="Add|Sub(Conv(x, W1, B1), Conv(x, W2, B2) | BatchNormalization(x)) -> Conv(x, W1 +- W2, B1 +- B2), "
        "the smaller kernel centered in the larger (MobileOne / FastViT / RepVGG branches reparameterized)",
    ),
)
