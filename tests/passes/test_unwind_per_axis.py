"""The unwind pass through ops with per-axis parameters (Pad, Slice, Resize, Concat, ...):
on tf2onnx-style NHWC nets, the Transpose pairs around them go and the numbers stay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli_helpers import invoke
from tests.passes import nhwc_nets
from tests.passes.test_unwind_pass import _save, _unwind_file, transposes

C = 4  # channels between the two Convs


def _count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(node.op_type == op_type for node in model.graph.node)


def _run(model: onnx.ModelProto, tmp_path: Path) -> tuple[onnx.ModelProto, dict]:
    """The default pipeline through the CLI, with its numerics check."""
    source, out, report = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(model, source)
    result = invoke("run", source, "-o", out, "--report", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["numerics"]["status"] == "passed", data["numerics"]
    return onnx.load(out), data


def test_mobilenet_with_zero_padding_keeps_only_the_input_transpose(tmp_path: Path) -> None:
    """Keras ZeroPadding2D before each strided depthwise Conv: the Pads follow the NCHW
    layout (and the Conv then takes them in), where a Transpose pair stayed around each."""
    model = nhwc_nets.mobilenet()
    assert transposes(model) == 26 and _count(model, "Pad") == 3
    written, _ = _run(model, tmp_path)
    assert transposes(written) == 1
    assert written.graph.node[0].op_type == "Transpose"  # the NHWC input's
    # An axis the layout leaves in place stays as written.
    (softmax,) = [n for n in written.graph.node if n.op_type == "Softmax"]
    assert [(a.name, a.i) for a in softmax.attribute] == [("axis", -1)]


def test_unet_with_pad_resize_and_skip_concats_keeps_the_interface_transposes(tmp_path: Path) -> None:
    """Pad before the strided Convs, nearest Resize upsampling and channel Concats of the
    skips: only the NHWC input's and the NHWC output's Transposes stay."""
    model = nhwc_nets.unet()
    assert transposes(model) == 12
    written, _ = _run(model, tmp_path)
    assert transposes(written) == 2
    assert {_count(written, op) for op in ("Resize", "Concat")} == {2}


def test_a_squeeze_excite_block_keeps_the_interface_transposes(tmp_path: Path) -> None:
    """Pad, a keepdims ReduceMean, a strided Slice, a linear Resize, a Tile and a Concat
    together: the NHWC input's and output's Transposes stay, no other."""
    model = nhwc_nets.squeeze_excite()
    assert transposes(model) == 10
    written, _ = _run(model, tmp_path)
    assert transposes(written) == 2


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# op, its inputs after the NHWC value (arrays become initializers, "" is left out, a name
# is a graph input), attributes, its output channels, opset.
CASES = {
    "Pad": ("Pad", [_i64(0, 1, 1, 0, 0, 1, 1, 0)], {}, C, 18),
    "Pad-reflect": ("Pad", [_i64(0, 1, 2, 0, 0, 2, 1, 0)], {"mode": "reflect"}, C, 18),
    "Pad-axes": ("Pad", [_i64(1, 2, 0, 1), np.float32(0.5), _i64(1, 2)], {}, C, 18),
    "Pad-attribute": ("Pad", [], {"pads": [0, 1, 1, 0, 0, 0, 1, 0]}, C, 10),
    "Slice": ("Slice", [_i64(1, 0), _i64(5, 6), _i64(1, 2), _i64(2, 1)], {}, C, 18),
    "Slice-no-axes": ("Slice", [_i64(0, 1, 0, 1), _i64(1, 5, 6, 3)], {}, 2, 18),
    "Slice-attributes": ("Slice", [], {"starts": [1, 1], "ends": [5, 100], "axes": [2, 3]}, C - 1, 9),
    "Resize-nearest": ("Resize", ["", _f32(1, 2, 2, 1)], {"mode": "nearest"}, C, 18),
    "Resize-linear": ("Resize", ["", _f32(1, 2, 2, 1)], {"mode": "linear"}, C, 18),
    "Resize-roi": (
        "Resize",
        [_f32(0, 0.1, 0.3, 0, 1, 0.9, 0.6, 1), _f32(1, 2, 2, 1)],
        {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"},
        C,
        18,
    ),
    "Resize-sizes": ("Resize", ["", "", _i64(1, 9, 12, C)], {"mode": "nearest"}, C, 18),
    "Resize-axes": ("Resize", ["", _f32(2, 3)], {"mode": "nearest", "axes": [1, 2]}, C, 18),
    "ReduceMean-attribute": ("ReduceMean", [], {"axes": [3], "keepdims": 1}, 1, 13),
    "ReduceMax-input": ("ReduceMax", [_i64(-1)], {"keepdims": 1}, 1, 18),
    "Concat": ("Concat", ["self"], {"axis": 3}, 2 * C, 18),
    "Concat-constant": ("Concat", [np.ones((1, 6, 6, 2), np.float32)], {"axis": -1}, C + 2, 18),
    "Split": ("Split", [_i64(1, 3)], {"axis": 3}, 1, 18),
    "Tile": ("Tile", [_i64(1, 1, 2, 2)], {}, 2 * C, 18),
    "Softmax": ("Softmax", [], {"axis": 3}, C, 13),
    "LogSoftmax": ("LogSoftmax", [], {"axis": -1}, C, 18),
    "Hardmax": ("Hardmax", [], {"axis": 1}, C, 18),
    "Gather": ("Gather", [_i64(3, 0, 2)], {"axis": 3}, 3, 18),
    "Expand": ("Expand", [_i64(2, 6, 6, C)], {}, C, 18),
}


def _operands(data: str, extra: list) -> tuple[list[str], list[onnx.TensorProto]]:
    """The op's inputs: ``data``, then ``extra`` (arrays as initializers, "self" is ``data``)."""
    inputs, initializers = [data], []
    for k, item in enumerate(extra):
        if isinstance(item, str):
            inputs.append(data if item == "self" else item)
        else:
            initializers.append(numpy_helper.from_array(np.asarray(item), f"p{k}"))
            inputs.append(f"p{k}")
    return inputs, initializers


