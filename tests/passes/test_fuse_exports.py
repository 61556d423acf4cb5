"""The fusion library on graphs PyTorch's exporters wrote (tests/fixtures/exports, made by its make.py):
one-layer bert, gpt2, llama (grouped-query attention, rotary, RMSNorm), llama with a KV cache and t5, LeViT's
attention (a per-head position bias, V wider than Q and K), from the dynamo and the TorchScript exporter. Each
optimized model must compute what the export does, padded masks included, and hold the fused ops a layer has."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from graphopt.passes.fuse import fuse_pass
from graphopt.passes.fuse.rules import LIBRARY
from graphopt.passes.rewrite.engine import RuleSet
from tests.numerics import assert_same_outputs, make_feeds, run_ort
from tests.passes.fuse_fixtures import (
    BROADCAST_BIAS,
    EXPORTERS,
    FIXTURES,
    exported_attention,
    fixture_feeds,
    softcapped,
)


def _optimized(name: str, **settings: Any) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    proto = onnx.load(str(FIXTURES / f"{name}.onnx"))
    # The rules' own output: the runtime guard would undo opset 24's Swish, which onnxruntime
    # 1.32 runs decomposed where it formed a QuickGelu on the original.
    result = optimize(from_proto(proto), strict=True, **{"runtime_guard": False, **settings}, check=False)
    return proto, to_proto(result.model)


def _ops(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in proto.graph.node)


def _tolerance(original: onnx.ModelProto) -> float:
    """float16 logits differ by their rounding where a fused op sums in another order (2 units of 2^-10)."""
    half = any(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for o in original.graph.output)
    return 2e-3 if half else 1e-4


def _same(original: onnx.ModelProto, optimized: onnx.ModelProto) -> None:
    pad = "head" if any(i.name == "past_key" for i in original.graph.input) else "tail"
    tolerance = _tolerance(original)
    for batch, seq in ((1, 4), (2, 6)):
        feeds = fixture_feeds(original, batch, seq, pad)
        assert_same_outputs(original, optimized, feeds, rtol=tolerance, atol=tolerance)


# model -> ops every export of it holds after --target-opset 23 (bert, gpt2, llama: two layers)
OPSET_23: dict[str, dict[str, int]] = {
    "bert": {"Attention": 2, "LayerNormalization": 5, "Gelu": 2},
    "gpt2": {"Attention": 2, "LayerNormalization": 5, "Gelu": 2},
    "llama": {"Attention": 2, "RMSNormalization": 5, "RotaryEmbedding": 4},
    "llama_kv": {"Attention": 1, "RMSNormalization": 3, "RotaryEmbedding": 2},
    "t5": {"Attention": 1, "RMSNormalization": 3, "Gelu": 1},
    "llama_fp16": {"Attention": 1, "RMSNormalization": 3, "RotaryEmbedding": 2},
    "phi": {"Attention": 2, "LayerNormalization": 3, "Gelu": 2, "RotaryEmbedding": 4},
    "gptj": {"Attention": 2, "LayerNormalization": 3, "Gelu": 2, "RotaryEmbedding": 4},
    # attention on merged (batch * heads) 3-D tensors with an ALiBi bias, the tanh GELU factored otherwise
    "bloom": {"Attention": 2, "LayerNormalization": 6, "Gelu": 2},
    # fairseq-style attention (OPT, BART, Marian before SDPA): merged heads, bmm, a 3-D Softmax
    "bmm_attention": {"Attention": 1},
    "levit": {"Attention": 2},
    "mpt": {"Attention": 1},
    "gpt2_kv": {"Attention": 1},
    # a diffusers-style UNet: every GroupNorm (InstanceNormalization between Reshapes), self and cross attention
    "unet": {"GroupNormalization": 18, "InstanceNormalization": 0, "Attention": 2},
}


@pytest.mark.parametrize(
    "name", [f"{m}_{e}" for m in OPSET_23 for e in EXPORTERS if (FIXTURES / f"{m}_{e}.onnx").exists()]
)
def test_opset_23_fuses_every_layer(name: str) -> None:
    original, out = _optimized(name, target_opset=23)
    found = _ops(out)
    want = OPSET_23[name.rsplit("_", 1)[0]]
    assert {op: found[op] for op in want} == want, found
    assert "Softmax" not in found
    _same(original, out)


# model -> MultiHeadAttention count after --target ort, per exporter where the rule proves the layer
ORT_MHA = {
    "bert_dynamo": 2,
    "bert_ts": 2,
    "gpt2_dynamo": 2,
    "llama_dynamo": 2,
    "llama_ts": 2,
    "t5_ts": 1,
    "phi_dynamo": 2,
    "phi_ts": 2,
    "gptj_dynamo": 2,
    "gptj_ts": 2,
    "bloom_dynamo": 2,
    "bloom_ts": 2,
    "bmm_attention_dynamo": 1,
    "bmm_attention_ts": 1,
    "mpt_dynamo": 1,
    "mpt_ts": 1,
}


# model -> (rotary_embedding_dim, interleaved) of each rotary op: phi rotates half of each head of 8 (rotate half),
# gptj its first 4 in pairs, before its heads are transposed (the op takes that layout as 3-D with num_heads)
PARTIAL_ROTARY = {"phi": (4, 0), "gptj": (4, 1)}


@pytest.mark.parametrize("settings", [{"target_opset": 23}, {"target": "ort"}], ids=["opset23", "ort"])
@pytest.mark.parametrize("name", [f"{m}_{e}" for m in PARTIAL_ROTARY for e in EXPORTERS])
def test_partial_and_interleaved_rotary_is_one_op_per_application(name: str, settings: dict[str, Any]) -> None:
    original, out = _optimized(name, **settings)
    rotary = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    dim, interleaved = PARTIAL_ROTARY[name.rsplit("_", 1)[0]]
    assert len(rotary) == 4
    for node in rotary:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes.get("rotary_embedding_dim"), attributes.get("interleaved", 0)) == (dim, interleaved)
    assert "Neg" not in _ops(out)
    _same(original, out)


@pytest.mark.parametrize("name", list(ORT_MHA))
def test_target_ort_writes_multihead_attention(name: str) -> None:
    original, out = _optimized(name, target="ort")
    found = _ops(out)
    assert found["MultiHeadAttention"] == ORT_MHA[name] and "Softmax" not in found, found
    _same(original, out)


def _ops_with_branches(proto: onnx.ModelProto) -> Counter[str]:
    found: Counter[str] = Counter()
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        found.update(n.op_type for n in graph.node)
        graphs += [a.g for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    return found


@pytest.mark.parametrize("name", [f"{m}_kv_{e}" for m in ("llama", "gpt2") for e in EXPORTERS])
def test_target_ort_writes_group_query_attention_on_kv_caches(name: str) -> None:
    """A decoder layer with a KV cache at dynamic batch, sequence and past: an If on those dims runs
    GroupQueryAttention where its kernel computes the export's attention, MultiHeadAttention elsewhere (the same
    outputs at a prompt, a decode step and left padding); the rotaries stay one op each."""
    original, out = _optimized(name, target="ort")
    found, everywhere = _ops(out), _ops_with_branches(out)
    assert found["If"] == 1 and "MultiHeadAttention" not in found, found
    assert everywhere["GroupQueryAttention"] == everywhere["MultiHeadAttention"] == 1, everywhere
    assert not {"Softmax", "Neg"} & set(everywhere), everywhere
    _same(original, out)


@pytest.mark.parametrize("settings", [{"target_opset": 23}, {"target": "ort"}], ids=["opset23", "ort"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_masked_fill_with_the_lowest_float_keeps_fully_masked_rows(exporter: str, settings: dict[str, Any]) -> None:
    """MPT writes Where(mask, finfo.min, scores + alibi) before its Softmax: a query whose keys are all masked (left
    padding in a causal LM, or a row whose mask is all zeros) weighs them alike, where a fill of -inf would give NaN.
    The fused attention (the fill plus the bias as its float mask) computes the same rows."""
    original, out = _optimized(f"mpt_{exporter}", **settings)
    assert "Softmax" not in _ops(out), _ops(out)
    feeds = fixture_feeds(original, 3, 6, "head")
    feeds["attention_mask"][0] = 0
    assert all(np.isfinite(v).all() for v in run_ort(original, feeds).values())
    assert_same_outputs(original, out, feeds, rtol=1e-4, atol=1e-4)


# model -> onnxruntime ops every export of it holds after --target ort, at the exports' own opsets (17, 18),
# below RMSNormalization's and RotaryEmbedding's: each RMSNorm (t5's layer norm is one too) of a residual sum
# becomes SkipSimplifiedLayerNormalization (the sum carried on by its fourth output), the first one (of the
# embeddings) SimplifiedLayerNormalization, each rotate-half rotary of Q and K com.microsoft RotaryEmbedding
ORT_LLM: dict[str, dict[str, int]] = {
    "llama": {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4, "RotaryEmbedding": 4},
    # its K rotary goes into the branches of its GroupQueryAttention's If where only the cache reads it
    "llama_kv": {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2},
    "t5": {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2},
}


@pytest.mark.parametrize(
    "name", [f"{m}_{e}" for m in ORT_LLM for e in EXPORTERS if (FIXTURES / f"{m}_{e}.onnx").exists()]
)
def test_target_ort_writes_onnxruntime_norms_and_rotary(name: str) -> None:
    original, out = _optimized(name, target="ort")
    found = _ops(out)
    want = ORT_LLM[name.rsplit("_", 1)[0]]
    assert {op: found[op] for op in want} == want, found
    assert not {"Pow", "Sqrt", "ReduceMean", "Neg"} & set(found), found
    _same(original, out)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_per_head_bias_below_4d_becomes_multihead_attention_where_enabled(exporter: str) -> None:
    """LeViT's learned (heads, S, T) position bias, gathered from a table, on scores whose V is wider than Q and K:
    with its rule on, --target ort writes one MultiHeadAttention a layer (K and V in 3-D, the bias given its
    leading 1); by default the layers stay as written (measured slower), the near miss saying why."""
    name = f"levit_{exporter}"
    original, out = _optimized(name, target="ort", fuse_enable=[BROADCAST_BIAS])
    found = _ops(out)
    assert found["MultiHeadAttention"] == 2 and "Softmax" not in found, found
    _same(original, out)
    result = optimize(from_proto(original), strict=True, target="ort", check=False)
    assert _ops(to_proto(result.model))["Softmax"] == 2
    misses = [m for run in result.report["passes"] if run["pass"] == "fuse" for m in _misses(run, "attention")]
    assert any(f"not 4-D ({BROADCAST_BIAS} takes it" in m for m in misses), misses


def _misses(run: dict[str, Any], family: str) -> list[str]:
    return list(run["details"]["near_misses"].get(family, {}).get("examples", []))


def test_grouped_query_attention_keeps_the_kv_heads() -> None:
    """Attention repeats the K / V heads itself: the exporters' Reshape(Expand(Unsqueeze(kv))) repeat no longer
    feeds it (4-D inputs carry their heads, so no q_num_heads / kv_num_heads attributes either)."""
    for exporter in EXPORTERS:
        _, out = _optimized(f"llama_{exporter}", target_opset=23)
        producer = {o: n for n in out.graph.node for o in n.output}
        for attention in [n for n in out.graph.node if n.op_type == "Attention"]:
            assert not [a.name for a in attention.attribute if a.name.endswith("num_heads")]
            for kv in attention.input[1:3]:
                node = producer.get(kv)
                feeds = [producer[i].op_type for i in node.input if i in producer] if node is not None else []
                assert not (node is not None and node.op_type == "Reshape" and "Expand" in feeds), (exporter, kv)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_kv_cache_moves_into_attention(exporter: str) -> None:
    """The cache's Concat(past, new) goes into the Attention (past_key / past_value in, present out): the
    graph's present outputs are the Attention's, bit for bit the past joined with the new K / V it reads, and
    the model computes what the export does at left and right padding with a non-empty past."""
    original, out = _optimized(f"llama_kv_{exporter}", target_opset=23)
    (attention,) = [n for n in out.graph.node if n.op_type == "Attention"]
    assert list(attention.input[4:]) == ["past_key", "past_value"], list(attention.input)
    assert list(attention.output[1:]) == ["present_key", "present_value"], list(attention.output)
    assert not [n for n in out.graph.node if n.op_type == "Concat" and {"past_key", "past_value"} & set(n.input)]
    for pad in ("head", "tail"):
        assert_same_outputs(original, out, fixture_feeds(original, 2, 6, pad), rtol=1e-4, atol=1e-4)
    new_kv = list(attention.input[1:3])
    out.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in new_kv)
    feeds = fixture_feeds(original, 2, 6, "head")
    got = run_ort(out, feeds)
    for past, new, present in zip(("past_key", "past_value"), new_kv, ("present_key", "present_value")):
        assert np.array_equal(got[present], np.concatenate([feeds[past], got[new]], axis=2)), present


def test_a_softcap_becomes_attentions_softcap() -> None:
    original = softcapped(exported_attention(), 2.0, 2.0)
    optimized = to_proto(optimize(from_proto(original), strict=True, target_opset=23, check=False).model)
    (attention,) = [n for n in optimized.graph.node if n.op_type == "Attention"]
    assert {a.name: a.f for a in attention.attribute}["softcap"] == 2.0
    assert "Tanh" not in _ops(optimized), _ops(optimized)
    assert_same_outputs(original, optimized, make_feeds(original), rtol=1e-4, atol=1e-4)


def test_opset_24_makes_silu_swish() -> None:
    for exporter in EXPORTERS:
        original, out = _optimized(f"llama_{exporter}", target_opset=24)
        found = _ops(out)
        assert found["Swish"] == 2 and "Sigmoid" not in found, found
        _same(original, out)


@pytest.mark.parametrize("name", list(ORT_MHA))
def test_target_ort_keeps_a_left_padded_row(name: str) -> None:
    # A causal decoder's left-padded row has queries whose keys are all masked: the export
    # zeroes their weights; MultiHeadAttention alone would give NaN along the row.
    original, out = _optimized(name, target="ort")
    assert_same_outputs(original, out, fixture_feeds(original, 2, 6, "head"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name",
    [f"{m}_{e}" for m in OPSET_23 for e in EXPORTERS if (FIXTURES / f"{m}_{e}.onnx").exists() and m != "unet"],
)
def test_opset_23_keeps_a_left_padded_row(name: str) -> None:
    # The dynamo export fills masked scores with float32's lowest value, which onnxruntime's
    # Attention reads as -inf: a query whose keys are all masked must still weigh them alike.
    original, out = _optimized(name, target_opset=23)
    tolerance = _tolerance(original)
    assert_same_outputs(original, out, fixture_feeds(original, 2, 6, "head"), rtol=tolerance, atol=tolerance)


def _static_sequence(name: str, seq: int) -> onnx.ModelProto:
    """The fixture with its sequence fixed at ``seq``, as a ViT's (the image fixes it) or a Whisper encoder's."""
    proto = onnx.load(str(FIXTURES / f"{name}.onnx"))
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        if len(dims) > 1 and dims[1].dim_param:
            dims[1].dim_value = seq
    del proto.graph.value_info[:]  # the exporter's, with the sequence dynamic
    for value in proto.graph.output:
        value.type.tensor_type.ClearField("shape")
    return proto


@pytest.mark.parametrize("name", [f"bert_{e}" for e in EXPORTERS])
def test_static_projections_become_gemm_after_the_attention_fusions(name: str) -> None:
    # Without onnxruntime's fusions a Gemm with its bias runs faster than MatMul + Add on 3-D
    # activations; the attention fusions, which read the MatMul + Add, take theirs first.
    original = _static_sequence(name, 6)
    feeds = fixture_feeds(original, 2, 6, "tail")
    weights = {i.name for i in original.graph.initializer}
    for settings, fused in (({}, None), ({"target_opset": 23}, "Attention"), ({"target": "ort"}, "MultiHeadAttention")):
        out = to_proto(optimize(from_proto(original), strict=True, **settings, check=False).model)
        products = {n.output[0] for n in out.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
        assert not [n.name for n in out.graph.node if n.op_type == "Add" and products & set(n.input)], settings
        assert fused is None or _ops(out)[fused] == 2, _ops(out)
        assert_same_outputs(original, out, feeds, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("settings", [{"target_opset": 23}, {"target": "ort"}], ids=["opset23", "ort"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_tanh_gelu_factored_another_way_is_one_op(exporter: str, settings: dict[str, Any]) -> None:
    """BLOOM's GELU, x * 0.5 * (1 + tanh(c * x * (1 + 0.044715 * x * x))), is the tanh GELU factored otherwise."""
    original, out = _optimized(f"bloom_{exporter}", **settings)
    gelus = [n for n in out.graph.node if n.op_type in ("Gelu", "FastGelu")]
    assert len(gelus) == 2 and "Tanh" not in _ops(out), _ops(out)
    for gelu in gelus:
        approximate = {a.name: onnx.helper.get_attribute_value(a) for a in gelu.attribute}.get("approximate")
        assert (gelu.op_type, approximate) == (("Gelu", b"tanh") if "target_opset" in settings else ("FastGelu", None))
    _same(original, out)


