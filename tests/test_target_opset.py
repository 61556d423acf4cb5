"""``--target-opset``: a conversion that cannot be done correctly is refused, never written.

Each case is a class of wrong or unloadable output that benchmarks/opset_sweep.py found over
the ONNX node suite: the run ends with exit 2, one line naming the op, and no output file.
What can be converted correctly still is (numerics equal in onnxruntime).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.cli_helpers import invoke
from tests.numerics import run_ort


def _model(nodes: list[onnx.NodeProto], inputs: list[Any], outputs: list[Any], opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


FLOAT = TensorProto.FLOAT
X = ("x", FLOAT, [1, 2, 6, 6])


def _cast(**attrs: Any) -> onnx.ModelProto:
    return _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16, **attrs)], [X], [("y", 10, None)], 21)


REFUSED = {
    # AveragePool has dilations from opset 19 on; the converter keeps the attribute below.
    "averagepool-dilations": (
        _model(
            [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], dilations=[2, 2])],
            [X],
            [("y", FLOAT, None)],
            22,
        ),
        17,
        "AveragePool",
    ),
    # saturate=0 changes float8 casts only, but Cast below opset 19 has no such attribute.
    "cast-saturate-0": (
        _cast(saturate=0),
        18,
        "Cast",
    ),
    # Scan-9 iterates without Scan-8's batch axis; the converter renames the op only.
    "scan-8": (
        _model(
            [
                helper.make_node(
                    "Scan",
                    ["", "s", "x"],
                    ["t", "ys"],
                    num_scan_inputs=1,
                    body=helper.make_graph(
                        [helper.make_node("Add", ["si", "xi"], ["so"]), helper.make_node("Identity", ["so"], ["yo"])],
                        "body",
                        [helper.make_tensor_value_info(n, FLOAT, [2]) for n in ("si", "xi")],
                        [helper.make_tensor_value_info(n, FLOAT, [2]) for n in ("so", "yo")],
                    ),
                )
            ],
            [("s", FLOAT, [1, 2]), ("x", FLOAT, [1, 3, 2])],
            [("t", FLOAT, [1, 2]), ("ys", FLOAT, [1, 3, 2])],
            8,
        ),
        17,
        "Scan",
    ),
    # Hardmax-11 flattens to 2-D around its axis, Hardmax-13 takes the one axis; the converter
    # renames the op only (Softmax and LogSoftmax it reshapes around).
    "hardmax-11": (
        _model([helper.make_node("Hardmax", ["x"], ["y"])], [X], [("y", FLOAT, None)], 11),
        17,
        "Hardmax",
    ),
    # Resize-10 maps coordinates asymmetrically, Resize-11 by default at half pixels; the
    # converter sets no coordinate_transformation_mode.
    "resize-10": (
        _model(
            [helper.make_node("Resize", ["x", "scales"], ["y"], mode="linear")],
            [X, ("scales", FLOAT, [4])],
            [("y", FLOAT, None)],
            10,
        ),
        17,
        "Resize",
    ),
    # onnxruntime has no kernel for RandomUniformLike-22 (its kernel is registered for -1 only).
    "randomuniformlike-22": (
        _model(
            [helper.make_node("RandomUniformLike", ["x"], ["y"], seed=1.0)],
            [X],
            [("y", FLOAT, None)],
            21,
        ),
        22,
        "RandomUniformLike",
    ),
    # A sliding window (Attention-25) that the lowering to primitives would drop.
    "attention-window": (
        _model(
            [helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1, left_window_size=2)],
            [(n, FLOAT, [1, 2, 5, 8]) for n in "qkv"],
            [("y", FLOAT, None)],
            25,
        ),
        17,
        "Attention",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_conversion_that_cannot_be_done_correctly_is_refused(case: str, tmp_path: Path) -> None:
    proto, goal, op_type = REFUSED[case]
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    result = invoke("run", source, "--target-opset", str(goal), "--no-check", "-o", out)
    assert result.exit_code == 2, result.output
    assert op_type in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_an_attribute_the_target_lacks_is_dropped_where_it_holds_its_default(tmp_path: Path) -> None:
    """Cast's saturate=1 is what every Cast below opset 19 does: the conversion drops it."""
    proto = _cast(saturate=1)
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    result = invoke("run", source, "--target-opset", "17", "--no-check", "-o", out)
    assert result.exit_code == 0, result.output
    converted = onnx.load(out)
    assert converted.opset_import[0].version == 17
    assert [a.name for a in converted.graph.node[0].attribute] == ["to"]
    feeds = {"x": np.linspace(-70000, 70000, 72, dtype=np.float32).reshape(1, 2, 6, 6)}
    np.testing.assert_array_equal(run_ort(converted, feeds)["y"], run_ort(proto, feeds)["y"])


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_an_upsample_becomes_a_resize_with_its_own_coordinates(mode: str, tmp_path: Path) -> None:
    """Upsample maps output pixel i to i / scale and, nearest, takes the floor (it only enlarges):
    the Resize-11+ it becomes says so, where its defaults (half pixels, rounding) would shift it."""
    proto = _model(
        [helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)],
        [X, ("scales", FLOAT, [4])],
        [("y", FLOAT, None)],
        9,
    )
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    result = invoke("run", source, "--target-opset", "17", "--no-check", "-o", out)
    assert result.exit_code == 0, result.output
    converted = onnx.load(out)
    assert [n.op_type for n in converted.graph.node if n.op_type in ("Resize", "Upsample")] == ["Resize"]
    x = np.random.default_rng(0).standard_normal((1, 2, 6, 6)).astype(np.float32)
    for scales in ([1, 1, 2, 3], [1, 1, 1.5, 2.5], [1, 1, 1.7, 1.3]):
        feeds = {"x": x, "scales": np.array(scales, np.float32)}
        np.testing.assert_allclose(run_ort(converted, feeds)["y"], run_ort(proto, feeds)["y"], rtol=0, atol=1e-6)
