"""Small models for the reliability suites: one valid base model, and the ways to break it.

Every builder writes into a folder and returns the path a command should be given; the
bad ones are what users actually feed a converter by mistake (a truncated download, a PNG
with the wrong extension, a hand-edited JSON graph), the valid-but-odd ones are what
exporters really produce (zero-sized tensors, NaN weights, custom-domain ops).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
Builder = Callable[[Path], Path]


def model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] | None = None,
    opsets: dict[str, int] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers or [])
    imports = [helper.make_opsetid(d, v) for d, v in (opsets or {"": OPSET}).items()]
    return helper.make_model(graph, opset_imports=imports, ir_version=9)


def float_info(name: str, shape: list[int | str | None]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def base_model(weight: np.ndarray | None = None) -> onnx.ModelProto:
    """x[batch, 4] @ w[4, 4] + b, through an Identity and a duplicated Relu: room to optimize."""
    w = weight if weight is not None else np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Add", ["h", "b"], ["a"], name="add"),
        helper.make_node("Identity", ["a"], ["i"], name="id"),
        helper.make_node("Relu", ["i"], ["r1"], name="relu1"),
        helper.make_node("Relu", ["i"], ["r2"], name="relu2"),
        helper.make_node("Add", ["r1", "r2"], ["y"], name="sum"),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(4, np.float32), "b")]
    return model(nodes, [float_info("x", ["batch", 4])], [float_info("y", ["batch", 4])], inits)


def write(proto: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> Path:
    path = folder / name
    path.write_bytes(proto.SerializeToString())
    return path


def _bytes(name: str, payload: bytes) -> Builder:
    def build(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(payload)
        return path

    return build


def _proto(make: Callable[[], onnx.ModelProto]) -> Builder:
    return lambda folder: write(make(), folder)


# -- bad input: every one must exit 2 with one line on stderr and write nothing -------------


def truncated(folder: Path) -> Path:
    payload = base_model().SerializeToString()
    return _bytes("model.onnx", payload[: len(payload) * 2 // 3])(folder)


def corrupt(folder: Path) -> Path:
    payload = bytearray(base_model().SerializeToString())
    payload[10:40] = b"\xff" * 30
    return _bytes("model.onnx", bytes(payload))(folder)


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"


def directory(folder: Path) -> Path:
    path = folder / "model.onnx"
    path.mkdir()
    return path


def external_model() -> onnx.ModelProto:
    """The base model at 32 features: its weights are worth an external data file."""
    proto = base_model(np.ones((32, 32), np.float32))
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 32
    proto.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 32
    proto.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones(32, np.float32), "b"))
    return proto


def with_external_data(folder: Path) -> Path:
    path = folder / "model.onnx"
    onnx.save(external_model(), path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path


def missing_external_data(folder: Path) -> Path:
    path = with_external_data(folder)
    (folder / "model.onnx.data").unlink()
    return path


def short_external_data(folder: Path) -> Path:
    path = missing_external_data(folder)
    (folder / "model.onnx.data").write_bytes(b"\0" * 16)
    return path


def _external_entry(path: Path, key: str, value: str) -> None:
    """Set ``key`` of every external tensor's reference in the model at ``path``."""
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == key:
                entry.value = value
    path.write_bytes(proto.SerializeToString())


def external_data_symlink(folder: Path) -> Path:
    """The weights file is a link to a file outside the model's folder (a secret of the
    right size): onnx refuses it, and so must graphopt."""
    inside = folder / "model"
    inside.mkdir()
    path = with_external_data(inside)
    (folder / "secret").write_bytes((inside / "model.onnx.data").read_bytes())
    (inside / "model.onnx.data").unlink()
    (inside / "model.onnx.data").symlink_to(folder / "secret")
    return path


def external_data_through_linked_folder(folder: Path) -> Path:
    """The weights sit in ``weights/``, a link to a folder outside the model's folder."""
    outside, inside = folder / "outside", folder / "model"
    outside.mkdir()
    inside.mkdir()
    path = with_external_data(outside).rename(inside / "model.onnx")
    (inside / "weights").symlink_to(outside)
    _external_entry(path, "location", "weights/model.onnx.data")
    return path


def _external_data_with(key: str, value: str) -> Builder:
    def build(folder: Path) -> Path:
        path = with_external_data(folder)
        _external_entry(path, key, value)
        return path

    return build


def _invalid_utf8(make: Callable[[onnx.ModelProto], None]) -> Builder:
    """A model where ``make`` set some string field to "@@@@", then those bytes replaced by
    invalid UTF-8 of the same length (protobuf itself would not store them)."""

    def build(folder: Path) -> Path:
        path = with_external_data(folder)
        proto = onnx.load(str(path), load_external_data=False)
        make(proto)
        payload = proto.SerializeToString()
        assert payload.count(b"@@@@") == 1
        path.write_bytes(payload.replace(b"@@@@", b"\xff\xfe\xfd\xfc"))
        return path

    return build