def test_a_keras_layer_norm_as_tf2onnx_writes_it_is_one_op() -> None:
    # tf2onnx writes the means as GlobalAveragePool, gamma and beta as (1, 1, C), the shift as -mean * inv + beta.
    original, out = _optimized("keras_layernorm")
    assert _ops(out) == Counter({"LayerNormalization": 1, "MatMul": 1, "Reshape": 2}), _ops(out)
    _same(original, out)


@pytest.mark.parametrize(
    ("settings", "fused"), [({"target_opset": 23}, "Attention"), ({"target": "ort"}, "MultiHeadAttention")]
)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_packed_qkv_split_by_unbind_fuses_with_nothing_failing(
    exporter: str, settings: dict[str, Any], fused: str
) -> None:
    # timm's attention unbinds its packed QKV (the dynamo exporter: Slice / Squeeze) and, with a static sequence,
    # the Reshape of K into K^T collapses onto the unbind while the attention fusion reads K itself: the fuse pass
    # once failed on every run, and no attention of such a model was fused.
    original = onnx.load(str(FIXTURES / f"mobilevit_{exporter}.onnx"))
    result = optimize(from_proto(original), **settings, check=False)
    assert result.report["failures"] == []
    out = to_proto(result.model)
    found = _ops(out)
    assert found[fused] == 1 and "Softmax" not in found, found
    _same(original, out)