def _between_convs(op: str, extra: list, attrs: dict, channels: int) -> onnx.GraphProto:
    """x (NHWC) -> Transpose -> Conv -> Transpose -> op in NHWC -> Transpose -> Conv -> y (NCHW)."""
    rng = np.random.default_rng(0)
    inputs, initializers = _operands("a", extra)
    initializers += [
        numpy_helper.from_array(rng.standard_normal((C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((2, channels, 1, 1)).astype(np.float32), "w2"),
    ]
    outputs = ["b", "unused"] if op == "Split" else ["b"]
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_nchw"], perm=nhwc_nets.TO_NCHW),
        helper.make_node("Conv", ["x_nchw", "w1"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["conv"], ["a"], perm=nhwc_nets.TO_NHWC),
        helper.make_node(op, inputs, outputs, **attrs),
        helper.make_node("Transpose", ["b"], ["b_nchw"], perm=nhwc_nets.TO_NCHW),
        helper.make_node("Conv", ["b_nchw", "w2"], ["y"]),
    ]
    return helper.make_graph(
        nodes,
        op,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 6, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)],
        initializers,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_per_axis_op_between_transposed_convs_follows_the_layout(case: str, tmp_path: Path) -> None:
    op, extra, attrs, channels, opset = CASES[case]
    source = _save(_between_convs(op, extra, attrs, channels), tmp_path / "m.onnx", opset)
    written, details = _unwind_file(source, tmp_path, "shape-infer")
    assert details["transposes"] == [3, 1]
    assert transposes(written) == 1 and _count(written, op) == 1


def test_pads_from_a_graph_input_keep_the_pad_a_barrier(tmp_path: Path) -> None:
    """Pads that are not a constant cannot be rewritten: the Pad reads NHWC data as before."""
    # make_feeds fills an integer input named like a mask with ones: every axis padded by 1
    graph = _between_convs("Pad", ["pads_mask"], {}, C + 2)
    graph.input.append(helper.make_tensor_value_info("pads_mask", TensorProto.INT64, [8]))
    source = _save(graph, tmp_path / "m.onnx")
    model = onnx.load(source)
    written, details = _unwind_file(source, tmp_path, "shape-infer")
    assert details["transposes"] == [3, 3] and not details["changed"]
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in model.graph.node]


def test_slice_starts_from_a_graph_input_follow_with_constant_axes(tmp_path: Path) -> None:
    """Starts per listed axis need no rewrite: only the axes are renumbered."""
    graph = _between_convs("Slice", ["starts", _i64(5, 6), _i64(1, 2)], {}, C)
    graph.input.append(helper.make_tensor_value_info("starts", TensorProto.INT64, [2]))
    source = _save(graph, tmp_path / "m.onnx")
    written, details = _unwind_file(source, tmp_path, "shape-infer")
    assert details["transposes"] == [3, 1] and transposes(written) == 1


