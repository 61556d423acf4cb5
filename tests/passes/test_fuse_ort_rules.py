"""The ``--target ort`` rules (onnxruntime contrib ops, run by its CPU provider in these
tests) and the standard rules added with them: each fires where it should, with numerics
equal in onnxruntime, and not where an extra reader, a graph output, a wrong attribute, an
unprovable shape or the default target forbids it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from tests.numerics import assert_same_outputs
from tests.passes.fuse_helpers import expose, fires, fuse, info, init, model, node, refused

RNG = np.random.default_rng(1)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _ort(
    proto: onnx.ModelProto, rule: str, expected: dict[str, int], passes: str = "shape-infer,fuse"
) -> onnx.ModelProto:
    out = fires(proto, rule, expected, target="ort", passes=passes, enable=[rule])
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    return out


# -- FusedConv ------------------------------------------------------------------------------------


def _conv_act(act: str = "Relu", extra: str = "", residual: bool = False, **attrs: Any) -> onnx.ModelProto:
    inputs = [info("x", ["n", 3, 8, 8])]
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1])]
    src = "c"
    if residual:
        inputs.append(info("z", ["n", 4, 8, 8] if extra != "broadcast" else [1, 4, 1, 1]))
        nodes.append(node("Add", ["c", "z"], "s"))
        src = "s"
    act_inputs = [src, "lo", "hi"] if act == "Clip" else [src]
    nodes.append(node(act, act_inputs, "y", **attrs))
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "c", extra)
    params = [init("w", _w(4, 3, 3, 3)), init("b", _w(4)), init("lo", 0.0), init("hi", 6.0)]
    return model(nodes, inputs, outputs, params)


@pytest.mark.parametrize(
    ("act", "attrs"),
    [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"alpha": 0.2}), ("Clip", {}), ("HardSigmoid", {})],
)
def test_conv_activation_becomes_fusedconv(act: str, attrs: dict[str, Any]) -> None:
    _ort(_conv_act(act, **attrs), "ort-fusedconv", {"FusedConv": 1})


def _residual_block(bias: bool = True, skip: str = "conv") -> onnx.ModelProto:
    """Relu(Conv(h) + z), h = Conv(x): z is h (a residual read from a Conv) or the input x."""
    inputs = ["h", "w", "b"] if bias else ["h", "w"]
    nodes = [
        node("Conv", ["x", "w0", "b0"], "h", pads=[1, 1, 1, 1]),
        node("Conv", inputs, "c", pads=[1, 1, 1, 1]),
        node("Add", ["c", "h" if skip == "conv" else "x"], "s"),
        node("Relu", ["s"], "y"),
    ]
    params = [init("w0", _w(4, 4, 3, 3)), init("b0", _w(4)), init("w", _w(4, 4, 3, 3)), init("b", _w(4))]
    return model(nodes, [info("x", ["n", 4, 8, 8])], ["y"], params)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_residual_relu_becomes_fusedconv_with_its_sum_input(bias: bool) -> None:
    out = _ort(_residual_block(bias), "ort-fusedconv-sum", {"Conv": 1, "FusedConv": 1})
    # onnxruntime's NCHWc layout transformer skips a FusedConv whose bias is "": a Conv
    # without one gets zeros.
    (fused,) = [n for n in out.graph.node if n.op_type == "FusedConv"]
    assert len(fused.input) == 4 and all(fused.input)


def test_a_residual_not_from_a_conv_stays_an_add() -> None:
    # onnxruntime lays out Conv outputs in blocks (NCHWc) and fuses an Add of two of them
    # itself; a FusedConv whose residual is not one stays in NCHW: measured 1.2x slower.
    details = refused(_residual_block(skip="input"), "ort-fusedconv-sum", target="ort")
    assert "not the output of a Conv" in " ".join(details["near_misses"]["conv"])


@pytest.mark.parametrize("extra", ["reader", "output"])
def test_fusedconv_refuses_a_conv_read_elsewhere(extra: str) -> None:
    refused(_conv_act(extra=extra), "ort-fusedconv", target="ort")


def test_fusedconv_refusals() -> None:
    details = refused(_conv_act(residual=True, extra="broadcast"), "ort-fusedconv-sum", target="ort")
    assert "not provably the Conv's" in " ".join(details["near_misses"]["conv"])
    refused(_conv_act(), "ort-fusedconv")  # target onnx: standard ops only
    clip = _conv_act("Clip")
    clip.graph.input.append(info("lo", []))
    clip.graph.initializer.pop(2)
    details = refused(clip, "ort-fusedconv", target="ort")
    assert "Clip bounds are not constants" in " ".join(details["near_misses"]["conv"])


# -- FusedMatMul ----------------------------------------------------------------------------------


def _scaled_matmul(op: str = "Div", transpose: bool = True, perm: list[int] | None = None) -> onnx.ModelProto:
    nodes = []
    b = "k"
    if transpose:
        nodes.append(node("Transpose", ["k"], "kt", perm=perm or [0, 2, 1]))
        b = "kt"
    nodes += [node("MatMul", ["q", b], "p"), node(op, ["p", "s"], "y")]
    k_shape = ([4, 2, 5] if perm else [2, 5, 4]) if transpose else [2, 4, 5]
    return model(nodes, [info("q", [2, 3, 4]), info("k", k_shape)], ["y"], [init("s", 8.0)])


def test_scaled_matmul_with_transposed_input_becomes_one_fusedmatmul() -> None:
    out = _ort(_scaled_matmul(), "ort-fusedmatmul-div", {"FusedMatMul": 1})
    (fused,) = out.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused.attribute}
    assert attrs["transB"] == 1 and attrs["alpha"] == pytest.approx(1 / 8)
    _ort(_scaled_matmul("Mul", transpose=False), "ort-fusedmatmul-mul", {"FusedMatMul": 1})


def test_fusedmatmul_refusals() -> None:
    details = refused(_scaled_matmul(perm=[1, 0, 2]), "ort-transpose-into-matmul-b", target="ort")
    assert "does not swap the last two dims" in " ".join(details["near_misses"]["matmul"])
    refused(_scaled_matmul(), "ort-fusedmatmul-div")
    exposed = _scaled_matmul(transpose=False)
    exposed.graph.output.append(info("p", None))
    refused(exposed, "ort-fusedmatmul-div", target="ort")


# -- standard rules that came with them -----------------------------------------------------------


def _computed_reshape(tail: list[int], allowzero: int = 0) -> onnx.ModelProto:
    return model(
        [
            node("Shape", ["x"], "shape"),
            node("Slice", ["shape", "zero", "one"], "batch"),
            node("Concat", ["batch", "tail"], "target", axis=0),
            node("Reshape", ["x", "target"], "y", allowzero=allowzero),
        ],
        [info("x", ["n", 4, 1, 1])],
        ["y"],
        [
            init("zero", np.array([0], np.int64)),
            init("one", np.array([1], np.int64)),
            init("tail", np.array(tail, np.int64)),
        ],
        opset=14,
    )


def test_a_computed_reshape_target_with_one_unknown_entry_becomes_a_constant() -> None:
    fires(_computed_reshape([4]), "reshape-one-unknown", {"Reshape": 1}, passes="shape-infer,fuse,dce")


def test_reshape_one_unknown_refusals() -> None:
    details = refused(_computed_reshape([-1]), "reshape-one-unknown")
    assert "more than one entry" in " ".join(details["near_misses"]["shape"])
    refused(_computed_reshape([4], allowzero=1), "reshape-one-unknown")


# -- BiasGelu -------------------------------------------------------------------------------------


def _bias_gelu(opset: int = 20, approximate: str = "none", bias_shape: tuple[int, ...] = (8,)) -> onnx.ModelProto:
    return model(
        [node("Add", ["x", "bias"], "h"), node("Gelu", ["h"], "y", approximate=approximate)],
        [info("x", ["b", 3, 8])],
        ["y"],
        [init("bias", _w(*bias_shape))],
        opset=opset,
    )


def test_gelu_of_a_biased_input_becomes_biasgelu_or_fastgelu() -> None:
    _ort(_bias_gelu(), "ort-biasgelu", {"BiasGelu": 1})
    _ort(_bias_gelu(approximate="tanh"), "ort-biasgelu", {"FastGelu": 1})


def test_biasgelu_refusals() -> None:
    details = refused(_bias_gelu(bias_shape=(3, 8)), "ort-biasgelu", target="ort")  # not a vector
    exposed = _bias_gelu()
    exposed.graph.output.append(info("h", None))
    refused(exposed, "ort-biasgelu", target="ort")
    refused(_bias_gelu(), "ort-biasgelu")
    assert details["applied"] == {}


# -- SkipLayerNormalization / SkipSimplifiedLayerNormalization ------------------------------------


def _skip_norm(
    norm: str = "LayerNormalization", bias: bool = True, carry: bool = False, skip_shape: list[Any] | None = None
) -> onnx.ModelProto:
    nodes = [node("MatMul", ["x", "w"], "p")]
    src = "p"
    if bias:
        nodes.append(node("Add", ["bias", "p"], "pb"))
        src = "pb"
    nodes.append(node("Add", [src, "skip"], "sum"))
    if norm == "LayerNormalization":
        nodes.append(node(norm, ["sum", "gamma", "beta"], "y", epsilon=1e-5))
    elif norm == "RMSNormalization":
        nodes.append(node(norm, ["sum", "gamma"], "y", epsilon=1e-5))
    else:  # decomposed RMSNorm
        nodes += [
            node("Mul", ["sum", "sum"], "sq"),
            node("ReduceMean", ["sq"], "ms", axes=[-1]),
            node("Add", ["ms", "eps"], "me"),
            node("Sqrt", ["me"], "r"),
            node("Div", ["sum", "r"], "n"),
            node("Mul", ["n", "gamma"], "y"),
        ]
    outputs: list[Any] = ["y"]
    if carry:
        nodes.append(node("Relu", ["sum"], "carried"))
        outputs.append("carried")
    params = [init("w", _w(8, 8)), init("bias", _w(8)), init("gamma", _w(8)), init("beta", _w(8)), init("eps", 1e-5)]
    inputs = [info("x", ["b", 3, 8]), info("skip", skip_shape or ["b", 3, 8])]
    return model(nodes, inputs, outputs, params, opset=23 if norm == "RMSNormalization" else 17)


def test_layernorm_of_a_biased_residual_becomes_skiplayernorm() -> None:
    _ort(_skip_norm(), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})
    _ort(_skip_norm(bias=False), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})


def test_a_residual_read_further_on_comes_from_the_fourth_output() -> None:
    out = _ort(_skip_norm(carry=True), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1, "Relu": 1})
    skip, relu = out.graph.node[1], out.graph.node[2]
    assert relu.input[0] == skip.output[3]


@pytest.mark.parametrize("norm", ["RMSNormalization", "decomposed"])
def test_rmsnorm_of_a_residual_becomes_skipsimplifiedlayernorm(norm: str) -> None:
    rule = "ort-skiprmsnorm" if norm == "RMSNormalization" else "ort-skiprmsnorm-decomposed"
    _ort(_skip_norm(norm, carry=True), rule, {"MatMul": 1, "SkipSimplifiedLayerNormalization": 1, "Relu": 1})


def test_skip_norm_refusals() -> None:
    details = refused(_skip_norm(skip_shape=[1, 3, 8]), "ort-skiplayernorm", target="ort", enable=["norm"])
    assert "do not provably have one" in " ".join(details["near_misses"]["norm"])
    refused(_skip_norm(), "ort-skiplayernorm", enable=["norm"])  # target onnx
    refused(_skip_norm(), "ort-skiplayernorm", target="ort")  # off by default: slower in onnxruntime
    exposed = _skip_norm()
    exposed.graph.output.append(info("pb", None))
    out, _ = fuse(exposed, target="ort", enable=["norm"])
    assert "Add" in {n.op_type for n in out.graph.node}  # the bias stays outside; the Add is not fused away


# -- Attention ------------------------------------------------------------------------------------

HEADS, SIZE = 2, 4
HIDDEN = HEADS * SIZE


def _attention(mask: str = "raw", packed: bool = False, fp16: bool = False, extra: str = "") -> onnx.ModelProto:
    """One attention layer as torch exports it: projections, head split, scores, mask, merge."""
    nodes: list[onnx.NodeProto] = []
    params = [
        init("split_shape", np.array([0, 0, HEADS, SIZE], np.int64)),
        init("merge_shape", np.array([0, 0, HIDDEN], np.int64)),
        init("scale", float(np.sqrt(SIZE))),
    ]
    if packed:
        params += [init("w", _w(HIDDEN, 3 * HIDDEN)), init("b", _w(3 * HIDDEN))]
        nodes += [node("MatMul", ["x", "w"], "qkv_mm"), node("Add", ["qkv_mm", "b"], "qkv")]
        nodes.append(node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2))
        params.append(init("sizes", np.array([HIDDEN] * 3, np.int64)))
    for part in "qkv" if not packed else "":
        weight = _w(HIDDEN, HIDDEN)
        if fp16:
            params.append(init(f"w{part}16", weight.astype(np.float16)))
            nodes.append(node("Cast", [f"w{part}16"], f"w{part}", to=onnx.TensorProto.FLOAT))
        else:
            params.append(init(f"w{part}", weight))
        params.append(init(f"b{part}", _w(HIDDEN)))
        nodes += [node("MatMul", ["x", f"w{part}"], f"{part}_mm"), node("Add", [f"b{part}", f"{part}_mm"], part)]
    for part, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            node("Reshape", [part, "split_shape"], f"{part}_4d"),
            node("Transpose", [f"{part}_4d"], f"{part}_t", perm=perm),
        ]
    nodes += [node("MatMul", ["q_t", "k_t"], "scores"), node("Div", ["scores", "scale"], "scaled")]
    inputs = [info("x", ["b", "s", HIDDEN])]
    probs_in = "scaled"
    if mask == "raw":
        inputs.append(info("attention_mask", ["b", "s"], onnx.TensorProto.INT64))
        params += [init("axes", np.array([1, 2], np.int64)), init("one", 1.0), init("fill", -10000.0)]
        nodes += [
            node("Unsqueeze", ["attention_mask", "axes"], "m4"),
            node("Cast", ["m4"], "mf", to=onnx.TensorProto.FLOAT),
            node("Sub", ["one", "mf"], "inv"),
            node("Mul", ["inv", "fill"], "additive"),
            node("Add", ["scaled", "additive"], "masked"),
        ]
        probs_in = "masked"
    elif mask == "bias":
        inputs.append(info("bias", ["b", 1, 1, "s"]))
        nodes.append(node("Add", ["scaled", "bias"], "masked"))
        probs_in = "masked"
    nodes += [
        node("Softmax", [probs_in], "probs", axis=-1),
        node("MatMul", ["probs", "v_t"], "ctx"),
        node("Transpose", ["ctx"], "ctx_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "merge_shape"], "y"),
    ]
    outputs: list[Any] = ["y"]
    if extra == "output":
        outputs.append("probs")
    if extra == "split-input":  # the head count comes from the caller: not provable
        inputs.append(info("split_shape", [4], onnx.TensorProto.INT64))
        params = params[1:]
    return model(nodes, inputs, outputs, params)


def _masked_feeds() -> dict[str, np.ndarray]:
    mask = np.ones((2, 5), np.int64)
    mask[0, 3:] = 0
    return {"x": RNG.standard_normal((2, 5, HIDDEN)).astype(np.float32), "attention_mask": mask}


@pytest.mark.parametrize(("packed", "fp16"), [(False, False), (True, False), (False, True)])
def test_attention_layer_becomes_one_contrib_attention(packed: bool, fp16: bool) -> None:
    rule = "ort-attention-packed" if packed else "ort-attention"
    expected = {"Attention": 1, "Cast": 2 if fp16 else 1}
    proto = _attention(packed=packed, fp16=fp16)
    out = _ort(proto, rule, expected, passes="shape-infer,fuse,dce")
    assert_same_outputs(proto, out, _masked_feeds(), rtol=1e-4, atol=1e-4)  # a mask with zeros
    attention = next(n for n in out.graph.node if n.op_type == "Attention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["num_heads"] == HEADS and attrs["mask_filter_value"] == pytest.approx(-10000.0)


def test_an_additive_mask_becomes_the_attention_bias() -> None:
    out = _ort(_attention(mask="bias"), "ort-attention", {"Attention": 1, "Shape": 1, "Concat": 1, "Expand": 1})
    assert len(next(n for n in out.graph.node if n.op_type == "Attention").input) == 6


def test_attention_refusals() -> None:
    refused(_attention(extra="output"), "ort-attention", target="ort")
    split_input = _attention(extra="split-input")
    feeds = {**_masked_feeds(), "split_shape": np.array([0, 0, HEADS, SIZE], np.int64)}
    out, details = fuse(split_input, target="ort")
    assert "ort-attention" not in details["applied"]
    assert "not provable" in " ".join(details["near_misses"]["attention"])
    assert_same_outputs(split_input, out, feeds)
    out, details = fuse(_attention(), target="onnx")
    assert "ort-attention" not in details["applied"]


# -- Pad into Conv and pooling; Gemm / MatMul + BatchNormalization -------------------------------


def _padded(consumer: str, pads: list[int], fill: float = 0.0, extra: str = "") -> onnx.ModelProto:
    params = [init("pads", np.array(pads, np.int64)), init("fill", fill), init("w", _w(4, 3, 3, 3))]
    attrs: dict[str, Any] = {"kernel_shape": [3, 3]} if consumer != "Conv" else {}
    inputs = ["p", "w"] if consumer == "Conv" else ["p"]
    nodes = [node("Pad", ["x", "pads", "fill"], "p", mode="constant"), node(consumer, inputs, "y", **attrs)]
    outputs: list[Any] = ["y"]
    if extra == "output":
        outputs.append("p")
    return model(nodes, [info("x", [1, 3, 6, 6])], outputs, params)


@pytest.mark.parametrize(("consumer", "fill"), [("Conv", 0.0), ("AveragePool", 0.0), ("MaxPool", -np.inf)])
def test_a_spatial_pad_goes_into_the_consumer(consumer: str, fill: float) -> None:
    fires(_padded(consumer, [0, 0, 1, 2, 0, 0, 2, 1], fill), "pad-into-consumer", {consumer: 1})


def test_a_pad_goes_into_a_fusedconv() -> None:
    proto = _padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1])
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
            params.append(init(f"w{k}", _w(4, 3, 3, 3)))
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
    details = refused(_padded("MaxPool", [0, 0, 1, 1, 0, 0, 1, 1], 0.0), "pad-into-consumer")
    assert "not -inf" in " ".join(details["near_misses"]["conv"])
    details = refused(_padded("AveragePool", [0, 1, 1, 1, 0, 0, 1, 1]), "pad-into-consumer")
    assert "channel dims" in " ".join(details["near_misses"]["conv"])
    refused(_padded("Conv", [0, 0, 1, 1, 0, 0, 1, 1], extra="output"), "pad-into-consumer")


def _gemm_bn(op: str = "Gemm", shape: list[Any] | None = None, extra: str = "") -> onnx.ModelProto:
    inputs = ["a", "w", "c"] if op == "Gemm" else ["a", "w"]
    attrs = {"transB": 1, "alpha": 0.5, "beta": 2.0} if op == "Gemm" else {}
    nodes = [
        node(op, inputs, "p", **attrs),
        node("BatchNormalization", ["p", "gamma", "beta", "mean", "var"], "y", epsilon=1e-3),
    ]
    weight = _w(4, 3) if op == "Gemm" else _w(3, 4)
    params = [init("w", weight), init("c", _w(4)), init("gamma", _w(4)), init("beta", _w(4)), init("mean", _w(4))]
    params.append(init("var", np.abs(_w(4)) + 0.5))
    outputs: list[Any] = ["y"]
    if extra == "output":
        outputs.append("p")
    return model(nodes, [info("a", shape or ["n", 3])], outputs, params)


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_gemm_or_matmul_with_batchnorm_becomes_one_gemm(op: str) -> None:
    fires(_gemm_bn(op), "gemm-bn", {"Gemm": 1})


def test_gemm_bn_refusals() -> None:
    details = refused(_gemm_bn("MatMul", shape=["n", 4, 3]), "gemm-bn")
    assert "not 2-D" in " ".join(details["near_misses"]["conv"])
    refused(_gemm_bn(extra="output"), "gemm-bn")


# -- EmbedLayerNormalization ----------------------------------------------------------------------


def _embed(extra: str = "none", ids_type: int = onnx.TensorProto.INT64, axis: int = -1) -> onnx.ModelProto:
    """BERT's embeddings as torch exports them: word[ids] + (segment[token types] or a constant
    row, or nothing) + position[position_ids[:, :S]], then LayerNormalization."""
    params = [
        init("word_table", _w(10, 8)),
        init("position_table", _w(16, 8)),
        init("position_ids", np.arange(16, dtype=np.int64).reshape(1, 16)),
        init("zero", np.array([0], np.int64)),
        init("one", np.array([1], np.int64)),
        init("gamma", _w(8)),
        init("beta", _w(8)),
    ]
    inputs = [info("input_ids", ["b", "s"], ids_type)]
    nodes = [
        node("Shape", ["input_ids"], "seq", start=1),
        node("Slice", ["position_ids", "zero", "seq", "one"], "positions"),
        node("Gather", ["word_table", "input_ids"], "words", axis=0),
        node("Gather", ["position_table", "positions"], "placed", axis=0),
    ]
    words = "words"
    if extra == "segment":
        params.append(init("segment_table", _w(2, 8)))
        inputs.append(info("token_type_ids", ["b", "s"], onnx.TensorProto.INT64))
        nodes.append(node("Gather", ["segment_table", "token_type_ids"], "segments", axis=0))
        nodes.append(node("Add", ["words", "segments"], "typed"))
        words = "typed"
    elif extra in ("row", "reader", "output"):
        params.append(init("row", _w(8)))
        nodes.append(node("Add", ["words", "row"], "typed"))
        words = "typed"
    elif extra == "position-input":
        inputs.append(info("given_positions", [1, "s"], onnx.TensorProto.INT64))
        nodes[3] = node("Gather", ["position_table", "given_positions"], "placed", axis=0)
    nodes.append(node("Add", ["placed", words], "summed"))
    nodes.append(node("LayerNormalization", ["summed", "gamma", "beta"], "y", axis=axis, epsilon=1e-12))
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "typed", extra)
    return model(nodes, inputs, outputs, params)


@pytest.mark.parametrize("extra", ["none", "segment", "row"])
def test_bert_embeddings_become_embedlayernorm(extra: str) -> None:
    expected = {"EmbedLayerNormalization": 1, "Cast": 1 + (extra == "segment")}
    out = _ort(_embed(extra), "ort-embedlayernorm", expected, passes="shape-infer,fuse,dce")
    assert [n.op_type for n in out.graph.node][-1] == "EmbedLayerNormalization"


def test_int32_ids_need_no_cast() -> None:
    _ort(
        _embed(ids_type=onnx.TensorProto.INT32),
        "ort-embedlayernorm",
        {"EmbedLayerNormalization": 1},
        "shape-infer,fuse,dce",
    )


def test_embedlayernorm_refusals() -> None:
    for extra in ("reader", "output"):
        refused(_embed(extra), "ort-embedlayernorm", target="ort", enable=["embed"])
    details = refused(_embed(axis=1), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not over the last axis" in " ".join(details["near_misses"]["embed"])
    details = refused(_embed("position-input"), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not provably 0 .. S-1" in " ".join(details["near_misses"]["embed"])
    refused(_embed(), "ort-embedlayernorm", enable=["embed"])  # target onnx
    refused(_embed(), "ort-embedlayernorm", target="ort")  # off by default: slower in onnxruntime
