"""MatMul / Gemm family: bias Adds and Transposes folded into Gemm.

``MatMul(a, W) + b -> Gemm(a, W, b)`` when ``a`` and ``W`` are 2-D (Gemm is 2-D only) and
``b`` broadcasts to the product's shape one way. ``Gemm(Transpose(a), B)`` flips
``transA`` and ``Gemm(A, Transpose(w))`` flips ``transB`` (a 2-D Transpose is always the
swap). ``Gemm(...) * s`` and ``Gemm(...) / s`` for a scalar constant ``s`` scale ``alpha``
and ``beta``.

``matmul-add-gemm-projection`` (a late rule: the default pipeline runs it in its last simplify,
after every other rule, so the attention, norm and bias fusions that read ``MatMul + Add`` take
theirs first): ``MatMul(x, W) + b`` for a float32 ``x`` of rank 3 or more, a constant 2-D ``W``
and a constant bias over the last axis -> ``Reshape(Gemm(Reshape(x, [-1, K]), W, b), [..., N])``.
Without onnxruntime's fusions one Gemm with its bias runs faster than MatMul + Add on 3-D
activations (onnxsim writes the projections so), and at ORT_ENABLE_ALL it measured no slower.
The target of the Reshape back is a constant, so every dim of the product but one must be
static (the other is -1). A target computed as Concat(Shape(x, end=-1), [N]) for a dynamic
batch and sequence measured no faster beyond noise (bert exports, bert_small, gpt2_small; ORT_ENABLE_ALL:
0.96 to 1.02 of the MatMul + Add output) and cost 13 to 15 nodes per model. Both projection rules leave a MatMul
whose x onnxruntime folds into a FusedMatMul at load: a Transpose of the last two dims (MLP-Mixer's token mixing)
or a scalar Mul or Div (the closing half of a tanh GELU before SigLIP's fc2; an erf GELU's half goes into
onnxruntime's Gelu instead); the Reshape to rows would stand between them, and the runtime guard undid the whole
rule there after 5 reruns (mixer_ts's run 2.65 -> 0.67 s; its output 1.034 -> 0.996 of the export's time).
``matmul-add-gemm-projection-reshaped`` (late too) needs no Reshape back where the projection's one
reader is a Reshape whose target copies no dim of it (``allowzero``, or a constant with no 0), as
the head split after a Q, K or V projection is: that Reshape reads the 2-D Gemm output as well,
with batch and sequence both dynamic, and the projections of one ``x`` share its Reshape to rows
(onnxsim writes them so; qwen2_kv_dynamo: 8 nodes fewer, no slower at either optimization level).

``matmul-scales-joined`` (late, so that the attention fusions take the scales first where the target has
an attention op): ``MatMul(x * s, y * t)`` for float16 or bfloat16 ``x`` and ``y`` and scalar constants ``s``
and ``t`` -> ``MatMul(x * (s*t), y)``. Both PyTorch exporters write scaled dot-product attention with
sqrt(scale) on Q and on K^T; below opset 23 that stays a MatMul of two scaled operands, and the Mul of K^T
runs over the whole key cache at every decode step. onnxruntime fuses both scales into FusedMatMul at
load in a float32 model, not in a float16 one, where the Casts its CPU provider inserts stand between
the scales and the MatMul (llama_kv_ts_fp16 at its largest binding: 0.864 of the variant's time with
both Muls, 0.832 with the joined scale on Q). On float32 activations (a float32 model, or a dynamically
quantized or int4 one) the rule measured slower where onnxruntime fused the scales either way
(vit_ts_dyn8: 0.967 -> 0.991 of the variant's time), so it leaves them.

``--target ort`` (com.microsoft ops onnxruntime's CPU provider runs):

- ``Act(Gemm(a, b, c))`` -> ``FusedGemm`` with the activation applied in the kernel.
- ``MatMul(a, b) * s`` (or ``/ s``) for a scalar constant ``s`` -> ``FusedMatMul(a, b, alpha=s)``;
  a Transpose swapping the last two dims of either input goes into ``transA`` / ``transB``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import HALF_FLOAT_TYPES
from graphopt.passes.fuse.rules._helpers import (
    attrs_of,
    is_float,
    named_after,
    new_const,
    scalar_factor,
    shared_reader,
)
from graphopt.passes.fuse.rules._ort import MS, activated, activation_params, check_activation
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import ANY_DOMAIN, Pattern, const, either, op, optional, var
from graphopt.passes.rewrite.proofs import PROJECTION, projection_bias, projection_target, swaps_last_two

FAMILY = "matmul"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY)
# The node name of a projection's Reshape of x to rows, which the projections of one x share.
_ROWS = "projection_rows"


def _check_matmul_add(m: Match, site: Site) -> Refuse | None:
    a, w, bias = m.value("a"), m.value("w"), m.value("bias")
    if site.rank(a) != 2 or site.rank(w) != 2:
        return Refuse("the MatMul is not 2-D (Gemm takes matrices only)")
    if not (is_float(a) and is_float(bias)):
        return Refuse("not a float MatMul")
    out = site.shape(m.node("matmul").outputs[0])
    shape = site.shape(bias)
    if out is None or shape is None or len(shape) > 2:
        return Refuse("the bias shape is not provable")
    padded = (1,) * (2 - len(shape)) + tuple(shape)
    if not all(d == 1 or d == o for d, o in zip(padded, out, strict=True)):
        return Refuse("the bias does not broadcast to the product one way")
    return None


def _plan_projection(m: Match, site: Site) -> tuple[list[int], np.ndarray | None] | Refuse:
    return projection_target(m.value("x"), m.node("matmul").outputs[0], m.value("bias"), site)


def _plan_reshaped_projection(m: Match, site: Site) -> np.ndarray | Refuse | None:
    """The bias vector, when the Reshape reading the projection gives the same result from the
    Gemm's 2-D rows: its target keeps no dim of its input (a 0 copies one unless allowzero)."""
    found = projection_bias(m.value("x"), m.node("matmul").outputs[0], m.value("bias"), site)
    if isinstance(found, Refuse):
        return found
    if m.node("reshape").attr("allowzero") != 1:
        target = Site.array(m.value("target"))
        if target is None or not target.all():
            return Refuse("the Reshape's target may copy a dim of the product (a 0 without allowzero)")
    return found[1]


