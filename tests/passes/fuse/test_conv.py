"""The conv rules' table: Conv with its BatchNormalization, channel scale / bias, padding and activation. Each rule
fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the
exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from graphopt.passes.pipeline import pipeline_from_config
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse.table import (
    CONSTANTS_ONLY,
    ELEMENTWISE,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    constant_at,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    training,
    untyped_at,
    weights,
)
from tests.passes.fuse_helpers import fires, fires_ort, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    conv_act,
    conv_bn,
    conv_branches,
    conv_channel,
    conv_input_scale,
    gemm_bn,
    padded,
    rand_weight,
    residual_block,
)


def _per_row_of_channels(values: np.ndarray) -> np.ndarray:
    """A (C, 1, 1) scale made to vary along the 8 rows of make.py's poolformer maps too."""
    rows = np.linspace(0.5, 1.5, 8, dtype=values.dtype).reshape(1, 8, 1)
    return (values.reshape(-1, 1, 1) * rows).astype(values.dtype)


CASES: dict[str, Case] = {
    "conv-bn": Case(
        conv_bn,
        {"Conv": 1},
        "c",
        Perturb(training, None, note="training_mode=1"),
        CONSTANTS_ONLY,
        NO_GATE,
    ),
    **{
        f"conv-{op.lower()}": Case(
            lambda op=op: conv_channel(weights(4), op),
            {"Conv": 1, "Transpose": 1},
            "c",
            # channels last no more: the operand would scale H, which is as long as C here
            Perturb(
                lambda p: set_attr("t", perm=[0, 1, 3, 2])(set_shape("x", [1, 3, 4, 4])(p)),
                "not per-channel",
                feeds=make_feeds,
            ),
            Perturb(set_shape("x", None), "output rank is unknown"),
            NO_GATE,
        )
        for op in ("Mul", "Add", "Sub")
    },
    "mul-conv": Case(
        lambda: conv_input_scale(weights(4, 1, 1)),
        {"Conv": 1},
        "m",
        Perturb(set_const("k", weights(4, 5, 1)), "not per input channel", note="the scale varies along H"),
        Perturb(set_shape("x", None), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
    "ort-fusedconv": Case(
        conv_act,
        {"FusedConv": 1},
        "c",
        "n/a: FusedConv takes the Conv's attributes as they are",
        ELEMENTWISE,
        NO_GATE,
        {"target": "ort"},
    ),
    "ort-fusedconv-sum": Case(
        residual_block,
        {"Conv": 1, "FusedConv": 1},
        "s",
        "n/a: FusedConv takes the Conv's attributes as they are",
        Perturb(set_shape("x", None), "not provably the Conv's"),
        NO_GATE,
        {"target": "ort"},
    ),
    "gemm-bn": Case(
        gemm_bn,
        {"Gemm": 1},
        "p",
        Perturb(training, None, note="training_mode=1"),
        Perturb(set_shape("a", None), "not 2-D"),
        NO_GATE,
    ),
    "pad-into-consumer": Case(
        lambda: padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1]),
        {"Conv": 1},
        "p",
        Perturb(set_attr("p", mode="reflect"), "not a constant-mode Pad"),
        Perturb(set_shape("x", None), "the padded rank is unknown"),
        NO_GATE,
    ),
    "conv-branches": Case(
        conv_branches,
        {"Conv": 1},
        "c1",
        Perturb(
            lambda p: set_attr("c1", pads=[1, 1, 0, 0])(set_const("w1", weights(4, 4, 2, 2))(p)),
            "odd number of taps",
            note="a 2x2 kernel beside the 3x3",
        ),
        Perturb(set_shape("x", None), "do not provably have one shape"),
        NO_GATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {
    "conv-branches": "n/a: no exporter fixture has parallel conv branches (timm's FastViT: benchmarks, not fixtures)",
    "mul-conv": Exported(
        ("poolformer_dynamo", "poolformer_ts"),
        {"Mul": 1, "Conv": 2},  # the second norm's gamma gone into the MLP's first Conv
        constant_at("c", _per_row_of_channels, "not per input channel", "gamma (C, 8, 1), varying along H"),
        untyped_at(("x",), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "conv-add",
        "conv-bn",
        "conv-mul",
        "conv-sub",
        "gemm-bn",
        "ort-fusedconv",
        "ort-fusedconv-sum",
        "pad-into-consumer",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_depthwise_branches_and_a_subtracted_norm_become_one_conv() -> None:
    """FastViT's RepMixer: depthwise 3x3 and 1x1 branches, the BatchNormalization of x subtracted: one Conv, the
    identity kernel on each channel's own input; the dynamo exporter spells auto_pad NOTSET out."""
    proto = set_attr("c3", auto_pad="NOTSET")(conv_branches(depthwise=True, combine="Sub"))
    fires(proto, "conv-branches", {"Conv": 1})


def test_merged_branches_are_no_lost_fusion_to_the_runtime_guard(tmp_path: Path) -> None:
    """Fewer Convs mean fewer NCHWc and FusedConv kernels in onnxruntime's graph: the guard keeps the merge
    and reports nothing lost (it undid the rule, or warned of losses no rewrite explained)."""
    source, out, report = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(conv_branches(), source)
    result = invoke("run", source, "-o", out, "--report", report)
    assert result.exit_code == 0 and "lost" not in result.stderr, result.stderr
    assert json.loads(report.read_text())["runtime_guard"]["status"] == "kept"
    assert ops(onnx.load(out))["Conv"] == 1


def test_conv_bn_fuses() -> None:
    fires(conv_bn(), "conv-bn", {"Conv": 1})


@pytest.mark.parametrize("case", ["reader", "output", "gamma-input"])
def test_conv_bn_refusals(case: str) -> None:
    proto = conv_bn(
        extra=case if case in ("reader", "output") else "",
        gamma_input=case == "gamma-input",
    )
    details = refused(proto, "conv-bn")
    if case == "gamma-input":
        assert "not a constant vector" in details["near_misses"]["conv"][0]


def test_conv_per_channel_mul_and_add_fuse_through_a_transpose() -> None:
    fires(conv_channel(rand_weight(4)), "conv-mul", {"Conv": 1, "Transpose": 1})
    fires(conv_channel(rand_weight(4), "Add"), "conv-add", {"Conv": 1, "Transpose": 1})
    fires(conv_channel(rand_weight(4, 1, 1), through_transpose=False), "conv-mul", {"Conv": 1})


def test_conv_mul_refuses_an_operand_that_is_not_per_channel() -> None:
    details = refused(conv_channel(rand_weight(5, 1)), "conv-mul")
    assert "not per-channel" in details["near_misses"]["conv"][0]


def test_a_per_channel_mul_goes_into_the_conv_it_feeds() -> None:
    fires(conv_input_scale(rand_weight(4, 1, 1)), "mul-conv", {"Conv": 1}, fuse_late=True)
    fires(conv_input_scale(rand_weight(1, 4, 1, 1), group=1), "mul-conv", {"Conv": 1}, fuse_late=True)
    fires(conv_input_scale(rand_weight(1)), "mul-conv", {"Conv": 1}, fuse_late=True)
    fires(
        conv_input_scale(rand_weight(4, 1, 1), shift=rand_weight(4, 1, 1), pad=0),
        "mul-conv",
        {"Conv": 1},
        fuse_late=True,
    )
    fires(
        conv_input_scale(rand_weight(1), group=1, shift=rand_weight(1), pad=0), "mul-conv", {"Conv": 1}, fuse_late=True
    )


@pytest.mark.parametrize(
    ("scale", "channels", "reason"),
    [
        (np.array([1.0, np.inf, 2.0, 3.0], np.float32).reshape(4, 1, 1), 4, "not finite"),
        (rand_weight(4, 5, 1), 4, "not per input channel"),
        (rand_weight(4, 1, 1), 1, "may broadcast them"),
    ],
)
def test_mul_conv_refusals(scale: np.ndarray, channels: int, reason: str) -> None:
    details = refused(conv_input_scale(scale, channels), "mul-conv", fuse_late=True)
    assert reason in details["near_misses"]["conv"][0]


def test_a_per_channel_mul_goes_into_a_fused_conv_for_target_ort() -> None:
    # at --target ort the Conv + Relu behind the scale has become a FusedConv before the late rule runs
    proto = conv_input_scale(rand_weight(4, 1, 1))
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
    params = [init("sqrt2", math.sqrt(2)), init("one", 1.0), init("half", 0.5), init("w", rand_weight(3, 4, 1, 1))]
    proto = model(half_gelu, [info("x", [1, 4, 5, 5])], ["y"], params)
    result = optimize(from_proto(proto), target_opset=23, check=False)
    assert ops(to_proto(result.model)) == {"Gelu": 1, "Conv": 1}
    assert_same_outputs(proto, to_proto(result.model))
    # below opset 20 the GELU stays decomposed, its 0.5 with it: onnxruntime's own Gelu fusion reads it
    assert ops(to_proto(optimize(from_proto(proto), check=False).model))["Mul"] == 2


def test_mul_conv_keeps_a_shift_the_padding_would_miss() -> None:
    details = refused(conv_input_scale(rand_weight(4, 1, 1), shift=rand_weight(4, 1, 1)), "mul-conv", fuse_late=True)
    assert "would reach the padded zeros" in details["near_misses"]["conv"][0]


def _traced_peak(model_ir: Any, steps: Any, **settings: Any) -> tuple[Any, int]:
    """The result of optimizing ``model_ir`` and the peak of the memory Python allocated meanwhile."""
    tracemalloc.start()
    try:
        result = optimize(model_ir, steps, check=False, **settings)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def test_mul_conv_scales_a_large_weight_in_its_own_type_without_a_float64_copy() -> None:
    """The scaled weight is W * c computed in float64 and rounded once into W's type, and the bias takes
    W's kernel sums times the shift; the plan, which runs at every round's match, no longer copies the
    weight to float64 (the float64 product peaked at eight times the weight's size)."""
    weight = np.random.default_rng(0).standard_normal((6, 2, 300, 300)).astype(np.float16)  # 2.2 MB
    scale, shift = rand_weight(4, 1, 1), rand_weight(4, 1, 1)
    proto = conv_input_scale(scale, shift=shift, pad=0)
    next(t for t in proto.graph.initializer if t.name == "w").CopyFrom(onnx.numpy_helper.from_array(weight, "w"))
    proto.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 304
    proto.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 304
    model_ir = from_proto(proto)
    steps = pipeline_from_config([{"pass": "shape-infer"}, {"pass": "fuse"}])
    result, peak = _traced_peak(model_ir, steps, fuse_late=True)
    assert result.report["passes"][-1]["details"]["applied"] == {"mul-conv": 1}
    assert peak < 4 * weight.nbytes, peak
    out = to_proto(result.model)
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    channel = (np.arange(6) // 3)[:, None] * 2 + np.arange(2)[None, :]  # input channel of W[m, j], 2 groups
    wide = weight.astype(np.float64)
    expected_w = (wide * scale.astype(np.float64).reshape(-1)[channel][:, :, None, None]).astype(np.float16)
    assert folded[conv.input[1]].dtype == np.float16
    assert folded[conv.input[1]].tobytes() == expected_w.tobytes()
    bias = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "b")
    expected_b = bias.astype(np.float64) + (wide * shift.astype(np.float64).reshape(-1)[channel][:, :, None, None]).sum(
        axis=(1, 2, 3)
    )
    np.testing.assert_allclose(folded[conv.input[2]].astype(np.float64), expected_b, rtol=2e-3)


@pytest.mark.parametrize(
    ("act", "attrs"),
    [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"alpha": 0.2}), ("Clip", {}), ("HardSigmoid", {})],
)
def test_conv_activation_becomes_fusedconv(act: str, attrs: dict[str, Any]) -> None:
    fires_ort(conv_act(act, **attrs), "ort-fusedconv", {"FusedConv": 1})


@pytest.mark.parametrize("bias", [True, False])
def test_conv_residual_relu_becomes_fusedconv_with_its_sum_input(bias: bool) -> None:
    out = fires_ort(residual_block(bias), "ort-fusedconv-sum", {"Conv": 1, "FusedConv": 1})
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


@pytest.mark.parametrize(("consumer", "fill"), [("Conv", 0.0), ("AveragePool", 0.0), ("MaxPool", -np.inf)])
def test_a_spatial_pad_goes_into_the_consumer(consumer: str, fill: float) -> None:
    fires(padded(consumer, [0, 0, 1, 2, 0, 0, 2, 1], fill), "pad-into-consumer", {consumer: 1})


def test_a_pad_goes_into_a_fusedconv() -> None:
    proto = padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1])
    proto.graph.node[-1].output[0] = "c"
    proto.graph.node.append(node("Relu", ["c"], "y"))
    fires_ort(proto, "pad-into-consumer", {"FusedConv": 1})


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


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conv_bn_weight_is_the_float64_product_rounded_once_into_its_type(dtype: type) -> None:
    """The folded weight is W * gamma / sqrt(var + eps) computed in float64 and rounded once into
    W's type (the rule scales the stored weight without a float64 copy of it)."""
    proto = conv_bn()
    for tensor in proto.graph.initializer:
        tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor).astype(dtype), tensor.name))
    for value in [*proto.graph.input, *proto.graph.output]:
        value.type.tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    out, details = fuse(proto)
    assert details["applied"].get("conv-bn") == 1
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    folded = next(onnx.numpy_helper.to_array(t) for t in out.graph.initializer if t.name == conv.input[1])
    params = {k: stored[k].astype(np.float64) for k in ("gamma", "var")}
    scale = params["gamma"] / np.sqrt(params["var"] + np.float32(1e-3).astype(np.float64))
    expected = (stored["w"].astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(dtype)
    assert folded.dtype == dtype
    assert folded.tobytes() == expected.tobytes()


def test_conv_bn_folds_a_large_weight_without_a_float64_copy_of_it() -> None:
    """resnet50's 25M weights were copied to float64 to be validated and scaled (200 MB): the fold now
    allocates the folded weight in its own type and little else."""
    proto = conv_bn()
    weight = np.random.default_rng(0).standard_normal((4, 3, 700, 700)).astype(np.float32)  # 5.9 MB
    next(t for t in proto.graph.initializer if t.name == "w").CopyFrom(onnx.numpy_helper.from_array(weight, "w"))
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = 704
    model_ir = from_proto(proto)
    steps = pipeline_from_config([{"pass": "shape-infer"}, {"pass": "fuse"}])
    result, peak = _traced_peak(model_ir, steps)
    assert result.report["passes"][-1]["details"]["applied"] == {"conv-bn": 1}
    # the weight read from its proto and the folded weight: two of its size (the float64 path peaked at five)
    assert peak < 3 * weight.nbytes, peak
