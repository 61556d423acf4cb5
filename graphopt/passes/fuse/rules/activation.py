"""Activation family: decomposed GELU, HardSigmoid, HardSwish, Swish and Softsign become one op; float16 ops
without a float16 kernel in onnxruntime are computed in float32.

- erf GELU ``x * 0.5 * (1 + erf(x / sqrt 2))`` -> ``Gelu(x)`` (opset 20), operands in any
  order and association, the argument of erf in any spelling of ``x / sqrt 2``.
- tanh GELU ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` -> ``Gelu(x, approximate="tanh")``
  (opset 20), the argument of tanh read as a polynomial in x (any factorization of it: ``x^3`` as
  ``Pow(x, 3)`` or products, BLOOM's ``c x (1 + a x x)``).
- ``Clip(x + 3, 0, 6) / 6`` (or ``* 1/6``) -> ``HardSigmoid(x, 1/6, 0.5)``.
- ``x * Clip(x + 3, 0, 6) / 6`` and ``x * HardSigmoid(x, 1/6, 0.5)`` -> ``HardSwish(x)`` (opset 14);
  below opset 14 the first becomes ``x * HardSigmoid(x, 1/6, 0.5)`` (two ops instead of four).
- SiLU ``x * Sigmoid(x)`` and ``x * Sigmoid(alpha * x)`` -> ``Swish(x, alpha)`` at opset 24 (onnxruntime
  1.32 has no Swish kernel for a model of a later opset, so the rule stops there). SwiGLU
  (opset 28) is left alone: onnxruntime 1.32 has no kernel for it, so the output would not run.
- Softsign ``x / (1 + |x|)``, ``Div(x, Add(Abs(x), 1))`` with the Add's operands in either order,
  -> ``Softsign(x)`` (opset 1): the same formula, three element-wise kernels and two intermediate
  tensors of x's size become one (on float32 [1, 64, 768], onnxruntime 1.32, 1 thread, 200 rounds:
  0.63 x the spelled-out time at ORT_ENABLE_ALL and ORT_DISABLE_ALL alike). Of float32 or float16
  only: onnxruntime 1.32's CPU provider has Softsign for float32 (float16 through a Cast it inserts)
  and no kernel for double.

A float16 Gelu, and from opset 13 a float16 Softmax or LogSoftmax, is computed in float32 between Casts
(``gelu-float32``, ``softmax-float32``, ``logsoftmax-float32``): onnxruntime's CPU provider has no float16 kernel
for them and runs their function bodies (_float32.py).

With ``--target ort`` below opset 20 the GELUs become onnxruntime's ``Gelu`` / ``FastGelu``
(com.microsoft), which its CPU provider implements; a GELU of ``x + bias`` (a constant vector
over the last axis, the MLP's bias) becomes ``BiasGelu(x, bias)`` / ``FastGelu(x, bias)`` unless the
bias is a projection's that ``matmul-add-gemm-projection`` writes as a Gemm (MatMul + BiasGelu
measured no faster than Gemm + Gelu at any shape, 1.09x at Swin's first stage) or a dynamic int8
MatMul's that ``ort-dynamic-quantize-matmul-bias`` adds in its own kernel (BiasGelu 1.5x the Gelu
alone on dynamic int8 BERT), and
``x * Sigmoid(alpha * x)`` of float32 (SiLU, CLIP's quick GELU) onnxruntime's ``QuickGelu(x, alpha)``
below opset 24.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from graphopt.ir import Node
from graphopt.passes.fuse.rules._float32 import in_float32, ort_in_float32
from graphopt.passes.fuse.rules._helpers import NOT_FLOAT, float_x, is_float, scalar_factor
from graphopt.passes.fuse.rules._ort import MS, cpu_float
from graphopt.passes.fuse.rules.matmul.quantized import quantized_with_bias
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import ANY_DOMAIN, Pattern, const, either, op, optional, polynomial, var
from graphopt.passes.rewrite.proofs import projected_as_gemm

FAMILY = "activation"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY)


def _products(x: Pattern, half: Pattern, rest: Pattern) -> Pattern:
    """``x * half * rest`` in each association the exporters write."""
    return either(op.Mul(op.Mul(x, rest), half), op.Mul(op.Mul(x, half), rest), op.Mul(x, op.Mul(rest, half)))


_x = var("x")


PolynomialTest = Callable[[dict[int, float], float], bool]


def _linear_and_cubic(linear: float, cubic_ratio: float | None, tol: float) -> PolynomialTest:
    """A test of a polynomial: ``linear * (x + cubic_ratio * x^3)`` (no cubic term when ``cubic_ratio`` is None),
    within ``tol`` relative or within the rounding of x's float type (each coefficient is a product of up to
    three stored constants, each within half a spacing of its number)."""

    def test(coefficients: dict[int, float], epsilon: float) -> bool:
        terms = {d: c for d, c in coefficients.items() if c != 0.0}
        if set(terms) != ({1} if cubic_ratio is None else {1, 3}):
            return False
        if abs(terms[1] - linear) > max(tol, 2 * epsilon) * abs(linear):
            return False
        return cubic_ratio is None or abs(terms[3] / terms[1] - cubic_ratio) <= max(1e-4, 3 * epsilon) * cubic_ratio

    return test


# GELU's inner argument is read as a polynomial in x, so every factorization matches: x / sqrt 2 or
# x * (1 / sqrt 2); c * (x + a * x^3), or BLOOM's c * x * (1 + a * x * x), or c * x + c * a * Pow(x, 3).
_ERF_GELU = _products(
    _x, const(0.5), op.Add(op.Erf(polynomial(_x, _linear_and_cubic(1 / math.sqrt(2), None, 1e-6))), const(1.0))
)
_TANH_GELU = _products(
    _x,
    const(0.5, name="half"),
    op.Add(op.Tanh(polynomial(_x, _linear_and_cubic(math.sqrt(2 / math.pi), 0.044715, 1e-5))), const(1.0)),
)


def _clip_bounds(node: Node) -> tuple[float, float] | None:
    if len(node.inputs) > 1:
        low = Site.array(node.inputs[1]) if node.inputs[1] is not None else None
        high = Site.array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if low is None or high is None or low.size != 1 or high.size != 1:
            return None
        return float(low.ravel()[0]), float(high.ravel()[0])
    if node.attr("min") is None or node.attr("max") is None:
        return None
    return Site.float_attr(node, "min", 0.0), Site.float_attr(node, "max", 0.0)


_RELU6 = op.Clip(op.Add(_x, const(3.0)), optional(var("lo")), optional(var("hi")), name="clip")


def _check_relu6(m: Match, site: Site) -> Refuse | None:
    if not is_float(m.value("x")):
        return Refuse(NOT_FLOAT)
    return None if _clip_bounds(m.node("clip")) == (0.0, 6.0) else Refuse("the Clip is not to [0, 6]")


def _divided_by_six(inner: Pattern) -> Pattern:
    return either(op.Div(inner, const(6.0)), op.Mul(inner, const(1 / 6, tol=1e-5)))


def _is_sixth_hardsigmoid(node: Node) -> bool:
    alpha, beta = Site.float_attr(node, "alpha", 0.2), Site.float_attr(node, "beta", 0.5)
    return abs(alpha - 1 / 6) < 1e-5 and abs(beta - 0.5) < 1e-6


_SPELLED_HARDSWISH = either(_divided_by_six(op.Mul(_x, _RELU6)), op.Mul(_x, _divided_by_six(_RELU6)))


def _bias_gelu_op(gelu: Node) -> str | None:
    """The contrib op that takes a bias for this GELU node (None: none does)."""
    if gelu.domain == MS:
        return {"Gelu": "BiasGelu", "FastGelu": "FastGelu"}.get(gelu.op_type) if len(gelu.inputs) == 1 else None
    if gelu.in_standard_domain and gelu.op_type == "Gelu":
        return "FastGelu" if gelu.attr("approximate", "none") in ("tanh", b"tanh") else "BiasGelu"
    return None


class _BiasGelu(NamedTuple):
    op_type: str  # the contrib op that takes the bias


def _plan_bias_gelu(m: Match, site: Site) -> _BiasGelu | Refuse:
    contrib = _bias_gelu_op(m.node("gelu"))
    if contrib is None:
        return Refuse("not a GELU that takes a bias")
    x = m.value("x")
    shape = site.shape(x)
    unsupported = cpu_float(site, x, contrib)
    if unsupported is not None or not shape:
        return Refuse(unsupported or "x is not of known rank")
    if site.shape(m.value("bias")) != (shape[-1],):
        return Refuse("the bias is not a vector over x's last axis")
    if site.dtype(m.value("bias")) != site.dtype(x):
        return Refuse("the bias is not of x's element type")
    total = m.node("sum").outputs[0]
    if projected_as_gemm(total, site):
        return Refuse(
            "the bias goes into the projection's Gemm (matmul-add-gemm-projection): MatMul + BiasGelu measured "
            "1.09x Gemm + Gelu at 3136 x 32 x 128 (Swin's first stage), 1.04x at 784 x 64 x 256, 1.01-1.02x at "
            "64-197 rows (1 thread, ORT_ENABLE_ALL)"
        )
    if quantized_with_bias(total, site):
        return Refuse(
            "the bias goes into the dynamic int8 MatMul (ort-dynamic-quantize-matmul-bias): BiasGelu measured "
            "1.5x the Gelu alone on bert_dynamo_dyn8 (0.126 against 0.082 ms per run, 1 thread), the model 1.07x"
        )
    return _BiasGelu(contrib)


# SiLU as both exporters write it, x * Sigmoid(x), and its scaled form x * Sigmoid(alpha * x).
_SWISH = op.Mul(_x, op.Sigmoid(either(op.Mul(_x, const(name="alpha")), _x), name="sigmoid"))


def _plan_swish(m: Match, site: Site) -> float | Refuse:
    if not is_float(m.value("x")):
        return Refuse(NOT_FLOAT)
    return _swish_alpha(m)


def _plan_quick_gelu(m: Match, site: Site) -> float | Refuse:
    unsupported = cpu_float(site, m.value("x"), "QuickGelu")
    return Refuse(unsupported) if unsupported else _swish_alpha(m)


# Softsign as written out: x / (1 + |x|), the Add's operands in either order (Add commutes).
_SOFTSIGN = op.Div(_x, op.Add(op.Abs(_x), const(1.0)))


def _plan_softsign(m: Match, site: Site) -> Refuse | None:
    unsupported = cpu_float(site, m.value("x"), "Softsign")
    return Refuse(unsupported) if unsupported else None


def _swish_alpha(m: Match) -> float | Refuse:
    if "alpha" not in m:
        return 1.0
    alpha = scalar_factor(m.value("alpha"), divides=False)
    return Refuse("alpha is not a scalar constant") if alpha is None else alpha


def _gelu_rules(
    name: str, ort_name: str, pattern: Pattern, label: str, form: str, attrs: dict[str, str], ort_op: str
) -> tuple[Rule[Any], Rule[Any]]:
    """A decomposed GELU (``form``) as the standard Gelu with ``attrs`` from opset 20 and, below
    it with ``--target ort``, as onnxruntime's ``ort_op``."""
    shared = partial(_rule, pattern=pattern, plan=float_x, label=label)
    return (
        shared(
            name=name,
            build=lambda b, m, plan: b.op("Gelu", m.value("x"), **attrs),
            min_opset=20,
            doc=f"decomposed {form} -> Gelu (opset 20)",
        ),
        shared(
            name=ort_name,
            build=lambda b, m, plan: b.op(ort_op, m.value("x"), domain=MS),
            max_opset=19,
            targets=frozenset({"ort"}),
            doc=f"decomposed GELU -> com.microsoft {ort_op} below opset 20 (target ort)",
        ),
    )


RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="swish",
        pattern=_SWISH,
        plan=_plan_swish,
        build=lambda b, m, alpha: b.op("Swish", m.value("x"), alpha=alpha),
        min_opset=24,
        max_opset=24,  # onnxruntime 1.32 registers its Swish kernel for opset 24 only
        label="Swish",
        doc="x * Sigmoid(alpha * x) (SiLU: alpha 1) -> Swish (opset 24)",
    ),
    _rule(
        name="ort-quickgelu",
        pattern=_SWISH,
        plan=_plan_quick_gelu,
        build=lambda b, m, alpha: b.op("QuickGelu", m.value("x"), alpha=alpha, domain=MS),
        max_opset=23,  # from opset 24 the standard Swish
        targets=frozenset({"ort"}),
        label="Swish",
        doc="x * Sigmoid(alpha * x) (SiLU: alpha 1; CLIP's quick GELU: 1.702) -> com.microsoft QuickGelu (target ort)",
    ),
    *_gelu_rules("gelu-none", "ort-gelu", _ERF_GELU, "GELU", "erf GELU", {}, "Gelu"),
    *_gelu_rules(
        "gelu-tanh", "ort-fastgelu", _TANH_GELU, "tanh GELU", "tanh GELU", {"approximate": "tanh"}, "FastGelu"
    ),
    _rule(
        name="hardsigmoid",
        pattern=_divided_by_six(_RELU6),
        plan=_check_relu6,
        build=lambda b, m, plan: b.op("HardSigmoid", m.value("x"), alpha=1 / 6, beta=0.5),
        label="HardSigmoid",
        doc="Clip(x + 3, 0, 6) / 6 -> HardSigmoid(x, alpha=1/6, beta=0.5)",
    ),
    _rule(
        name="hardswish",
        pattern=either(_SPELLED_HARDSWISH, op.Mul(_x, op.HardSigmoid(_x, where=_is_sixth_hardsigmoid))),
        plan=lambda m, site: _check_relu6(m, site) if "clip" in m else float_x(m, site),
        build=lambda b, m, plan: b.op("HardSwish", m.value("x")),
        min_opset=14,
        label="HardSwish",
        doc="x * Clip(x + 3, 0, 6) / 6 or x * HardSigmoid(x, 1/6, 1/2) -> HardSwish(x) (opset 14)",
    ),
    _rule(
        name="hardswish-as-hardsigmoid",
        pattern=_SPELLED_HARDSWISH,
        plan=_check_relu6,
        build=lambda b, m, plan: b.op("Mul", m.value("x"), b.op("HardSigmoid", m.value("x"), alpha=1 / 6, beta=0.5)),
        max_opset=13,
        label="HardSwish",
        doc="x * Clip(x + 3, 0, 6) / 6 -> x * HardSigmoid(x, 1/6, 1/2) below opset 14 (no HardSwish there)",
    ),
    _rule(
        name="softsign",
        pattern=_SOFTSIGN,
        plan=_plan_softsign,
        build=lambda b, m, plan: b.op("Softsign", m.value("x")),
        label="Softsign",
        doc="x / (1 + |x|) -> Softsign(x) (float32 or float16)",
    ),
    _rule(
        name="ort-biasgelu",
        pattern=op.any_of(
            ("Gelu", "FastGelu"),
            op.Add(var("x"), const(name="bias", rank=1), name="sum"),
            name="gelu",
            domain=ANY_DOMAIN,
        ),
        plan=_plan_bias_gelu,
        build=lambda b, m, plan: b.op(plan.op_type, m.value("x"), m.value("bias"), domain=MS),
        targets=frozenset({"ort"}),
        label="bias GELU",
        doc="Gelu(x + bias) -> com.microsoft BiasGelu (FastGelu for the tanh form) (target ort)",
    ),
    in_float32(
        "gelu-float32",
        FAMILY,
        "Gelu",
        1,
        min_opset=20,
        label="float16 GELU",
        doc="Gelu on float16 -> Cast to float32, Gelu, Cast to float16: onnxruntime's CPU provider has no float16 "
        "Gelu kernel and runs the op's function body instead (1.9x the float32 kernel's time, 3.3x for the tanh form)",
    ),
    *(
        in_float32(
            f"{op_type.lower()}-float32",
            FAMILY,
            op_type,
            1,
            min_opset=13,
            label=f"float16 {op_type}",
            doc=f"{op_type} on float16 -> Cast to float32, {op_type}, Cast to float16: from opset 13 onnxruntime's CPU "
            f"provider has no float16 {op_type} kernel and runs the op's function body instead ({slower} the float32 "
            "kernel's time)",
        )
        for op_type, slower in (("Softmax", "2.7x to 3.3x"), ("LogSoftmax", "2.4x to 2.8x"))
    ),
    *(
        ort_in_float32(
            f"ort-{op_type.lower()}-float32",
            FAMILY,
            op_type,
            inputs,
            doc=f"com.microsoft {op_type} on float16 -> Cast to float32, {op_type}, Cast to float16: onnxruntime's "
            f"CPU provider runs the float16 op decomposed ({slower} the float32 kernel's time) (target ort)",
        )
        for op_type, inputs, slower in (("Gelu", 1, "2.3x"), ("FastGelu", 2, "3.2x"))
    ),
)
