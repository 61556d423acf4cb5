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

from graphopt.api import optimize
from graphopt.errors import InputError
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from graphopt.passes.pipeline import pipeline_from_config
from tests.numerics import assert_same_outputs
from tests.passes.fuse_exported import FIXTURES, fixture_inputs
from tests.passes.fuse_helpers import fires as _fires
from tests.passes.fuse_helpers import fuse, info, init, model, node, ops
from tests.passes.fuse_helpers import refused as _refused
from tests.passes.fuse_models import (
    conv_bn,
    conv_channel,
    conv_input_scale,
    erf_gelu,
    group_norm,
    hardswish,
    keras_layer_norm,
    layer_norm,
    matmul_add,
    rope_model,
    split_projections,
    tanh_gelu,
)

RNG = np.random.default_rng(0)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- conv ---------------------------------------------------------------------------------------


def test_conv_bn_fuses() -> None:
    _fires(conv_bn(), "conv-bn", {"Conv": 1})


@pytest.mark.parametrize("case", ["reader", "output", "gamma-input"])
def test_conv_bn_refusals(case: str) -> None:
    proto = conv_bn(
        extra=case if case in ("reader", "output") else "",
        gamma_input=case == "gamma-input",
    )
    details = _refused(proto, "conv-bn")
    if case == "gamma-input":
        assert "not a constant vector" in details["near_misses"]["conv"][0]


def test_conv_per_channel_mul_and_add_fuse_through_a_transpose() -> None:
    _fires(conv_channel(_w(4)), "conv-mul", {"Conv": 1, "Transpose": 1})
    _fires(conv_channel(_w(4), "Add"), "conv-add", {"Conv": 1, "Transpose": 1})
    _fires(conv_channel(_w(4, 1, 1), through_transpose=False), "conv-mul", {"Conv": 1})


def test_conv_mul_refuses_an_operand_that_is_not_per_channel() -> None:
    details = _refused(conv_channel(_w(5, 1)), "conv-mul")
    assert "not per-channel" in details["near_misses"]["conv"][0]


def test_a_per_channel_mul_goes_into_the_conv_it_feeds() -> None:
    _fires(conv_input_scale(_w(4, 1, 1)), "mul-conv", {"Conv": 1}, fuse_late=True)
    _fires(conv_input_scale(_w(1, 4, 1, 1), group=1), "mul-conv", {"Conv": 1}, fuse_late=True)
    _fires(conv_input_scale(_w(1)), "mul-conv", {"Conv": 1}, fuse_late=True)
    _fires(conv_input_scale(_w(4, 1, 1), shift=_w(4, 1, 1), pad=0), "mul-conv", {"Conv": 1}, fuse_late=True)
    _fires(conv_input_scale(_w(1), group=1, shift=_w(1), pad=0), "mul-conv", {"Conv": 1}, fuse_late=True)


@pytest.mark.parametrize(
    ("scale", "channels", "reason"),
    [
        (np.array([1.0, np.inf, 2.0, 3.0], np.float32).reshape(4, 1, 1), 4, "not finite"),
        (RNG.standard_normal((4, 5, 1)).astype(np.float32), 4, "not per input channel"),
        (RNG.standard_normal((4, 1, 1)).astype(np.float32), 1, "may broadcast them"),
    ],
)
def test_mul_conv_refusals(scale: np.ndarray, channels: int, reason: str) -> None:
    details = _refused(conv_input_scale(scale, channels), "mul-conv", fuse_late=True)
    assert reason in details["near_misses"]["conv"][0]


def test_a_per_channel_mul_goes_into_a_fused_conv_for_target_ort() -> None:
    # at --target ort the Conv + Relu behind the scale has become a FusedConv before the late rule runs
    proto = conv_input_scale(_w(4, 1, 1))
    proto.graph.node.append(node("Relu", ["y"], "r"))
    proto.graph.output[0].name = "r"
    result = optimize(from_proto(proto), target="ort", check=False)
    out = to_proto(result.model)
    assert ops(out) == {"FusedConv": 1}, ops(out)
    assert_same_outputs(proto, out)


