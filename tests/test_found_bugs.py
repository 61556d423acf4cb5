"""Regressions for bugs found by probing graphopt with unusual but valid models."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from graphopt.check import check_models

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
