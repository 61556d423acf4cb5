"""The ``--target ort`` rules (onnxruntime contrib ops, run by its CPU provider in these
tests) and the standard rules added with them: each fires where it should, with numerics
equal in onnxruntime, and not where an extra reader, a graph output, a wrong attribute, an
unprovable shape or the default target forbids it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tests.numerics import assert_same_outputs
from tests.passes.fuse_helpers import fires, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    HEADS,
    HIDDEN,
    SIZE,
    WINDOW,
    bias_gelu,
    computed_reshape,
    conv_act,
    embed,
    gemm_bn,
    masked_feeds,
    ort_attention,
    padded,
    rand_weight,
    residual_block,
    rope_model,
    scaled_matmul,
    skip_norm,
)


def _ort(
    proto: onnx.ModelProto, rule: str, expected: dict[str, int], passes: str = "shape-infer,fuse"
) -> onnx.ModelProto:
    out = fires(proto, rule, expected, target="ort", passes=passes, enable=[rule])
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    return out


# -- FusedConv ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("act", "attrs"),
    [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"alpha": 0.2}), ("Clip", {}), ("HardSigmoid", {})],
)
def test_conv_activation_becomes_fusedconv(act: str, attrs: dict[str, Any]) -> None:
    _ort(conv_act(act, **attrs), "ort-fusedconv", {"FusedConv": 1})


@pytest.mark.parametrize("bias", [True, False])
def test_conv_residual_relu_becomes_fusedconv_with_its_sum_input(bias: bool) -> None:
    out = _ort(residual_block(bias), "ort-fusedconv-sum", {"Conv": 1, "FusedConv": 1})
    # onnxruntime's NCHWc layout transformer skips a FusedConv whose bias is "": a Conv
    # without one gets zeros.
    (fused,) = [n for n in out.graph.node if n.op_type == "FusedConv"]
    assert len(fused.input) == 4 and all(fused.input)


def test_a_residual_not_from_a_conv_stays_an_add() -> None:
    # onnxruntime lays out Conv outputs in blocks (NCHWc) and fuses an Add of two of them
    # itself; a FusedConv whose residual is not one stays in NCHW: measured 1.2x slower.
    details = refused(residual_block(skip="input"), "ort-fusedconv-sum", target="ort")
    assert "not the output of a Conv" in " ".join(details["near_misses"]["conv"])


@pytest.mark.parametrize("extra", ["reader", "output"])
def test_fusedconv_refuses_a_conv_read_elsewhere(extra: str) -> None:
    refused(conv_act(extra=extra), "ort-fusedconv", target="ort")


def test_fusedconv_refusals() -> None:
    details = refused(conv_act(residual=True, extra="broadcast"), "ort-fusedconv-sum", target="ort")
    assert "not provably the Conv's" in " ".join(details["near_misses"]["conv"])
    refused(conv_act(), "ort-fusedconv")  # target onnx: standard ops only
    clip = conv_act("Clip")
    clip.graph.input.append(info("lo", []))
    clip.graph.initializer.pop(2)
    details = refused(clip, "ort-fusedconv", target="ort")
    assert "Clip bounds are not constants" in " ".join(details["near_misses"]["conv"])


# -- FusedMatMul ----------------------------------------------------------------------------------


def test_scaled_matmul_with_transposed_input_becomes_one_fusedmatmul() -> None:
    out = _ort(scaled_matmul(), "ort-fusedmatmul-div", {"FusedMatMul": 1})
    (fused,) = out.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused.attribute}
    assert attrs["transB"] == 1 and attrs["alpha"] == pytest.approx(1 / 8)
    _ort(scaled_matmul("Mul", transpose=False), "ort-fusedmatmul-mul", {"FusedMatMul": 1})


def test_fusedmatmul_refusals() -> None:
    details = refused(scaled_matmul(perm=[1, 0, 2]), "ort-transpose-into-matmul-b", target="ort")
    assert "does not swap the last two dims" in " ".join(details["near_misses"]["matmul"])
    refused(scaled_matmul(), "ort-fusedmatmul-div")
    exposed = scaled_matmul(transpose=False)
    exposed.graph.output.append(info("p", None))
    refused(exposed, "ort-fusedmatmul-div", target="ort")


# -- standard rules that came with them -----------------------------------------------------------


def test_a_computed_reshape_target_with_one_unknown_entry_becomes_a_constant() -> None:
    fires(computed_reshape([4]), "reshape-one-unknown", {"Reshape": 1}, passes="shape-infer,fuse,dce")


def test_reshape_one_unknown_refusals() -> None:
    details = refused(computed_reshape([-1]), "reshape-one-unknown")
    assert "more than one entry" in " ".join(details["near_misses"]["shape"])
    refused(computed_reshape([4], allowzero=1), "reshape-one-unknown")


# -- BiasGelu -------------------------------------------------------------------------------------


def test_gelu_of_a_biased_input_becomes_biasgelu_or_fastgelu() -> None:
    _ort(bias_gelu(), "ort-biasgelu", {"BiasGelu": 1})
    _ort(bias_gelu(approximate="tanh"), "ort-biasgelu", {"FastGelu": 1})


def test_biasgelu_refusals() -> None:
    details = refused(bias_gelu(bias_shape=(3, 8)), "ort-biasgelu", target="ort")  # not a vector
    exposed = bias_gelu()
    exposed.graph.output.append(info("h", None))
    refused(exposed, "ort-biasgelu", target="ort")
    refused(bias_gelu(), "ort-biasgelu")
    assert details["applied"] == {}


# -- SkipLayerNormalization / SkipSimplifiedLayerNormalization ------------------------------------


def test_layernorm_of_a_biased_residual_becomes_skiplayernorm() -> None:
    _ort(skip_norm(), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})
    _ort(skip_norm(bias=False), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})


def test_a_residual_read_further_on_comes_from_the_fourth_output() -> None:
    out = _ort(skip_norm(carry=True), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1, "Relu": 1})
    skip, relu = out.graph.node[1], out.graph.node[2]
    assert relu.input[0] == skip.output[3]


@pytest.mark.parametrize("norm", ["RMSNormalization", "decomposed"])
def test_rmsnorm_of_a_residual_becomes_skipsimplifiedlayernorm(norm: str) -> None:
    rule = "ort-skiprmsnorm" if norm == "RMSNormalization" else "ort-skiprmsnorm-decomposed"
    _ort(skip_norm(norm, carry=True), rule, {"MatMul": 1, "SkipSimplifiedLayerNormalization": 1, "Relu": 1})


def test_an_rmsnorm_whose_residual_is_unprovable_becomes_simplifiedlayernorm_alone() -> None:
    # Below opset 23 onnxruntime's SimplifiedLayerNormalization stands for RMSNormalization; where the skip
    # form is refused (the operands' shapes differ) the residual Add stays in front of it.
    unprovable = skip_norm("decomposed", skip_shape=[1, 3, 8])
    out = fires(unprovable, "ort-rmsnorm", {"MatMul": 1, "Add": 2, "SimplifiedLayerNormalization": 1}, target="ort")
    assert [o.domain for o in out.opset_import] == [""]  # onnxruntime has it in the default domain
    refused(unprovable, "ort-rmsnorm")  # target onnx: the model's opset 17 has no RMS norm at all


def test_skip_norm_refusals() -> None:
    details = refused(skip_norm(skip_shape=[1, 3, 8]), "ort-skiplayernorm", target="ort", enable=["norm"])
    assert "do not provably have one" in " ".join(details["near_misses"]["norm"])
    refused(skip_norm(), "ort-skiplayernorm", enable=["norm"])  # target onnx
    refused(skip_norm(), "ort-skiplayernorm", target="ort")  # off by default: slower in onnxruntime
    exposed = skip_norm()
    exposed.graph.output.append(info("pb", None))
    out, _ = fuse(exposed, target="ort", enable=["norm"])
    assert "Add" in {n.op_type for n in out.graph.node}  # the bias stays outside; the Add is not fused away


def _onnxruntime_ops(proto: onnx.ModelProto, tmp_path: Path) -> Counter[str]:
    """The ops of ``proto`` after onnxruntime's own graph optimizations (extended level)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return ops(onnx.load(options.optimized_model_filepath))