def test_a_gelu_before_a_conv_keeps_its_half_at_opset_23() -> None:
    """GELU's closing Mul by 0.5 is also a scale a Conv could take; the Gelu fusion reads it first (wav2vec2's
    feature projection), so mul-conv waits until the other rules are done."""
    half_gelu = [
        node("Div", ["x", "sqrt2"], "d"),
        node("Erf", ["d"], "e"),
        node("Add", ["e", "one"], "p"),
        node("Mul", ["x", "p"], "m"),
        node("Mul", ["m", "half"], "g"),
        node("Conv", ["g", "w"], "y", kernel_shape=[1, 1]),
    ]
    params = [init("sqrt2", math.sqrt(2)), init("one", 1.0), init("half", 0.5), init("w", _w(3, 4, 1, 1))]
    proto = model(half_gelu, [info("x", [1, 4, 5, 5])], ["y"], params)
    result = optimize(from_proto(proto), target_opset=23, check=False)
    assert ops(to_proto(result.model)) == {"Gelu": 1, "Conv": 1}
    assert_same_outputs(proto, to_proto(result.model))
    # below opset 20 the GELU stays decomposed, its 0.5 with it: onnxruntime's own Gelu fusion reads it
    assert ops(to_proto(optimize(from_proto(proto), check=False).model))["Mul"] == 2


def test_mul_conv_keeps_a_shift_the_padding_would_miss() -> None:
    details = _refused(conv_input_scale(_w(4, 1, 1), shift=_w(4, 1, 1)), "mul-conv", fuse_late=True)
    assert "would reach the padded zeros" in details["near_misses"]["conv"][0]


# -- matmul -------------------------------------------------------------------------------------


def test_matmul_add_becomes_gemm() -> None:
    _fires(matmul_add(["n", 3]), "matmul-add-gemm", {"Gemm": 1})


def test_matmul_add_refusals() -> None:
    details = _refused(matmul_add([2, 5, 3]), "matmul-add-gemm")
    assert "not 2-D" in details["near_misses"]["matmul"][0]
    _refused(matmul_add(["n", 3], extra_reader=True), "matmul-add-gemm")


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


def test_reshape_chains_collapse_spelling_out_the_dims_a_zero_copies() -> None:
    def chain(target: list[int], batch: int | str = 2) -> onnx.ModelProto:
        return model(
            [node("Flatten", ["x"], "f", axis=1), node("Reshape", ["f", "s"], "y")],
            [info("x", [batch, 3, 4])],
            ["y"],
            [init("s", np.array(target, np.int64))],
        )

    _fires(chain([4, -1]), "reshape-chain", {"Reshape": 1})
    # the 0 copies Flatten's first dim: 2, or the batch, which the one -1 then stands for
    for batch in (2, "batch"):
        _fires(chain([0, 3, 4], batch), "reshape-chain", {"Reshape": 1})
    _refused(chain([0, -1], "batch"), "reshape-chain")


@pytest.mark.parametrize("bias", [(5,), (1, 5), (1, 1, 5), (1,)])
def test_a_projection_takes_its_bias_as_gemms_in_any_rank(bias: tuple[int, ...]) -> None:
    proto = model(
        [node("MatMul", ["x", "w"], "p"), node("Add", ["p", "b"], "y")],
        [info("x", ["batch", 3, 4])],
        ["y"],
        [
            init("w", np.arange(20, dtype=np.float32).reshape(4, 5) / 10),
            init("b", np.linspace(-1, 1, np.prod(bias), dtype=np.float32).reshape(bias)),
        ],
    )
    _fires(proto, "matmul-add-gemm-projection", {"Reshape": 2, "Gemm": 1}, fuse_late=True)


def test_a_projection_split_to_heads_takes_no_reshape_back_and_shares_its_rows() -> None:
    # the target copies no dim (allowzero): the 2-D Gemm output reshapes to the same heads
    out = _fires(
        split_projections(allowzero=1),
        "matmul-add-gemm-projection-reshaped",
        {"Shape": 1, "Concat": 1, "Reshape": 3, "Gemm": 2},
        fuse_late=True,
    )
    rows = [n for n in out.graph.node if n.op_type == "Reshape" and n.input[0] == "x"]
    assert len(rows) == 1
    # a 0 in a computed target would copy a dim of the 3-D product, which the rows lack
    details = _refused(split_projections(allowzero=0), "matmul-add-gemm-projection-reshaped", fuse_late=True)
    assert "may copy a dim of the product" in " ".join(details["near_misses"]["matmul"])


