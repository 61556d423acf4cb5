"""The matmul rules' table: MatMul / Gemm: bias, transposes, scales, tied weights, onnxruntime's FusedGemm /
FusedMatMul. Each rule fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a
rule newer than the exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.passes.pipeline import pipeline_from_config
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs
from tests.passes.fuse.table import (
    BOTH_DYNAMIC,
    CONSTANTS_ONLY,
    ELEMENTWISE,
    LATE,
    NO_ATTR,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    at_opset,
    attr_at,
    constant_at,
    exported_mlp,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    untyped_at,
    weights,
)
from tests.passes.fuse_fixtures import FIXTURES
from tests.passes.fuse_helpers import fires, fires_ort, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    erf_gelu_nodes,
    gelu_constants,
    matmul_add,
    rand_weight,
    scaled_matmul,
    split_projections,
    tied,
)


def _dynamic_int8_matmul(bias: bool) -> onnx.ModelProto:
    """x @ W as onnxruntime's quantize_dynamic writes it: DynamicQuantizeLinear, MatMulInteger, the
    scales multiplied, the int32 product cast back and scaled (then the bias added)."""
    nodes = [
        onnx.helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        node("Mul", ["xs", "ws"], "s"),
        node("MatMulInteger", ["xq", "wq", "xz", "wz"], "i"),
        node("Cast", ["i"], "f", to=onnx.TensorProto.FLOAT),
        node("Mul", ["f", "s"], "scaled" if bias else "y"),
    ]
    if bias:
        nodes.append(node("Add", ["scaled", "bias"], "y"))
    quantized = np.clip(np.round(weights(8, 4) * 40), -127, 127).astype(np.int8)
    params = [init("wq", quantized), init("ws", 0.025), init("wz", 0, np.int8), init("bias", weights(4))]
    return model(nodes, [info("x", ["b", 3, 8])], ["y"], params[:3] + params[3:] * bias)


def _shared_dynamic_int8_projections() -> onnx.ModelProto:
    """Two projections of one activation, as quantize_dynamic writes Q and K: one DynamicQuantizeLinear
    read by both MatMulIntegers, the second with its bias."""
    nodes = [onnx.helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    params = []
    for name, bias in (("q", False), ("k", True)):
        nodes += [
            node("Mul", ["xs", f"{name}_ws"], f"{name}_s"),
            node("MatMulInteger", ["xq", f"{name}_wq", "xz", f"{name}_wz"], f"{name}_i"),
            node("Cast", [f"{name}_i"], f"{name}_f", to=onnx.TensorProto.FLOAT),
            node("Mul", [f"{name}_f", f"{name}_s"], f"{name}_scaled" if bias else name),
        ]
        quantized = np.clip(np.round(weights(8, 4) * 40), -127, 127).astype(np.int8)
        params += [init(f"{name}_wq", quantized), init(f"{name}_ws", 0.025), init(f"{name}_wz", 0, np.int8)]
        if bias:
            nodes.append(node("Add", [f"{name}_scaled", f"{name}_bias"], name))
            params.append(init(f"{name}_bias", weights(4)))
    return model(nodes, [info("x", ["b", 3, 8])], ["q", "k"], params)


def _transposed_gemm(which: str) -> onnx.ModelProto:
    if which == "a":
        nodes = [node("Transpose", ["a"], "t", perm=[1, 0]), node("Gemm", ["t", "w", "c"], "y")]
        return model(nodes, [info("a", [3, 3])], ["y"], [init("w", weights(3, 4)), init("c", weights(4))])
    nodes = [node("Transpose", ["b"], "t", perm=[1, 0]), node("Gemm", ["w", "t", "c"], "y")]
    return model(nodes, [info("b", [4, 4])], ["y"], [init("w", weights(2, 4)), init("c", weights(4))])


def _scaled_gemm(op: str) -> onnx.ModelProto:
    return model(
        [node("Gemm", ["a", "w", "c"], "g", alpha=0.5), node(op, ["g", "s"], "y")],
        [info("a", [2, 3])],
        ["y"],
        [init("w", weights(3, 4)), init("c", weights(4)), init("s", 4.0)],
    )


def _gemm_relu() -> onnx.ModelProto:
    return model(
        [node("Gemm", ["a", "w", "c"], "g", transB=1), node("Relu", ["g"], "y")],
        [info("a", [2, 3])],
        ["y"],
        [init("w", weights(4, 3)), init("c", weights(4))],
    )


def _transposed_matmul(which: str) -> onnx.ModelProto:
    if which == "a":
        nodes = [node("Transpose", ["q"], "t", perm=[0, 2, 1]), node("MatMul", ["t", "k"], "y")]
    else:
        nodes = [node("Transpose", ["k"], "t", perm=[0, 2, 1]), node("MatMul", ["q", "t"], "y")]
    return model(nodes, [info("q", [4, 4, 4]), info("k", [4, 4, 4])], ["y"])


F16 = TensorProto.FLOAT16


def _scaled_operands(elem_type: int = F16, scale: float = float(np.sqrt(0.125))) -> onnx.ModelProto:
    """Attention scores as both exporters write them below opset 23, float16 by default: sqrt(scale) on Q and on K^T
    (here a scalar and a one-element vector)."""
    root = np.asarray(scale, helper.tensor_dtype_to_np_dtype(elem_type))
    return model(
        [
            node("Mul", ["q", "s"], "q_scaled"),
            node("Mul", ["t", "kt"], "kt_scaled"),
            node("MatMul", ["q_scaled", "kt_scaled"], "scores"),
        ],
        [info("q", ["batch", 2, "seq", 8], elem_type), info("kt", ["batch", 2, 8, "total"], elem_type)],
        [info("scores", None, elem_type)],
        [init("s", root), init("t", root.reshape(1))],
    )


def _scale_under_transpose(elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Attention's scores once the unwind pass sank Q's head Transpose below its sqrt(scale) (a one-element vector)."""
    return model(
        [
            node("Mul", ["q", "s"], "q_scaled"),
            node("Transpose", ["q_scaled"], "q_heads", perm=[0, 2, 1, 3]),
            node("MatMul", ["q_heads", "kt"], "scores"),
        ],
        [info("q", ["batch", "seq", 2, 8], elem_type), info("kt", ["batch", 2, 8, "total"], elem_type)],
        [info("scores", None, elem_type)],
        [init("s", np.asarray([np.sqrt(0.125)], helper.tensor_dtype_to_np_dtype(elem_type)))],
    )