@pytest.mark.parametrize("bias", [True, False])
def test_the_default_output_keeps_a_residual_norm_out_of_onnxruntimes_skiplayernorm(bias: bool, tmp_path: Path) -> None:
    # onnxruntime fuses Add -> LayerNormalization into SkipLayerNormalization wherever it can
    # prove the Add's operands share one 3-D shape (graphopt's static Reshape targets give it
    # that proof on TorchScript exports); on CPU that kernel measured 4-8x slower than the
    # Add and the LayerNormalization it replaces. The default output writes the residual as a
    # two-input Sum, which onnxruntime runs as fast and does not fuse.
    proto = skip_norm(bias=bias)
    assert _onnxruntime_ops(proto, tmp_path)["SkipLayerNormalization"] == 1  # the form it fuses
    expected = {"MatMul": 1, "Sum": 1, "LayerNormalization": 1} | ({"Add": 1} if bias else {})
    out = fires(proto, "layernorm-residual-sum", expected)
    assert _onnxruntime_ops(out, tmp_path)["SkipLayerNormalization"] == 0


def _post_norm_block() -> onnx.ModelProto:
    """BERT's post-norm block: LayerNorm -> projection -> residual Add -> LayerNorm."""
    nodes = [
        node("LayerNormalization", ["x", "gamma", "beta"], "h", epsilon=1e-5),
        node("MatMul", ["h", "w"], "p"),
        node("Add", ["p", "h"], "sum"),
        node("LayerNormalization", ["sum", "gamma", "beta"], "y", epsilon=1e-5),
    ]
    params = [init("w", rand_weight(8, 8)), init("gamma", rand_weight(8)), init("beta", rand_weight(8))]
    return model(nodes, [info("x", ["b", 3, 8])], ["y"], params)


