"""The models the fuse rule tests build: one builder per rule pattern (and its variants),
shared by the rule's own tests and by the table-driven negative tests (tests/passes/fuse)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from tests.passes.fuse_helpers import expose, info, init, model, node

RNG = np.random.default_rng(1)


def rand_weight(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- the --target ort rules ------------------------------------------------------------------


def conv_act(act: str = "Relu", extra: str = "", residual: bool = False, **attrs: Any) -> onnx.ModelProto:
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
    params = [init("w", rand_weight(4, 3, 3, 3)), init("b", rand_weight(4)), init("lo", 0.0), init("hi", 6.0)]
    return model(nodes, inputs, outputs, params)


def residual_block(bias: bool = True, skip: str = "conv") -> onnx.ModelProto:
    """Relu(Conv(h) + z), h = Conv(x): z is h (a residual read from a Conv) or the input x."""
    inputs = ["h", "w", "b"] if bias else ["h", "w"]
    nodes = [
        node("Conv", ["x", "w0", "b0"], "h", pads=[1, 1, 1, 1]),
        node("Conv", inputs, "c", pads=[1, 1, 1, 1]),
        node("Add", ["c", "h" if skip == "conv" else "x"], "s"),
        node("Relu", ["s"], "y"),
    ]
    params = [
        init("w0", rand_weight(4, 4, 3, 3)),
        init("b0", rand_weight(4)),
        init("w", rand_weight(4, 4, 3, 3)),
        init("b", rand_weight(4)),
    ]
    return model(nodes, [info("x", ["n", 4, 8, 8])], ["y"], params)


def scaled_matmul(op: str = "Div", transpose: bool = True, perm: list[int] | None = None) -> onnx.ModelProto:
    nodes = []
    b = "k"
    if transpose:
        nodes.append(node("Transpose", ["k"], "kt", perm=perm or [0, 2, 1]))
        b = "kt"
    nodes += [node("MatMul", ["q", b], "p"), node(op, ["p", "s"], "y")]
    k_shape = ([4, 2, 5] if perm else [2, 5, 4]) if transpose else [2, 4, 5]
    return model(nodes, [info("q", [2, 3, 4]), info("k", k_shape)], ["y"], [init("s", 8.0)])


def computed_reshape(tail: list[int], allowzero: int = 0) -> onnx.ModelProto:
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


def bias_gelu(opset: int = 20, approximate: str = "none", bias_shape: tuple[int, ...] = (8,)) -> onnx.ModelProto:
    return model(
        [node("Add", ["x", "bias"], "h"), node("Gelu", ["h"], "y", approximate=approximate)],
        [info("x", ["b", 3, 8])],
        ["y"],
        [init("bias", rand_weight(*bias_shape))],
        opset=opset,
    )


def skip_norm(
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
    params = [
        init("w", rand_weight(8, 8)),
        init("bias", rand_weight(8)),
        init("gamma", rand_weight(8)),
        init("beta", rand_weight(8)),
        init("eps", 1e-5),
    ]
    inputs = [info("x", ["b", 3, 8]), info("skip", skip_shape or ["b", 3, 8])]
    return model(nodes, inputs, outputs, params, opset=23 if norm == "RMSNormalization" else 17)


HEADS, SIZE = 2, 4


HIDDEN = HEADS * SIZE
WINDOW = 4  # tokens per window of ort_attention(windows=...)


def ort_attention(
    mask: str = "raw", packed: bool = False, fp16: bool = False, extra: str = "", windows: int = 0
) -> onnx.ModelProto:
    """One attention layer as torch exports it: projections, head split, scores, mask, merge. ``windows``:
    Swin's windowed attention instead, its input (b, windows, WINDOW, HIDDEN) attended per window (a batch of
    b * windows) with a learned per-head position bias (1, HEADS, WINDOW, WINDOW) as the mask."""
    nodes: list[onnx.NodeProto] = []
    params = [
        init("split_shape", np.array([0, 0, HEADS, SIZE], np.int64)),
        init("merge_shape", np.array([0, 0, HIDDEN], np.int64)),
        init("scale", float(np.sqrt(SIZE))),
    ]
    inputs = [info("x", ["b", "s", HIDDEN])]
    if windows:
        mask = "position"
        inputs = [info("x_windows", ["b", windows, WINDOW, HIDDEN])]
        params += [
            init("rows", np.array([-1, WINDOW, HIDDEN], np.int64)),
            init("bias", rand_weight(1, HEADS, WINDOW, WINDOW)),
        ]
        nodes.append(node("Reshape", ["x_windows", "rows"], "x"))
    if packed:
        params += [init("w", rand_weight(HIDDEN, 3 * HIDDEN)), init("b", rand_weight(3 * HIDDEN))]
        nodes += [node("MatMul", ["x", "w"], "qkv_mm"), node("Add", ["qkv_mm", "b"], "qkv")]
        nodes.append(node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2))
        params.append(init("sizes", np.array([HIDDEN] * 3, np.int64)))
    for part in "qkv" if not packed else "":
        weight = rand_weight(HIDDEN, HIDDEN)
        if fp16:
            params.append(init(f"w{part}16", weight.astype(np.float16)))
            nodes.append(node("Cast", [f"w{part}16"], f"w{part}", to=onnx.TensorProto.FLOAT))
        else:
            params.append(init(f"w{part}", weight))
        params.append(init(f"b{part}", rand_weight(HIDDEN)))
        nodes += [node("MatMul", ["x", f"w{part}"], f"{part}_mm"), node("Add", [f"b{part}", f"{part}_mm"], part)]
    for part, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            node("Reshape", [part, "split_shape"], f"{part}_4d"),
            node("Transpose", [f"{part}_4d"], f"{part}_t", perm=perm),
        ]
    nodes += [node("MatMul", ["q_t", "k_t"], "scores"), node("Div", ["scores", "scale"], "scaled")]
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
    elif mask in ("bias", "position"):
        if mask == "bias":
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


def masked_feeds() -> dict[str, np.ndarray]:
    mask = np.ones((2, 5), np.int64)
    mask[0, 3:] = 0
    return {"x": RNG.standard_normal((2, 5, HIDDEN)).astype(np.float32), "attention_mask": mask}


def padded(consumer: str, pads: list[int], fill: float = 0.0, extra: str = "") -> onnx.ModelProto:
    params = [init("pads", np.array(pads, np.int64)), init("fill", fill), init("w", rand_weight(4, 3, 3, 3))]
    attrs: dict[str, Any] = {"kernel_shape": [3, 3]} if consumer != "Conv" else {}
    inputs = ["p", "w"] if consumer == "Conv" else ["p"]
    nodes = [node("Pad", ["x", "pads", "fill"], "p", mode="constant"), node(consumer, inputs, "y", **attrs)]
    outputs: list[Any] = ["y"]
    if extra == "output":
        outputs.append("p")
    return model(nodes, [info("x", [1, 3, 6, 6])], outputs, params)


def gemm_bn(op: str = "Gemm", shape: list[Any] | None = None, extra: str = "") -> onnx.ModelProto:
    inputs = ["a", "w", "c"] if op == "Gemm" else ["a", "w"]
    attrs = {"transB": 1, "alpha": 0.5, "beta": 2.0} if op == "Gemm" else {}
    nodes = [
        node(op, inputs, "p", **attrs),
        node("BatchNormalization", ["p", "gamma", "beta", "mean", "var"], "y", epsilon=1e-3),
    ]
    weight = rand_weight(4, 3) if op == "Gemm" else rand_weight(3, 4)
    params = [
        init("w", weight),
        init("c", rand_weight(4)),
        init("gamma", rand_weight(4)),
        init("beta", rand_weight(4)),
        init("mean", rand_weight(4)),
    ]
    params.append(init("var", np.abs(rand_weight(4)) + 0.5))
    outputs: list[Any] = ["y"]
    if extra == "output":
        outputs.append("p")
    return model(nodes, [info("a", shape or ["n", 3])], outputs, params)


def embed(extra: str = "none", ids_type: int = onnx.TensorProto.INT64, axis: int = -1) -> onnx.ModelProto:
    """BERT's embeddings as torch exports them: word[ids] + (segment[token types] or a constant
    row, or nothing) + position[position_ids[:, :S]], then LayerNormalization."""
    params = [
        init("word_table", rand_weight(10, 8)),
        init("position_table", rand_weight(16, 8)),
        init("position_ids", np.arange(16, dtype=np.int64).reshape(1, 16)),
        init("zero", np.array([0], np.int64)),
        init("one", np.array([1], np.int64)),
        init("gamma", rand_weight(8)),
        init("beta", rand_weight(8)),
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
        params.append(init("segment_table", rand_weight(2, 8)))
        inputs.append(info("token_type_ids", ["b", "s"], onnx.TensorProto.INT64))
        nodes.append(node("Gather", ["segment_table", "token_type_ids"], "segments", axis=0))
        nodes.append(node("Add", ["words", "segments"], "typed"))
        words = "typed"
    elif extra in ("row", "reader", "output"):
        params.append(init("row", rand_weight(8)))
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


# -- the standard fuse rules ------------------------------------------------------------------


def conv_bn(extra: str = "", gamma_input: bool = False) -> onnx.ModelProto:
    params = [
        init("w", rand_weight(4, 3, 3, 3)),
        init("b", rand_weight(4)),
        init("beta", rand_weight(4)),
        init("mean", rand_weight(4)),
    ]
    params.append(init("var", np.abs(rand_weight(4)) + 0.5))
    inputs = [info("x", [1, 3, 8, 8])]
    if gamma_input:
        inputs.append(info("gamma", [4]))
    else:
        params.append(init("gamma", rand_weight(4)))
    nodes = [
        node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], "y", epsilon=1e-3),
    ]
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "c", extra)
    return model(nodes, inputs, outputs, params)


def conv_branches(depthwise: bool = False, combine: str = "Add") -> onnx.ModelProto:
    """A MobileOne-style block: Conv3x3(x) + Conv1x1(x), then ``combine`` with BatchNormalization(x)
    (FastViT's RepMixer subtracts it); ``depthwise``: every Conv one group per channel."""
    group = 4 if depthwise else 1
    nodes = [
        node("Conv", ["x", "w3", "b3"], "c3", pads=[1, 1, 1, 1], group=group),
        node("Conv", ["x", "w1", "b1"], "c1", group=group),
        node("Add", ["c3", "c1"], "s"),
        node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"], "n", epsilon=1e-3),
        node(combine, ["s", "n"], "y"),
    ]
    params = [
        init("w3", rand_weight(4, 4 // group, 3, 3)),
        init("b3", rand_weight(4)),
        init("w1", rand_weight(4, 4 // group, 1, 1)),
        init("b1", rand_weight(4)),
        init("gamma", rand_weight(4)),
        init("beta", rand_weight(4)),
        init("mean", rand_weight(4)),
        init("var", np.abs(rand_weight(4)) + 0.5),
    ]
    return model(nodes, [info("x", [1, 4, 6, 6])], ["y"], params)


def conv_channel(c: np.ndarray, op: str = "Mul", through_transpose: bool = True) -> onnx.ModelProto:
    nodes = [node("Conv", ["x", "w", "b"], "c")]
    src = "c"
    if through_transpose:
        nodes.append(node("Transpose", ["c"], "t", perm=[0, 2, 3, 1]))
        src = "t"
    nodes.append(node(op, [src, "k"], "y"))
    return model(
        nodes,
        [info("x", [1, 3, 5, 5])],
        ["y"],
        [init("w", rand_weight(4, 3, 1, 1)), init("b", rand_weight(4)), init("k", c)],
    )


def conv_input_scale(
    c: np.ndarray, channels: int = 4, group: int = 2, shift: np.ndarray | None = None, pad: int = 1
) -> onnx.ModelProto:
    """Conv(x * c (+ shift), W) of 4 input channels in ``group`` groups, 3x3, zero-padded by ``pad``; ``x`` has
    ``channels`` channels."""
    nodes = [node("Mul", ["x", "k"], "m")]
    params = [init("w", rand_weight(6, 4 // group, 3, 3)), init("b", rand_weight(6)), init("k", c)]
    if shift is not None:
        nodes.append(node("Add", ["m", "d"], "a"))
        params.append(init("d", shift))
    nodes.append(node("Conv", [nodes[-1].output[0], "w", "b"], "y", group=group, pads=[pad] * 4))
    return model(nodes, [info("x", [1, channels, 5, 5])], ["y"], params)


def matmul_add(a_shape: list[Any], extra_reader: bool = False) -> onnx.ModelProto:
    nodes = [node("MatMul", ["a", "w"], "p"), node("Add", ["p", "b"], "y")]
    outputs: list[Any] = ["y"]
    if extra_reader:
        nodes.append(node("Relu", ["p"], "r"))
        outputs.append("r")
    return model(nodes, [info("a", a_shape)], outputs, [init("w", rand_weight(3, 4)), init("b", rand_weight(4))])


def erf_gelu_nodes(x: str, y: str, tag: str = "") -> list[onnx.NodeProto]:
    """y = x * (1 + erf(x / sqrt 2)) * 0.5, its half last (onnxruntime's Gelu fusion takes it whole); the inner
    values named with ``tag``, the constants :func:`gelu_constants`."""
    return [
        node("Div", [x, "sqrt2"], f"{tag}d"),
        node("Erf", [f"{tag}d"], f"{tag}e"),
        node("Add", [f"{tag}e", "one"], f"{tag}p"),
        node("Mul", [x, f"{tag}p"], f"{tag}m"),
        node("Mul", [f"{tag}m", "half"], y),
    ]


def gelu_constants() -> list[onnx.TensorProto]:
    return [init("sqrt2", math.sqrt(2)), init("one", 1.0), init("half", 0.5)]


def erf_gelu(opset: int) -> onnx.ModelProto:
    return model(erf_gelu_nodes("x", "y"), [info("x", [2, 5])], ["y"], gelu_constants(), opset=opset)


def tanh_gelu(opset: int) -> onnx.ModelProto:
    return model(
        [
            node("Pow", ["x", "three"], "cube"),
            node("Mul", ["cube", "k"], "kc"),
            node("Add", ["x", "kc"], "inner"),
            node("Mul", ["inner", "c"], "scaled"),
            node("Tanh", ["scaled"], "t"),
            node("Add", ["one", "t"], "p"),
            node("Mul", ["half", "x"], "hx"),
            node("Mul", ["hx", "p"], "y"),
        ],
        [info("x", [2, 5])],
        ["y"],
        [
            init("three", 3.0),
            init("k", 0.044715),
            init("c", math.sqrt(2 / math.pi)),
            init("one", 1.0),
            init("half", 0.5),
        ],
        opset=opset,
    )


def hardswish(opset: int, high: float = 6.0) -> onnx.ModelProto:
    return model(
        [
            node("Add", ["x", "three"], "a"),
            node("Clip", ["a", "lo", "hi"], "c"),
            node("Mul", ["x", "c"], "m"),
            node("Div", ["m", "six"], "y"),
        ],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", high), init("six", 6.0)],
        opset=opset,
    )


def _normalized(x: str, out: str, axes: list[int], opset: int) -> list[onnx.NodeProto]:
    """(x - mean) / sqrt(var + eps) spelled out over ``axes`` (an attribute below opset 18,
    else the input "axes"); reads the initializers "two" and "eps"."""
    reduce = {"axes": axes} if opset < 18 else {}
    axes_input = [] if reduce else ["axes"]
    return [
        node("ReduceMean", [x, *axes_input], "mean", **reduce),
        node("Sub", [x, "mean"], "d"),
        node("Pow", ["d", "two"], "sq"),
        node("ReduceMean", ["sq", *axes_input], "var", **reduce),
        node("Add", ["var", "eps"], "ve"),
        node("Sqrt", ["ve"], "std"),
        node("Div", ["d", "std"], out),
    ]


def layer_norm(opset: int = 17, gamma_input: bool = False, axes: list[int] | None = None) -> onnx.ModelProto:
    inputs = [info("x", ["b", 3, 8])] + ([info("gamma", [8])] if gamma_input else [])
    params = [init("two", 2.0), init("eps", 1e-5), init("beta", rand_weight(8))]
    params += [] if gamma_input else [init("gamma", rand_weight(8))]
    nodes = _normalized("x", "n", axes or [-1], opset)
    nodes += [node("Mul", ["n", "gamma"], "g"), node("Add", ["g", "beta"], "y")]
    return model(nodes, inputs, ["y"], params, opset=opset)


def keras_layer_norm(mean: str = "GlobalAveragePool", rank: int = 3, extra: str = "") -> onnx.ModelProto:
    """Keras' LayerNormalization as tf2onnx writes it (tf.nn.moments, then
    tf.nn.batch_normalization): both means of a rank-3 x over its last axis become
    GlobalAveragePool (tf2onnx's global pool optimizer; ``mean="ReduceMean"`` keeps them),
    SquaredDifference is Sub and Mul, Rsqrt is Sqrt and Reciprocal, and the affine part is
    ``x * inv + (beta - mean * inv)`` with ``inv = gamma / Sqrt(var + eps)``."""

    def reduce(x: str, out: str) -> onnx.NodeProto:
        if mean == "GlobalAveragePool":
            return node("GlobalAveragePool", [x], out)
        return node("ReduceMean", [x], out, axes=list(range(2, rank)), keepdims=1)

    nodes = [
        reduce("x", "mean"),
        node("Sub", ["x", "mean"], "d"),
        node("Mul", ["d", "d"], "sq"),
        reduce("sq", "var"),
        node("Add", ["var", "eps"], "ve"),
        node("Sqrt", ["ve"], "std"),
        node("Reciprocal", ["std"], "r"),
        node("Mul", ["r", "gamma"], "inv"),
        node("Mul", ["x", "inv"], "xi"),
        node("Mul", ["mean", "inv"], "mi"),
        node("Sub", ["beta", "mi"], "off"),
        node("Add", ["xi", "off"], "y"),
    ]
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "inv", extra)
    normalized = [8] * (rank - 2)
    params = [init("eps", 1e-6), init("gamma", rand_weight(*normalized)), init("beta", rand_weight(*normalized))]
    return model(nodes, [info("x", ["b", 3, *normalized])], outputs, params, opset=17)


def group_norm(
    form: str = "instance",
    opset: int = 21,
    extra: str = "",
    channels: int | str = 6,
    groups: int = 3,
    axes: list[int] | None = None,
    gamma: np.ndarray | None = None,
) -> onnx.ModelProto:
    """GroupNorm over 6 channels as the PyTorch exporter writes it ("instance") or spelled out
    with means over the groups ("decomposed")."""
    nodes = [node("Reshape", ["x", "group_shape"], "split")]
    params = [init("group_shape", np.array([0, groups, -1], np.int64)), init("eps", 1e-5), init("two", 2.0)]
    affine = (6, 1, 1) if isinstance(channels, int) else ()  # a symbolic channel dim takes scalars
    params += [init("gamma", rand_weight(*affine) if gamma is None else gamma), init("beta", rand_weight(*affine))]
    if form == "instance":
        params += [init("in_scale", np.abs(rand_weight(groups)) + 0.5), init("in_bias", rand_weight(groups))]
        nodes.append(node("InstanceNormalization", ["split", "in_scale", "in_bias"], "grouped", epsilon=1e-3))
    else:
        params.append(init("axes", np.array(axes or [-1], np.int64)))
        nodes += _normalized("split", "grouped", axes or [-1], opset)
    nodes += [
        node("Shape", ["x"], "x_shape"),
        node("Reshape", ["grouped", "x_shape"], "merged"),
        node("Mul", ["merged", "gamma"], "scaled"),
        node("Add", ["scaled", "beta"], "y"),
    ]
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "grouped", extra)
    return model(nodes, [info("x", ["b", channels, 4, 5])], outputs, params, opset=opset)


def exported_group_norm(
    split: str = "zero",
    back: str = "shape",
    dims: tuple[int | str | None, ...] = ("batch", 32, 4, 6),
    groups: int = 8,
    silu: bool = False,
    elem_type: int = TensorProto.FLOAT,
    in_scale: np.ndarray | None = None,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
) -> onnx.ModelProto:
    """nn.GroupNorm as PyTorch's exporters write it (diffusers' UNets and VAEs, 8 groups of 32 channels here):
    Reshape(x, split) / InstanceNormalization(ones, zeros over the groups) / Reshape(., back) / Mul(gamma (C, 1, 1))
    / Add(beta (C, 1, 1)), then SiLU (Sigmoid, Mul) where ``silu``.

    ``split``: "zero" [0, G, -1] (both exporters at a dynamic batch), "static" [N, G, -1] (the dynamo exporter at a
    static batch), "read" Concat(Shape(x, 0, 1), [G], [-1]). ``back``: "shape" Shape(x) (TorchScript), "shape-start"
    Shape(x, start=0) (dynamo), "zero" [0, C, H, W] and "inferred" [-1, C, H, W] (Shape(x) folded where only the
    batch is dynamic), "gathered" x's dims read one by one (Shape / Gather / Unsqueeze / Concat); the refusals:
    "swapped" [0, C, W, H], "flat" [0, C, -1]."""
    channels, spatial = int(dims[1]), dims[2:]  # type: ignore[arg-type]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    shape = [0, channels, *spatial]
    nodes, params = [], [init("ones", np.ones(groups), dtype), init("zeros", np.zeros(groups), dtype)]
    if split == "read":
        nodes.append(node("Shape", ["x"], "batch", start=0, end=1))
        nodes.append(node("Concat", ["batch", "groups", "rest"], "group_shape", axis=0))
        params += [init("groups", np.array([groups], np.int64)), init("rest", np.array([-1], np.int64))]
    else:
        first = dims[0] if split == "static" else 0
        params.append(init("group_shape", np.array([first, groups, -1], np.int64)))
    nodes += [
        node("Reshape", ["x", "group_shape"], "split"),
        node("InstanceNormalization", ["split", "in_scale", "zeros"], "grouped", epsilon=1e-6),
    ]
    params.append(init("in_scale", np.ones(groups) if in_scale is None else in_scale, dtype))
    if back in ("shape", "shape-start"):
        nodes.append(node("Shape", ["x"], "back_shape", **({"start": 0} if back == "shape-start" else {})))
    elif back == "gathered":
        nodes.append(node("Shape", ["x"], "x_shape"))
        for axis in range(len(dims)):
            params.append(init(f"axis{axis}", np.array(axis, np.int64)))
            nodes.append(node("Gather", ["x_shape", f"axis{axis}"], f"dim{axis}", axis=0))
            nodes.append(node("Unsqueeze", [f"dim{axis}", "zero_axis"], f"entry{axis}"))
        nodes.append(node("Concat", [f"entry{a}" for a in range(len(dims))], "back_shape", axis=0))
        params.append(init("zero_axis", np.array([0], np.int64)))
    else:
        targets = {"zero": shape, "inferred": [-1, *shape[1:]], "swapped": [0, channels, *spatial[::-1]]}
        params.append(init("back_shape", np.array(targets.get(back, [0, channels, -1]), np.int64)))
    nodes += [
        node("Reshape", ["grouped", "back_shape"], "merged"),
        node("Mul", ["merged", "gamma"], "scaled"),
        node("Add", ["scaled", "beta"], "normed" if silu else "y"),
    ]
    if silu:
        nodes += [node("Sigmoid", ["normed"], "gate"), node("Mul", ["normed", "gate"], "y")]
    affine = (channels, *[1] * (1 if back == "flat" else len(dims) - 2))
    params.append(init("gamma", (1 + 0.1 * rand_weight(*affine)) if gamma is None else gamma, dtype))
    params.append(init("beta", rand_weight(*affine) if beta is None else beta, dtype))
    return model(nodes, [info("x", list(dims), elem_type)], [info("y", None, elem_type)], params, opset=17)


HALF = 4  # head size 8


def rope_model(
    cos: str = "gathered", opset: int = 23, extra: str = "", swapped: bool = False, roped: tuple[str, ...] = ("q", "k")
) -> onnx.ModelProto:
    """RoPE of q and k (batch, heads, seq, 8) as the exporters write it: x * cos +
    Concat(-x[..., 4:], x[..., :4]) * sin. cos / sin are gathered from constant tables by
    position ids ("gathered"), computed at run time from frequencies ("runtime", or
    "runtime-4d" with the heads axis), constant over a static batch ("constant"), or a
    graph input that proves nothing ("input")."""
    freqs = RNG.uniform(0, 3, (16, HALF)).astype(np.float32)
    table = np.concatenate([freqs, freqs], axis=-1)
    params = [init(n, np.array([v], np.int64)) for n, v in (("zero", 0), ("mid", HALF), ("end", 2**62), ("last", -1))]
    params.append(init("heads_axis", np.array([1], np.int64)))
    inputs = [info(x, ["b", 2, "s", 2 * HALF]) for x in roped]
    nodes: list[onnx.NodeProto] = []
    if cos == "gathered":
        params += [init("cos_table", np.cos(table)), init("sin_table", np.sin(table))]
        inputs.append(info("position_ids", ["b", "s"], TensorProto.INT64))
        for part in ("cos", "sin"):
            nodes.append(node("Gather", [f"{part}_table", "position_ids"], f"{part}_rows", axis=0))
            nodes.append(node("Unsqueeze", [f"{part}_rows", "heads_axis"], part))
    elif cos == "runtime":
        inputs.append(info("freqs", ["b", "s", HALF]))
        nodes.append(node("Concat", ["freqs", "freqs"], "emb", axis=-1))
        for part, fn in (("cos", "Cos"), ("sin", "Sin")):
            nodes += [node(fn, ["emb"], f"{part}_rows"), node("Unsqueeze", [f"{part}_rows", "heads_axis"], part)]
    elif cos == "runtime-4d":
        inputs.append(info("freqs", ["b", 1, "s", HALF]))
        nodes += [node("Concat", ["freqs", "freqs"], "emb", axis=-1), node("Cos", ["emb"], "cos")]
        nodes.append(node("Sin", ["emb"], "sin"))
    elif cos == "constant":
        inputs = [info(x, [2, 2, 5, 2 * HALF]) for x in roped]
        params += [init("cos", np.cos(table[:5])), init("sin", np.sin(table[:5]))]
    else:
        inputs += [info("cos", ["b", 1, "s", 2 * HALF]), info("sin", ["b", 1, "s", 2 * HALF])]
    outputs: list[Any] = []
    for x in roped:
        first, second = (f"{x}2", f"{x}1") if swapped else (f"{x}1", f"{x}2")
        nodes += [
            node("Slice", [x, "zero", "mid", "last"], first),
            node("Slice", [x, "mid", "end", "last"], second),
            node("Neg", [f"{x}2"], f"{x}_neg"),
            node("Concat", [f"{x}_neg", f"{x}1"], f"{x}_rot", axis=-1),
            node("Mul", [x, "cos"], f"{x}_cos"),
            node("Mul", ["sin", f"{x}_rot"], f"{x}_sin"),
            node("Add", [f"{x}_cos", f"{x}_sin"], f"{x}_roped"),
        ]
        outputs.append(f"{x}_roped")
    expose(nodes, outputs, "q_neg", extra)
    return model(nodes, inputs, outputs, params, opset=opset)


def split_projections(allowzero: int = 1, names: tuple[str, ...] = ("q", "k")) -> onnx.ModelProto:
    """Biased projections of one x [batch, seq, 8], each split to heads by a Reshape whose target
    is computed from x's Shape (both dims dynamic), as the dynamo exporter writes it."""
    nodes = [node("Shape", ["x"], "dims", end=2), node("Concat", ["dims", "heads"], "target", axis=0)]
    params = [init("heads", np.array([2, 4], np.int64))]
    for name in names:
        nodes += [
            node("MatMul", ["x", f"w_{name}"], f"{name}_product"),
            node("Add", [f"{name}_product", f"b_{name}"], f"{name}_biased"),
            node("Reshape", [f"{name}_biased", "target"], name, allowzero=allowzero),
        ]
        params += [init(f"w_{name}", rand_weight(8, 8)), init(f"b_{name}", rand_weight(8))]
    return model(nodes, [info("x", ["batch", "seq", 8])], list(names), params)


# -- the shatter rules (lowering, expose, kronecker) ---------------------------------------------


def _attention(**attrs: Any) -> onnx.ModelProto:
    """Grouped-query attention (4 query heads, 2 KV heads) with an additive mask."""
    inputs = [info("q", ["b", "s", 32]), info("k", ["b", "t", 16]), info("v", ["b", "t", 16])]
    inputs.append(info("m", ["b", 1, "s", "t"]))
    return model(
        [node("Attention", ["q", "k", "v", "m"], "y", q_num_heads=4, kv_num_heads=2, **attrs)],
        inputs,
        ["y"],
        opset=23,
    )


LOWERED: dict[str, tuple[onnx.ModelProto, int, str]] = {
    "layernorm": (
        model(
            [node("LayerNormalization", ["x", "g", "b"], "y", epsilon=1e-3)],
            [info("x", ["n", 5, 8])],
            ["y"],
            [init("g", rand_weight(8)), init("b", rand_weight(8))],
            opset=23,
        ),
        16,
        "LayerNormalization",
    ),
    "gelu": (model([node("Gelu", ["x"], "y")], [info("x", ["n", 8])], ["y"], opset=23), 17, "Gelu"),
    "gelu-tanh": (
        model([node("Gelu", ["x"], "y", approximate="tanh")], [info("x", ["n", 8])], ["y"], opset=23),
        17,
        "Gelu",
    ),
    "rmsnorm": (
        model(
            [node("RMSNormalization", ["x", "g"], "y", epsilon=1e-4)],
            [info("x", ["n", 5, 8])],
            ["y"],
            [init("g", rand_weight(8))],
            opset=23,
        ),
        17,
        "RMSNormalization",
    ),
    "groupnorm": (
        model(
            [node("GroupNormalization", ["x", "g", "b"], "y", num_groups=2)],
            [info("x", ["n", 6, 4, 4])],
            ["y"],
            [init("g", rand_weight(6)), init("b", rand_weight(6))],
            opset=23,
        ),
        17,
        "GroupNormalization",
    ),
    "attention-gqa-mask": (_attention(scale=0.3), 17, "Attention"),
    "attention-causal": (
        model(
            [node("Attention", ["q", "k", "v"], "y", q_num_heads=4, kv_num_heads=4, is_causal=1)],
            [info("q", ["b", "s", 32]), info("k", ["b", "s", 32]), info("v", ["b", "s", 32])],
            ["y"],
            opset=23,
        ),
        17,
        "Attention",
    ),
    "attention-4d-bool-mask": (
        model(
            [node("Attention", ["q", "k", "v", "m"], "y")],
            [*(info(n, [2, 4, d, 8]) for n, d in (("q", 5), ("k", 6), ("v", 6))), info("m", [5, 6], TensorProto.BOOL)],
            ["y"],
            opset=23,
        ),
        17,
        "Attention",
    ),
    "split": (
        model([node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3)], [info("x", [2, 8])], ["a", "b", "c"]),
        17,
        "Split",
    ),
}


LOWERED["split"][0].opset_import[0].version = 18


def projections(bias: bool = False, k_add: bool = False, transA: int = 0, b_input: bool = False) -> onnx.ModelProto:
    """Three projections of one 2-D activation: Gemm (transB=1), MatMul, Gemm (alpha 0.5)."""
    q_inputs = ["x", "wq", "bq"] if bias else ["x", "wq"]
    nodes = [
        node("Gemm", q_inputs, "q", transB=1, transA=transA),
        node("MatMul", ["x", "wk"], "k"),
        node("Gemm", ["x", "wv"], "v", transB=1, alpha=0.5),
    ]
    outputs: list[Any] = ["q", "v"]
    if k_add:
        nodes.append(node("Add", ["k", "bk"], "kb"))
        outputs.append("kb")
    else:
        outputs.append("k")
    params = [
        init("wk", rand_weight(64, 64)),
        init("wv", rand_weight(64, 64)),
        init("bq", rand_weight(64)),
        init("bk", rand_weight(64)),
    ]
    inputs = [info("x", ["n", 64] if not transA else [64, 64])]
    if b_input:
        inputs.append(info("wq", [64, 64]))
    else:
        params.append(init("wq", rand_weight(64, 64)))
    return model(nodes, inputs, outputs, params)


def kronecker(weight: np.ndarray, x_shape: list[Any], elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    return model(
        [node("MatMul", ["x", "w"], "y")],
        [info("x", x_shape, elem_type)],
        [info("y", None, elem_type)],
        [init("w", weight)],
    )


# -- tied weights ----------------------------------------------------------------------------

W = np.random.default_rng(0).standard_normal((10, 6)).astype(np.float32)  # [vocab, hidden]


def tied(shape: list[int | str], opset: int = 17, extra_reader: bool = False) -> object:
    nodes = [
        node("Gather", ["wte", "ids"], ["embedded"]),
        node("Add", ["embedded", "x"], ["h"]),
        node("Transpose", ["wte"], ["wte_t"], perm=[1, 0]),
        node("MatMul", ["h", "wte_t"], ["logits"]),
    ]
    outputs = ["logits"]
    if extra_reader:
        nodes.append(node("Relu", ["wte_t"], ["side"]))
        outputs.append("side")
    inputs = [info("ids", shape[:-1], 7), info("x", shape)]
    return model(nodes, inputs, outputs, [init("wte", W)], opset=opset)


def rope_variant_model(
    interleaved: bool, partial: bool, opset: int = 23, rest_start: int = HALF, odd_start: int = 1
) -> onnx.ModelProto:
    """RoPE of 4 entries of each head of q as the exporters write it: rotate half on q (batch,
    2 heads, seq, d) with cos (batch, 1, seq, 4) from Concat(f, f); or (``interleaved``, GPT-J)
    pairs on q (batch, seq, 2 heads, d) before its head transpose, ``Stack(-x[..., 1::2],
    x[..., ::2], -1)`` flattened, with cos ``repeat_interleave(Cos(f), 2)`` over (batch, seq, 1,
    4). ``partial``: d is 8 and only its first 4 rotate, the rest passed on (Phi, GPT-NeoX,
    GPT-J); else d is 4. ``f`` (batch, seq, 2) is an input."""
    r = HALF
    size = 2 * r if partial else r
    shape: list[int | str] = ["b", "s", 2, size] if interleaved else ["b", 2, "s", size]
    values = {"zero": 0, "two": 2, "rot": r, "rest": rest_start, "odd": odd_start, "end": 2**62, "last": -1}
    params = [init(n, np.array([v], np.int64)) for n, v in values.items()]
    nodes = []
    if partial:
        nodes += [
            node("Slice", ["q", "zero", "rot", "last"], "x"),
            node("Slice", ["q", "rest", "end", "last"], "q_pass"),
        ]

    if interleaved:
        params += [
            init("pair_axes", np.array([2, 4], np.int64)),
            init("repeats", np.array([1, 1, 1, 1, 2], np.int64)),
            init("cos_shape", np.array([0, 0, 1, -1], np.int64)),
            init("x_shape", np.array([0, 0, 2, r], np.int64)),
        ]
        for part, fn in (("cos", "Cos"), ("sin", "Sin")):
            nodes += [
                node(fn, ["freqs"], f"{part}_half"),
                node("Unsqueeze", [f"{part}_half", "pair_axes"], f"{part}_5d"),
                node("Tile", [f"{part}_5d", "repeats"], f"{part}_pairs"),
                node("Reshape", [f"{part}_pairs", "cos_shape"], part),
            ]
        nodes += [
            node("Slice", ["x", "zero", "end", "last", "two"], "x1"),
            node("Slice", ["x", "odd", "end", "last", "two"], "x2"),
            node("Neg", ["x2"], "q_neg"),
            node("Unsqueeze", ["q_neg", "last"], "odd_5d"),
            node("Unsqueeze", ["x1", "last"], "even_5d"),
            node("Concat", ["odd_5d", "even_5d"], "stacked", axis=-1),
            node("Reshape", ["stacked", "x_shape"], "x_rot"),
        ]
    else:
        params.append(init("heads_axis", np.array([1], np.int64)))
        nodes += [node("Concat", ["freqs", "freqs"], "emb", axis=-1)]
        for part, fn in (("cos", "Cos"), ("sin", "Sin")):
            nodes += [node(fn, ["emb"], f"{part}_rows"), node("Unsqueeze", [f"{part}_rows", "heads_axis"], part)]
        half = init("half", np.array([r // 2], np.int64))
        params.append(half)
        nodes += [
            node("Slice", ["x", "zero", "half", "last"], "x1"),
            node("Slice", ["x", "half", "end", "last"], "x2"),
            node("Neg", ["x2"], "q_neg"),
            node("Concat", ["q_neg", "x1"], "x_rot", axis=-1),
        ]
    nodes += [
        node("Mul", ["x", "cos"], "x_cos"),
        node("Mul", ["x_rot", "sin"], "x_sin"),
        node("Add", ["x_cos", "x_sin"], "x_roped" if partial else "y"),
    ]
    if partial:
        nodes.append(node("Concat", ["x_roped", "q_pass"], "y", axis=-1))
    else:  # x is q itself
        for found in nodes:
            found.input[:] = ["q" if name == "x" else name for name in found.input]
    inputs = [info("q", shape), info("freqs", ["b", "s", r // 2])]
    return model(nodes, inputs, ["y"], params, opset=opset)