def test_a_linear_resize_the_runtime_cannot_run_in_the_new_layout_stays_put(tmp_path: Path) -> None:
    """onnxruntime's linear Resize takes unit scales on the outermost two axes (or the
    outermost and innermost); scales that the layout would move elsewhere keep the Resize
    in its own layout, with Transposes, and the model still runs."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 3, 0, 1]),
        helper.make_node("Resize", ["t", "", "scales"], ["r"], mode="linear"),
        helper.make_node("Transpose", ["r"], ["y"], perm=[2, 3, 0, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6, 4, 5])],
        [numpy_helper.from_array(_f32(1, 1, 2, 2), "scales")],
    )
    written, details = _unwind_file(_save(graph, tmp_path / "m.onnx"), tmp_path, "shape-infer")
    assert details["transposes"] == [2, 2] and not details["changed"]
    assert _count(written, "Resize") == 1


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_drops_its_axis_from_the_layout(opset: int, tmp_path: Path) -> None:
    """Squeeze (axes an attribute before opset 13, an input from 13) of an NHWC Conv's unit
    channel: it squeezes the NCHW Conv output's axis 1, and no Transpose is left after it."""
    axes: dict = {"axes": [3]} if opset < 13 else {}
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_nchw"], perm=nhwc_nets.TO_NCHW),
        helper.make_node("Conv", ["x_nchw", "w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["conv"], ["a"], perm=nhwc_nets.TO_NHWC),
        helper.make_node("Squeeze", ["a"] if opset < 13 else ["a", "axes"], ["y"], **axes),
    ]
    initializers = [numpy_helper.from_array(np.ones((1, 3, 3, 3), np.float32), "w")]
    if opset >= 13:
        initializers.append(numpy_helper.from_array(_i64(-1), "axes"))
    graph = helper.make_graph(
        nodes,
        "squeeze",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 6, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 6])],
        initializers,
    )
    written, details = _unwind_file(_save(graph, tmp_path / "m.onnx", opset), tmp_path, "shape-infer")
    assert details["transposes"] == [2, 1] and transposes(written) == 1


RANK3 = {
    "Pad": ("Pad", [_i64(1, 0, 2, 0, 1, 1)], {}),
    "Slice-no-axes": ("Slice", [_i64(1, 0, 1), _i64(4, 2, 3)], {}),
    "Slice-axes-steps": ("Slice", [_i64(2, 0), _i64(3, 4), _i64(2, 0), _i64(1, 2)], {}),
    "Tile": ("Tile", [_i64(1, 2, 3)], {}),
    "Resize": ("Resize", ["", _f32(2, 1, 3)], {"mode": "nearest"}),
    "Gather": ("Gather", [_i64(1, 0, 1)], {"axis": 1}),
    "Split": ("Split", [_i64(1, 2)], {"axis": -1}),
    "Concat": ("Concat", ["self"], {"axis": 0}),
    "Softmax": ("Softmax", [], {"axis": 1}),
    "GatherElements": ("GatherElements", [np.array([[[1, 0, 2]] * 2] * 4, np.int64)], {"axis": 2}),
    "ScatterElements": (
        "ScatterElements",
        [np.array([[[1], [0]]] * 4, np.int64), np.ones((4, 2, 1), np.float32)],
        {"axis": 1, "reduction": "add"},
    ),
    "CumSum": ("CumSum", [np.array(-2, np.int64)], {"reverse": 1}),
    "TopK": ("TopK", [_i64(2)], {"axis": 0}),
    "ArgMax": ("ArgMax", [], {"axis": 2, "keepdims": 1}),
    "LpNormalization": ("LpNormalization", [], {"axis": 0, "p": 1}),
}


@pytest.mark.parametrize("case", list(RANK3))
def test_a_per_axis_op_between_cancelling_transposes_runs_on_the_input(case: str, tmp_path: Path) -> None:
    """x -> Transpose [2, 0, 1] -> op -> Transpose [1, 2, 0]: the op runs on x itself (a
    cyclic layout, where a mapping read backwards would show)."""
    op, extra, attrs = RANK3[case]
    inputs, initializers = _operands("t", extra)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
        helper.make_node(op, inputs, ["o", "unused"] if op in ("Split", "TopK") else ["o"], **attrs),
        helper.make_node("Transpose", ["o"], ["y"], perm=[1, 2, 0]),
    ]
    graph = helper.make_graph(
        nodes,
        case,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64 if op == "ArgMax" else TensorProto.FLOAT, [None] * 3)],
        initializers,
    )
    written, details = _unwind_file(_save(graph, tmp_path / "m.onnx"), tmp_path, "shape-infer")
    assert details["transposes"] == [2, 0] and transposes(written) == 0


def test_gather_elements_indices_from_a_graph_input_are_transposed_to_the_data(tmp_path: Path) -> None:
    """Indices that are not a constant are laid out as the data by a Transpose of their own."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
        helper.make_node("GatherElements", ["t", "indices"], ["o"], axis=1),
        helper.make_node("Transpose", ["o"], ["y"], perm=[1, 2, 0]),
    ]
    graph = helper.make_graph(
        nodes,
        "gather-elements",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [4, 2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
    )
    written, details = _unwind_file(_save(graph, tmp_path / "m.onnx"), tmp_path, "shape-infer")
    assert details["transposes"] == [2, 1]
    (transpose,) = [n for n in written.graph.node if n.op_type == "Transpose"]
    assert list(transpose.input) == ["indices"]


def test_argmax_without_keepdims_changes_the_rank_and_stays_fixed(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
        helper.make_node("ArgMax", ["t"], ["o"], axis=0, keepdims=0),
        helper.make_node("Transpose", ["o"], ["y"], perm=[1, 0]),
    ]
    graph = helper.make_graph(
        nodes,
        "argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [3, 2])],
    )
    _, details = _unwind_file(_save(graph, tmp_path / "m.onnx"), tmp_path, "shape-infer")
    assert details["transposes"] == [2, 2] and not details["changed"]