def test_a_post_norm_residual_stays_an_add_for_onnxruntimes_attention_fusion() -> None:
    # onnxruntime's attention fusion reads LayerNorm -> residual Add.
    details = refused(_post_norm_block(), "layernorm-residual-sum")
    assert "comes from a LayerNormalization" in " ".join(details["near_misses"]["norm"])


def test_at_target_ort_a_post_norm_residual_is_kept_out_of_onnxruntimes_skiplayernorm(tmp_path: Path) -> None:
    # --target ort writes the attention itself, so onnxruntime's attention fusion has nothing to read
    # the Add for, and the Add would become its slower SkipLayerNormalization (a post-norm RoBERTa: all nine).
    proto = _post_norm_block()
    assert _onnxruntime_ops(proto, tmp_path)["SkipLayerNormalization"] == 1
    out = fires(proto, "layernorm-residual-sum", {"LayerNormalization": 2, "MatMul": 1, "Sum": 1}, target="ort")
    assert _onnxruntime_ops(out, tmp_path)["SkipLayerNormalization"] == 0


@pytest.mark.parametrize(("windows", "fused"), [(4, True), (32, False)])
def test_windowed_attention_with_a_bias_stays_unfused_over_many_batch_head_pairs(windows: int, fused: bool) -> None:
    # Swin's windows make the attention's batch windows * batch; with a bias onnxruntime's CPU
    # MultiHeadAttention ran 64 and more (batch, head) pairs per image slower than the written form.
    proto = ort_attention(windows=windows)
    out, details = fuse(proto, "shape-infer,fuse,dce", target="ort")
    fused_ops = ops(out)["MultiHeadAttention"] + ops(out)["Attention"]
    assert fused_ops == (1 if fused else 0) and ("Softmax" in ops(out)) != fused
    if not fused:
        assert any(
            "64 (batch, head) pairs per sample with a mask or bias" in m for m in details["near_misses"]["attention"]
        ), details
    x = np.random.default_rng(0).standard_normal((2, windows, WINDOW, HIDDEN)).astype(np.float32)
    assert_same_outputs(proto, out, {"x_windows": x}, rtol=1e-4, atol=1e-4)


