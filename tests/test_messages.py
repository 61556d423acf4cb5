"""What people read when something is off (issue 39 item 6): every line names the file and says
what to do, the output format is checked before the work, a folder's totals read right, and
what a round trip or a fold would lose is kept."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli_helpers import error_lines, invoke, mlp, one_line_error
from tests.passes.fuse_models import conv_bn


def test_an_output_name_with_no_format_is_refused_before_the_pipeline_runs(tmp_path: Path) -> None:
    """Before: the whole pipeline ran, then the save failed naming a staging folder."""
    result = invoke("run", mlp(tmp_path / "m.onnx"), "-o", tmp_path / "notes.txt")
    line = one_line_error(result, 2)
    assert line == f"graphopt: error: {tmp_path / 'notes.txt'}: unknown output format '.txt' (use .onnx or .json)"
    assert "pass " not in result.stderr and ".graphopt-" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def _zip_checkpoint(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"weight": [1.0, 2.0]}))


def _pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}, protocol=4))


def _safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_zip_checkpoint, "a zip archive (a PyTorch checkpoint saved with torch.save?), not an ONNX model"),
        (_pickle, "a Python pickle (a PyTorch or scikit-learn checkpoint?), not an ONNX model"),
        (_safetensors, "a safetensors file (weights only), not an ONNX model"),
    ],
)
def test_a_checkpoint_given_as_a_model_is_named_for_what_it_is(tmp_path: Path, make: object, says: str) -> None:
    """Before: "not a valid ONNX protobuf (unsupported wire type 3)"."""
    path = tmp_path / "model.onnx"
    make(path)  # type: ignore[operator]
    for command in (("run", path, "-o", tmp_path / "out.onnx"), ("inspect", path)):
        line = one_line_error(invoke(*command), 2)
        assert f"{path}: {says}" in line and "export the model to ONNX first" in line
    assert not (tmp_path / "out.onnx").exists()


def test_a_folder_whose_models_all_failed_totals_nothing_optimized(tmp_path: Path) -> None:
    """Before: "1 models, 1 failures, 0 not checked, nodes 0 -> 0, weights 0 B -> 0 B"."""
    (tmp_path / "models").mkdir()
    _pickle(tmp_path / "models" / "model.onnx")
    result = invoke("run", tmp_path / "models", "-o", tmp_path / "out/")
    assert result.exit_code == 2
    assert "1 model, 1 failure, 0 not checked, nothing optimized" in result.stderr
    mlp(tmp_path / "models" / "good.onnx")
    mixed = invoke("run", tmp_path / "models", "-o", tmp_path / "out/")
    assert "2 models, 1 failure, 0 not checked, nodes 2 -> 1" in mixed.stderr


def _bad_graph(path: Path) -> Path:
    invoke("convert", mlp(path.with_suffix(".onnx")), path)
    data = json.loads(path.read_text())
    data["graph"]["nodes"][0]["op"] = 7  # two places that break the schema
    data["graph"]["outputs"][0]["name"] = ["y"]
    path.write_text(json.dumps(data))
    return path


def test_validate_lists_every_schema_error_of_every_file(tmp_path: Path) -> None:
    """Before: it stopped at the first error of the first file."""
    bad = _bad_graph(tmp_path / "bad.json")
    good = mlp(tmp_path / "good.onnx")
    result = invoke("validate", bad, good)
    assert result.exit_code == 2
    errors = error_lines(result)
    assert len(errors) == 2 and all(line.startswith(f"graphopt: error: {bad}: $.graph.") for line in errors)
    assert any(".nodes[0].op" in line for line in errors) and any(".outputs[0].name" in line for line in errors)
    assert f"{good}: valid" in result.stderr
    run = invoke("run", bad, "-o", tmp_path / "out.onnx")  # elsewhere, the first error and how many more
    assert "(and 1 more: `graphopt validate` lists them)" in one_line_error(run, 2)


def test_the_json_round_trip_keeps_an_initializers_doc_and_metadata(tmp_path: Path) -> None:
    """Before: the initializer's value_info (its doc and metadata_props) was dropped."""
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    described = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4], doc_string="the weight")
    described.metadata_props.add(key="source", value="layer1.weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [weight],
        value_info=[described],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    assert invoke("convert", tmp_path / "m.onnx", tmp_path / "m.json").exit_code == 0
    assert invoke("convert", tmp_path / "m.json", tmp_path / "back.onnx").exit_code == 0
    for path in (tmp_path / "back.onnx",):
        kept = {v.name: v for v in onnx.load(path).graph.value_info}
        assert kept["w"].doc_string == "the weight"
        assert {p.key: p.value for p in kept["w"].metadata_props} == {"source": "layer1.weight"}


def test_folded_weights_keep_the_names_of_their_sources(tmp_path: Path) -> None:
    """Before: a Conv with its BatchNormalization folded read "fused_weight" and "fused_bias"."""
    onnx.save(conv_bn(), tmp_path / "m.onnx")
    result = invoke("run", tmp_path / "m.onnx", "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    names = [t.name for t in onnx.load(tmp_path / "out.onnx").graph.initializer]
    assert names == ["w_fused", "b_fused"]


def test_a_warning_names_its_model_under_the_gate_and_inspect(tmp_path: Path) -> None:
    """Before: "graphopt: warning: value 'x' declares dim -3 ..." with no model named."""
    proto = onnx.load(mlp(tmp_path / "m.onnx"))
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -3
    onnx.save(proto, tmp_path / "neg.onnx")
    for command in (("run", tmp_path / "neg.onnx", "--check-optimized"), ("inspect", tmp_path / "neg.onnx")):
        warnings = [line for line in invoke(*command).stderr.splitlines() if "warning:" in line]
        assert warnings == [
            f"graphopt: warning: {tmp_path / 'neg.onnx'}: value 'x' declares dim -3: read as an unknown dim"
        ]