def test_a_library_rule_that_raises_leaves_the_other_fusions_standing(monkeypatch: pytest.MonkeyPatch) -> None:
    """reshape-chain broken in the library's table: its rewrites fail and are undone, the attention still fuses
    (the same round), and each failure is in the report naming the rule and its node."""

    def boom(*args: object) -> object:
        raise RuntimeError("boom")

    library = RuleSet(dataclasses.replace(r, build=boom) if r.name == "reshape-chain" else r for r in LIBRARY)
    monkeypatch.setattr(fuse_pass, "LIBRARY", library)
    original = onnx.load(str(FIXTURES / "mobilevit_dynamo.onnx"))
    result = optimize(from_proto(original), target_opset=23, check=False)
    failures = result.report["failures"]
    assert failures and all(f["pass"] == "fuse" and f["rule"] == "reshape-chain" for f in failures), failures
    assert all(f"at {f['node']}: RuntimeError: boom" in f["error"] for f in failures), failures
    out = to_proto(result.model)
    assert _ops(out)["Attention"] == 1 and "Softmax" not in _ops(out), _ops(out)
    _same(original, out)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_target_ort_keeps_the_unet_group_norms_as_exported(exporter: str) -> None:
    # onnxruntime's CPU has no GroupNormalization kernel (it runs the function body) and no com.microsoft GroupNorm
    original, out = _optimized(f"unet_{exporter}", target="ort", target_opset=23)
    assert _ops(out)["InstanceNormalization"] == 18 and "GroupNormalization" not in _ops(out), _ops(out)
    _same(original, out)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_group_norm_scale_before_a_conv_goes_into_its_weight(exporter: str) -> None:
    # timm's PoolFormer v2 block: the second GroupNorm's gamma (Mul by (C, 1, 1)) feeds the MLP's first 1x1 Conv;
    # the first norm's gamma, read by the pooling and the Sub, stays
    original = onnx.load(str(FIXTURES / f"poolformer_{exporter}.onnx"))
    out = to_proto(optimize(from_proto(original), strict=True, check=False).model)
    assert _ops(out)["Mul"] == 1, _ops(out)
    _same(original, out)