# -- RotaryEmbedding -------------------------------------------------------------------------------


# The kernel's caches are 2-D (position, d/2): run-time ones are flattened once (a Reshape each, shared
# by q and k), the ids (batch, seq) counting their rows (Shape / ReduceProd / Range / Reshape, made once);
# a constant table keeps its own ids.
_RUNTIME_IDS = {"Reshape": 3, "Shape": 1, "ReduceProd": 1, "Range": 1}


@pytest.mark.parametrize(
    ("cos", "left"),
    [
        ("gathered", {}),
        ("runtime", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, **_RUNTIME_IDS}),
        ("runtime-4d", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, "Squeeze": 1, **_RUNTIME_IDS}),
        ("constant", {}),
    ],
)
def test_rotate_half_rope_becomes_contrib_rotaryembedding_below_opset_23(cos: str, left: dict[str, int]) -> None:
    out = _ort(
        rope_model(cos, opset=18), "ort-rotary-embedding", {"RotaryEmbedding": 2, **left}, "shape-infer,fuse,dce"
    )
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert {n.domain for n in rope} == {"com.microsoft"}


def test_contrib_rotary_refusals() -> None:
    refused(rope_model(opset=18), "ort-rotary-embedding")  # target onnx
    details = refused(rope_model("input", opset=18), "ort-rotary-embedding", target="ort")
    assert "halves of cos are not provably equal" in " ".join(details["near_misses"]["rotary"])


# -- Attention ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("packed", "fp16"), [(False, False), (True, False), (False, True)])
def test_attention_layer_becomes_one_contrib_attention(packed: bool, fp16: bool) -> None:
    rule = "ort-attention-packed" if packed else "ort-attention"
    expected = {"Attention": 1, "Cast": 2 if fp16 else 1}
    proto = ort_attention(packed=packed, fp16=fp16)
    out = _ort(proto, rule, expected, passes="shape-infer,fuse,dce")
    assert_same_outputs(proto, out, masked_feeds(), rtol=1e-4, atol=1e-4)  # a mask with zeros
    attention = next(n for n in out.graph.node if n.op_type == "Attention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["num_heads"] == HEADS and attrs["mask_filter_value"] == pytest.approx(-10000.0)


def test_an_additive_mask_becomes_the_attention_bias() -> None:
    out = _ort(ort_attention(mask="bias"), "ort-attention", {"Attention": 1, "Shape": 1, "Concat": 1, "Expand": 1})
    assert len(next(n for n in out.graph.node if n.op_type == "Attention").input) == 6


def test_attention_refusals() -> None:
    refused(ort_attention(extra="output"), "ort-attention", target="ort")
    split_input = ort_attention(extra="split-input")
    feeds = {**masked_feeds(), "split_shape": np.array([0, 0, HEADS, SIZE], np.int64)}
    out, details = fuse(split_input, target="ort")
    assert "ort-attention" not in details["applied"]
    assert "not provable" in " ".join(details["near_misses"]["attention"])
    assert_same_outputs(split_input, out, feeds)
    out, details = fuse(ort_attention(), target="onnx")
    assert "ort-attention" not in details["applied"]


# -- Pad into Conv and pooling; Gemm / MatMul + BatchNormalization -------------------------------


@pytest.mark.parametrize(("consumer", "fill"), [("Conv", 0.0), ("AveragePool", 0.0), ("MaxPool", -np.inf)])
def test_a_spatial_pad_goes_into_the_consumer(consumer: str, fill: float) -> None:
    fires(padded(consumer, [0, 0, 1, 2, 0, 0, 2, 1], fill), "pad-into-consumer", {consumer: 1})


def test_a_pad_goes_into_a_fusedconv() -> None:
    proto = padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1])
    proto.graph.node[-1].output[0] = "c"
    proto.graph.node.append(node("Relu", ["c"], "y"))
    _ort(proto, "pad-into-consumer", {"FusedConv": 1})


