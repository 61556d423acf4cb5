"""MatMul family, dynamic int8 for ``--target ort``: the integer MatMul onnxruntime's
``quantize_dynamic`` writes, as one com.microsoft ``DynamicQuantizeMatMul`` (or
``MatMulIntegerToFloat`` where the activation's quantization is shared).

``quantize_dynamic`` writes each float MatMul ``x @ W`` as

    xq, xs, xz = DynamicQuantizeLinear(x)
    y = Cast(MatMulInteger(xq, Wq, xz, Wz), float) * (xs * Ws)      [+ bias]

``DynamicQuantizeMatMul(x, Wq, Ws, Wz, bias)`` is that computation in one kernel: it quantizes
``x`` as DynamicQuantizeLinear does (uint8, the scale and zero point from x's range), multiplies
in integers and scales the int32 product back to float. onnxruntime forms it itself at its
extended level; written in the file, the model runs it at every level and holds five nodes
fewer per MatMul.

Where several MatMuls read one DynamicQuantizeLinear (Q, K and V read one quantized hidden
state), each DynamicQuantizeMatMul would quantize that activation again: vit_ts_dyn8's
``--target ort`` output quantized each layer's hidden state three times, where onnxruntime's own
fusion keeps the one quantization and reads its result with ``MatMulIntegerToFloat(xq, Wq, xs,
Ws, xz, Wz, bias)``, the integer product scaled to float and the bias added. The rule writes that
op there. The DynamicQuantizeLinear stays a leaf of each match: its outputs bind as variables, so
the match never removes a node another projection reads.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._ort import MS
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import const, match, op, optional, var

__all__ = ["RULES", "quantized_with_bias"]

FAMILY = "matmul"
_INTEGER_WEIGHTS = (np.dtype(np.int8), np.dtype(np.uint8))

_SCALED = op.Mul(
    op.Cast(
        op.MatMulInteger(var("xq"), const(name="wq"), var("xz"), optional(const(name="wz")), name="matmul"),
        name="cast",
    ),
    op.Mul(var("xs"), const(name="ws"), name="scales"),
    name="scaled",
)


def _plan(m: Match, site: Site) -> Refuse | None:
    """Why the integer MatMul is not DynamicQuantizeMatMul's computation (None: it is)."""
    quantize = m.value("xq").producer
    if (
        quantize is None
        or quantize.op_type != "DynamicQuantizeLinear"
        or not quantize.in_standard_domain
        or [m.value(n) for n in ("xq", "xs", "xz")] != list(quantize.outputs)
    ):
        return Refuse("the activation is not quantized by one DynamicQuantizeLinear")
    x = quantize.inputs[0]
    if x is None or site.dtype(x) != DataType.FLOAT or site.int_attr(m.node("cast"), "to", 0) != DataType.FLOAT:
        return Refuse("not a float32 activation cast back to float32 (DynamicQuantizeMatMul's types)")
    weights, scale = site.array(m.value("wq")), site.array(m.value("ws"))
    if weights is None or weights.dtype not in _INTEGER_WEIGHTS or weights.ndim != 2:
        return Refuse("the weights are not a constant 2-D int8 or uint8 matrix")
    columns = weights.shape[1]
    if scale is None or scale.dtype != np.float32 or scale.size not in (1, columns) or scale.ndim > 1:
        return Refuse("the weight scale is not a float32 scalar or one per column")
    if "wz" in m:
        zero = site.array(m.value("wz"))
        if zero is None or zero.dtype != weights.dtype or zero.shape != scale.shape:
            return Refuse("the weight zero point does not match the weights' type and the scale's shape")
    if "bias" in m:
        bias = site.array(m.value("bias"))
        if bias is None or bias.dtype != np.float32 or bias.shape != (columns,):
            return Refuse("the bias is not a float32 vector over the columns")
    return None


def _build(b: Builder, m: Match, plan: None) -> Value:
    quantized = m.value("xq")
    quantize = quantized.producer
    assert quantize is not None and quantize.inputs[0] is not None  # the plan proved it
    bias = m.value("bias") if "bias" in m else None
    if len(quantized.uses()) > 1:  # read by other MatMuls too: quantized once, for all of them
        inputs = [quantized, m.value("wq"), m.value("xs"), m.value("ws"), m.value("xz"), m.optional("wz"), bias]
        op_type = "MatMulIntegerToFloat"
    else:
        inputs = [quantize.inputs[0], m.value("wq"), m.value("ws"), m.optional("wz"), bias]
        op_type = "DynamicQuantizeMatMul"
    while inputs[-1] is None:
        inputs.pop()
    return b.op(op_type, *inputs, domain=MS)


_BIASED = op.Add(_SCALED, const(name="bias"))

_rule = partial(Rule, family=FAMILY, plan=_plan, build=_build, targets=frozenset({"ort"}))

RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="ort-dynamic-quantize-matmul",
        pattern=_SCALED,
        label="dynamic int8 MatMul",
        doc="Cast(MatMulInteger(DynamicQuantizeLinear(x), Wq, .., Wz)) * (xs * Ws) -> com.microsoft "
        "DynamicQuantizeMatMul(x, Wq, Ws, Wz), or MatMulIntegerToFloat(xq, Wq, xs, Ws, xz, Wz) where other "
        "MatMuls read the quantized x (target ort)",
    ),
    _rule(
        name="ort-dynamic-quantize-matmul-bias",
        pattern=_BIASED,
        label="dynamic int8 MatMul",
        doc="the same with the bias Add after it, which the op takes as its bias (target ort)",
    ),
)


def quantized_with_bias(total: Value, site: Site) -> bool:
    """Whether ``ort-dynamic-quantize-matmul-bias`` writes ``total``, a dynamic int8 MatMul plus a
    constant bias, as one op that adds the bias in its own kernel."""
    rule, root = RULES[1], total.producer
    return root is not None and any(
        _plan(Match(rule, root, bound, site), site) is None for bound in match(_BIASED, total)
    )
