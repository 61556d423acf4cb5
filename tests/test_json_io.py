"""JSON form: lossless ONNX -> JSON -> ONNX, exact tensors and floats, sidecars, readable text, bad input."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt.io
from graphopt.errors import InputError
from graphopt.io import json_io, json_write, onnx_io, onnx_write
from graphopt.ir import DataType, Graph, Model, Node, Sym, Tensor, TensorType, Value
from graphopt.ir.clone import clone_model
from tests import node_suite
from tests.conftest import CORPUS_MODELS
from tests.protocompare import first_difference


def _through_json(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    """ONNX file -> IR -> JSON file -> IR -> ONNX file, as a user converting both ways would."""
    onnx.save(model, tmp_path / "in.onnx")
    json_write.save(onnx_io.load(tmp_path / "in.onnx"), tmp_path / "model.json")
    onnx_write.save(json_io.load(tmp_path / "model.json"), tmp_path / "out.onnx", external_data=False)
    return onnx.load(tmp_path / "out.onnx")


def _differences(cases: list[Any], tmp_path: Path) -> list[str]:
    differences = []
    for case in cases:
        difference = first_difference(case.model, _through_json(case.model, tmp_path))
        if difference:
            differences.append(f"{case.name}: {difference}")
    return differences


@pytest.mark.slow
def test_node_suite_round_trips_through_json(tmp_path: Path) -> None:
    """All 1,884 models of the ONNX node test suite (~25 s on one core)."""
    cases = node_suite.cases()
    start = time.perf_counter()
    differences = _differences(cases, tmp_path)
    assert len(cases) > 1800
    assert not differences, "\n".join(differences[:20])
    print(f"{len(cases)} node-suite models equal after ONNX -> JSON -> ONNX in {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("name", CORPUS_MODELS)
def test_corpus_model_round_trips_with_lazy_sidecars(name: str, corpus_dir: Path, tmp_path: Path) -> None:
    original = onnx.load(corpus_dir / f"{name}.onnx")
    json_write.save(onnx_io.load(corpus_dir / f"{name}.onnx"), tmp_path / f"{name}.json")
    loaded = json_io.load(tmp_path / f"{name}.json")
    sidecars = sorted(tmp_path.glob(f"{name}.*.npy"))
    assert sidecars, "large weights should live in .npy files next to the JSON"
    lazy = [v.const for v in loaded.graph.initializers.values() if isinstance(v.const, Tensor)]
    assert any(isinstance(t.source, json_io.NpySource) for t in lazy)
    assert (tmp_path / f"{name}.json").stat().st_size < (corpus_dir / f"{name}.onnx").stat().st_size
    onnx_write.save(loaded, tmp_path / "out.onnx", external_data=False)
    assert first_difference(original, onnx.load(tmp_path / "out.onnx")) is None


# -- exactness --------------------------------------------------------------------------------


def _bits32(values: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def test_float_attributes_round_trip_bit_for_bit(tmp_path: Path) -> None:
    awkward = [0.1, 1e-45, -0.0, 3.4028234663852886e38, 1.1754942106924411e-38, float("inf"), float("-inf")]
    awkward = [float(np.float32(v)) for v in awkward]
    node = helper.make_node("Custom", ["x"], ["y"], domain="test", f=awkward[0], fs=awkward, nan=float("nan"))
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("test", 1)])
    back = _through_json(model, tmp_path)
    attrs = {a.name: a for a in back.graph.node[0].attribute}
    assert _bits32(list(attrs["fs"].floats)) == _bits32(awkward)
    assert _bits32([attrs["f"].f]) == _bits32([awkward[0]])
    assert np.isnan(attrs["nan"].f)
    # Written as the short text a person would type, not the float64 expansion.
    assert '"f": {"float": 0.1}' in (tmp_path / "model.json").read_text()


def _tensor_model(*tensors: TensorProto) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [t.name], [f"out{i}"]) for i, t in enumerate(tensors)]
    outputs = [
        helper.make_value_info(f"out{i}", helper.make_tensor_type_proto(t.data_type, None))
        for i, t in enumerate(tensors)
    ]
    graph = helper.make_graph(nodes, "tensors", [], outputs, list(tensors))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _bf16(values: np.ndarray) -> bytes:
    return values.astype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)).tobytes()


def test_exotic_and_non_finite_tensors_keep_their_exact_bytes(tmp_path: Path) -> None:
    payload_nan = np.array([0x7FC00001, 0xFFC00000, 0x7F800000, 0x80000000], dtype=np.uint32).view(np.float32)
    tensors = [
        numpy_helper.from_array(payload_nan, "nan_payloads"),
        numpy_helper.from_array(np.array([np.nan, -np.inf, 0.1, -0.0], dtype=np.float32), "non_finite"),
        numpy_helper.from_array(np.array([65504, -0.0, np.nan], dtype=np.float16), "half"),
        helper.make_tensor("bf16", TensorProto.BFLOAT16, [3], [1.0, -2.5, 3.0e38]),
        helper.make_tensor("bf16_raw", TensorProto.BFLOAT16, [2], b"\x80\x3f\x01\xff", raw=True),
        helper.make_tensor("f8", TensorProto.FLOAT8E4M3FN, [3], [0.5, -448.0, 1.0]),
        helper.make_tensor("i4", TensorProto.INT4, [3], [1, -8, 7]),
        helper.make_tensor("u4_raw", TensorProto.UINT4, [3], b"\x21\x0f", raw=True),
        helper.make_tensor("strings", TensorProto.STRING, [3], [b"text", b"\xff\xfe", b""]),
        numpy_helper.from_array(np.array([1 + 2j, np.nan], dtype=np.complex64), "complex"),
        helper.make_tensor("typed_floats", TensorProto.FLOAT, [2], [0.1, float("nan")]),
        helper.make_tensor("typed_doubles", TensorProto.DOUBLE, [2], [0.1, 1e-310]),
        numpy_helper.from_array(np.array([2**63 - 1, -(2**63)], dtype=np.int64), "int64_limits"),
        numpy_helper.from_array(np.array([2**64 - 1], dtype=np.uint64), "uint64_max"),
        numpy_helper.from_array(np.array(True), "bool_scalar"),
        numpy_helper.from_array(np.zeros((0, 3), dtype=np.float32), "empty"),
        numpy_helper.from_array(np.linspace(-1, 1, 5000, dtype=np.float64), "big_double"),
    ]
    model = _tensor_model(*tensors)
    assert first_difference(model, _through_json(model, tmp_path)) is None
    loaded = json_io.load(tmp_path / "model.json")
    assert isinstance(loaded.graph.initializers["big_double"].const.source, json_io.NpySource)  # type: ignore[union-attr]


def test_bfloat16_sidecar_is_lazy_and_exact(tmp_path: Path) -> None:
    raw = _bf16(np.linspace(-3, 3, 3000))
    model = _tensor_model(helper.make_tensor("big_bf16", TensorProto.BFLOAT16, [3000], raw, raw=True))
    onnx.save(model, tmp_path / "in.onnx")
    json_write.save(onnx_io.load(tmp_path / "in.onnx"), tmp_path / "model.json")
    loaded = json_io.load(tmp_path / "model.json")
    tensor = loaded.graph.initializers["big_bf16"].const
    assert isinstance(tensor, Tensor) and isinstance(tensor.source, json_io.NpySource)
    assert np.load(tmp_path / "model.0.npy").dtype == np.uint16  # plain numpy can read the bits
    assert tensor.numpy().tobytes() == raw
    onnx_write.save(loaded, tmp_path / "out.onnx", external_data=False)
    assert first_difference(model, onnx.load(tmp_path / "out.onnx")) is None


def test_every_ir_field_survives(tmp_path: Path) -> None:
    """Functions, sparse initializers, quantization annotations, metadata, opaque fields and extensions."""
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.5, 2.5], dtype=np.float32), "sp"),
        numpy_helper.from_array(np.array([1, 5], dtype=np.int64), "sp_idx"),
        [2, 3],
    )
    function = helper.make_function(
        "local",
        "Scale",
        ["X"],
        ["Y"],
        [helper.make_node("Mul", ["X", "X"], ["Y"]), helper.make_node("Constant", [], ["unused"], value_float=1.0)],
        [helper.make_opsetid("", 21)],
        attributes=["alpha"],
    )
    ref = onnx.AttributeProto(name="value_float", ref_attr_name="alpha", type=onnx.AttributeProto.FLOAT)
    del function.node[1].attribute[:]
    function.node[1].attribute.append(ref)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "(n) // 2", "n*m + 1"])
    x.doc_string = "the input"
    seq = helper.make_value_info(
        "s", helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, ["n"]))
    )
    graph = helper.make_graph(
        [
            helper.make_node("Scale", ["x"], ["y"], domain="local", name="call"),
            helper.make_node("SequenceEmpty", [], ["s"], dtype=TensorProto.INT64),
        ],
        "main",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), seq],
        sparse_initializer=[sparse],
    )
    graph.quantization_annotation.add(tensor_name="y").quant_parameter_tensor_names.add(key="SCALE_TENSOR", value="s")
    model = helper.make_model(
        graph, functions=[function], opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("local", 1)]
    )
    model.producer_name, model.doc_string = "test", "a model"
    helper.set_model_props(model, {"author": "me", "unicode": "żółw"})
    model.training_info.add().algorithm.name = "training step"
    assert first_difference(model, _through_json(model, tmp_path)) is None

    ir = json_io.load(tmp_path / "model.json")
    ir.extensions["unwind"] = {"layout": [1, 2, {"x": None}]}
    json_write.save(ir, tmp_path / "again.json")
    assert json_io.load(tmp_path / "again.json").extensions == {"unwind": {"layout": [1, 2, {"x": None}]}}
    assert clone_model(ir).extensions == ir.extensions


# -- sidecars and saving -------------------------------------------------------------------------------


def _weights_model(*arrays: np.ndarray) -> Model:
    """y = x + w0 + w1 + ..., with each w large enough for a sidecar."""
    x = Value("x", TensorType(DataType.FLOAT, (len(arrays[0]),)))
    graph = Graph(inputs=[x])
    current = x
    for i, array in enumerate(arrays):
        weight = graph.add_initializer(
            Value(f"w{i}", TensorType(DataType.FLOAT, array.shape), Tensor.from_array(array, f"w{i}"))
        )
        current = graph.append(Node("Add", [current, weight], [f"sum{i}"])).outputs[0]
    graph.outputs = [current]
    return Model(graph)


def test_saving_over_the_loaded_file_keeps_lazy_tensors_right(tmp_path: Path) -> None:
    arrays = [np.full(2000, i, dtype=np.float32) for i in range(3)]
    json_write.save(_weights_model(*arrays), tmp_path / "m.json")
    model = json_io.load(tmp_path / "m.json")
    first = model.graph.nodes[0]
    first.outputs[0].replace_all_uses_with(model.graph.inputs[0])
    model.graph.remove(first)
    model.graph.remove_initializer(model.graph.initializers["w0"])
    json_write.save(model, tmp_path / "m.json")  # w1 now takes file 0, w2 file 1
    assert model.graph.initializers["w1"].const.numpy()[0] == 1  # type: ignore[union-attr]
    assert model.graph.initializers["w2"].const.numpy()[0] == 2  # type: ignore[union-attr]
    again = json_io.load(tmp_path / "m.json")
    assert [float(v.const.numpy()[0]) for v in again.graph.initializers.values()] == [1.0, 2.0]  # type: ignore[union-attr]


def test_failed_save_writes_nothing(tmp_path: Path) -> None:
    model = _weights_model(np.ones(2000, dtype=np.float32))
    model.extensions["bad"] = object()  # not JSON: fails after the sidecar was staged
    with pytest.raises(TypeError):
        json_write.save(model, tmp_path / "m.json")
    assert list(tmp_path.iterdir()) == []


def test_independent_dims_split_same_named_dims(tmp_path: Path) -> None:
    json_write.save(_readable_model(), tmp_path / "m.json")
    shared = json_io.load(tmp_path / "m.json")
    split = json_io.load(tmp_path / "m.json", independent_dims=True)
    x_shared, y_shared = shared.graph.inputs[0].type, shared.graph.outputs[0].type
    x_split, y_split = split.graph.inputs[0].type, split.graph.outputs[0].type
    assert isinstance(x_shared, TensorType) and isinstance(y_shared, TensorType)
    assert isinstance(x_split, TensorType) and isinstance(y_split, TensorType)
    assert x_shared.shape is not None and y_shared.shape is not None
    assert x_split.shape is not None and y_split.shape is not None
    assert x_shared.shape[0] == y_shared.shape[0] == Sym("batch")
    assert x_split.shape[0] != y_split.shape[0]


# -- readability ---------------------------------------------------------------------------------


def _readable_model() -> Model:
    onnx_model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                helper.make_node("LeakyRelu", ["h"], ["r"], alpha=0.1),
                helper.make_node("Pad", ["r", "pads"], ["y"], mode="constant"),
            ],
            "small",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq + 1", 4])],
            [
                numpy_helper.from_array(np.eye(4, dtype=np.float32), "W"),
                numpy_helper.from_array(np.array([0, 0, 0, 0, 1, 0], dtype=np.int64), "pads"),
            ],
            value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", "seq", 4])],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    return onnx_io.from_proto(onnx_model)


def test_small_graph_reads_like_the_model(tmp_path: Path) -> None:
    graphopt.io.save(_readable_model(), tmp_path / "small.json")
    text = (tmp_path / "small.json").read_text()
    data = json.loads(text)
    assert data["dims"] == ["batch", "seq", "seq + 1"]
    assert text.count('"batch"') == 1  # declared once, then named inside type strings
    assert data["graph"]["inputs"] == [{"name": "x", "type": "float32[batch, seq, 4]"}]
    assert data["graph"]["outputs"] == [{"name": "y", "type": "float32[batch, seq + 1, 4]"}]
    # One node a line, in execution order, with typed attributes.
    assert '{"op": "MatMul", "name": "mm", "inputs": ["x", "W"], "outputs": ["h"]}' in text
    assert '"attributes": {"alpha": {"float": 0.1}}' in text
    assert [n["op"] for n in data["graph"]["nodes"]] == ["MatMul", "LeakyRelu", "Pad"]
    assert {"name": "pads", "dtype": "int64", "shape": [6], "data": [0, 0, 0, 0, 1, 0]} in data["graph"]["initializers"]
    assert graphopt.io.load(tmp_path / "small.json").graph.nodes[0].op_type == "MatMul"


# -- bad input ---------------------------------------------------------------------------------


def _valid() -> dict[str, Any]:
    return {
        "format_version": 1,
        "ir_version": 10,
        "opsets": {"": 21},
        "dims": ["n"],
        "graph": {
            "inputs": [{"name": "x", "type": "float32[n]"}],
            "outputs": ["y"],
            "nodes": [
                {"op": "Relu", "inputs": ["x"], "outputs": ["h"]},
                {"op": "Neg", "inputs": ["h"], "outputs": ["y"]},
            ],
        },
    }


def _broken(change: str) -> dict[str, Any]:
    data = _valid()
    graph = data["graph"]
    if change == "schema":
        del graph["nodes"][1]["op"]
    elif change == "dtype":
        graph["inputs"][0]["type"] = "float33[n]"
    elif change == "tensor dtype":
        graph["initializers"] = [{"name": "w", "dtype": "float33", "shape": [1], "data": [1]}]
    elif change == "cycle":
        graph["nodes"][0]["inputs"] = ["y"]
    elif change == "duplicate":
        graph["nodes"][1]["outputs"] = ["h"]
        graph["outputs"] = ["h"]
    elif change == "undefined":
        graph["nodes"][1]["inputs"] = ["nowhere"]
    elif change == "undeclared dim":
        graph["inputs"][0]["type"] = "float32[m]"
    elif change == "sidecar":
        graph["initializers"] = [{"name": "w", "dtype": "float32", "shape": [2000], "file": "gone.0.npy"}]
    elif change == "data shape":
        graph["initializers"] = [{"name": "w", "dtype": "float32", "shape": [3], "data": [1.0, 2.0]}]
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("schema", "$.graph.nodes[1]: 'op' is a required property"),
        ("dtype", "$.graph.inputs[0].type: unknown dtype 'float33'"),
        ("tensor dtype", "$.graph.initializers[0].dtype: 'float33' is not one of"),
        ("cycle", "cycle"),
        ("duplicate", "$.graph.nodes[1]: value 'h' is defined twice"),
        ("undefined", "$.graph.nodes[1] reads 'nowhere', which nothing defines"),
        ("undeclared dim", "$.graph.inputs[0].type: dim 'm' is not declared in $.dims"),
        ("sidecar", "$.graph.initializers[0].file: sidecar file"),
        ("data shape", "$.graph.initializers[0].data: data has shape [2], the tensor [3]"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(change: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_broken(change)))
    with pytest.raises(InputError) as caught:
        json_io.load(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message in text


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "format_version": 1,\n  "graph": {,}\n}')
    with pytest.raises(InputError, match=r"bad\.json: invalid JSON at line 3, column 13"):
        json_io.load(path)


def test_valid_base_case_loads(tmp_path: Path) -> None:
    """The bad-input cases above differ from this valid file by one change each."""
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_valid()))
    model = json_io.load(path)
    assert [n.op_type for n in model.graph] == ["Relu", "Neg"]


def test_identical_tensors_share_one_content_addressed_sidecar_and_both_move_to_it(tmp_path: Path) -> None:
    weight = np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y"])],
        "twins",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(weight, "w1"), numpy_helper.from_array(weight.copy(), "w2")],
    )
    json_write.save(onnx_io.from_proto(helper.make_model(graph)), tmp_path / "m.json")  # m.0.npy, m.1.npy
    model = json_io.load(tmp_path / "m.json")
    json_write.save(model, tmp_path / "m.json", content_addressed=True)
    sidecars = sorted(p.name for p in tmp_path.glob("m.*.npy"))
    assert len(sidecars) == 3  # the two numbered ones, and one file for both weights
    for name in ("m.0.npy", "m.1.npy"):
        (tmp_path / name).unlink()  # what the runner's commit does with the old sidecars
    for value in model.graph.initializers.values():
        np.testing.assert_array_equal(value.const.numpy(), weight)  # the model in memory reads the new file
    reloaded = json_io.load(tmp_path / "m.json")
    for value in reloaded.graph.initializers.values():
        np.testing.assert_array_equal(value.const.numpy(), weight)