def _set_location(proto: onnx.ModelProto) -> None:
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "@@@@"


def reads_its_own_output() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["x", "a"], ["a"], name="loop"),
        helper.make_node("Relu", ["a"], ["y"], name="out"),
    ]
    return model(nodes, [float_info("x", [4])], [float_info("y", [4])])


def _with_node(node: onnx.NodeProto, opsets: dict[str, int] | None = None) -> Callable[[], onnx.ModelProto]:
    """The base model with ``node`` (reading "y", writing "z") added and "z" as the output."""

    def make() -> onnx.ModelProto:
        proto = base_model()
        proto.graph.node.append(node)
        del proto.graph.output[:]
        proto.graph.output.append(float_info("z", ["batch", 4]))
        if opsets is not None:
            del proto.opset_import[:]
            proto.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets.items())
        return proto

    return make


def _opset(version: int) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        proto = base_model()
        proto.opset_import[0].version = version
        return proto

    return make


def no_default_opset() -> onnx.ModelProto:
    proto = base_model()
    del proto.opset_import[:]
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    return proto


def cycle() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["x", "c"], ["a"], name="first"),
        helper.make_node("Relu", ["a"], ["c"], name="second"),
        helper.make_node("Identity", ["a"], ["y"], name="out"),
    ]
    return model(nodes, [float_info("x", [4])], [float_info("y", [4])])


def dangling_input() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.node[1].input[1] = "nowhere"
    return proto


def dangling_output() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.output[0].name = "nowhere"
    return proto


def duplicate_output_names() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.node[4].output[0] = "r1"
    return proto


def duplicate_initializers() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.initializer.append(numpy_helper.from_array(np.zeros(4, np.float32), "b"))
    return proto


def duplicate_inputs() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.input.append(float_info("x", ["batch", 4]))
    return proto


def unknown_dtype() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.input[0].type.tensor_type.elem_type = 77
    return proto


def negative_initializer_dim() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.initializer[1].dims[0] = -4
    return proto


def initializer_size_mismatch() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.initializer[1].raw_data = b"\0" * 7
    return proto


def huge_declared_dim() -> onnx.ModelProto:
    proto = base_model()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2**62
    return proto


def huge_valid_dim() -> onnx.ModelProto:
    """An input of 2**36 x 4 floats: a terabyte, valid ONNX, too big to feed to a check."""
    proto = base_model()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2**36
    return proto


def hollow_initializer() -> onnx.ModelProto:
    """An initializer that declares 2**40 floats and carries no data."""
    proto = base_model()
    proto.graph.initializer[1].CopyFrom(TensorProto(name="b", data_type=TensorProto.FLOAT, dims=[2**40]))
    return proto