def _shared_pad(consumers: list[str], source: str = "Relu") -> onnx.ModelProto:
    """A zero Pad of ``source(x)`` read by every op of ``consumers``."""
    nodes = [node(source, ["x"], "r"), node("Pad", ["r", "pads"], "p", mode="constant")]
    params = [init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))]
    for k, consumer in enumerate(consumers):
        if consumer == "Conv":
            nodes.append(node("Conv", ["p", f"w{k}"], f"y{k}"))
            params.append(init(f"w{k}", rand_weight(4, 3, 3, 3)))
        else:
            nodes.append(node(consumer, ["p"], f"y{k}", kernel_shape=[3, 3]))
    return model(nodes, [info("x", [1, 3, 6, 6])], [f"y{k}" for k in range(len(consumers))], params)


@pytest.mark.parametrize("consumers", [["Conv", "Conv"], ["Conv", "MaxPool"], ["MaxPool"]])
def test_a_zero_pad_goes_into_each_of_its_consumers(consumers: list[str]) -> None:
    # A zero pad of a Relu's output is a -inf pad for MaxPool: nothing negative to lose to.
    expected = {"Relu": 1, **{c: consumers.count(c) for c in consumers}}
    fires(_shared_pad(consumers), "pad-into-consumer", expected)


def test_a_zero_pad_of_a_value_that_may_be_negative_stays_before_maxpool() -> None:
    details = refused(_shared_pad(["MaxPool"], source="Neg"), "pad-into-consumer")
    assert "not -inf" in " ".join(details["near_misses"]["conv"])


def test_pad_refusals() -> None:
    details = refused(padded("MaxPool", [0, 0, 1, 1, 0, 0, 1, 1], 0.0), "pad-into-consumer")
    assert "not -inf" in " ".join(details["near_misses"]["conv"])
    details = refused(padded("AveragePool", [0, 1, 1, 1, 0, 0, 1, 1]), "pad-into-consumer")
    assert "channel dims" in " ".join(details["near_misses"]["conv"])
    refused(padded("Conv", [0, 0, 1, 1, 0, 0, 1, 1], extra="output"), "pad-into-consumer")


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_gemm_or_matmul_with_batchnorm_becomes_one_gemm(op: str) -> None:
    fires(gemm_bn(op), "gemm-bn", {"Gemm": 1})


def test_gemm_bn_refusals() -> None:
    details = refused(gemm_bn("MatMul", shape=["n", 4, 3]), "gemm-bn")
    assert "not 2-D" in " ".join(details["near_misses"]["conv"])
    refused(gemm_bn(extra="output"), "gemm-bn")


# -- EmbedLayerNormalization ----------------------------------------------------------------------


@pytest.mark.parametrize("extra", ["none", "segment", "row"])
def test_bert_embeddings_become_embedlayernorm(extra: str) -> None:
    expected = {"EmbedLayerNormalization": 1, "Cast": 1 + (extra == "segment")}
    out = _ort(embed(extra), "ort-embedlayernorm", expected, passes="shape-infer,fuse,dce")
    assert [n.op_type for n in out.graph.node][-1] == "EmbedLayerNormalization"


def test_int32_ids_need_no_cast() -> None:
    _ort(
        embed(ids_type=onnx.TensorProto.INT32),
        "ort-embedlayernorm",
        {"EmbedLayerNormalization": 1},
        "shape-infer,fuse,dce",
    )


def test_embedlayernorm_refusals() -> None:
    for extra in ("reader", "output"):
        refused(embed(extra), "ort-embedlayernorm", target="ort", enable=["embed"])
    details = refused(embed(axis=1), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not over the last axis" in " ".join(details["near_misses"]["embed"])
    details = refused(embed("position-input"), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not provably 0 .. S-1" in " ".join(details["near_misses"]["embed"])
    refused(embed(), "ort-embedlayernorm", enable=["embed"])  # target onnx
    refused(embed(), "ort-embedlayernorm", target="ort")  # off by default: slower in onnxruntime
