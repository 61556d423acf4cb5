"""The built-in fuse rules: each fires where it should (numerics equal in onnxruntime) and
not where an extra reader, a graph output, a wrong attribute, an unprovable shape or a too
low opset forbids it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphopt.errors import InputError
from tests.passes.fuse_helpers import expose, fuse, info, init, model, node
from tests.passes.fuse_helpers import fires as _fires
from tests.passes.fuse_helpers import refused as _refused

RNG = np.random.default_rng(0)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- conv ---------------------------------------------------------------------------------------


def _conv_bn(extra: str = "", gamma_input: bool = False) -> onnx.ModelProto:
    params = [init("w", _w(4, 3, 3, 3)), init("b", _w(4)), init("beta", _w(4)), init("mean", _w(4))]
    params.append(init("var", np.abs(_w(4)) + 0.5))
    inputs = [info("x", [1, 3, 8, 8])]
    if gamma_input:
        inputs.append(info("gamma", [4]))
    else:
        params.append(init("gamma", _w(4)))
    nodes = [
        node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], "y", epsilon=1e-3),
    ]
    outputs: list[Any] = ["y"]
    expose(nodes, outputs, "c", extra)
    return model(nodes, inputs, outputs, params)


def test_conv_bn_fuses() -> None:
    _fires(_conv_bn(), "conv-bn", {"Conv": 1})


@pytest.mark.parametrize("case", ["reader", "output", "gamma-input"])
def test_conv_bn_refusals(case: str) -> None:
    proto = _conv_bn(
        extra=case if case in ("reader", "output") else "",
        gamma_input=case == "gamma-input",
    )
    details = _refused(proto, "conv-bn")
    if case == "gamma-input":
        assert "not a constant vector" in details["near_misses"]["conv"][0]


def _conv_channel(c: np.ndarray, op: str = "Mul", through_transpose: bool = True) -> onnx.ModelProto:
    nodes = [node("Conv", ["x", "w", "b"], "c")]
    src = "c"
    if through_transpose:
        nodes.append(node("Transpose", ["c"], "t", perm=[0, 2, 3, 1]))
        src = "t"
    nodes.append(node(op, [src, "k"], "y"))
    return model(nodes, [info("x", [1, 3, 5, 5])], ["y"], [init("w", _w(4, 3, 1, 1)), init("b", _w(4)), init("k", c)])


def test_conv_per_channel_mul_and_add_fuse_through_a_transpose() -> None:
    _fires(_conv_channel(_w(4)), "conv-mul", {"Conv": 1, "Transpose": 1})
    _fires(_conv_channel(_w(4), "Add"), "conv-add", {"Conv": 1, "Transpose": 1})
    _fires(_conv_channel(_w(4, 1, 1), through_transpose=False), "conv-mul", {"Conv": 1})


def test_conv_mul_refuses_an_operand_that_is_not_per_channel() -> None:
    details = _refused(_conv_channel(_w(5, 1)), "conv-mul")
    assert "not per-channel" in details["near_misses"]["conv"][0]


# -- matmul -------------------------------------------------------------------------------------


def _matmul_add(a_shape: list[Any], extra_reader: bool = False) -> onnx.ModelProto:
    nodes = [node("MatMul", ["a", "w"], "p"), node("Add", ["p", "b"], "y")]
    outputs: list[Any] = ["y"]
    if extra_reader:
        nodes.append(node("Relu", ["p"], "r"))
        outputs.append("r")
    return model(nodes, [info("a", a_shape)], outputs, [init("w", _w(3, 4)), init("b", _w(4))])


def test_matmul_add_becomes_gemm() -> None:
    _fires(_matmul_add(["n", 3]), "matmul-add-gemm", {"Gemm": 1})


def test_matmul_add_refusals() -> None:
    details = _refused(_matmul_add([2, 5, 3]), "matmul-add-gemm")
    assert "not 2-D" in details["near_misses"]["matmul"][0]
    _refused(_matmul_add(["n", 3], extra_reader=True), "matmul-add-gemm")


def test_transposes_fold_into_gemm_and_scalars_into_alpha() -> None:
    proto = model(
        [
            node("Transpose", ["a"], "at", perm=[1, 0]),
            node("Gemm", ["at", "w", "c"], "g"),
            node("Mul", ["g", "s"], "y"),
        ],
        [info("a", [3, 2])],
        ["y"],
        [init("w", _w(3, 4)), init("c", _w(4)), init("s", 0.5)],
    )
    _fires(proto, "transpose-into-gemm-a", {"Gemm": 1})


# -- shape ----------------------------------------------------------------------------------------


def test_transpose_pairs_compose_or_vanish() -> None:
    pair = model(
        [
            node("Transpose", ["x"], "t", perm=[1, 2, 0]),
            node("Transpose", ["t"], "u", perm=[2, 0, 1]),
            node("Relu", ["u"], "y"),
        ],
        [info("x", [2, 3, 4])],
        ["y"],
    )
    _fires(pair, "transpose-transpose", {"Relu": 1})
    exposed = model(
        [node("Transpose", ["x"], "t", perm=[1, 2, 0]), node("Transpose", ["t"], "y", perm=[2, 0, 1])],
        [info("x", [2, 3, 4])],
        ["t", "y"],
    )
    _refused(exposed, "transpose-transpose")


def test_reshape_chains_collapse_unless_a_zero_copies_a_dim() -> None:
    def chain(target: list[int]) -> onnx.ModelProto:
        return model(
            [node("Flatten", ["x"], "f", axis=1), node("Reshape", ["f", "s"], "y")],
            [info("x", [2, 3, 4])],
            ["y"],
            [init("s", np.array(target, np.int64))],
        )

    _fires(chain([4, -1]), "reshape-chain", {"Reshape": 1})
    _refused(chain([0, 3, 4]), "reshape-chain")


def test_unsqueeze_pairs_merge() -> None:
    proto = model(
        [node("Unsqueeze", ["x", "a1"], "u"), node("Unsqueeze", ["u", "a2"], "y")],
        [info("x", ["b", "s"])],
        ["y"],
        [init("a1", np.array([1], np.int64)), init("a2", np.array([0, 3], np.int64))],
    )
    _fires(proto, "unsqueeze-unsqueeze", {"Unsqueeze": 1})


def test_lossless_cast_chains_collapse_and_lossy_ones_stay() -> None:
    def chain(source: int, middle: int) -> onnx.ModelProto:
        return model(
            [node("Cast", ["x"], "c", to=middle), node("Cast", ["c"], "d", to=source), node("Neg", ["d"], "y")],
            [info("x", [2, 3], source)],
            [info("y", None, source)],
        )

    _fires(chain(TensorProto.FLOAT16, TensorProto.FLOAT), "cast-chain", {"Neg": 1})
    details = _refused(chain(TensorProto.FLOAT, TensorProto.FLOAT16), "cast-chain")
    assert "may lose values" in details["near_misses"]["shape"][0]


# -- arith ----------------------------------------------------------------------------------------


def test_constant_chains_combine_for_floats_only() -> None:
    def chain(dtype: int, np_type: Any) -> onnx.ModelProto:
        return model(
            [node("Mul", ["x", "a"], "m"), node("Div", ["m", "b"], "y")],
            [info("x", [2, 3], dtype)],
            [info("y", None, dtype)],
            [init("a", 3.0, np_type), init("b", 2.0, np_type)],
        )

    _fires(chain(TensorProto.FLOAT, np.float32), "mul-div-constants", {"Mul": 1})
    _refused(chain(TensorProto.INT64, np.int64), "mul-div-constants")


# -- activation -----------------------------------------------------------------------------------


def _erf_gelu(opset: int) -> onnx.ModelProto:
    return model(
        [
            node("Div", ["x", "sqrt2"], "d"),
            node("Erf", ["d"], "e"),
            node("Add", ["e", "one"], "p"),
            node("Mul", ["x", "p"], "m"),
            node("Mul", ["m", "half"], "y"),
        ],
        [info("x", [2, 5])],
        ["y"],
        [init("sqrt2", math.sqrt(2)), init("one", 1.0), init("half", 0.5)],
        opset=opset,
    )


def _tanh_gelu(opset: int) -> onnx.ModelProto:
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


@pytest.mark.parametrize(("build", "rule"), [(_erf_gelu, "gelu-none"), (_tanh_gelu, "gelu-tanh")])
def test_gelu_fuses_at_opset_20_and_is_a_near_miss_below(build: Callable[[int], onnx.ModelProto], rule: str) -> None:
    _fires(build(20), rule, {"Gelu": 1})
    details = _refused(build(17), rule)
    assert "needs opset >= 20" in details["near_misses"]["activation"][0]


def test_gelu_becomes_the_contrib_op_for_target_ort_below_opset_20() -> None:
    _fires(_erf_gelu(17), "ort-gelu", {"Gelu": 1}, target="ort")
    _fires(_tanh_gelu(17), "ort-fastgelu", {"FastGelu": 1}, target="ort")


def test_gelu_with_an_intermediate_graph_output_stays() -> None:
    proto = _erf_gelu(20)
    proto.graph.output.append(info("e", None))
    _refused(proto, "gelu-none")


def _hardswish(opset: int, high: float = 6.0) -> onnx.ModelProto:
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


def test_hardswish_and_hardsigmoid_decompositions_fuse() -> None:
    _fires(_hardswish(14), "hardswish", {"HardSwish": 1})
    sigmoid = model(
        [node("Add", ["x", "three"], "a"), node("Clip", ["a", "lo", "hi"], "c"), node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
    )
    _fires(sigmoid, "hardsigmoid", {"HardSigmoid": 1})


def test_hardswish_below_opset_14_becomes_x_times_hardsigmoid() -> None:
    _fires(_hardswish(13), "hardswish-as-hardsigmoid", {"Mul": 1, "HardSigmoid": 1})
    _refused(_hardswish(14), "hardswish-as-hardsigmoid")  # HardSwish itself there
    exposed = _hardswish(13)
    exposed.graph.output.append(info("c", None))
    _refused(exposed, "hardswish-as-hardsigmoid")


def test_hardswish_refusals() -> None:
    details = _refused(_hardswish(13), "hardswish")
    assert "needs opset >= 14" in details["near_misses"]["activation"][0]
    details = _refused(_hardswish(14, high=5.0), "hardswish")
    assert "not to [0, 6]" in " ".join(details["near_misses"]["activation"])


# -- norm -----------------------------------------------------------------------------------------


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


def _layer_norm(opset: int = 17, gamma_input: bool = False, axes: list[int] | None = None) -> onnx.ModelProto:
    inputs = [info("x", ["b", 3, 8])] + ([info("gamma", [8])] if gamma_input else [])
    params = [init("two", 2.0), init("eps", 1e-5), init("beta", _w(8))]
    params += [] if gamma_input else [init("gamma", _w(8))]
    nodes = _normalized("x", "n", axes or [-1], opset)
    nodes += [node("Mul", ["n", "gamma"], "g"), node("Add", ["g", "beta"], "y")]
    return model(nodes, inputs, ["y"], params, opset=opset)


def test_layernorm_fuses() -> None:
    _fires(_layer_norm(), "layernorm", {"LayerNormalization": 1})


def test_layernorm_refusals() -> None:
    details = _refused(_layer_norm(gamma_input=True), "layernorm")
    assert any("gamma is not a constant" in m for m in details["near_misses"]["norm"])
    _refused(_layer_norm(axes=[1]), "layernorm")
    details = _refused(_layer_norm(opset=16), "layernorm")
    assert "needs opset >= 17" in " ".join(details["near_misses"]["norm"])


def _group_norm(
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
    params += [init("gamma", _w(*affine) if gamma is None else gamma), init("beta", _w(*affine))]
    if form == "instance":
        params += [init("in_scale", np.abs(_w(groups)) + 0.5), init("in_bias", _w(groups))]
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


@pytest.mark.parametrize("form", ["instance", "decomposed"])
def test_groupnorm_fuses_at_opset_21(form: str) -> None:
    _fires(_group_norm(form), "groupnorm", {"GroupNormalization": 1})


def test_groupnorm_takes_a_gamma_broadcast_over_the_channels() -> None:
    _fires(_group_norm(gamma=np.array(1.5, np.float32)), "groupnorm", {"GroupNormalization": 1})


def test_groupnorm_refusals() -> None:
    for extra in ("reader", "output"):
        _refused(_group_norm(extra=extra), "groupnorm")
    details = _refused(_group_norm("decomposed", axes=[1]), "groupnorm")
    assert "do not reduce the last axis" in " ".join(details["near_misses"]["norm"])
    details = _refused(_group_norm(channels="c"), "groupnorm")
    assert "channel dim is not static" in " ".join(details["near_misses"]["norm"])
    details = _refused(_group_norm(groups=4), "groupnorm")  # 4 groups do not divide 6 channels
    assert "G dividing the channels" in " ".join(details["near_misses"]["norm"])
    details = _refused(_group_norm(gamma=_w(6, 1, 5)), "groupnorm")
    assert "gamma is not per channel" in " ".join(details["near_misses"]["norm"])
    details = _refused(_group_norm(opset=20), "groupnorm")
    assert "needs opset >= 21" in " ".join(details["near_misses"]["norm"])


def test_softmax_decomposition_fuses() -> None:
    proto = model(
        [
            node("ReduceMax", ["x"], "mx", axes=[1]),
            node("Sub", ["x", "mx"], "d"),
            node("Exp", ["d"], "e"),
            node("ReduceSum", ["e", "axes"], "s"),
            node("Div", ["e", "s"], "y"),
        ],
        [info("x", [2, 6])],
        ["y"],
        [init("axes", np.array([1], np.int64))],
    )
    _fires(proto, "softmax", {"Softmax": 1})


# -- target opset ---------------------------------------------------------------------------------


def test_target_opset_upgrades_first_so_gelu_fuses() -> None:
    out = _fires(_erf_gelu(17), "gelu-none", {"Gelu": 1}, target_opset=20)
    assert out.opset_import[0].version == 20


def test_a_model_that_cannot_be_converted_is_bad_input_naming_the_op() -> None:
    # No rule lowers RotaryEmbedding (LayerNormalization, which this used to test, now lowers).
    proto = model(
        [node("RotaryEmbedding", ["x", "cos", "sin"], "y")],
        [info("x", [1, 2, 3, 4])],
        ["y"],
        [init("cos", _w(3, 2)), init("sin", _w(3, 2))],
        opset=23,
    )
    with pytest.raises(InputError, match="RotaryEmbedding"):
        fuse(proto, target_opset=22)


# -- rotary ---------------------------------------------------------------------------------------

HALF = 4  # head size 8


def _rope(
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


@pytest.mark.parametrize(
    ("cos", "left"),
    [
        ("gathered", {}),
        ("runtime", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2}),  # the caches: one half each
        ("runtime-4d", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, "Squeeze": 2}),
        ("constant", {}),
    ],
)
def test_rotate_half_rope_becomes_rotaryembedding(cos: str, left: dict[str, int]) -> None:
    out = _fires(_rope(cos), "rotary-embedding", {"RotaryEmbedding": 2, **left}, passes="shape-infer,fuse,dce")
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rope[0].input) == (4 if cos == "gathered" else 3)


def test_rotary_refusals() -> None:
    for extra in ("reader", "output"):
        _refused(_rope(extra=extra, roped=("q",)), "rotary-embedding")
    details = _refused(_rope(swapped=True), "rotary-embedding")
    assert "not the two halves" in " ".join(details["near_misses"]["rotary"])
    details = _refused(_rope("input"), "rotary-embedding")
    assert "halves of cos are not provably equal" in " ".join(details["near_misses"]["rotary"])
    details = _refused(_rope(opset=22), "rotary-embedding")
    assert "needs opset >= 23" in " ".join(details["near_misses"]["rotary"])