def huge_reshape() -> onnx.ModelProto:
    shape = numpy_helper.from_array(np.array([2**31, 2**31], np.int64), "huge_shape")
    nodes = [
        helper.make_node("Reshape", ["x", "huge_shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    return model(nodes, [float_info("x", [4, 4])], [float_info("y", None)], [shape])


def huge_constant_of_shape() -> onnx.ModelProto:
    shape = numpy_helper.from_array(np.array([2**20, 2**20, 2**10], np.int64), "huge_shape")
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["huge_shape"], ["c"], value=numpy_helper.from_array(np.ones(1, np.float32))
        ),
        helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    return model(nodes, [float_info("x", [4])], [float_info("y", [4])], [shape])


def json_graph(break_it: Callable[[dict[str, Any]], None]) -> Builder:
    """A valid JSON graph from ``graphopt convert``, then broken by ``break_it``."""

    def build(folder: Path) -> Path:
        from graphopt.io import load, save

        source = write(base_model(), folder, "source.onnx")
        path = folder / "model.json"
        save(load(source), path)
        source.unlink()
        document = json.loads(path.read_text())
        break_it(document)
        path.write_text(json.dumps(document))
        return path

    return build


def bad_json_text(folder: Path) -> Path:
    path = json_graph(lambda d: None)(folder)
    path.write_text(path.read_text()[:-20])
    return path


def unknown_op(opset: int, op: str) -> Builder:
    return _proto(_with_node(helper.make_node(op, ["y"], ["z"]), {"": opset}))


BAD_INPUTS: dict[str, Builder] = {
    "truncated protobuf": truncated,
    "corrupt protobuf": corrupt,
    "empty file": _bytes("model.onnx", b""),
    "png named .onnx": _bytes("model.onnx", PNG),
    "text named .onnx": _bytes("model.onnx", b"this is not a model\n"),
    "unknown extension": _bytes("model.txt", b"hello"),
    "directory named .onnx": directory,
    "missing file": lambda folder: folder / "absent.onnx",
    "missing external data": missing_external_data,
    "short external data": short_external_data,
    "opset 0": _proto(_opset(0)),
    "opset 99": _proto(_opset(99)),
    "no default-domain opset": _proto(no_default_opset),
    "cycle": _proto(cycle),
    "dangling input": _proto(dangling_input),
    "dangling graph output": _proto(dangling_output),
    "duplicate node outputs": _proto(duplicate_output_names),
    "duplicate initializers": _proto(duplicate_initializers),
    "duplicate graph inputs": _proto(duplicate_inputs),
    "unknown element type": _proto(unknown_dtype),
    "declared dim of 2**62": _proto(huge_declared_dim),
    "initializer of 2**40 floats without data": _proto(hollow_initializer),
    "negative initializer dim": _proto(negative_initializer_dim),
    "initializer data of the wrong size": _proto(initializer_size_mismatch),
    "external data is a symlink": external_data_symlink,
    "external data through a linked folder": external_data_through_linked_folder,
    "external data length disagrees with the shape": _external_data_with("length", "12"),
    "external data offset negative": _external_data_with("offset", "-4096"),
    "external data location not UTF-8": _invalid_utf8(_set_location),
    "node name not UTF-8": _invalid_utf8(lambda proto: setattr(proto.graph.node[0], "name", "@@@@")),
    "node reads its own output": _proto(reads_its_own_output),
    "json: not json": bad_json_text,
    "json: missing graph": json_graph(lambda d: d.pop("graph")),
    "json: empty object": json_graph(lambda d: d.clear()),
    "json: format version 99": json_graph(lambda d: d.update(format_version=99)),
    "json: node without op": json_graph(lambda d: d["graph"]["nodes"][0].pop("op")),
    "json: nodes not a list": json_graph(lambda d: d["graph"].update(nodes={})),
    "json: type not a string": json_graph(lambda d: d["graph"]["inputs"][0].update(type=5)),
    "json: unparsable type": json_graph(lambda d: d["graph"]["inputs"][0].update(type="float32[batch")),
    "json: unknown dtype": json_graph(lambda d: d["graph"]["initializers"][1].update(dtype="float33")),
    "json: data of the wrong size": json_graph(lambda d: d["graph"]["initializers"][1].update(data=[1.0, 2.0])),
    "json: unknown key": json_graph(lambda d: d["graph"].update(surprise=1)),
    "json: dangling input": json_graph(lambda d: d["graph"]["nodes"][1]["inputs"].__setitem__(1, "nowhere")),
    "json: duplicate outputs": json_graph(lambda d: d["graph"]["nodes"][4]["outputs"].__setitem__(0, "r1")),
    "json: cycle": json_graph(lambda d: d["graph"]["nodes"][0]["inputs"].__setitem__(0, "y")),
}

# -- ops without a schema at the model's opset: accepted with a warning, kept opaque --------

OPAQUE_OPS: dict[str, Builder] = {
    "op newer than the opset": unknown_op(13, "Gelu"),
    "op removed at the opset": unknown_op(OPSET, "Scatter"),
    "json: op newer than the opset": json_graph(lambda d: d["graph"]["nodes"][2].update(op="Gelu", name="g")),
}


def layer_norm_at(opset: int) -> onnx.ModelProto:
    """LayerNormalization (ONNX opset 17) at an older opset, as older exporters wrote it and
    onnxruntime runs it, between an Identity and a Relu that the passes may remove."""
    nodes = [
        helper.make_node("Identity", ["x"], ["i"], name="id"),
        helper.make_node("LayerNormalization", ["i", "gamma", "beta"], ["n"], name="ln", axis=-1, epsilon=1e-5),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    inits = [
        numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "gamma"),
        numpy_helper.from_array(np.full(8, 0.1, np.float32), "beta"),
    ]
    return model(nodes, [float_info("x", ["batch", 8])], [float_info("y", ["batch", 8])], inits, {"": opset})


# -- valid but unusual: these must optimize (exit 0) --------------------------------------


def custom_domain_op() -> onnx.ModelProto:
    return _with_node(
        helper.make_node("Mystery", ["y"], ["z"], domain="com.example", flavour=3),
        {"": OPSET, "com.example": 1},
    )()


def custom_default_domain_op() -> onnx.ModelProto:
    return _with_node(helper.make_node("MyLegacyOp", ["y"], ["z"]))()


def zero_sized() -> onnx.ModelProto:
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    nodes = [
        helper.make_node("Concat", ["x", "empty"], ["c"], axis=0),
        helper.make_node("Identity", ["c"], ["i"]),
        helper.make_node("Relu", ["i"], ["y"]),
        helper.make_node("Shape", ["e"], ["s"]),
        helper.make_node("Identity", ["e"], ["e2"]),
        helper.make_node("Relu", ["e2"], ["ez"]),
    ]
    return model(
        nodes,
        [float_info("x", ["batch", 4]), float_info("e", [0, 3])],
        [
            float_info("y", ["batch", 4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
            float_info("ez", [0, 3]),
        ],
        [empty],
    )


def nan_inf_weights() -> onnx.ModelProto:
    weight = np.arange(16, dtype=np.float32).reshape(4, 4)
    weight[0, 0], weight[1, 1], weight[2, 2] = np.nan, np.inf, -np.inf
    return base_model(weight)