def test_a_reshape_pair_around_a_scale_goes_for_a_scalar_only() -> None:
    def scaled(scale: np.ndarray) -> onnx.ModelProto:
        return model(
            [node("Reshape", ["x", "rows"], "r"), node("Mul", ["r", "c"], "m"), node("Reshape", ["m", "heads"], "y")],
            [info("x", [2, 3, 8])],
            ["y"],
            [
                init("rows", np.array([-1, 8], np.int64)),
                init("heads", np.array([2, 3, 2, 4], np.int64)),
                init("c", scale),
            ],
        )

    late = {"fuse_late": True}
    dce = "shape-infer,fuse,dce"  # dce drops the Mul and the Reshape the rewritten ones stand for
    _fires(
        scaled(np.full((1, 1), 0.5, np.float32)),
        "reshape-through-elementwise",
        {"Mul": 1, "Reshape": 1},
        passes=dce,
        **late,
    )
    details = _refused(scaled(np.arange(8, dtype=np.float32)), "reshape-through-elementwise", **late)
    assert "not a scalar" in " ".join(details["near_misses"]["shape"])
    _refused(scaled(np.full((1, 1), 0.5, np.float32)), "reshape-through-elementwise")  # not late: not run


def test_unsqueeze_pairs_merge() -> None:
    proto = model(
        [node("Unsqueeze", ["x", "a1"], "u"), node("Unsqueeze", ["u", "a2"], "y")],
        [info("x", ["b", "s"])],
        ["y"],
        [init("a1", np.array([1], np.int64)), init("a2", np.array([0, 3], np.int64))],
    )
    _fires(proto, "unsqueeze-unsqueeze", {"Unsqueeze": 1})


def test_an_unsqueeze_read_by_unsqueezes_only_goes_into_each() -> None:
    # a causal mask's row and column indices: arange[None, None, :, None] and arange[None, None, None, :]
    def fanned(other: str) -> onnx.ModelProto:
        return model(
            [
                node("Unsqueeze", ["x", "a01"], "u"),
                node("Unsqueeze", ["u", "a3"], "rows"),
                node(other, ["u", "a2"] if other == "Unsqueeze" else ["u"], "cols"),
            ],
            [info("x", ["s"])],
            ["rows", "cols"],
            [init(f"a{''.join(map(str, a))}", np.array(a, np.int64)) for a in ([0, 1], [3], [2])],
        )

    _fires(fanned("Unsqueeze"), "unsqueeze-unsqueeze", {"Unsqueeze": 2})
    # three in a chain, the first two read twice (llama_ts's positions): each outer one takes x as it is by then
    tree = model(
        [
            node("Unsqueeze", ["x", "a0"], "u0"),
            node("Unsqueeze", ["u0", "a0"], "u1"),
            node("Unsqueeze", ["u0", "a2"], "y0"),
            node("Unsqueeze", ["u1", "a0"], "y1"),
            node("Unsqueeze", ["u1", "a3"], "y2"),
        ],
        [info("x", ["s"])],
        ["y0", "y1", "y2"],
        [init(f"a{a}", np.array([a], np.int64)) for a in (0, 2, 3)],
    )
    _fires(tree, "unsqueeze-unsqueeze", {"Unsqueeze": 3})
    details = _refused(fanned("Relu"), "unsqueeze-unsqueeze")
    assert "'u' is also read by" in " ".join(details["near_misses"]["shape"])


