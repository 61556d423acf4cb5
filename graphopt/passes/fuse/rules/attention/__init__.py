"""Attention family: scaled dot-product attention with head split / merge -> Attention (opset 23).

The exporters write one attention layer as::

    q = Transpose(Reshape(Q, [B, S, H, d]), [0, 2, 1, 3])       # (B, H, S, d)
    k = Transpose(Reshape(K, [B, S, Hkv, d]), [0, 2, 3, 1])     # (B, Hkv, d, S), or k^T later
    v = Transpose(Reshape(V, [B, S, Hkv, d]), [0, 2, 1, 3])
    p = Softmax(mask(MatMul(q, k) / sqrt(d)), axis=-1)           # additive mask or Where(cond, s, -inf)
    y = Reshape(Transpose(MatMul(p, v), [0, 2, 1, 3]), [B, S, H*d])

which is ``Attention(Q, K, V, mask, q_num_heads=H, kv_num_heads=Hkv, scale=...)`` on the 3-D
projections (ONNX splits and merges the heads itself; Hkv < H is grouped-query attention).
The mask: an additive float mask is passed as is; ``Where(cond, s, c)`` with ``c`` at or
below -1e30 is a boolean mask; when ``cond`` is the causal band a GPT-2 export slices from
its ``tril`` buffer (``buf[:, :, klen-qlen:klen, :klen]`` with qlen = klen provably), the
plumbing goes and ``is_causal=1`` stands for it.

``--target ort``: the same layer with its projections, ``Q = x @ Wq + bq`` (likewise K, V;
weights constant, or a float16 constant Cast to float), or one packed projection ``Split``
into Q, K, V (GPT-2's c_attn), becomes onnxruntime's ``Attention`` (com.microsoft, packed
weights ``[Wq Wk Wv]``; float16 weights are packed as float16 and Cast once). The causal band
becomes ``unidirectional=1``; BERT's additive mask ``(1 - float(m[:, None, None, :])) * c``
becomes the raw 2-D mask ``m`` as int32 with ``mask_filter_value=c`` (masks are 0 / 1 by
contract, as onnxruntime's own fusion assumes); another additive mask is its attention_bias.

What PyTorch's exporters write (torch's scaled_dot_product_attention, decomposed by the dynamo
and the TorchScript exporter alike) is matched from ``P V`` backwards instead (``attention-4d``,
see plans.py for the spellings): the 4-D Q, K, V (after rotary embeddings, with GQA's
head repeat dropped) become Attention's inputs, and ``attention-heads-3d`` then takes head splits
and the merge into it where Q, K and V all have them, ``attention-kv-cache`` a KV cache's Concat with
the past (past_key / past_value in, present_key / present_value out). For ``--target ort`` the same match with
its merge becomes ``MultiHeadAttention`` (``ort-multihead-attention``; an attention bias of rank below 4,
``ort-multihead-attention-broadcast-bias``, off by default); grouped-query attention
keeps its repeated heads there. From opset 23 a float32 attention without a KV cache is left to the standard
Attention, which onnxruntime 1.32 runs as fast or faster (float16 and cached attention still become
MultiHeadAttention: see ort.py). On a KV cache whose mask is proven the causal band over the past (any padding
in the same mask, a -inf fill zeroed after the attention) and whose batch 1, one new token or no past is static,
that MultiHeadAttention becomes ``GroupQueryAttention`` (``ort-group-query-attention`` for at most 32 new tokens,
a decode step; ``ort-group-query-attention-any-length``, off by default, for a count read at run time, measured
slower on long prompts: the K / V heads unrepeated, past_key / past_value in, the Concats' present_key /
present_value out, the padding kept as its attention_bias).

Attention computed on merged (batch * heads) 3-D tensors, as BLOOM (with its ALiBi bias) and
fairseq-style bmm attention write it, is read as the 4-D attention it is (``attention-merged-heads``,
``ort-multihead-attention-merged``; see plans.py).
"""

from __future__ import annotations

from typing import Any

from graphopt.passes.fuse.rules.attention import gqa, ort, standard
from graphopt.passes.rewrite.engine import Rule

__all__ = ["RULES"]

RULES: tuple[Rule[Any], ...] = standard.RULES + ort.RULES + gqa.RULES