CASES: dict[str, Case] = {
    "matmul-add-gemm": Case(
        lambda: matmul_add(["n", 3]),
        {"Gemm": 1},
        "p",
        NO_ATTR,
        Perturb(set_shape("a", None), "not 2-D"),
        NO_GATE,
    ),
    **{
        f"transpose-into-gemm-{which}": Case(
            lambda which=which: _transposed_gemm(which),
            {"Gemm": 1},
            "t",
            Perturb(set_attr("t", perm=[0, 1]), "not a 2-D swap"),
            Perturb(set_shape(which, None), "not a 2-D swap"),
            NO_GATE,
        )
        for which in ("a", "b")
    },
    **{
        f"gemm-{op.lower()}-scalar": Case(
            lambda op=op: _scaled_gemm(op),
            {"Gemm": 1},
            "g",
            Perturb(set_const("s", [2.0, 3.0, 4.0, 5.0]), "not a scalar", note="a constant"),
            CONSTANTS_ONLY,
            NO_GATE,
        )
        for op in ("Mul", "Div")
    },
    "ort-fusedgemm": Case(
        _gemm_relu,
        {"FusedGemm": 1},
        "g",
        NO_ATTR,
        ELEMENTWISE,
        NO_GATE,
        {"target": "ort", "enable": ["ort-fusedgemm"]},
    ),
    **{
        f"ort-fusedmatmul-{op.lower()}": Case(
            lambda op=op: scaled_matmul(op, transpose=False),
            {"FusedMatMul": 1},
            "p",
            Perturb(set_const("s", [2.0, 3.0, 4.0, 5.0, 6.0]), "not a scalar", note="a constant"),
            Perturb(set_shape("q", None), "rank is unknown"),
            NO_GATE,
            {"target": "ort"},
        )
        for op in ("Mul", "Div")
    },
    **{
        f"ort-transpose-into-matmul-{which}": Case(
            lambda which=which: _transposed_matmul(which),
            {"FusedMatMul": 1},
            "t",
            Perturb(set_attr("t", perm=[1, 0, 2]), "does not swap the last two dims"),
            Perturb(set_shape("q" if which == "a" else "k", None), "does not swap the last two dims"),
            NO_GATE,
            {"target": "ort"},
        )
        for which in ("a", "b")
    },
    **{
        name: Case(
            lambda bias=bias: _dynamic_int8_matmul(bias),
            {"DynamicQuantizeMatMul": 1, "DynamicQuantizeLinear": 1},  # a leaf: dce takes it once unread
            "f",
            Perturb(set_const("ws", [[0.025, 0.03, 0.02, 0.025]]), "not a float32 scalar or one per column"),
            CONSTANTS_ONLY,
            NO_GATE,
            {"target": "ort"},
        )
        for name, bias in (("ort-dynamic-quantize-matmul", False), ("ort-dynamic-quantize-matmul-bias", True))
    },
    "tied-weight-gemm": Case(
        lambda: tied(["batch", "seq", 6]),
        {"Gather": 1, "Add": 1, "Flatten": 1, "Gemm": 1, "Shape": 1, "Concat": 1, "Reshape": 1},
        "wte_t",
        "n/a: a 2-D Transpose has one perm that swaps",
        Perturb(lambda p: set_shape("x", None)(set_shape("ids", None)(p)), "rank is not provable"),
        Perturb(at_opset(14), "needs opset 15", note="dynamic dims need Shape(end), opset 15"),
    ),
    "matmul-scales-joined": Case(
        _scaled_operands,
        {"MatMul": 1, "Mul": 1},
        "kt_scaled",
        Perturb(set_const("t", weights(8, 1)), "a scale is not a scalar constant", note="one per row of K^T"),
        Perturb(set_shape("kt", None), "could widen its operand's rank", note="K^T's rank unknown"),
        NO_GATE,
        LATE,
        # small scores: the joined scale rounds once where the two rounded twice, a float16 ulp apart, which stays
        # within the table's 1e-4 only there
        feeds=lambda: {
            "q": (0.05 * np.random.default_rng(0).standard_normal((2, 2, 3, 8))).astype(np.float16),
            "kt": (0.05 * np.random.default_rng(1).standard_normal((2, 2, 8, 5))).astype(np.float16),
        },
    ),
    "matmul-scale-over-transpose": Case(
        _scale_under_transpose,
        {"Transpose": 1, "Mul": 1, "MatMul": 1},
        "q_scaled",
        NO_ATTR,
        Perturb(set_shape("q", None), "could widen its operand's rank", note="Q's rank unknown, the scale 1-D"),
        NO_GATE,
        LATE,
    ),
    "matmul-add-gemm-projection": Case(
        lambda: exported_mlp("linear_4"),
        {"Reshape": 2, "Gemm": 1},
        "val_124",
        Perturb(
            set_const("model.encoder.layer.0.intermediate.dense.bias", weights(6, 64)),
            "not a vector over the last axis",
            note="bias [6, 64], a constant",
        ),
        Perturb(BOTH_DYNAMIC, "more than one dim of the product is not static", note="batch and sequence dynamic"),
        NO_GATE,
        LATE,
    ),
    "matmul-add-gemm-projection-reshaped": Case(
        lambda: split_projections(names=("q",)),
        {"Shape": 1, "Concat": 1, "Reshape": 2, "Gemm": 1},
        "q_biased",
        Perturb(set_attr("q", allowzero=0), "may copy a dim of the product", note="a computed target"),
        Perturb(set_shape("x", None), "the product's rank is unknown"),
        NO_GATE,
        LATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {
    **dict.fromkeys(
        ("ort-dynamic-quantize-matmul", "ort-dynamic-quantize-matmul-bias"),
        "n/a: no exporter writes integer MatMuls; test_dynamic_int8_export runs quantize_dynamic's output of a fixture",
    ),
    # Late rules fire on static dims only, which no fixture has (their batch and sequence are dynamic): their CASES
    # are the bert_dynamo fixture's MLP as exported, its sequence fixed as a ViT's or a Whisper encoder's is.
    "matmul-add-gemm-projection": "n/a: its CASES entry is the exported bert_dynamo MLP at a static sequence",
    "matmul-scales-joined": Exported(
        ("llama_fp16_dynamo",),
        {"Mul": 8},  # the cut's 9, one scale gone
        constant_at(
            "t",
            lambda scale: scale * np.linspace(1, 2, 4, dtype=scale.dtype).reshape(1, 4, 1, 1),
            "not a scalar constant",
            "one per head (the four heads of Q and of the repeated K^T)",
        ),
        "n/a: the exporters' scales are 0-d, which widen no rank whatever the operands' (the case built here has a "
        "1-D one)",
        NO_GATE,
        {"fuse_late": True},
    ),
    "matmul-scale-over-transpose": "n/a: no exporter writes a scale under the Transpose; the unwind pass sinks Q's "
    "and K's there (test_the_scales_stay_next_to_the_product_after_the_unwind_pass)",
    "matmul-add-gemm-projection-reshaped": Exported(
        ("bert_dynamo",),
        {"Gemm": 1},
        attr_at("reshape", "may copy a dim of the product", allowzero=0),
        untyped_at(("x",), "the product's rank is unknown", undeclared=True),
        NO_GATE,
        {"fuse_late": True},
    ),
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "gemm-div-scalar",
        "gemm-mul-scalar",
        "matmul-add-gemm",
        "ort-fusedgemm",
        "ort-fusedmatmul-div",
        "ort-fusedmatmul-mul",
        "ort-transpose-into-matmul-a",
        "ort-transpose-into-matmul-b",
        "tied-weight-gemm",
        "transpose-into-gemm-a",
        "transpose-into-gemm-b",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


# -- the tied-weight rule: MatMul(x, Transpose(W)) reads W transposed through Gemm, no copy ---------------------


@pytest.mark.parametrize(
    ("elem_type", "scale", "reason"),
    [
        (TensorProto.FLOAT, 0.35, "not a float16 or bfloat16 MatMul"),
        (F16, 300.0, "the joined scale overflows or underflows the type"),
        (F16, 1e-4, "the joined scale overflows or underflows the type"),
    ],
    ids=["float32", "float16-overflow", "float16-underflow"],
)
def test_the_scales_stay_on_both_operands_where_joining_them_is_no_gain_or_leaves_the_type(
    elem_type: int, scale: float, reason: str
) -> None:
    """onnxruntime fuses a float32 MatMul's scales into FusedMatMul itself; two float16 scales whose product float16
    cannot hold (300 x 300, 1e-4 x 1e-4) stay where they are."""
    details = refused(_scaled_operands(elem_type, scale), "matmul-scales-joined", fuse_late=True)
    assert any(reason in miss for miss in details["near_misses"]["matmul"]), details["near_misses"]


def test_the_scales_join_through_the_transposes_that_split_the_heads() -> None:
    """BEiT's TorchScript export in float16: once the unwind pass moved the head Transposes of Q and K past their
    sqrt(scale) (the relative position bias's Resize no longer pinning them), the rule saw Transpose(k * t) and left
    both Muls (beit_ts_fp16: 4 Muls more than before)."""
    root = np.asarray(np.sqrt(0.125), np.float16)
    proto = model(
        [
            node("Mul", ["q", "s"], "q_scaled"),
            node("Transpose", ["q_scaled"], "q_heads", perm=[0, 2, 1, 3]),
            node("Mul", ["t", "k"], "k_scaled"),
            node("Transpose", ["k_scaled"], "kt_heads", perm=[0, 2, 3, 1]),
            node("MatMul", ["q_heads", "kt_heads"], "scores"),
        ],
        [info("q", ["batch", "seq", 2, 8], F16), info("k", ["batch", "total", 2, 8], F16)],
        [info("scores", None, F16)],
        [init("s", root), init("t", root)],
    )
    out, details = fuse(proto, fuse_late=True)
    assert details["applied"]["matmul-scales-joined"] == 1
    assert (ops(out)["Mul"], ops(out)["Transpose"]) == (1, 2)
    feeds = {
        name: (0.05 * np.random.default_rng(seed).standard_normal((2, 3, 2, 8))).astype(np.float16)
        for seed, name in enumerate(("q", "k"))
    }
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4, feeds=feeds)


def test_the_scales_stay_next_to_the_product_after_the_unwind_pass(tmp_path: Path) -> None:
    """The unwind pass writes a Transpose it keeps just before the MatMul that reads it, under Q's scale, where
    onnxruntime no longer folds the scale into FusedMatMul: the runtime guard then undid the whole pass (2 reruns,
    its two Transposes around the Relu kept). The scale goes back next to the product."""
    proto = model(
        [
            node("Transpose", ["x"], "xt", perm=[0, 2, 1]),
            node("Relu", ["xt"], "r"),
            node("Transpose", ["r"], "y", perm=[0, 2, 1]),
            node("Transpose", ["q"], "q_heads", perm=[0, 2, 1, 3]),
            node("Mul", ["q_heads", "s"], "q_scaled"),
            node("MatMul", ["q_scaled", "kt"], "scores"),
        ],
        [info("x", [2, 3, 4]), info("q", [2, 5, 2, 8]), info("kt", [2, 2, 8, 5])],
        [info("y", None), info("scores", None)],
        [init("s", np.asarray(np.sqrt(0.125), np.float32))],
    )
    source, out = tmp_path / "scores.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    result = invoke("run", source, "-o", out, "--report", tmp_path / "report.json")
    assert result.exit_code == 0, result.stderr
    guard = json.loads((tmp_path / "report.json").read_text())["runtime_guard"]
    assert (guard["undone"], guard["reruns"]) == ([], 0)
    written = onnx.load(out)
    assert [n.op_type for n in written.graph.node] == ["Relu", "Transpose", "Mul", "MatMul"]
    assert_same_outputs(proto, written)


def test_a_tied_weight_is_read_transposed_by_gemm_with_dynamic_leading_dims() -> None:
    proto = tied(["batch", "seq", 6])
    out, details = fuse(proto)
    assert details["applied"]["tied-weight-gemm"] == 1
    assert ops(out)["Transpose"] == 0 and ops(out)["Gemm"] == 1
    assert [t.name for t in out.graph.initializer if t.dims == [10, 6]] == ["wte"]  # one copy of the weight
    assert [o.name for o in out.graph.output] == ["logits"]
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_a_tied_weight_with_static_and_matrix_activations() -> None:
    for shape in ([3, 6], [2, 3, 6]):
        proto = tied(shape)
        out, details = fuse(proto)
        assert details["applied"]["tied-weight-gemm"] == 1 and ops(out)["Shape"] == 0
        assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_tied_weight_refusals() -> None:
    # the Transposed weight has another reader; dynamic leading dims below opset 15
    for proto in (tied(["batch", "seq", 6], extra_reader=True), tied(["batch", "seq", 6], opset=14)):
        out, details = fuse(proto)
        assert "tied-weight-gemm" not in details["applied"], details
        assert Counter(ops(out))["Transpose"] == 1
        assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)
    # for onnxruntime, FusedMatMul reads the weight transposed instead
    proto = tied(["batch", "seq", 6])
    out, details = fuse(proto, target="ort")
    assert "tied-weight-gemm" not in details["applied"] and ops(out)["FusedMatMul"] == 1, details
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def _tied_head(dtype: int, weight: np.ndarray) -> onnx.ModelProto:
    """A tied LM head whose float32 logits a float16 converter writes as a Cast: hidden states of ``dtype``,
    MatMul(h, Transpose(W)), the logits cast to float32."""
    nodes = [
        node("Transpose", ["wte"], "wte_t", perm=[1, 0]),
        node("MatMul", ["h", "wte_t"], "product"),
        node("Cast", ["product"], "logits", to=onnx.TensorProto.FLOAT),
    ]
    return model(nodes, [info("h", ["batch", "seq", 64], dtype)], ["logits"], [init("wte", weight)])


def test_a_float16_tied_head_stays_a_matmul() -> None:
    # onnxruntime's CPU provider has no float16 MatMul or Gemm: the Gemm form of gpt2_dynamo's float16 variant ran
    # 1.23x the variant at ORT_ENABLE_ALL, and its Reshape between the Gemm and the output Cast rounded the float32
    # logits to float16.
    weight = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float16)
    variant = _tied_head(onnx.TensorProto.FLOAT16, weight)
    out, details = fuse(variant)
    assert "tied-weight-gemm" not in details["applied"] and ops(out)["Gemm"] == 0
    assert any("not a float32 MatMul" in miss for miss in details["near_misses"]["matmul"])