def _rows(b: Builder, m: Match) -> Value:
    """``x`` as the 2-D rows of its product: ``Reshape(x, [-1, K])``."""
    depth = int((Site.shape(m.value("w")) or (-1,))[0])
    return b.op("Reshape", m.value("x"), b.constant(np.array([-1, depth], np.int64), "rows_shape"), name=_ROWS)


def _projection_gemm(b: Builder, m: Match, rows: Value, vector: np.ndarray | None) -> Value:
    bias = m.value("bias") if vector is None else b.constant(vector, "bias")
    return b.op("Gemm", rows, m.value("w"), bias)


def _build_projection(b: Builder, m: Match, plan: tuple[list[int], np.ndarray | None]) -> Value:
    target, vector = plan
    gemm = _projection_gemm(b, m, _rows(b, m), vector)
    return b.op("Reshape", gemm, b.constant(np.array(target, np.int64), "projection_shape"))


def _build_reshaped_projection(b: Builder, m: Match, plan: np.ndarray | None) -> Value:
    # Q, K and V project the same x: one Reshape to rows serves them all.
    rows = shared_reader(m.value("x"), _ROWS, lambda: _rows(b, m))
    return b.op("Reshape", _projection_gemm(b, m, rows, plan), m.value("target"), **attrs_of(m.node("reshape")))


def _transposed(which: str) -> tuple[Pattern, Pattern]:
    """Input A (``which`` "a") or B of a product is a Transpose ("t" of "inner"); the other is "other"."""
    t = op.Transpose(var("inner"), name="t")
    return (t, var("other")) if which == "a" else (var("other"), t)


def _untransposed(m: Match, which: str) -> list[Value]:
    """The product's two inputs with the Transpose taken off."""
    inner, other = m.value("inner"), m.value("other")
    return [inner, other] if which == "a" else [other, inner]


def _flag(which: str) -> str:
    """The product's attribute that transposes input ``which``."""
    return "transA" if which == "a" else "transB"


def _check_2d_swap(m: Match, site: Site) -> Refuse | None:
    perm = m.node("t").attr("perm")
    return None if site.rank(m.value("inner")) == 2 and perm in (None, [1, 0]) else Refuse("not a 2-D swap")


def _build_transposed_gemm(which: str, b: Builder, m: Match, plan: None) -> Value:
    gemm, flag = m.node("gemm"), _flag(which)
    args = _untransposed(m, which)
    return b.op("Gemm", *args, m.optional("c"), **attrs_of(gemm, **{flag: 1 - Site.int_attr(gemm, flag, 0)}))


