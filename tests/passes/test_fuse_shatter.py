"""The shatter rules: lowering for a target opset that lacks an op, a bias-free Gemm beside
MatMuls made a MatMul for fold, and Kronecker-product weights as two small contractions.
Each fires where it should (numerics equal in onnxruntime), not where it should not, and
says why in the near misses."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from graphopt.api import optimize
from graphopt.errors import InputError
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs, run_ort
from tests.passes.fuse_helpers import fuse, info, init, lowering_misses, model, node, ops
from tests.passes.fuse_models import LOWERED, kronecker, projections

RNG = np.random.default_rng(7)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- lowering -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(LOWERED))
def test_lowering_for_a_target_opset_that_lacks_the_op(case: str) -> None:
    proto, goal, op_type = LOWERED[case]
    out, details = fuse(proto, target_opset=goal)
    assert any(rule.startswith("lower-") for rule in details["applied"]), details
    assert op_type not in ops(out)
    assert out.opset_import[0].version == goal
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(LOWERED))
def test_a_run_without_target_opset_leaves_the_op_alone(case: str) -> None:
    proto, _, op_type = LOWERED[case]
    out, details = fuse(proto)
    assert ops(out)[op_type] == 1
    assert not any(rule.startswith("lower-") for rule in details["applied"])
    assert "lower" not in details["near_misses"]


def test_opset_18_group_norm_is_per_group_and_lowers_below_18() -> None:
    proto = model(
        [node("GroupNormalization", ["x", "g", "b"], "y", num_groups=3)],
        [info("x", [2, 6, 5])],
        ["y"],
        [init("g", _w(3)), init("b", _w(3))],
        opset=18,
    )
    out, details = fuse(proto, target_opset=17)
    assert details["applied"].get("lower-groupnorm") == 1
    expected = ReferenceEvaluator(proto).run(None, feeds := {"x": _w(2, 6, 5)})[0]
    np.testing.assert_allclose(run_ort(out, feeds)["y"], expected, rtol=1e-4, atol=1e-5)


def test_layer_norm_statistics_outputs_survive_the_lowering() -> None:
    """Mean and InvStdDev are graph outputs: the lowering stands for them too (float16
    input, statistics in float32 as stash_type says)."""
    proto = model(
        [node("LayerNormalization", ["x", "g"], ["y", "mean", "inv"], axis=1)],
        [info("x", [2, 5, 8], TensorProto.FLOAT16)],
        [info("y", None, TensorProto.FLOAT16), "mean", "inv"],
        [init("g", _w(5, 8).astype(np.float16))],
        opset=23,
    )
    out, details = fuse(proto, target_opset=16)
    assert details["applied"] == {"lower-layernorm": 1}
    assert [o.name for o in out.graph.output] == ["y", "mean", "inv"]
    assert_same_outputs(proto, out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.BOOL])
def test_a_mask_shorter_than_the_keys_is_padded_as_attention_pads_it(dtype: int) -> None:
    # onnxruntime refuses such a mask, so onnx's reference implementation is the judge.
    proto = model(
        [node("Attention", ["q", "k", "v", "m"], "y", q_num_heads=2, kv_num_heads=2)],
        [info("q", [1, 3, 8]), info("k", [1, 5, 8]), info("v", [1, 5, 8]), info("m", [3, 4], dtype)],
        ["y"],
        opset=23,
    )
    out, details = fuse(proto, target_opset=17)
    assert details["applied"] == {"lower-attention": 1}
    mask = _w(3, 4) if dtype == TensorProto.FLOAT else RNG.random((3, 4)) > 0.3
    feeds = {"q": _w(1, 3, 8), "k": _w(1, 5, 8), "v": _w(1, 5, 8), "m": mask}
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    np.testing.assert_allclose(run_ort(out, feeds)["y"], expected, rtol=1e-5, atol=1e-6)


def test_attention_with_a_past_is_a_near_miss_and_the_conversion_names_it() -> None:
    proto = model(
        [node("Attention", ["q", "k", "v", "", "pk", "pv"], "y")],
        [info(n, [1, 2, 3, 4]) for n in ("q", "k", "v", "pk", "pv")],
        ["y"],
        opset=23,
    )
    miss = "Attention at y: past key / value (or nonpad_kv_seqlen) inputs are not lowered"
    with pytest.raises(InputError, match="Attention") as raised:
        fuse(proto, target_opset=17)
    assert str(raised.value).endswith(f"not lowered: {miss}")  # the user learns why, not only which op
    assert lowering_misses(proto, 17) == [miss]


def test_cli_run_with_target_opset_lowers_and_exits_0(tmp_path: Path) -> None:
    source, out = tmp_path / "m23.onnx", tmp_path / "m17.onnx"
    onnx.save(LOWERED["attention-gqa-mask"][0], source)
    result = invoke("run", source, "--target-opset", "17", "-o", out)
    assert result.exit_code == 0, result.output
    lowered = onnx.load(out)
    assert lowered.opset_import[0].version == 17 and "Attention" not in ops(lowered)


def test_bert_small_round_trip_to_opset_23_and_back_to_17(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "bert_small.onnx"
    fused = optimize(source, target_opset=23, check=False)
    counts = Counter(n.op_type for n in fused.model.all_nodes())
    assert counts["Attention"] == 4 and counts["Gelu"] == 4
    lowered = optimize(fused.model, target_opset=17, check=False)
    counts = Counter(n.op_type for n in lowered.model.all_nodes())
    assert lowered.model.opset == 17
    assert not {"Attention", "Gelu"} & set(counts)
    assert_same_outputs(source, to_proto(lowered.model), rtol=1e-3, atol=1e-4)


# -- Gemm beside MatMuls ---------------------------------------------------------------------------


def test_a_bias_free_gemm_beside_a_matmul_becomes_a_matmul_and_fold_groups_them() -> None:
    proto = projections()
    out, details = fuse(proto, "shape-infer,fuse,fold")
    assert details["applied"] == {"gemm-as-matmul": 2}
    assert ops(out)["MatMul"] == 1 and "Gemm" not in ops(out)
    assert [o.name for o in out.graph.output] == ["q", "v", "k"]
    assert_same_outputs(proto, out)
    # Without the rule fold finds no group: the Gemms differ from the MatMul and each other.
    untouched, _ = fuse(proto, "shape-infer,fold")
    assert ops(untouched) == Counter({"Gemm": 2, "MatMul": 1})


def test_the_gemm_rule_reaches_a_fixpoint_in_two_rounds() -> None:
    result = optimize(from_proto(projections()), "shape-infer,fuse", strict=True, check=False)
    fuse_run = result.report["passes"][-1]
    assert fuse_run["details"]["rounds"] == 2  # the second round changes nothing


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("bias", "it has a bias"),
        ("transA", "transA=1"),
        ("b-input", "B is not a constant"),
        ("no-bare-sibling", None),
    ],
)
def test_gemm_rule_refusals(case: str, reason: str | None) -> None:
    proto = projections(
        bias=case == "bias", transA=int(case == "transA"), b_input=case == "b-input", k_add=case == "no-bare-sibling"
    )
    out, details = fuse(proto)
    assert ops(out)["Gemm"] >= 1
    if reason is not None:
        assert any(reason in miss for miss in details["near_misses"]["expose"]), details
    assert_same_outputs(proto, out)


# -- Kronecker weights --------------------------------------------------------------------------------


def _weight_bytes(proto: onnx.ModelProto) -> int:
    return sum(
        np.prod(t.dims, dtype=np.int64) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for t in proto.graph.initializer
    )


def test_a_kronecker_weight_becomes_two_small_contractions() -> None:
    proto = kronecker(np.kron(_w(8, 6), _w(32, 48)), ["b", 5, 256])
    out = to_proto(optimize(from_proto(proto), check=False).model)
    assert ops(out)["MatMul"] == 2
    assert _weight_bytes(out) * 40 < _weight_bytes(proto)  # 294912 bytes -> 6336 (+ two shapes)
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4)


def test_an_integer_kronecker_weight_factors_exactly() -> None:
    weight = np.kron(RNG.integers(-3, 4, (16, 16)), RNG.integers(-3, 4, (16, 16))).astype(np.int64)
    proto = kronecker(weight, [3, 256], TensorProto.INT64)
    out, details = fuse(proto)
    assert details["applied"] == {"kronecker-matmul": 1}
    assert_same_outputs(proto, out, rtol=0, atol=0)


def test_kronecker_refusals() -> None:
    almost = np.kron(_w(8, 6), _w(32, 48))
    almost[3, 5] += 1e-3
    small = np.kron(_w(8, 8), _w(16, 16))  # factoring a [128, 256] weight does not pay on onnxruntime
    for weight in (almost, _w(256, 288), small):
        assert fuse(kronecker(weight, ["b", weight.shape[0]]))[1]["applied"] == {}
    # A column is a Kronecker product of columns, and two contractions save nothing there.
    _, details = fuse(kronecker(np.kron(_w(256, 1), _w(256, 1)), ["b", 65536]))
    assert details["applied"] == {}
    assert details["near_misses"]["kronecker"] == [
        "Kronecker MatMul at y: W = A 256x1 (x) B 256x1, but two contractions save no multiplications"
    ]
    # A weight fed at run time is not examined.
    fed = model([node("MatMul", ["x", "w"], "y")], [info("x", ["b", 256]), info("w", [256, 288])], ["y"])
    assert fuse(fed)[1]["applied"] == {}
