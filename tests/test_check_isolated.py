"""An onnxruntime crash during the check is a result ("not checked" or "failed"), never graphopt's end."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt.numerics.isolated as isolated
from graphopt.numerics import check_models_isolated
from tests.cli_helpers import invoke


def _model(path: Path, scale: float = 1.0) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [onnx.numpy_helper.from_array(np.array([scale, scale], np.float32), "s")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


def _crash_on(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the check's child segfault whenever it is asked to run ``target``."""
    real = isolated.check_models

    def crashing(original: Any, optimized: Any, **options: Any) -> Any:
        if Path(optimized) == target or Path(original) == target:
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(original, optimized, **options)

    monkeypatch.setattr(isolated, "check_models", crashing)


def test_crash_of_the_optimized_model_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original, optimized = _model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx")
    _crash_on(optimized, monkeypatch)
    result = check_models_isolated(original, optimized)
    assert result.status == "failed"
    assert result.reason == "onnxruntime crashed with SIGSEGV running the optimized model"


def test_crash_of_the_original_is_not_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original, optimized = _model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx")
    _crash_on(original, monkeypatch)
    result = check_models_isolated(original, optimized)
    assert result.status == "not checked" and "SIGSEGV running the original" in (result.reason or "")


def test_results_and_errors_come_back_from_the_child(tmp_path: Path) -> None:
    original = _model(tmp_path / "a.onnx")
    assert check_models_isolated(original, _model(tmp_path / "b.onnx")).status == "passed"
    assert check_models_isolated(original, _model(tmp_path / "c.onnx", 2.0)).status == "failed"
    with pytest.raises(Exception, match="no_such_dim"):
        check_models_isolated(original, original, dims={"no_such_dim": 2})


def test_run_survives_an_onnxruntime_segfault(tmp_path: Path) -> None:
    # onnxruntime 1.31 segfaults on a Split whose middle output is omitted; a valid model.
    graph = helper.make_graph(
        [helper.make_node("Split", ["x"], ["a", "", "b"], axis=0, num_outputs=3)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2]),
        ],
    )
    source = tmp_path / "split.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), source)
    result = invoke("run", source, "-o", tmp_path / "out" / "split.onnx", "--json")
    assert result.exit_code in (0, 1), result.stderr
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".graphopt-")]


def test_a_crash_of_a_model_with_relaid_inputs_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second child runs the original against itself: the optimized model's input
    layouts are not applied there."""

    def transposed(path: Path, shape: list[int]) -> Path:
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
        return path

    original, optimized = transposed(tmp_path / "a.onnx", [2, 3]), transposed(tmp_path / "b.onnx", [3, 2])
    _crash_on(optimized, monkeypatch)
    result = check_models_isolated(original, optimized, input_layouts={"x": [1, 0]})
    assert result.status == "failed"
    assert result.reason == "onnxruntime crashed with SIGSEGV running the optimized model"
