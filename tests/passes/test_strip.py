"""strip-value-info: intermediate types leave the file, custom ops' and graph outputs' stay."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from graphopt import io
from graphopt.api import optimize


def test_strips_standard_intermediates_only(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Magic", ["a"], ["b"], domain="com.example"),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)], ir_version=10
    )
    onnx.save(model, tmp_path / "in.onnx")
    inferred = optimize(io.load(tmp_path / "in.onnx"), "shape-infer", check=False)
    assert inferred.model.graph.nodes[0].outputs[0].type is not None
    result = optimize(inferred.model, "strip-value-info", check=False)
    assert result.report["passes"][0]["details"] == {"stripped": 1}
    io.save(result.model, tmp_path / "out.onnx")
    saved = onnx.load(tmp_path / "out.onnx")
    assert [v.name for v in saved.graph.value_info] == ["b"]
    assert saved.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "n"


def test_keeps_the_types_a_softmax_reads_and_writes(tmp_path: Path) -> None:
    # onnxruntime runs Softmax in place only where the declared shapes prove input and output the same size
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "x_t"], ["scores"]),
            helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "x"], ["mixed"]),
            helper.make_node("Relu", ["mixed"], ["y"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 4]),
            helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["n", 4, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 4])],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), tmp_path / "in.onnx"
    )
    result = optimize(io.load(tmp_path / "in.onnx"), "shape-infer,strip-value-info", check=False)
    assert result.report["passes"][1]["details"] == {"stripped": 1}  # mixed
    io.save(result.model, tmp_path / "out.onnx")
    saved = onnx.load(tmp_path / "out.onnx")
    kept = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in saved.graph.value_info}
    assert kept == {"scores": ["n", 8, 8], "probs": ["n", 8, 8]}