def _scale(m: Match, site: Site) -> float | Refuse:
    """The factor the scalar constant ``s`` applies, or why not."""
    found = scalar_factor(m.value("s"), divides=m.root.op_type == "Div")
    return Refuse("not a scalar") if found is None else found


def _plan_scaled_gemm(m: Match, site: Site) -> float | Refuse:
    return _scale(m, site) if is_float(m.root.outputs[0]) else Refuse("not a scalar")


def _build_scaled_gemm(b: Builder, m: Match, scale: float) -> Value:
    gemm = m.node("gemm")
    alpha = Site.float_attr(gemm, "alpha", 1.0) * scale
    beta = Site.float_attr(gemm, "beta", 1.0) * scale
    return b.op("Gemm", *gemm.inputs, **attrs_of(gemm, alpha=alpha, beta=beta))


def _check_fused_gemm(m: Match, site: Site) -> Refuse | None:
    reason = "Clip is not a FusedGemm activation" if m.root.op_type == "Clip" else check_activation(m, site)
    return None if reason is None else Refuse(reason)


def _build_fused_gemm(b: Builder, m: Match, plan: None) -> Value:
    act = m.node("act")
    params = activation_params(act) or []
    names = ("activation_alpha", "activation_beta")
    extra = dict(zip(names, params, strict=False))
    return b.op(
        "FusedGemm", *m.node("gemm").inputs, domain=MS, activation=act.op_type, **attrs_of(m.node("gemm")), **extra
    )


_MATMULS = ("MatMul", "FusedMatMul")


def _fused_matmul_attrs(node: Node) -> dict[str, object]:
    if node.op_type == "MatMul":
        return {}
    return attrs_of(node)


def _build_scaled_matmul(b: Builder, m: Match, scale: float) -> Value:
    mm = m.node("mm")
    attrs = _fused_matmul_attrs(mm)
    attrs["alpha"] = float(attrs.get("alpha", 1.0)) * scale  # type: ignore[arg-type]
    return b.op("FusedMatMul", *mm.inputs, domain=MS, **attrs)


def _matmul_ranks(m: Match, site: Site) -> Refuse | None:
    mm = m.node("mm")
    if mm.op_type == "FusedMatMul" and mm.domain != MS:
        return Refuse("not onnxruntime's FusedMatMul")
    if site.dtype(mm.outputs[0]) != DataType.FLOAT:
        return Refuse("FusedMatMul is float32 only here")
    if any((site.rank(v) or 0) < 2 for v in mm.inputs):
        return Refuse("an input's rank is unknown or below 2")
    return None


def _swaps_last_two(node: Node, site: Site) -> bool:
    rank = site.rank(node.inputs[0])
    perm = node.attr("perm")
    if rank is None or rank < 2 or perm is None:
        return rank == 2
    return len(perm) == rank and swaps_last_two(perm)


def _build_transposed_matmul(which: str, b: Builder, m: Match, plan: None) -> Value:
    flag = _flag(which)
    attrs = _fused_matmul_attrs(m.node("mm"))
    attrs[flag] = 1 - int(attrs.get(flag, 0))  # type: ignore[call-overload]
    args = _untransposed(m, which)
    return b.op("FusedMatMul", *args, domain=MS, **attrs)


def _check_transposed_matmul(m: Match, site: Site) -> Refuse | None:
    if not _swaps_last_two(m.node("t"), site):
        return Refuse("the Transpose does not swap the last two dims")
    if m.node("mm").attr("transBatchA", 0) or m.node("mm").attr("transBatchB", 0):
        return Refuse("a batch-transposed FusedMatMul")
    return _matmul_ranks(m, site)


def _scaled_matmul(root: str) -> Pattern:
    """``root(MatMul or FusedMatMul(a, b), s)``."""
    return op.any_of((root,), op.any_of(_MATMULS, var("a"), var("b"), name="mm", domain=ANY_DOMAIN), const(name="s"))


def _plan_scaled_matmul(m: Match, site: Site) -> float | Refuse:
    return _matmul_ranks(m, site) or _scale(m, site)


