"""MatMul / Gemm family: bias Adds and Transposes folded into Gemm.

``MatMul(a, W) + b -> Gemm(a, W, b)`` when ``a`` and ``W`` are 2-D (Gemm is 2-D only) and
``b`` broadcasts to the product's shape one way. ``Gemm(Transpose(a), B)`` flips
``transA`` and ``Gemm(A, Transpose(w))`` flips ``transB`` (a 2-D Transpose is always the
swap). ``Gemm(...) * s`` and ``Gemm(...) / s`` for a scalar constant ``s`` scale ``alpha``
and ``beta``.

``--target ort`` (com.microsoft ops onnxruntime's CPU provider runs):

- ``Act(Gemm(a, b, c))`` -> ``FusedGemm`` with the activation applied in the kernel.
- ``MatMul(a, b) * s`` (or ``/ s``) for a scalar constant ``s`` -> ``FusedMatMul(a, b, alpha=s)``;
  a Transpose swapping the last two dims of either input goes into ``transA`` / ``transB``.
"""

from __future__ import annotations

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import ANY_DOMAIN, Pattern, const, op, optional, var
from graphopt.passes.fuse.rules._helpers import MS, activation_params, attrs_of, is_float, scalar_factor
from graphopt.passes.fuse.rules.conv import activated, check_activation

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


def _transposed_input(which: str) -> tuple[str, tuple[Pattern, Pattern]]:
    """For a Transpose on input A (``which`` "a") or B: the flag it flips, the input patterns."""
    t = op.Transpose(var("inner"), name="t")
    return ("transA", (t, var("other"))) if which == "a" else ("transB", (var("other"), t))


def _untransposed(m: Match, which: str) -> list[Value]:
    """The product's two inputs with the Transpose taken off."""
    inner, other = m.value("inner"), m.value("other")
    return [inner, other] if which == "a" else [other, inner]


def _transposed_gemm(which: str) -> Rule:
    flag, inputs = _transposed_input(which)

    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        gemm = m.node("gemm")
        args = _untransposed(m, which)
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
    return scalar_factor(m.value("s"), divides=m.root.op_type == "Div")


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


def _rewrite_fused_gemm(b: Builder, m: Match, site: Site) -> Value:
    act = m.node("act")
    params = activation_params(act) or []
    names = ("activation_alpha", "activation_beta")
    extra = dict(zip(names, params, strict=False))
    return b.op(
        "FusedGemm", *m.node("gemm").inputs, domain=MS, activation=act.op_type, **attrs_of(m.node("gemm")), **extra
    )


add_rule(
    Rule(
        "ort-fusedgemm",
        FAMILY,
        activated(op.Gemm(var("a"), var("b"), optional(var("c")), name="gemm")),
        _rewrite_fused_gemm,
        lambda m, site: "Clip is not a FusedGemm activation" if m.root.op_type == "Clip" else check_activation(m, site),
        targets=frozenset({"ort"}),
        default=False,
        label="Gemm+activation",
        doc="Act(Gemm(a, b, c)) -> com.microsoft FusedGemm (target ort)",
    )
)

_MATMULS = ("MatMul", "FusedMatMul")


def _fused_matmul_attrs(node: Node) -> dict[str, object]:
    if node.op_type == "MatMul":
        return {}
    return attrs_of(node)


def _rewrite_scaled_matmul(b: Builder, m: Match, site: Site) -> Value:
    mm, scale = m.node("mm"), _scale(m)
    assert scale is not None
    attrs = _fused_matmul_attrs(mm)
    attrs["alpha"] = float(attrs.get("alpha", 1.0)) * scale  # type: ignore[arg-type]
    return b.op("FusedMatMul", *mm.inputs, domain=MS, **attrs)


def _matmul_ranks(m: Match, site: Site) -> str | None:
    mm = m.node("mm")
    if mm.op_type == "FusedMatMul" and mm.domain != MS:
        return "not onnxruntime's FusedMatMul"
    if site.dtype(mm.outputs[0]) != DataType.FLOAT:
        return "FusedMatMul is float32 only here"
    if any((site.rank(v) or 0) < 2 for v in mm.inputs):
        return "an input's rank is unknown or below 2"
    return None


for _root in ("Mul", "Div"):
    add_rule(
        Rule(
            f"ort-fusedmatmul-{_root.lower()}",
            FAMILY,
            getattr(op, _root)(op.any_of(_MATMULS, var("a"), var("b"), name="mm", domain=ANY_DOMAIN), const(name="s")),
            _rewrite_scaled_matmul,
            lambda m, site: _matmul_ranks(m, site) or (None if _scale(m) is not None else "not a scalar"),
            targets=frozenset({"ort"}),
            label=f"MatMul+{_root}",
            doc=f"{_root}(MatMul(a, b), s) -> com.microsoft FusedMatMul(a, b, alpha) (target ort)",
        )
    )


def _swaps_last_two(node: Node, site: Site) -> bool:
    rank = site.rank(node.inputs[0])
    perm = node.attr("perm")
    if rank is None or rank < 2 or perm is None:
        return rank == 2
    return list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def _transposed_matmul(which: str) -> Rule:
    flag, inputs = _transposed_input(which)

    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        attrs = _fused_matmul_attrs(m.node("mm"))
        attrs[flag] = 1 - int(attrs.get(flag, 0))  # type: ignore[call-overload]
        args = _untransposed(m, which)
        return b.op("FusedMatMul", *args, domain=MS, **attrs)

    def check(m: Match, site: Site) -> str | None:
        if not _swaps_last_two(m.node("t"), site):
            return "the Transpose does not swap the last two dims"
        if m.node("mm").attr("transBatchA", 0) or m.node("mm").attr("transBatchB", 0):
            return "a batch-transposed FusedMatMul"
        return _matmul_ranks(m, site)

    return Rule(
        f"ort-transpose-into-matmul-{which}",
        FAMILY,
        op.any_of(_MATMULS, *inputs, name="mm", domain=ANY_DOMAIN, commute=False),
        rewrite,
        check,
        targets=frozenset({"ort"}),
        label="Transpose+MatMul",
        doc=f"MatMul with input {which.upper()} Transposed in its last two dims -> FusedMatMul {flag} (target ort)",
    )


add_rule(_transposed_matmul("a"))
add_rule(_transposed_matmul("b"))