def test_dynamic_int8_export_gets_one_fused_integer_matmul_per_matmul(tmp_path: Path) -> None:
    source, quantized = FIXTURES / "bert_ts.onnx", tmp_path / "bert_ts_dyn8.onnx"
    quantize_dynamic(str(source), str(quantized), weight_type=QuantType.QInt8)
    integer_matmuls = ops(onnx.load(str(quantized)))["MatMulInteger"]
    out = tmp_path / "out.onnx"
    done = invoke("run", quantized, "-o", out, "--target", "ort")
    assert done.exit_code == 0, done.stderr
    found = ops(onnx.load(str(out)))
    shared = sum(1 for n in onnx.load(str(quantized)).graph.node if n.op_type == "DynamicQuantizeLinear")
    assert integer_matmuls > 0 and found["DynamicQuantizeMatMul"] + found["MatMulIntegerToFloat"] == integer_matmuls
    assert found["MatMulInteger"] == 0 and 0 < found["DynamicQuantizeLinear"] < shared  # Q, K, V: one kept each


def test_a_quantization_several_matmuls_read_is_done_once() -> None:
    # each DynamicQuantizeMatMul quantizes its input again: vit_ts_dyn8's --target ort output quantized each
    # layer's hidden state once for Q, K and V; MatMulIntegerToFloat reads the one quantization, as onnxruntime's
    # own fusion does
    proto = _shared_dynamic_int8_projections()
    out, details = fuse(proto, target="ort")
    assert details["applied"] == {"ort-dynamic-quantize-matmul": 1, "ort-dynamic-quantize-matmul-bias": 1}
    assert dict(ops(out)) == {"DynamicQuantizeLinear": 1, "MatMulIntegerToFloat": 2}
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_a_gelu_after_a_dynamic_int8_projection_leaves_the_bias_to_the_integer_matmul() -> None:
    # BiasGelu took the bias the integer MatMul adds for free: bert_dynamo_dyn8's --target ort output ran
    # 1.07x the time of the bias in the DynamicQuantizeMatMul and the GELU on its own
    proto = _dynamic_int8_matmul(bias=True)
    proto.graph.node[-1].output[0] = "biased"
    proto.graph.node.append(node("Gelu", ["biased"], "y"))  # as the dynamo exporter writes it
    proto.opset_import[0].version = 20
    out, details = fuse(proto, passes="shape-infer,fuse,dce", target="ort")
    assert dict(ops(out)) == {"DynamicQuantizeMatMul": 1, "Gelu": 1}, details
    assert any("goes into the dynamic int8 MatMul" in m for m in details["near_misses"]["activation"]), details
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_matmul_add_becomes_gemm() -> None:
    fires(matmul_add(["n", 3]), "matmul-add-gemm", {"Gemm": 1})


