"""Both readers build the IR through one builder: the same invariants hold for ONNX and JSON input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.cli_helpers import invoke


def _if_body_reusing_an_outer_name() -> onnx.ModelProto:
    """y = If(c) then (t = x + 1) else (t = x - 1), where the outer graph also defines t = x * 2."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")

    def branch(op: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["x", "one"], ["t"])], op, [], [helper.make_tensor_value_info("t", 1, [2])]
        )

    nodes = [
        helper.make_node("Mul", ["x", "x"], ["t"]),
        helper.make_node("If", ["c"], ["u"], then_branch=branch("Add"), else_branch=branch("Sub")),
        helper.make_node("Add", ["t", "u"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", 1, [2]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", 1, [2])],
        [one],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _as_json(model: onnx.ModelProto, tmp_path: Path) -> dict:
    onnx.save(model, tmp_path / "m.onnx")
    assert invoke("convert", tmp_path / "m.onnx", tmp_path / "m.json").exit_code == 0
    return json.loads((tmp_path / "m.json").read_text())


def test_a_json_body_reusing_an_outer_name_loads_as_the_onnx_one_does(tmp_path: Path) -> None:
    # The ONNX reader renames the body's t; written back by hand, the JSON graph reuses the outer name.
    text = json.dumps(_as_json(_if_body_reusing_an_outer_name(), tmp_path)).replace('"t__1"', '"t"')
    assert text.count('"t"') > 3
    (tmp_path / "m.json").write_text(text)
    result = invoke("run", tmp_path / "m.json", "-o", tmp_path / "out.json", "--debug")
    assert result.exit_code == 0, result.output
    assert "failed" not in result.output and "rolled back" not in result.output


def test_a_json_graph_listing_an_input_twice_is_bad_input(tmp_path: Path) -> None:
    data = _as_json(_if_body_reusing_an_outer_name(), tmp_path)
    data["graph"]["inputs"].append(data["graph"]["inputs"][0])
    (tmp_path / "m.json").write_text(json.dumps(data))
    result = invoke("run", tmp_path / "m.json", "-o", tmp_path / "out.onnx")
    assert result.exit_code == 2, result.output
    assert "graph input 'x' is listed twice" in result.output
    assert not (tmp_path / "out.onnx").exists()
