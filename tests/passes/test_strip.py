"""strip-value-info: intermediate types leave the file but those the input declared, custom ops' and graph
outputs' stay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphopt import io
from graphopt.api import optimize
from graphopt.ir import DataType, Sym, TensorType
from graphopt.ir.clone import Snapshot, clone_model
from graphopt.passes.shapes.strip import declaration_holds
from tests.numerics import assert_same_outputs


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
    assert result.report["passes"][0]["details"] == {"stripped": 1, "as_declared": 0}
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
    assert result.report["passes"][1]["details"] == {"stripped": 1, "as_declared": 0}  # mixed
    io.save(result.model, tmp_path / "out.onnx")
    saved = onnx.load(tmp_path / "out.onnx")
    kept = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in saved.graph.value_info}
    assert kept == {"scores": ["n", 8, 8], "probs": ["n", 8, 8]}


def _declaring_model(path: Path) -> None:
    """x -> Relu -> a -> Neg -> b -> Add(b, x) -> y, where the file declares ``a`` with its batch dim
    named apart (as the TorchScript exporter writes it) and nothing for ``b``."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Neg", ["a"], ["b"]),
            helper.make_node("Add", ["b", "x"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        value_info=[helper.make_tensor_value_info("a", TensorProto.FLOAT, ["unk__1", 8])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def _declared(path: Path) -> dict[str, list[str | int]]:
    saved = onnx.load(path)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in saved.graph.value_info}


def test_the_output_declares_what_its_input_declared(tmp_path: Path) -> None:
    # onnxruntime plans its buffer reuse from the declared shapes: a file that proves more sizes equal
    # than its input did ran slower (the pass's docstring), so the input's declarations are written back
    _declaring_model(tmp_path / "in.onnx")
    result = optimize(io.load(tmp_path / "in.onnx"))
    strip = [p for p in result.report["passes"] if p["pass"] == "strip-value-info"]
    assert strip[0]["details"] == {"stripped": 1, "as_declared": 1}
    io.save(result.model, tmp_path / "out.onnx")
    assert _declared(tmp_path / "out.onnx") == {"a": ["unk__1", 8]}  # graphopt knows it as ["n", 8]
    again = optimize(io.load(tmp_path / "out.onnx"))
    io.save(again.model, tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "out.onnx").read_bytes()


def test_a_snapshot_and_a_copy_keep_what_the_file_declared(tmp_path: Path) -> None:
    _declaring_model(tmp_path / "in.onnx")
    model = io.load(tmp_path / "in.onnx")
    for copy in (Snapshot(model).model(), clone_model(model)):
        relu = copy.graph.nodes[0]
        assert relu.outputs[0].declared == TensorType(DataType.FLOAT, (Sym("unk__1"), 8))
        assert relu.outputs[0].declared == model.graph.nodes[0].outputs[0].declared


def test_a_declaration_holds_where_it_fixes_nothing_the_value_differs_in() -> None:
    n, unk = Sym("n"), Sym("unk__1")
    found = TensorType(DataType.FLOAT, (n, 8))
    assert declaration_holds(TensorType(DataType.FLOAT, (unk, 8)), found)
    assert declaration_holds(TensorType(DataType.FLOAT, (None, None)), found)
    assert declaration_holds(TensorType(DataType.FLOAT), found)  # the element type only
    assert not declaration_holds(TensorType(DataType.FLOAT16, (unk, 8)), found)  # a Cast's type changed
    assert not declaration_holds(TensorType(DataType.FLOAT, (unk, 4)), found)
    assert not declaration_holds(TensorType(DataType.FLOAT, (3, 8)), found)  # fixes a dim graphopt does not know
    assert not declaration_holds(TensorType(DataType.FLOAT, (unk, 8, 1)), found)
    assert not declaration_holds(TensorType(DataType.FLOAT, (unk, 8)), None)
    assert not declaration_holds(None, found)


def _relaid(path: Path, *, as_output: bool) -> None:
    """x -> Transpose -> Relu -> r -> Transpose -> + x: unwind computes r in x's layout, which moves r's axes. The
    file declares r as [a, c, b]; as_output: r is a graph output, else a Reshape to y's shape reads it too."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Transpose", ["r"], ["u"], perm=[0, 2, 1]),
        helper.make_node("Add", ["u", "x"], ["z"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", "c"])]
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["a", "b", "c"])]
    declared = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["a", "c", "b"])
    if as_output:
        outputs.append(declared)
        value_info = []
    else:
        nodes += [helper.make_node("Shape", ["y"], ["s"]), helper.make_node("Reshape", ["r", "s"], ["q"])]
        inputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c"]))
        outputs.append(helper.make_tensor_value_info("q", TensorProto.FLOAT, ["a", "b", "c"]))
        value_info = [declared]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=value_info)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def test_a_value_unwind_lays_out_anew_is_declared_in_its_new_layout(tmp_path: Path) -> None:
    # declared as read, [a, c, b] for a value now computed as [a, b, c], a second run folded the Reshape that
    # undoes its Transpose as if it changed nothing, and q came out (2, 5, 3)
    _relaid(tmp_path / "in.onnx", as_output=False)
    first = optimize(io.load(tmp_path / "in.onnx"))
    io.save(first.model, tmp_path / "out.onnx")
    relu = next(n.output[0] for n in onnx.load(tmp_path / "out.onnx").graph.node if n.op_type == "Relu")
    assert _declared(tmp_path / "out.onnx") == {relu: ["a", "b", "c"]}
    second = optimize(io.load(tmp_path / "out.onnx"))
    io.save(second.model, tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "out.onnx").read_bytes()
    feeds = {"x": np.random.default_rng(0).random((2, 3, 5), np.float32), "y": np.zeros((2, 3, 5), np.float32)}
    assert_same_outputs(tmp_path / "in.onnx", tmp_path / "again.onnx", feeds)


def test_a_graph_outputs_declaration_stays_with_the_output(tmp_path: Path) -> None:
    # a graph output's type is written with it, never declared again for the value unwind left behind
    _relaid(tmp_path / "in.onnx", as_output=True)
    io.save(optimize(io.load(tmp_path / "in.onnx")).model, tmp_path / "out.onnx")
    assert _declared(tmp_path / "out.onnx") == {}