def test_the_mpt_exports_causal_mask_indices_take_one_unsqueeze_each() -> None:
    proto = onnx.load(str(FIXTURES / "mpt_dynamo.onnx"))
    out, details = fuse(proto)
    # arange[None, None] read as rows and as columns goes into both; one other pair merged before too
    assert details["applied"]["unsqueeze-unsqueeze"] == 3
    assert (ops(proto)["Unsqueeze"], ops(out)["Unsqueeze"]) == (7, 5)
    assert_same_outputs(proto, out, fixture_inputs(proto), rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize(("build", "rule"), [(erf_gelu, "gelu-none"), (tanh_gelu, "gelu-tanh")])
def test_gelu_fuses_at_opset_20_and_is_a_near_miss_below(build: Callable[[int], onnx.ModelProto], rule: str) -> None:
    _fires(build(20), rule, {"Gelu": 1})
    details = _refused(build(17), rule)
    assert "needs opset >= 20" in details["near_misses"]["activation"][0]


def test_gelu_becomes_the_contrib_op_for_target_ort_below_opset_20() -> None:
    _fires(erf_gelu(17), "ort-gelu", {"Gelu": 1}, target="ort")
    _fires(tanh_gelu(17), "ort-fastgelu", {"FastGelu": 1}, target="ort")


C, A = math.sqrt(2 / math.pi), 0.044715
# tanh's argument c * (x + a * x^3), spelled out as other code writes it: (nodes, constants)
_TANH_ARGUMENTS: dict[str, tuple[list[onnx.NodeProto], dict[str, float]]] = {
    "expanded, x^3 by Pow": (
        [
            node("Mul", ["x", "c"], "cx"),
            node("Pow", ["x", "three"], "cube"),
            node("Mul", ["cube", "ca"], "cax3"),
            node("Add", ["cx", "cax3"], "arg"),
        ],
        {"c": C, "three": 3.0, "ca": C * A},
    ),
    "c x (1 + a x x), divided by 1 / c": (
        [
            node("Div", ["x", "inv_c"], "cx"),
            node("Mul", ["x", "x"], "xx"),
            node("Mul", ["a", "xx"], "axx"),
            node("Add", ["one", "axx"], "poly"),
            node("Mul", ["cx", "poly"], "arg"),
        ],
        {"inv_c": 1 / C, "a": A, "one": 1.0},
    ),
    "x minus a negated cube": (
        [
            node("Mul", ["x", "x"], "xx"),
            node("Mul", ["xx", "x"], "cube"),
            node("Mul", ["cube", "minus_a"], "neg_ax3"),
            node("Sub", ["x", "neg_ax3"], "sum"),
            node("Mul", ["c", "sum"], "arg"),
        ],
        {"minus_a": -A, "c": C},
    ),
}


def _tanh_gelu_of(argument: str, factor: float = 1.0) -> onnx.ModelProto:
    nodes, constants = _TANH_ARGUMENTS[argument]
    tail = [
        node("Tanh", ["arg"], "t"),
        node("Add", ["t", "one_"], "p"),
        node("Mul", ["x", "half"], "hx"),
        node("Mul", ["hx", "p"], "y"),
    ]
    values = {**constants, "one_": 1.0, "half": 0.5}
    inits = [init(name, value * (factor if name in ("c", "inv_c") else 1.0)) for name, value in values.items()]
    return model([*nodes, *tail], [info("x", [2, 5])], ["y"], inits, opset=20)


@pytest.mark.parametrize("argument", list(_TANH_ARGUMENTS))
def test_the_tanh_gelu_is_read_in_any_factorization_of_its_argument(argument: str) -> None:
    out = _fires(_tanh_gelu_of(argument), "gelu-tanh", {"Gelu": 1})
    assert [a.s for a in out.graph.node[0].attribute] == [b"tanh"]
    _refused(_tanh_gelu_of(argument, factor=1.01), "gelu-tanh")  # not sqrt(2 / pi): another function


def test_gelu_with_an_intermediate_graph_output_stays() -> None:
    proto = erf_gelu(20)
    proto.graph.output.append(info("e", None))
    _refused(proto, "gelu-none")


def test_hardswish_and_hardsigmoid_decompositions_fuse() -> None:
    _fires(hardswish(14), "hardswish", {"HardSwish": 1})
    sigmoid = model(
        [node("Add", ["x", "three"], "a"), node("Clip", ["a", "lo", "hi"], "c"), node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
    )
    _fires(sigmoid, "hardsigmoid", {"HardSigmoid": 1})


def test_hardswish_below_opset_14_becomes_x_times_hardsigmoid() -> None:
    _fires(hardswish(13), "hardswish-as-hardsigmoid", {"Mul": 1, "HardSigmoid": 1})
    _refused(hardswish(14), "hardswish-as-hardsigmoid")  # HardSwish itself there
    exposed = hardswish(13)
    exposed.graph.output.append(info("c", None))
    _refused(exposed, "hardswish-as-hardsigmoid")


def test_hardswish_refusals() -> None:
    details = _refused(hardswish(13), "hardswish")
    assert "needs opset >= 14" in details["near_misses"]["activation"][0]
    details = _refused(hardswish(14, high=5.0), "hardswish")
    assert "not to [0, 6]" in " ".join(details["near_misses"]["activation"])


def _quick_gelu(alpha: float, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """CLIP's quick GELU as exported: x * Sigmoid(alpha * x)."""
    dtype = {TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}.get(elem_type, np.float32)
    return model(
        [node("Mul", ["x", "alpha"], "ax"), node("Sigmoid", ["ax"], "s"), node("Mul", ["x", "s"], "y")],
        [info("x", [2, 7, 16], elem_type)],
        [info("y", None, elem_type)],
        [init("alpha", alpha, dtype)],
    )


def test_quick_gelu_becomes_the_contrib_op_with_its_alpha_for_target_ort() -> None:
    out = _fires(_quick_gelu(1.702), "ort-quickgelu", {"QuickGelu": 1}, target="ort")
    (alpha,) = out.graph.node[0].attribute
    assert alpha.name == "alpha" and alpha.f == pytest.approx(1.702)
    _refused(_quick_gelu(1.702), "ort-quickgelu")  # the standard target has no such op


def test_quick_gelu_of_float16_becomes_the_contrib_op_its_cpu_kernel_takes() -> None:
    _fires(_quick_gelu(1.702, TensorProto.FLOAT16), "ort-quickgelu", {"QuickGelu": 1}, target="ort")


def test_quick_gelu_of_double_stays_naming_the_type() -> None:
    details = _refused(_quick_gelu(1.702, TensorProto.DOUBLE), "ort-quickgelu", target="ort")
    assert "takes float32 or float16, not double" in " ".join(details["near_misses"]["activation"])


# -- norm -----------------------------------------------------------------------------------------


def test_layernorm_fuses() -> None:
    _fires(layer_norm(), "layernorm", {"LayerNormalization": 1})


def test_layernorm_refusals() -> None:
    details = _refused(layer_norm(gamma_input=True), "layernorm")
    assert any("gamma is not a constant" in m for m in details["near_misses"]["norm"])
    _refused(layer_norm(axes=[1]), "layernorm")
    details = _refused(layer_norm(opset=16), "layernorm")
    assert "needs opset >= 17" in " ".join(details["near_misses"]["norm"])


@pytest.mark.parametrize(("mean", "rank"), [("GlobalAveragePool", 3), ("ReduceMean", 3), ("GlobalAveragePool", 4)])
def test_keras_layernorm_from_tf2onnx_fuses(mean: str, rank: int) -> None:
    # Keras' LayerNormalization as tf2onnx writes it: the means as GlobalAveragePool over
    # axes 2.. (its global pool optimizer), x * inv + (beta - mean * inv).
    out = _fires(keras_layer_norm(mean, rank), "layernorm-tf", {"LayerNormalization": 1})
    (ln,) = out.graph.node
    assert onnx.helper.get_attribute_value(ln.attribute[0]) == 2 - rank  # normalizes axes 2..


@pytest.mark.parametrize("form", ["instance", "decomposed"])
def test_groupnorm_fuses_at_opset_21(form: str) -> None:
    _fires(group_norm(form), "groupnorm", {"GroupNormalization": 1})


def test_groupnorm_takes_a_gamma_broadcast_over_the_channels() -> None:
    _fires(group_norm(gamma=np.array(1.5, np.float32)), "groupnorm", {"GroupNormalization": 1})


def test_groupnorm_refusals() -> None:
    for extra in ("reader", "output"):
        _refused(group_norm(extra=extra), "groupnorm")
    details = _refused(group_norm("decomposed", axes=[1]), "groupnorm")
    assert "do not reduce the last axis" in " ".join(details["near_misses"]["norm"])
    details = _refused(group_norm(channels="c"), "groupnorm")
    assert "channel dim is not static" in " ".join(details["near_misses"]["norm"])
    details = _refused(group_norm(groups=4), "groupnorm")  # 4 groups do not divide 6 channels
    assert "G dividing the channels" in " ".join(details["near_misses"]["norm"])
    details = _refused(group_norm(gamma=_w(6, 1, 5)), "groupnorm")
    assert "gamma is not per channel" in " ".join(details["near_misses"]["norm"])
    details = _refused(group_norm(opset=20), "groupnorm")
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
    out = _fires(erf_gelu(17), "gelu-none", {"Gelu": 1}, target_opset=20)
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
    out = _fires(rope_model(cos), "rotary-embedding", {"RotaryEmbedding": 2, **left}, passes="shape-infer,fuse,dce")
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rope[0].input) == (4 if cos == "gathered" else 3)


def test_rotary_refusals() -> None:
    for extra in ("reader", "output"):
        _refused(rope_model(extra=extra, roped=("q",)), "rotary-embedding")
    details = _refused(rope_model(swapped=True), "rotary-embedding")
    assert "not the two halves" in " ".join(details["near_misses"]["rotary"])
    details = _refused(rope_model("input"), "rotary-embedding")
    assert "halves of cos are not provably equal" in " ".join(details["near_misses"]["rotary"])
    details = _refused(rope_model(opset=22), "rotary-embedding")
    assert "needs opset >= 23" in " ".join(details["near_misses"]["rotary"])


def test_the_late_rules_get_a_round_after_the_last_of_max_rounds() -> None:
    # With max_rounds 1 the round that finds nothing else to do is the last: the late rules, which
    # join after such a round, never ran.
    nodes = [node("MatMul", ["x", "w"], "product"), node("Add", ["product", "b"], "y")]
    params = [init("w", RNG.standard_normal((8, 4)).astype(np.float32)), init("b", np.ones(4, np.float32))]
    proto = model(nodes, [info("x", [2, 6, 8])], ["y"], params)
    steps = [{"pass": "shape-infer"}, {"pass": "fuse", "options": {"late": True, "max_rounds": 1}}]
    result = optimize(from_proto(proto), pipeline_from_config(steps), strict=True, check=False)
    assert result.report["passes"][-1]["details"]["applied"] == {"matmul-add-gemm-projection": 1}


# -- attention on merged heads ----------------------------------------------------------------------


def _merged_attention(
    bias_shape: list[int | str], style: str, opset: int = 17, axis: int | None = -1
) -> onnx.ModelProto:
    """bmm attention on (batch * heads, S, d) with a 3-D bias on the merged scores: the Softmax on them (fairseq)
    or on their (batch, heads, S, S) split (BLOOM); batch 2, 4 heads, S 5, head size 8."""
    batch, heads, seq, size = 2, 4, 5, 8
    softmax = {} if axis is None else {"axis": axis}
    nodes = [node("Reshape", [n, "merged"], f"{n}3") for n in "qkv"]
    nodes += [
        node("Transpose", ["k3"], "kt", perm=[0, 2, 1]),
        node("MatMul", ["q3", "kt"], "qk"),
        node("Mul", ["qk", "scale"], "scaled"),
        node("Add", ["scaled", "bias"], "scores"),
    ]
    if style == "fairseq":
        nodes.append(node("Softmax", ["scores"], "p", **softmax))
    else:
        nodes += [
            node("Reshape", ["scores", "split"], "scores4"),
            node("Softmax", ["scores4"], "p4", **softmax),
            node("Reshape", ["p4", "merged_scores"], "p"),
        ]
    nodes += [
        node("MatMul", ["p", "v3"], "pv"),
        node("Reshape", ["pv", "heads"], "y4"),
        node("Transpose", ["y4"], "yt", perm=[0, 2, 1, 3]),
        node("Reshape", ["yt", "rows"], "y"),
    ]
    shapes = {
        "merged": [batch * heads, seq, size],
        "split": [batch, heads, seq, seq],
        "merged_scores": [batch * heads, seq, seq],
        "heads": [batch, heads, seq, size],
        "rows": [batch, seq, heads * size],
    }
    inits = [init(name, np.array(shape, np.int64)) for name, shape in shapes.items()] + [init("scale", 0.35)]
    inputs = [info(n, [batch, heads, seq, size]) for n in "qkv"] + [info("bias", bias_shape)]
    return model(nodes, inputs, ["y"], inits, opset=opset)


MERGED_TARGETS = [
    ({"target_opset": 23}, "attention-merged-heads", "Attention"),
    ({"target": "ort"}, "ort-multihead-attention-merged", "MultiHeadAttention"),
]


@pytest.mark.parametrize("style", ["fairseq", "bloom"])
@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
@pytest.mark.parametrize("bias_shape", [[8, 1, 5], [1, 5, 5]])
def test_a_merged_bias_per_head_or_shared_by_all_fuses(
    bias_shape: list[int | str], settings: dict[str, Any], rule: str, fused: str, style: str
) -> None:
    # (1, S, T) is fairseq's causal mask unsqueezed at 0: one bias for every (batch, head)
    proto = _merged_attention(bias_shape, style)
    out, details = fuse(proto, **settings)
    assert details["applied"].get(rule) == 1 and dict(ops(out))[fused] == 1, details
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
def test_a_merged_bias_not_provably_per_head_stays(settings: dict[str, Any], rule: str, fused: str) -> None:
    _, details = fuse(_merged_attention(["n", 1, 5], "fairseq"), **settings)
    assert rule not in details["applied"]
    assert any("first dim" in m for m in details["near_misses"]["attention"]), details


@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
def test_a_softmax_without_axis_below_opset_13_is_not_over_the_last_axis(
    settings: dict[str, Any], rule: str, fused: str
) -> None:
    # below opset 13 the axis defaults to 1 and the (8, 5, 5) scores are normalized over 5 * 5 values at once
    details = _refused(_merged_attention([8, 1, 5], "fairseq", opset=11, axis=None), rule, **settings)
    assert any("not over the last axis" in m for m in details["near_misses"]["attention"]), details
    _fires_merged = _merged_attention([8, 1, 5], "fairseq", opset=11, axis=2)
    out, found = fuse(_fires_merged, **settings)
    assert found["applied"].get(rule) == 1
    assert_same_outputs(_fires_merged, out, rtol=1e-4, atol=1e-4)


def _tanh_gelu_of_pow(exponent: np.ndarray) -> onnx.ModelProto:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 Pow(x, exponent)))), beside an unrelated Relu."""
    nodes = [
        node("Pow", ["x", "three"], "x3"),
        node("Mul", ["x3", "a"], "ax3"),
        node("Add", ["x", "ax3"], "s"),
        node("Mul", ["s", "k"], "u"),
        node("Tanh", ["u"], "t"),
        node("Add", ["t", "one"], "t1"),
        node("Mul", ["x", "half"], "hx"),
        node("Mul", ["hx", "t1"], "y"),
        node("Relu", ["x"], "z"),
    ]
    constants = [init("a", 0.044715), init("k", float(np.sqrt(2 / np.pi))), init("one", 1.0), init("half", 0.5)]
    return model(nodes, [info("x", [2, 3])], ["y", "z"], [init("three", exponent), *constants], opset=20)


def test_a_tanh_gelu_with_an_integer_exponent_fuses() -> None:
    _fires(_tanh_gelu_of_pow(np.array(3, np.int64)), "gelu-tanh", {"Gelu": 1, "Relu": 1})


@pytest.mark.parametrize("exponent", [np.inf, np.nan])
def test_a_non_finite_exponent_is_no_gelu_and_fails_nothing(exponent: float) -> None:
    proto = _tanh_gelu_of_pow(np.array(exponent, np.float32))
    result = optimize(from_proto(proto), "shape-infer,fuse", check=False)
    assert result.report["failures"] == []
    assert "Gelu" not in {n.op_type for n in result.model.graph}
