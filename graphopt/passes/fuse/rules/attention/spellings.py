"""The attention family's patterns: the layer around 3-D projections (``core``), the Softmax with the
exporters' IsNaN guard, attention on merged heads, Attention's own head split and merge, and a KV cache."""

from __future__ import annotations

from graphopt.passes.rewrite.patterns import Pattern, const, either, op, optional, var
from graphopt.passes.rewrite.proofs import HEADS

FAMILY = "attention"
STANDARD_ATTENTION_OPSET = 23  # the first with Attention


def core(q: Pattern, k: Pattern, v: Pattern) -> Pattern:
    """The attention layer around the 3-D projections ``q``, ``k``, ``v``."""

    def split(name: str, source: Pattern, perm: list[int]) -> Pattern:
        reshape = op.Reshape(source, var(f"{name}_shape"), name=f"{name}_split")
        return op.Transpose(reshape, perm=perm, name=f"{name}_t")

    k_t = either(split("k", k, [0, 2, 3, 1]), op.Transpose(split("k", k, HEADS), perm=[0, 1, 3, 2], name="k_tt"))
    scores = op.MatMul(split("q", q, HEADS), k_t, name="qk")
    scaled = either(
        op.Div(scores, const(name="scale"), name="scaling"), op.Mul(scores, const(name="scale"), name="scaling"), scores
    )
    masked = either(
        op.Add(scaled, var("mask"), name="masking"),
        op.Where(var("cond"), scaled, const(name="fill"), name="masking"),
        scaled,
    )
    probs = op.Softmax(masked, name="softmax")
    return op.Reshape(
        op.Transpose(op.MatMul(probs, split("v", v, HEADS), name="pv"), perm=HEADS, name="merge_t"),
        var("merge_shape"),
        name="merge",
    )


ATTENTION = core(var("q"), var("k"), var("v"))


SOFTMAX = op.Softmax(var("scores"), name="softmax")
NAN_GUARD = op.Where(op.IsNaN(SOFTMAX, name="isnan"), const(0.0), SOFTMAX, name="nan_guard")


MERGED_HEADS = op.Reshape(
    op.MatMul(
        either(op.Reshape(either(NAN_GUARD, SOFTMAX), var("probs_shape"), name="probs_merge"), SOFTMAX),
        var("v3"),
        name="pv",
    ),
    var("heads_shape"),
    name="heads_split",
)


# -- Attention's own head split and merge --------------------------------------------------------
#
# Where Q, K and V of a 4-D Attention are all head splits of 3-D projections and its output is
# merged back, ``Reshape(Transpose(Attention(split(Q), split(K), split(V)), [0, 2, 1, 3]), (B, S, H*d))``
# is the same Attention on the projections (ONNX splits and merges the heads itself).


def _split_entry(name: str) -> Pattern:
    reshape = op.Reshape(var(name), var(f"{name}_shape"), name=f"{name}_split")
    return op.Transpose(reshape, perm=HEADS, name=f"{name}_t")


HEADS_3D = op.Reshape(
    op.Transpose(
        op.Attention(_split_entry("q"), _split_entry("k"), _split_entry("v"), optional(var("mask")), name="attention"),
        perm=HEADS,
        name="merge_t",
    ),
    var("merge_shape"),
    name="merge",
)


# -- a KV cache: Attention on Concat(past, new) keys and values ----------------------------------
#
# A decoder with a cache concatenates the past keys and values with this step's and outputs the
# result as the present ones; ONNX's Attention does that itself (past_key / past_value in,
# present_key / present_value out, the same Concat along the sequence axis), so the Concats go
# and their readers (the graph's present outputs) read the Attention's.

KV_CACHE = op.Attention(
    var("q"),
    op.Concat(var("past_key"), var("key"), name="key_cache"),
    op.Concat(var("past_value"), var("value"), name="value_cache"),
    optional(var("mask")),
    name="attention",
)