def _scaled_operand(operand: str, scale: str) -> Pattern:
    """``operand * scale``, or that Transposed (a scalar commutes with the Transpose: the exporters scale K^T, and
    the unwind pass may move K's Transpose past its scale)."""
    scaled = op.Mul(var(operand), const(name=scale), name=f"{operand}_scaled", commute=True)
    return either(scaled, op.Transpose(scaled, name=f"{operand}_transposed"))


# MatMul(x * s, y * t): each operand scaled by a constant, maybe then Transposed.
_SCALED_OPERANDS = op.MatMul(_scaled_operand("x", "s"), _scaled_operand("y", "t"))


def _could_widen(site: Site, scale: Value, operand: Value) -> bool:
    """Whether multiplying ``operand`` by ``scale`` may give more dims than ``operand`` has (a 0-d scale widens
    nothing)."""
    scale_rank, rank = site.rank(scale) or 0, site.rank(operand)
    return bool(scale_rank) and (rank is None or scale_rank > rank)


def _plan_joined_scales(m: Match, site: Site) -> float | Refuse:
    """The product of the two scales, or why they do not join."""
    x, y = m.value("x"), m.value("y")
    dtype = site.dtype(x)
    if dtype not in HALF_FLOAT_TYPES or site.dtype(y) != dtype:
        return Refuse("not a float16 or bfloat16 MatMul (onnxruntime fuses a float32 one's scales into FusedMatMul)")
    factors = [scalar_factor(m.value(scale), divides=False) for scale in ("s", "t")]
    if factors[0] is None or factors[1] is None:
        return Refuse("a scale is not a scalar constant")
    for operand, scale in ((x, "s"), (y, "t")):
        if _could_widen(site, m.value(scale), operand):
            return Refuse("a scale could widen its operand's rank")
    # The two scales each fit the type; their product, stored in it, may not (two 300s, two 1e-4s in float16).
    with np.errstate(over="ignore"):  # an overflow is refused below, not warned of
        joined = float(np.asarray(factors[0] * factors[1]).astype(dtype.numpy()))
    if not np.isfinite(joined) or joined == 0:
        return Refuse("the joined scale overflows or underflows the type")
    return joined


def _build_joined_scales(b: Builder, m: Match, factor: float) -> Value:
    x = m.value("x")
    joined = new_const(b, np.array(factor), x, named_after(m.value("s"), "joined"))
    operands = [b.op("Mul", x, joined), m.value("y")]
    for index, transposed in enumerate(("x_transposed", "y_transposed")):
        if transposed in m:
            operands[index] = b.op("Transpose", operands[index], **attrs_of(m.node(transposed)))
    return b.op("MatMul", *operands)


# A product with input A or B a Transpose ("t") of "inner" scaled by a constant "s" (Mul or Div: "scale").
_SCALED = either(
    op.Mul(var("inner"), const(name="s"), name="scale", commute=True),
    op.Div(var("inner"), const(name="s"), name="scale"),
)
_SCALE_UNDER_TRANSPOSE = either(
    op.MatMul(op.Transpose(_SCALED, name="t"), var("other"), name="mm"),
    op.MatMul(var("other"), op.Transpose(_SCALED, name="t"), name="mm"),
)


def _plan_scale_under_transpose(m: Match, site: Site) -> Refuse | None:
    if scalar_factor(m.value("s"), divides=m.node("scale").op_type == "Div") is None:
        return Refuse("the scale is not a scalar constant")
    if _could_widen(site, m.value("s"), m.value("inner")):
        return Refuse("the scale could widen its operand's rank")
    return None


def _build_scale_under_transpose(b: Builder, m: Match, plan: None) -> Value:
    transposed = b.op("Transpose", m.value("inner"), **attrs_of(m.node("t")))
    scaled = b.op(m.node("scale").op_type, transposed, m.value("s"))
    first = m.node("mm").inputs[0] is m.node("t").outputs[0]
    return b.op("MatMul", *((scaled, m.value("other")) if first else (m.value("other"), scaled)))


_GEMM = op.Gemm(var("a"), var("b"), optional(var("c")), name="gemm")

# Which input a Transpose folds into; which scalar op scales a product.
_SIDES = ("a", "b")
_SCALES = ("Mul", "Div")
_ORT_RULE = partial(_rule, targets=frozenset({"ort"}))

RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="matmul-add-gemm",
        pattern=op.Add(op.MatMul(var("a"), var("w"), name="matmul"), var("bias")),
        plan=_check_matmul_add,
        build=lambda b, m, plan: b.op("Gemm", m.value("a"), m.value("w"), m.value("bias")),
        label="MatMul+Add",
        doc="Add(MatMul(a, W), b) -> Gemm(a, W, b) for 2-D a and W",
    ),
    _rule(
        name="matmul-add-gemm-projection",
        pattern=PROJECTION,
        plan=_plan_projection,
        build=_build_projection,
        kind="late",
        label="MatMul+Add projection",
        doc="Add(MatMul(x, W), b) for x of rank >= 3 -> Reshape(Gemm(Reshape(x, [-1, K]), W, b), back) "
        "(late; static dims but one)",
    ),
    _rule(
        name="matmul-add-gemm-projection-reshaped",
        pattern=op.Reshape(PROJECTION, var("target"), name="reshape"),
        plan=_plan_reshaped_projection,
        build=_build_reshaped_projection,
        kind="late",
        label="MatMul+Add projection",
        doc="Reshape(Add(MatMul(x, W), b), t) for x of rank >= 3 and a t that copies no dim "
        "-> Reshape(Gemm(Reshape(x, [-1, K]), W, b), t) (late; no Reshape back)",
    ),
    _rule(
        name="matmul-scales-joined",
        pattern=_SCALED_OPERANDS,
        plan=_plan_joined_scales,
        build=_build_joined_scales,
        kind="late",
        label="MatMul of scaled operands",
        doc="MatMul(x * s, y * t) -> MatMul(x * (s*t), y) for float16 or bfloat16 x and y and scalar constants s "
        "and t, either product maybe Transposed (late; attention's sqrt(scale) on Q and K^T below opset 23)",
    ),
    _rule(
        name="matmul-scale-over-transpose",
        pattern=_SCALE_UNDER_TRANSPOSE,
        plan=_plan_scale_under_transpose,
        build=_build_scale_under_transpose,
        kind="late",
        label="scale under a Transpose into MatMul",
        doc="MatMul(Transpose(x * s), y) -> MatMul(Transpose(x) * s, y), either input, a Mul or Div by a scalar "
        "constant (late; onnxruntime fuses a scale next to a MatMul into FusedMatMul, after the unwind pass sank "
        "the Transposes of attention's Q and K^T below their sqrt(scale))",
    ),
    *(
        _rule(
            name=f"transpose-into-gemm-{side}",
            pattern=op.Gemm(*_transposed(side), optional(var("c")), name="gemm"),
            plan=_check_2d_swap,
            build=partial(_build_transposed_gemm, side),
            label="Transpose+Gemm",
            doc=f"Gemm with a Transposed input {side.upper()} -> Gemm with trans{side.upper()} flipped",
        )
        for side in _SIDES
    ),
    *(
        _rule(
            name=f"gemm-{scale.lower()}-scalar",
            pattern=getattr(op, scale)(_GEMM, const(name="s")),
            plan=_plan_scaled_gemm,
            build=_build_scaled_gemm,
            label=f"Gemm+{scale}",
            doc=f"{scale}(Gemm(a, b, c), s) -> Gemm(a, b, c) with alpha and beta scaled",
        )
        for scale in _SCALES
    ),
    _ORT_RULE(
        name="ort-fusedgemm",
        pattern=activated(_GEMM),
        plan=_check_fused_gemm,
        build=_build_fused_gemm,
        default=False,
        label="Gemm+activation",
        doc="Act(Gemm(a, b, c)) -> com.microsoft FusedGemm (target ort)",
    ),
    *(
        _ORT_RULE(
            name=f"ort-fusedmatmul-{scale.lower()}",
            pattern=_scaled_matmul(scale),
            plan=_plan_scaled_matmul,
            build=_build_scaled_matmul,
            label=f"MatMul+{scale}",
            doc=f"{scale}(MatMul(a, b), s) -> com.microsoft FusedMatMul(a, b, alpha) (target ort)",
        )
        for scale in _SCALES
    ),
    *(
        _ORT_RULE(
            name=f"ort-transpose-into-matmul-{side}",
            pattern=op.any_of(_MATMULS, *_transposed(side), name="mm", domain=ANY_DOMAIN, commute=False),
            plan=_check_transposed_matmul,
            build=partial(_build_transposed_matmul, side),
            label="Transpose+MatMul",
            doc=f"MatMul with input {side.upper()} Transposed in its last two dims -> FusedMatMul trans{side.upper()} "
            "(target ort)",
        )
        for side in _SIDES
    ),
)
