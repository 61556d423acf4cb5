"""Regressions for bugs found by probing graphopt with unusual but valid models."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from graphopt.numerics import check_models
from tests.cli_helpers import invoke

FLOAT, BOOL = TensorProto.FLOAT, TensorProto.BOOL


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
