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

float32 only: onnxruntime's CPU provider has no float16 MatMul or Gemm and runs both in
float32 behind casts it inserts, and there the Gemm form of gpt2_dynamo's float16 variant
(``convert_float_to_float16``) ran 1.23x the variant at ORT_ENABLE_ALL (the MatMul form 0.98x;
60 interleaved runs), though 0.79x at ORT_DISABLE_ALL (0.96x).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import is_float
from graphopt.passes.fuse.rules.matmul.standard import FAMILY
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import const, op, var


def _check(m: Match, site: Site) -> Refuse | None:
    x, w = m.value("x"), m.value("w")
    rank = site.rank(x)
    if site.rank(w) != 2 or m.node("t").attr("perm") not in (None, [1, 0]):
        return Refuse("the weight is not a 2-D matrix transposed")
    if rank is None or rank < 2 or not is_float(x):
        return Refuse("the activation's rank is not provable (or it is not float)")
    if site.dtype(x) != DataType.FLOAT:
        return Refuse("not a float32 MatMul (a float16 Gemm measured slower)")
    leading = (site.shape(x) or ())[:-1]
    if rank > 2 and not all(isinstance(d, int) for d in leading) and site.opset < 15:
        return Refuse("its leading dims are dynamic and Shape(start, end) needs opset 15")
    return None


def _build(b: Builder, m: Match, plan: None) -> Value:
    site, x, w = m.site, m.value("x"), m.value("w")
    shape = site.shape(x) or ()
    if len(shape) == 2:
        return b.op("Gemm", x, w, transB=1)
    flat = b.op("Flatten", x, axis=len(shape) - 1)
    product = b.op("Gemm", flat, w, transB=1)
    n = (site.shape(w) or (None,))[0]
    leading = shape[:-1]
    if all(isinstance(d, int) for d in leading) and isinstance(n, int):
        target = b.constant(np.array([*leading, n], np.int64), "tied_shape")
    else:
        dims = b.shape(x, 0, len(shape) - 1)
        target = b.op("Concat", dims, b.constant(np.array([-1], np.int64), "tied_width"), axis=0)
    return b.op("Reshape", product, target)


RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="tied-weight-gemm",
        family=FAMILY,
        pattern=op.MatMul(var("x"), op.Transpose(const(name="w"), name="t"), name="matmul"),
        plan=_check,
        build=_build,
        targets=frozenset({"onnx"}),
        label="MatMul of a transposed weight",
        doc="MatMul(x, Transpose(W)) -> Gemm(Flatten(x), W, transB=1), reshaped back (no transposed copy of W)",
    ),
)
