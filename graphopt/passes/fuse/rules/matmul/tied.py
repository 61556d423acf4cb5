"""A tied weight read transposed: ``MatMul(x, Transpose(W))`` -> ``Gemm(x, W, transB=1)``.

GPT-2 style models reuse the token embedding ``W[vocab, hidden]`` as the output projection
through a Transpose. Folding that Transpose would store the embedding twice (onnxsim and
onnxruntime write gpt2_small's 23.2 MB as 31.6 MB), and const-cache's size guard refuses
it; left alone, every inference transposes the whole embedding (at ORT_DISABLE_ALL, half
of gpt2_small's time). Gemm reads ``W`` transposed in place. Gemm is 2-D, so a rank-r ``x``
is flattened first and the product reshaped back to ``x``'s leading dims (from Shape(x)
when they are dynamic: Shape's ``end`` needs opset 15).

For the portable target only: onnxruntime folds the Transpose itself at ORT_ENABLE_ALL and
runs its MatMul 1.7% faster than this Gemm (gpt2_small, 400 interleaved runs), while at
ORT_DISABLE_ALL, what other runtimes see, the Gemm form runs in 0.53x the time.

A Cast right after the MatMul (a float16 model's float32 logits, as converters with
float32 outputs write them) is taken into the match and goes before the Reshape back:
``Reshape(Cast(Gemm))`` computes the same values as ``Cast(Reshape(Gemm))``, and
onnxruntime's CPU provider, which has no float16 MatMul or Gemm, computes the product in
float32 and drops the casts to float16 and back only when the Cast reads the product
itself. With the Reshape (a float16 kernel) between them the logits were rounded to
float16: gpt2_dynamo's float16 variant 1.07x further from the float32 export's logits
than the variant itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import is_float
from graphopt.passes.fuse.rules.matmul.standard import FAMILY
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import const, either, op, var


def _check(m: Match, site: Site) -> Refuse | None:
    x, w = m.value("x"), m.value("w")
    rank = site.rank(x)
    if site.rank(w) != 2 or m.node("t").attr("perm") not in (None, [1, 0]):
        return Refuse("the weight is not a 2-D matrix transposed")
    if rank is None or rank < 2 or not is_float(x):
        return Refuse("the activation's rank is not provable (or it is not float)")
    leading = (site.shape(x) or ())[:-1]
    if rank > 2 and not all(isinstance(d, int) for d in leading) and site.opset < 15:
        return Refuse("its leading dims are dynamic and Shape(start, end) needs opset 15")
    return None


def _build(b: Builder, m: Match, plan: None) -> Value:
    site, x, w = m.site, m.value("x"), m.value("w")
    shape = site.shape(x) or ()
    widen = {"to": m.node("cast").attr("to")} if "cast" in m else None
    if len(shape) == 2:
        product = b.op("Gemm", x, w, transB=1)
        return b.op("Cast", product, **widen) if widen else product
    flat = b.op("Flatten", x, axis=len(shape) - 1)
    product = b.op("Gemm", flat, w, transB=1)
    if widen:
        product = b.op("Cast", product, **widen)
    n = (site.shape(w) or (None,))[0]
    leading = shape[:-1]
    if all(isinstance(d, int) for d in leading) and isinstance(n, int):
        target = b.constant(np.array([*leading, n], np.int64), "tied_shape")
    else:
        dims = b.shape(x, 0, len(shape) - 1)
        target = b.op("Concat", dims, b.constant(np.array([-1], np.int64), "tied_width"), axis=0)
    return b.op("Reshape", product, target)


_PRODUCT = op.MatMul(var("x"), op.Transpose(const(name="w"), name="t"), name="matmul")

RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="tied-weight-gemm",
        family=FAMILY,
        pattern=either(op.Cast(_PRODUCT, name="cast"), _PRODUCT),
        plan=_check,
        build=_build,
        targets=frozenset({"onnx"}),
        label="MatMul of a transposed weight",
        doc="MatMul(x, Transpose(W)) -> Gemm(Flatten(x), W, transB=1), reshaped back (no transposed copy of W; "
        "a Cast of the product before the Reshape)",
    ),
)
