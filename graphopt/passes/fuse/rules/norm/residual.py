"""The residual sum a LayerNormalization reads, written as ``Sum`` (norm family).

``LayerNormalization(Add(a, skip))`` -> ``LayerNormalization(Sum(a, skip))`` when ``a`` and
``skip`` are activations of one 3-D shape, the norm is over the last axis and is the sum's
only reader.

Why: onnxruntime (ORT_ENABLE_EXTENDED and up) fuses exactly that Add into
com.microsoft SkipLayerNormalization wherever its shape inference proves the two operands
share one 3-D shape, and its CPU kernel measured 4-8x slower than the Add and the
LayerNormalization it replaces (onnxruntime 1.32; hidden 64 to 768, 1 and 2 threads;
3 x 197 x 256: 625 us against 87 us). Exports often hide the shapes from it (a Reshape to a
target computed at run time); the const-cache pass's static targets reveal them, so on the
TorchScript ViT and Whisper encoders the default output ran 2-3% slower than the export
for that one fused final norm. A two-input Sum is the same element-wise addition, runs as
fast, and is no Add to that fusion.

Also where an operand comes from a LayerNormalization (BERT-style post-norm blocks) or a Gather
(the embeddings' lookups): onnxruntime's attention and embedding fusions read that Add in the
older BERT exports, but on none of the 20 exports, the corpus nor RoBERTa / DistilBERT exports
did onnxruntime 1.32 form an Attention or EmbedLayerNormalization from the original, while
wherever it proved the shapes it fused the Add into SkipLayerNormalization instead. The
default output of a post-norm RoBERTa (roberta_ts, 4 layers, hidden 256, seq 64, 1 thread)
had all nine norms so fused and ran 1.039 of the export (0.984 with the Sums; ORT_ENABLE_ALL,
139 interleaved rounds, load 6); at ``--target ort`` those nine kernels took 0.78 ms, the
export's nine LayerNormalizations, whose shapes onnxruntime could not prove, 0.12 ms. Where the original
does get one of those fusions, the runtime guard (runtime/guard.py) finds the loss and undoes
this rule. ``--target ort`` with the ``ort-skiplayernorm`` rule enabled fuses the Add first
(the rules of standard.py win the tie).

Not through a QDQ model's pairs (unlike the rest of the family): where the Add's result is quantized before the
norm reads it, onnxruntime fuses no SkipLayerNormalization across the pair, and a Sum read through it would only
drop a quantization the original computes. On bert_ts's QDQ variant that moved the outputs by 4.7% (relative L2)
and ran no faster (5.97 ms against 5.84 without it, ORT_ENABLE_ALL, 1 thread).
"""

from __future__ import annotations

from typing import Any

from graphopt.ir import Value
from graphopt.ir.constness import is_constant
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import is_float
from graphopt.passes.fuse.rules.norm.standard import FAMILY
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, optional, var


def _plan(m: Match, site: Site) -> Refuse | None:
    a, skip = m.value("a"), m.value("skip")
    if is_constant(a) or is_constant(skip):
        return Refuse("an operand is a constant (a bias, not a residual)")
    shape = site.shape(a)
    if not is_float(a) or shape is None or len(shape) != 3 or None in shape or shape != site.shape(skip):
        return Refuse("the operands do not provably have one 3-D float shape")
    ln = m.node("ln")
    if Site.int_attr(ln, "axis", -1) not in (-1, 2):
        return Refuse("the norm is not over the last axis (SkipLayerNormalization's)")
    if any(v.is_used() for v in ln.outputs[1:]):
        return Refuse("the norm's statistics are read")
    return None


def _build(b: Builder, m: Match, _: None) -> Value:
    ln = m.node("ln")
    total = b.op("Sum", m.value("a"), m.value("skip"))
    return b.op("LayerNormalization", total, *ln.inputs[1:], **ln.attributes)


RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="layernorm-residual-sum",
        family=FAMILY,
        pattern=op.LayerNormalization(
            op.Add(var("a"), var("skip"), name="sum"), var("gamma"), optional(var("beta")), name="ln"
        ),
        plan=_plan,
        build=_build,
        label="residual sum",
        doc="LayerNormalization(a + skip) -> LayerNormalization(Sum(a, skip)): onnxruntime's CPU "
        "SkipLayerNormalization, which it would fuse the Add into, is slower",
    ),
)
