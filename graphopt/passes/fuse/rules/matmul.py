"""MatMul / Gemm family: bias Adds and Transposes folded into Gemm.

``MatMul(a, W) + b -> Gemm(a, W, b)`` when ``a`` and ``W`` are 2-D (Gemm is 2-D only) and
``b`` broadcasts to the product's shape one way. ``Gemm(Transpose(a), B)`` flips
``transA`` and ``Gemm(A, Transpose(w))`` flips ``transB`` (a 2-D Transpose is always the
swap). ``Gemm(...) * s`` and ``Gemm(...) / s`` for a scalar constant ``s`` scale ``alpha``
and ``beta``.
"""

from __future__ import annotations

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import const, op, optional, var
from graphopt.passes.fuse.rules._helpers import attrs_of, float_array, is_float

FAMILY = "matmul"


def _check_matmul_add(m: Match, site: Site) -> str | None:
    a, w, bias = m.value("a"), m.value("w"), m.value("bias")
    if site.rank(a) != 2 or site.rank(w) != 2:
        return "the MatMul is not 2-D (Gemm takes matrices only)"
    if not (is_float(a) and is_float(bias)):
        return "not a float MatMul"
    out = site.shape(m.node("matmul").outputs[0])
    shape = site.shape(bias)
    if out is None or shape is None or len(shape) > 2:
        return "the bias shape is not provable"
    padded = (1,) * (2 - len(shape)) + tuple(shape)
    if not all(d == 1 or d == o for d, o in zip(padded, out, strict=True)):
        return "the bias does not broadcast to the product one way"
    return None


add_rule(
    Rule(
        "matmul-add-gemm",
        FAMILY,
        op.Add(op.MatMul(var("a"), var("w"), name="matmul"), var("bias")),
        lambda b, m, site: b.op("Gemm", m.value("a"), m.value("w"), m.value("bias")),
        _check_matmul_add,
        label="MatMul+Add",
        doc="Add(MatMul(a, W), b) -> Gemm(a, W, b) for 2-D a and W",
    )
)


def _transposed_gemm(which: str) -> Rule:
    flag = "transA" if which == "a" else "transB"
    t = op.Transpose(var("inner"), name="t")
    inputs = (t, var("other")) if which == "a" else (var("other"), t)

    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        gemm = m.node("gemm")
        args = [m.value("inner"), m.value("other")] if which == "a" else [m.value("other"), m.value("inner")]
        return b.op("Gemm", *args, m.optional("c"), **attrs_of(gemm, **{flag: 1 - int(gemm.attr(flag, 0))}))

    def check(m: Match, site: Site) -> str | None:
        perm = m.node("t").attr("perm")
        return None if site.rank(m.value("inner")) == 2 and perm in (None, [1, 0]) else "not a 2-D swap"

    return Rule(
        f"transpose-into-gemm-{which}",
        FAMILY,
        op.Gemm(*inputs, optional(var("c")), name="gemm"),
        rewrite,
        check,
        label="Transpose+Gemm",
        doc=f"Gemm with a Transposed input {which.upper()} -> Gemm with {flag} flipped",
    )


add_rule(_transposed_gemm("a"))
add_rule(_transposed_gemm("b"))


def _scale(m: Match) -> float | None:
    s = float_array(m.value("s"))
    if s is None or s.size != 1:
        return None
    value = float(s.ravel()[0])
    return value if m.root.op_type == "Mul" else (1.0 / value if value else None)


def _rewrite_scaled_gemm(b: Builder, m: Match, site: Site) -> Value:
    gemm, scale = m.node("gemm"), _scale(m)
    assert scale is not None
    alpha = float(gemm.attr("alpha", 1.0)) * scale
    beta = float(gemm.attr("beta", 1.0)) * scale
    return b.op("Gemm", *gemm.inputs, **attrs_of(gemm, alpha=alpha, beta=beta))


for _root in ("Mul", "Div"):
    add_rule(
        Rule(
            f"gemm-{_root.lower()}-scalar",
            FAMILY,
            getattr(op, _root)(op.Gemm(var("a"), var("b"), optional(var("c")), name="gemm"), const(name="s")),
            _rewrite_scaled_gemm,
            lambda m, site: None if _scale(m) is not None and is_float(m.root.outputs[0]) else "not a scalar",
            label=f"Gemm+{_root}",
            doc=f"{_root}(Gemm(a, b, c), s) -> Gemm(a, b, c) with alpha and beta scaled",
        )
    )