def test_matmul_add_refusals() -> None:
    details = refused(matmul_add([2, 5, 3]), "matmul-add-gemm")
    assert "not 2-D" in details["near_misses"]["matmul"][0]
    refused(matmul_add(["n", 3], extra_reader=True), "matmul-add-gemm")


def test_transposes_fold_into_gemm_and_scalars_into_alpha() -> None:
    proto = model(
        [
            node("Transpose", ["a"], "at", perm=[1, 0]),
            node("Gemm", ["at", "w", "c"], "g"),
            node("Mul", ["g", "s"], "y"),
        ],
        [info("a", [3, 2])],
        ["y"],
        [init("w", rand_weight(3, 4)), init("c", rand_weight(4)), init("s", 0.5)],
    )
    fires(proto, "transpose-into-gemm-a", {"Gemm": 1})


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
    fires(proto, "matmul-add-gemm-projection", {"Reshape": 2, "Gemm": 1}, fuse_late=True)


def _projection_of(fed: list[onnx.NodeProto], inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """MatMul(x_fed, W) + b over a (2, 6, 6) input, ``fed`` making x_fed from x."""
    nodes = [*fed, node("MatMul", ["x_fed", "w"], "p"), node("Add", ["p", "b"], "y")]
    params = [init("w", rand_weight(6, 4)), init("b", rand_weight(4)), *inits]
    return model(nodes, [info("x", [2, 6, 6])], ["y"], params)


@pytest.mark.parametrize(
    ("fed", "folded"),
    [
        # MLP-Mixer's token mixing: the MatMul reads a Transpose of the last two dims
        ([node("Transpose", ["x"], "x_fed", perm=[0, 2, 1])], "a Transpose of its last two dims"),
        # a GELU's closing half, as SigLIP's TorchScript export writes it before fc2
        ([node("Mul", ["half", "x"], "x_fed")], "a Mul by a scalar constant"),
        ([node("Div", ["x", "two"], "x_fed")], "a Div by a scalar constant"),
    ],
)
def test_a_projection_leaves_onnxruntime_the_transpose_or_scale_it_folds_into_fusedmatmul(
    fed: list[onnx.NodeProto], folded: str
) -> None:
    proto = _projection_of(fed, [init("half", np.float32(0.5)), init("two", np.float32(2.0))])
    details = refused(proto, "matmul-add-gemm-projection", fuse_late=True)
    assert any(folded in miss and "FusedMatMul" in miss for miss in details["near_misses"]["matmul"]), details


def test_a_projection_of_a_transpose_onnxruntime_does_not_fold_becomes_a_gemm() -> None:
    # batch and sequence swapped: onnxruntime folds only a swap of the last two dims
    proto = _projection_of([node("Transpose", ["x"], "x_fed", perm=[1, 0, 2])])
    fires(proto, "matmul-add-gemm-projection", {"Transpose": 1, "Reshape": 2, "Gemm": 1}, fuse_late=True)


def test_a_projection_after_an_erf_gelus_half_becomes_a_gemm() -> None:
    # onnxruntime fuses the GELU with its half, so no scale is left for its MatMul to fold
    proto = _projection_of(erf_gelu_nodes("x", "x_fed", "gelu_"), gelu_constants())
    fires(
        proto,
        "matmul-add-gemm-projection",
        {"Div": 1, "Erf": 1, "Add": 1, "Mul": 2, "Reshape": 2, "Gemm": 1},
        fuse_late=True,
    )


def test_the_runtime_guard_keeps_a_token_mixing_mlp_at_once(tmp_path: Path) -> None:
    """MLP-Mixer's token mixing over a dynamic batch, where onnxruntime folds the Transpose into its first
    MatMul: that projection stays a MatMul and the second becomes a Gemm, so the runtime guard has nothing
    to undo and runs the pipeline once (it undid the projection rule after 3 reruns)."""
    nodes = [
        node("Transpose", ["x"], "t", perm=[0, 2, 1]),
        node("MatMul", ["t", "w"], "p"),
        node("Add", ["p", "b"], "h"),
    ]
    nodes += [*erf_gelu_nodes("h", "g", "gelu_"), node("MatMul", ["g", "w2"], "q"), node("Add", ["q", "b2"], "y")]
    params = [
        init("w", rand_weight(6, 6)),
        init("b", rand_weight(6)),
        init("w2", rand_weight(6, 4)),
        init("b2", rand_weight(4)),
    ]
    proto = model(nodes, [info("x", ["batch", 6, 6])], ["y"], [*params, *gelu_constants()])
    source, out, report = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(proto, source)
    result = invoke("run", source, "-o", out, "--report", report)
    assert result.exit_code == 0, result.stderr
    guard = json.loads(report.read_text())["runtime_guard"]
    assert (guard["status"], guard["reruns"]) == ("kept", 0), guard
    expected = {"Transpose": 1, "MatMul": 1, "Add": 2, "Div": 1, "Erf": 1, "Mul": 2, "Reshape": 2, "Gemm": 1}
    assert ops(onnx.load(out)) == Counter(expected)


def test_a_projection_split_to_heads_takes_no_reshape_back_and_shares_its_rows() -> None:
    # the target copies no dim (allowzero): the 2-D Gemm output reshapes to the same heads
    out = fires(
        split_projections(allowzero=1),
        "matmul-add-gemm-projection-reshaped",
        {"Shape": 1, "Concat": 1, "Reshape": 3, "Gemm": 2},
        fuse_late=True,
    )
    rows = [n for n in out.graph.node if n.op_type == "Reshape" and n.input[0] == "x"]
    assert len(rows) == 1
    # a 0 in a computed target would copy a dim of the 3-D product, which the rows lack
    details = refused(split_projections(allowzero=0), "matmul-add-gemm-projection-reshaped", fuse_late=True)
    assert "may copy a dim of the product" in " ".join(details["near_misses"]["matmul"])


def test_the_late_rules_get_a_round_after_the_last_of_max_rounds() -> None:
    # With max_rounds 1 the round that finds nothing else to do is the last: the late rules, which
    # join after such a round, never ran.
    nodes = [node("MatMul", ["x", "w"], "product"), node("Add", ["product", "b"], "y")]
    params = [init("w", rand_weight(8, 4)), init("b", np.ones(4, np.float32))]
    proto = model(nodes, [info("x", [2, 6, 8])], ["y"], params)
    steps = [{"pass": "shape-infer"}, {"pass": "fuse", "options": {"late": True, "max_rounds": 1}}]
    result = optimize(from_proto(proto), pipeline_from_config(steps), strict=True, check=False)
    assert result.report["passes"][-1]["details"]["applied"] == {"matmul-add-gemm-projection": 1}


def test_scaled_matmul_with_transposed_input_becomes_one_fusedmatmul() -> None:
    out = fires_ort(scaled_matmul(), "ort-fusedmatmul-div", {"FusedMatMul": 1})
    (fused,) = out.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused.attribute}
    assert attrs["transB"] == 1 and attrs["alpha"] == pytest.approx(1 / 8)
    fires_ort(scaled_matmul("Mul", transpose=False), "ort-fusedmatmul-mul", {"FusedMatMul": 1})


def test_fusedmatmul_refusals() -> None:
    details = refused(scaled_matmul(perm=[1, 0, 2]), "ort-transpose-into-matmul-b", target="ort")
    assert "does not swap the last two dims" in " ".join(details["near_misses"]["matmul"])
    refused(scaled_matmul(), "ort-fusedmatmul-div")
    exposed = scaled_matmul(transpose=False)
    exposed.graph.output.append(info("p", None))
    refused(exposed, "ort-fusedmatmul-div", target="ort")
