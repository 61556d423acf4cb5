"""Regressions for bugs found by probing graphopt with unusual but valid models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.numerics import check_models
from tests.cli_helpers import invoke
from tests.numerics import run_ort

FLOAT, FLOAT16, BOOL = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BOOL


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def test_check_feeds_a_scalar_bool_input(tmp_path: Path) -> None:
    # A rank-0 bool input (an If condition) used to be fed as a numpy scalar, which
    # onnxruntime refuses: the check said "not checked" instead of running.
    branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", FLOAT, None)]
    )
    other = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", FLOAT, None)]
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
        "g",
        [helper.make_tensor_value_info("x", FLOAT, [2, 3]), helper.make_tensor_value_info("c", BOOL, [])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    path = _save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), tmp_path / "m.onnx"
    )
    result = check_models(path, path)
    assert result.status == "passed", result.reason


def _relu_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_run_refuses_two_models_with_one_output_path(tmp_path: Path) -> None:
    # `run a/m.onnx b/m.onnx -o out` wrote both to out/m.onnx: the second silently replaced the first.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _save(_relu_model(), tmp_path / "a" / "m.onnx")
    second = _save(_relu_model(), tmp_path / "b" / "m.onnx")
    out = tmp_path / "out"
    result = invoke("run", first, second, "-o", out, "--no-check", "--quiet")
    assert result.exit_code == 2, result.output
    assert "m.onnx" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_folded_float16_rotary_table_is_the_one_the_model_computes(tmp_path: Path) -> None:
    # x + Cos(positions * frequencies) in float16: graphopt folded the table with numpy, rounding the angles to
    # float16 before their Cos, where onnxruntime computes the chain in float32 and rounds once: cosines up to 0.48
    # away, "passed" only within the original's own rounding. The folded table is now onnxruntime's own.
    positions = np.arange(2048, dtype=np.float16).reshape(-1, 1)
    frequencies = (1 / 10000 ** (np.arange(0, 32, 2) / 32)).astype(np.float16).reshape(1, -1)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["positions", "frequencies"], ["angles"]),
            helper.make_node("Cos", ["angles"], ["table"]),
            helper.make_node("Add", ["x", "table"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", FLOAT16, [2048, 16])],
        [helper.make_tensor_value_info("y", FLOAT16, [2048, 16])],
        [numpy_helper.from_array(positions, "positions"), numpy_helper.from_array(frequencies, "frequencies")],
    )
    source = _save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), tmp_path / "m.onnx"
    )
    target = tmp_path / "out.onnx"
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert "numerics: passed (fixed tolerance)" in result.output
    assert [n.op_type for n in onnx.load(target).graph.node] == ["Add"]
    feeds = {"x": np.zeros((2048, 16), np.float16)}
    np.testing.assert_array_equal(run_ort(target, feeds)["y"], run_ort(source, feeds)["y"])
