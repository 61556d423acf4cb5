"""The qdq rules' table: the Q/DQ clean-up of statically quantized models. Each rule fires on its model and
refuses its perturbations (tests/passes/fuse/table.py says how); the family's own tests follow its table: every
data-movement op on integers, per-axis quantizations whose axis maps through or not, a Q -> DQ that rounds, and
the default pipeline's run with its numerics check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.runtime.census import census_of_file
from tests.cli_helpers import invoke
from tests.numerics import run_ort
from tests.passes.fuse.table import F16, LATE, Case, Perturb, set_const, table_tests, weights
from tests.passes.fuse_helpers import fires, fuse, info, init, model, node, ops, refused

# The quantization's parameters: a scale and a uint8 zero point (quantize_static's activations as QUInt8).
SCALE, ZERO = 0.05, 131
PASSES = "shape-infer,fuse,dce"


def _params(prefix: str, scale: Any = SCALE, zero: Any = ZERO, dtype: Any = np.uint8) -> list[onnx.TensorProto]:
    return [init(f"{prefix}_s", np.asarray(scale, np.float32)), init(f"{prefix}_z", np.asarray(zero, dtype))]


def _around(
    move: onnx.NodeProto | None,
    constants: Sequence[onnx.TensorProto] = (),
    shape: Sequence[int | str] = ("b", 4, 6),
    dq_axis: int | None = None,
    q_axis: int | None = None,
    scales: tuple[Any, Any] = (SCALE, SCALE),
    zeros: tuple[Any, Any] = (ZERO, ZERO),
) -> onnx.ModelProto:
    """quantize_static's QDQ around one op: x -> Q -> DQ -> ``move`` (reading "d", writing "m") -> Q -> DQ -> y,
    the two quantizations of ``scales`` and ``zeros`` (per axis where given ``dq_axis`` / ``q_axis``). Without
    ``move`` the second Q reads the DQ: a requantization."""
    axis_of = {"dq": dq_axis, "q": q_axis}
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq", **_axis(dq_axis)),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "d", **_axis(dq_axis)),
        *([move] if move is not None else []),
        node("QuantizeLinear", ["m" if move is not None else "d", "b_s", "b_z"], "mq", **_axis(axis_of["q"])),
        node("DequantizeLinear", ["mq", "b_s", "b_z"], "y", **_axis(q_axis)),
    ]
    params = [*_params("a", scales[0], zeros[0]), *_params("b", scales[1], zeros[1]), *constants]
    return model(nodes, [info("x", list(shape))], ["y"], params)


def _axis(axis: int | None) -> dict[str, int]:
    return {} if axis is None else {"axis": axis}


def _transposed() -> onnx.ModelProto:
    return _around(node("Transpose", ["d"], "m", perm=[0, 2, 1]))


def _requantized() -> onnx.ModelProto:
    return _around(None)


def _joined() -> onnx.ModelProto:
    """A rotary's halves: the DQ's output and its negation, each quantized, joined and quantized again."""
    proto = _around(node("Concat", ["d", "nd"], "m", axis=-1))
    nodes = list(proto.graph.node)
    nodes[2:2] = [
        node("Neg", ["d"], "n"),
        node("QuantizeLinear", ["n", "a_s", "a_z"], "nq"),
        node("DequantizeLinear", ["nq", "a_s", "a_z"], "nd"),
    ]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto


def _transposed_for_attention() -> onnx.ModelProto:
    """What a fusion through Q/DQ leaves (attention-4d on gpt2_ts_qdq): K quantized to int8, dequantized, then
    transposed into the Attention op's [batch, heads, sequence, head] layout."""
    nodes = [
        node("QuantizeLinear", ["k", "a_s", "a_z"], "kq"),
        node("DequantizeLinear", ["kq", "a_s", "a_z"], "d"),
        node("Transpose", ["d"], "m", perm=[0, 2, 1, 3]),
        node("Attention", ["q", "m", "v"], "y"),
    ]
    inputs = [info("q", [1, 2, 4, 8]), info("k", [1, 4, 2, 8]), info("v", [1, 2, 4, 8])]
    return model(nodes, inputs, ["y"], _params("a", zero=0, dtype=np.int8), opset=23)


def _read_by_an_add(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The transposed K read by an Add, which onnxruntime runs as an integer kernel from its DequantizeLinear; at
    opset 20, where onnxruntime's propagation of the DequantizeLinear across the Transpose loads (from 21 on it fails,
    and the moves read the integers)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    attention = out.graph.node[-1]
    attention.CopyFrom(node("Add", ["m", "v"], "y"))
    out.opset_import[0].version = 20
    return out


def _gathered_table(table: np.ndarray | None = None, zero: int = 3, opset: int = 17) -> onnx.ModelProto:
    """quantize_static's embedding: an int8 table (its weight quantization, zero point ``zero``) dequantized whole,
    gathered by the ids, and the rows quantized and dequantized again with the table's parameters."""
    if table is None:
        table = np.random.default_rng(4).integers(-128, 128, (6, 4)).astype(np.int8)
    nodes = [
        node("DequantizeLinear", ["t", "w_s", "w_z"], "d"),
        node("Gather", ["d", "ids"], "g", axis=0),
        node("QuantizeLinear", ["g", "b_s", "b_z"], "gq"),
        node("DequantizeLinear", ["gq", "b_s", "b_z"], "y"),
    ]
    params = [init("t", table), *_params("w", zero=zero, dtype=np.int8), *_params("b", zero=zero, dtype=np.int8)]
    return model(nodes, [info("ids", ["b", "s"], TensorProto.INT64)], ["y"], params, opset=opset)


def _per_channel_table(gathered_axis: int) -> onnx.ModelProto:
    """The table quantized per column (axis 1, four scales and zero points), gathered along ``gathered_axis``: the
    rows' quantization along axis 2 of [b, s, 4] (a Gather along axis 1 would cut the columns)."""
    proto = _gathered_table()
    scales = np.asarray([0.05, 0.1, 0.02, 0.07], np.float32)
    zeros = np.asarray([3, -5, 0, 127], np.int8)
    for prefix in ("w", "b"):
        for index, found in enumerate(proto.graph.initializer):
            if found.name == f"{prefix}_s":
                proto.graph.initializer[index].CopyFrom(init(found.name, scales))
            if found.name == f"{prefix}_z":
                proto.graph.initializer[index].CopyFrom(init(found.name, zeros))
    for found in proto.graph.node:
        found.attribute.extend([helper.make_attribute("axis", 1 if found.input[0] == "t" else 2)])
        if found.op_type == "Gather":
            del found.attribute[:]
            found.attribute.extend([helper.make_attribute("axis", gathered_axis)])
    return proto


NO_SHAPE = "n/a: a per-tensor quantization needs no shape"
WRONG_SCALE = Perturb(set_const("b_s", SCALE * 1.01), "the scales differ", note="the QuantizeLinear's scale")


def _case(build: Callable[[], onnx.ModelProto], expected: dict[str, int], interior: str, **kinds: Any) -> Case:
    """A qdq rule's case: the late rules' settings, the table's perturbations as given or the family's own."""
    return Case(
        build,
        expected,
        interior,
        kinds.get("wrong_attr", WRONG_SCALE),
        kinds.get("unprovable", NO_SHAPE),
        "n/a: QuantizeLinear exists from opset 10, the rule's gate",
        settings=LATE,
        passes=PASSES,
    )


CASES: dict[str, Case] = {
    "qdq-move-integers": _case(
        _transposed,
        {"QuantizeLinear": 1, "Transpose": 1, "DequantizeLinear": 1},
        "m",
        unprovable=NO_SHAPE + " (per axis: test_a_per_axis_quantization_...)",
    ),
    "qdq-concat-integers": _case(_joined, {"QuantizeLinear": 2, "DequantizeLinear": 2, "Neg": 1, "Concat": 1}, "m"),
    "qdq-dequantize-after-move": _case(
        _transposed_for_attention,
        {"QuantizeLinear": 1, "DequantizeLinear": 1, "Transpose": 1, "Attention": 1},
        "n/a: one node (the DequantizeLinear stays while something else reads it)",
        wrong_attr=Perturb(
            _read_by_an_add,
            "the move is not read by fused float ops alone",
            note="the move's reader an Add, which onnxruntime runs as an integer kernel",
        ),
    ),
    "qdq-gather-table-uint8": _case(
        _gathered_table,
        {"Gather": 1, "DequantizeLinear": 1},
        "gq",
        wrong_attr=Perturb(set_const("b_z", 4), "the zero points differ", note="the rows' zero point"),
    ),
    "qdq-requantize-same": _case(
        _requantized,
        {"QuantizeLinear": 1, "DequantizeLinear": 1},
        "n/a: one node (the DequantizeLinear stays while something reads it)",
        wrong_attr=Perturb(
            set_const("b_z", ZERO + 1), "the zero points differ", note="the QuantizeLinear's zero point"
        ),
    ),
}

EXPORTED: dict[str, Any] = {
    "qdq-concat-integers": "no exporter fixture is quantized (quantize_static writes the Q/DQ after export)",
    "qdq-dequantize-after-move": "no exporter fixture is quantized (quantize_static writes the Q/DQ after export)",
    "qdq-gather-table-uint8": "no exporter fixture is quantized (quantize_static writes the Q/DQ after export)",
    "qdq-move-integers": "no exporter fixture is quantized (quantize_static writes the Q/DQ after export)",
    "qdq-requantize-same": "no exporter fixture is quantized (quantize_static writes the Q/DQ after export)",
}

BEFORE_EXPORTS: frozenset[str] = frozenset()

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def _const(name: str, values: Sequence[int]) -> onnx.TensorProto:
    return init(name, np.asarray(values, np.int64))


# Each data-movement op between a DQ and a Q of the same parameters, with the input's shape.
MOVES: dict[str, tuple[onnx.NodeProto, list[onnx.TensorProto], list[int | str]]] = {
    "Transpose": (node("Transpose", ["d"], "m", perm=[2, 0, 1]), [], ["b", 4, 6]),
    "Reshape": (node("Reshape", ["d", "shape"], "m"), [_const("shape", [0, 24])], ["b", 4, 6]),
    "Flatten": (node("Flatten", ["d"], "m", axis=1), [], ["b", 4, 6]),
    "Squeeze": (node("Squeeze", ["d", "axes"], "m"), [_const("axes", [1])], ["b", 1, 6]),
    "Unsqueeze": (node("Unsqueeze", ["d", "axes"], "m"), [_const("axes", [1])], ["b", 4, 6]),
    "Slice": (
        node("Slice", ["d", "starts", "ends", "axes"], "m"),
        [_const("starts", [1]), _const("ends", [3]), _const("axes", [2])],
        ["b", 4, 6],
    ),
    "Gather": (node("Gather", ["d", "idx"], "m", axis=2), [_const("idx", [[5, 0], [2, 2]])], ["b", 4, 6]),
}


@pytest.mark.parametrize("op_type", list(MOVES))
def test_each_data_movement_op_moves_the_integers(op_type: str) -> None:
    """DQ -> op -> Q of the same scale and zero point: the op on the uint8 tensor, numerics equal in onnxruntime."""
    move, constants, shape = MOVES[op_type]
    proto = _around(move, constants, shape)
    expected = {"QuantizeLinear": 1, op_type: 1, "DequantizeLinear": 1}
    out = fires(proto, "qdq-move-integers", expected, passes=PASSES, **LATE)
    (moved,) = (n for n in out.graph.node if n.op_type == op_type)
    assert moved.input[0] == "xq"  # it reads the uint8 tensor now


def _per_axis(
    move: onnx.NodeProto, constants: Sequence[onnx.TensorProto], shape: Sequence[int | str], q_axis: int
) -> onnx.ModelProto:
    """uint8 per-axis quantization along axis 1 (4 channels) before ``move``, along ``q_axis`` after it."""
    scales = np.asarray([0.05, 0.1, 0.02, 0.07], np.float32)
    zeros = np.asarray([128, 131, 126, 129], np.uint8)
    return _around(move, constants, shape, dq_axis=1, q_axis=q_axis, scales=(scales, scales), zeros=(zeros, zeros))


def test_a_max_pool_stays_float() -> None:
    """DQ -> MaxPool -> Q is exact on integers too, but onnxruntime's int8 MaxPool ran resnet18_ts_qdq 1.24x slower."""
    pool = node("MaxPool", ["d"], "m", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    proto = _around(pool, shape=["b", 2, 5, 5])
    out, details = fuse(proto, PASSES, **LATE)
    assert not details["applied"], details
    assert ops(out)["DequantizeLinear"] == 2


def test_a_per_axis_quantization_moves_where_the_move_carries_its_axis() -> None:
    """Axis 1 goes to 2 under perm [0, 2, 1], and stays 1 under a Reshape that splits the dims after it."""
    transpose = node("Transpose", ["d"], "m", perm=[0, 2, 1])
    expected = {"QuantizeLinear": 1, "Transpose": 1, "DequantizeLinear": 1}
    fires(_per_axis(transpose, [], [2, 4, 4], q_axis=2), "qdq-move-integers", expected, passes=PASSES, **LATE)
    reshape = node("Reshape", ["d", "shape"], "m")
    split = _per_axis(reshape, [_const("shape", [2, 4, 2, 3])], [2, 4, 6], q_axis=1)
    expected = {"QuantizeLinear": 1, "Reshape": 1, "DequantizeLinear": 1}
    fires(split, "qdq-move-integers", expected, passes=PASSES, **LATE)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        # perm [0, 2, 1] takes channel axis 1 to axis 2, and the Q quantizes along axis 1
        (lambda: _per_axis(node("Transpose", ["d"], "m", perm=[0, 2, 1]), [], [2, 4, 4], 1), "does not carry"),
        # [2, 4, 6] -> [2, 6, 4] mixes the channels with the dim after them
        (lambda: _per_axis(node("Reshape", ["d", "s"], "m"), [_const("s", [2, 6, 4])], [2, 4, 6], 2), "does not carry"),
        # the dims before the channels are not static: the Reshape's axis is not provable
        (lambda: _per_axis(node("Reshape", ["d", "s"], "m"), [_const("s", [0, 4, 2, 3])], ["b", 4, 6], 1), "carry"),
        # a Slice along the channels cuts them (it would need the scales cut too)
        (
            lambda: _per_axis(
                node("Slice", ["d", "st", "en", "ax"], "m"),
                [_const("st", [0]), _const("en", [2]), _const("ax", [1])],
                [2, 4, 4],
                2,
            ),
            "does not carry",
        ),
    ],
    ids=["transpose-axis-elsewhere", "reshape-mixes-channels", "reshape-not-static", "slice-cuts-channels"],
)
def test_a_per_axis_quantization_whose_axis_does_not_map_stays(
    build: Callable[[], onnx.ModelProto], reason: str
) -> None:
    proto = build()
    details = refused(proto, "qdq-move-integers", passes=PASSES, **LATE)
    assert any(reason in m for m in details["near_misses"]["qdq"]), details


def test_a_quantization_of_a_float_activation_stays() -> None:
    """x -> Q -> DQ rounds x to the grid of the scale: that is the quantization itself, not a round trip."""
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq"),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "d"),
        node("Relu", ["d"], "y"),
    ]
    proto = model(nodes, [info("x", ["b", 4])], ["y"], _params("a"))
    out, details = fuse(proto, PASSES, **LATE)
    assert not details["applied"], details
    assert dict(ops(out)) == {"QuantizeLinear": 1, "DequantizeLinear": 1, "Relu": 1}


def test_a_dequantized_value_read_elsewhere_keeps_its_dequantize() -> None:
    """DQ -> Transpose -> Q with the DQ's output also read by a Relu: the Transpose moves the integers all the
    same (exact), and the DQ stays for the Relu."""
    proto = _transposed()
    proto.graph.node.append(node("Relu", ["d"], "r"))
    proto.graph.output.append(info("r", None))
    expected = {"QuantizeLinear": 1, "DequantizeLinear": 2, "Transpose": 1, "Relu": 1}
    out = fires(proto, "qdq-move-integers", expected, passes=PASSES, **LATE)
    (relu,) = (n for n in out.graph.node if n.op_type == "Relu")
    assert relu.input[0] == "d"


def test_other_integer_types_or_an_inexact_round_trip_stay() -> None:
    """uint8 dequantized and int8 quantized (zero points 128 and 0: the same numbers) is a conversion; float16
    scales cannot give every int16 step back exactly."""
    proto = _around(node("Transpose", ["d"], "m", perm=[0, 2, 1]))
    proto.graph.initializer[1].CopyFrom(init("a_z", np.asarray(128, np.uint8)))
    proto.graph.initializer[3].CopyFrom(init("b_z", np.asarray(0, np.int8)))
    details = refused(proto, "qdq-move-integers", passes=PASSES, **LATE)
    assert any("integer types differ (uint8 dequantized, int8 quantized)" in m for m in details["near_misses"]["qdq"])
    nodes = [
        node("DequantizeLinear", ["q", "s", "z"], "d"),
        node("QuantizeLinear", ["d", "s", "z"], "mq"),
        node("DequantizeLinear", ["mq", "s", "z"], "y"),
    ]
    params = [init("s", np.asarray(0.5, np.float16)), init("z", np.asarray(0, np.int16))]
    wide = model(nodes, [info("q", ["b", 4], TensorProto.INT16)], ["y"], params, opset=21)
    _, details = fuse(wide, PASSES, **LATE)
    assert not details["applied"], details
    assert any("float16 cannot hold every int16 step" in m for m in details["near_misses"]["qdq"]), details


def _written(tmp_path: Path, proto: onnx.ModelProto) -> Path:
    path = tmp_path / "qdq.onnx"
    onnx.save(proto, path)
    return path


@pytest.mark.parametrize("target", [[], ["--target", "ort"], ["--target-opset", "23"]], ids=["default", "ort", "23"])
def test_the_default_pipeline_moves_the_integers_and_the_check_passes(tmp_path: Path, target: list[str]) -> None:
    """quantize_static's Q/DQ around a Transpose and a Reshape between two MatMuls: graphopt run exits 0 with the
    check passed, two Q/DQ pairs fewer."""
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq"),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "xd"),
        node("MatMul", ["xd", "w"], "h"),
        node("QuantizeLinear", ["h", "a_s", "a_z"], "hq"),
        node("DequantizeLinear", ["hq", "a_s", "a_z"], "d"),
        node("Transpose", ["d"], "t", perm=[0, 2, 1]),
        node("QuantizeLinear", ["t", "a_s", "a_z"], "tq"),
        node("DequantizeLinear", ["tq", "a_s", "a_z"], "td"),
        node("Reshape", ["td", "shape"], "r"),
        node("QuantizeLinear", ["r", "a_s", "a_z"], "rq"),
        node("DequantizeLinear", ["rq", "a_s", "a_z"], "rd"),
        node("MatMul", ["rd", "w2"], "y"),
    ]
    params = [*_params("a"), init("w", weights(8, 6)), init("w2", weights(24, 3)), _const("shape", [0, 24])]
    proto = model(nodes, [info("x", ["b", 4, 8])], [info("y", ["b", 3])], params)
    out = tmp_path / "out.onnx"
    result = invoke("run", _written(tmp_path, proto), "-o", out, *target)
    assert result.exit_code == 0, result.stderr
    assert "numerics: passed" in result.stderr
    found = ops(onnx.load(out))
    assert found["QuantizeLinear"] == 2 and found["DequantizeLinear"] == 2, found
    assert found["Transpose"] == 1 and found["Reshape"] == 1, found


@pytest.mark.parametrize(
    ("integer", "float_type"),
    [
        (TensorProto.UINT8, TensorProto.FLOAT),
        (TensorProto.INT8, TensorProto.FLOAT),
        (TensorProto.INT16, TensorProto.FLOAT),
        (TensorProto.UINT8, F16),
        (TensorProto.INT8, F16),
    ],
    ids=["uint8-float32", "int8-float32", "int16-float32", "uint8-float16", "int8-float16"],
)
def test_the_round_trip_it_removes_gives_every_integer_back(integer: int, float_type: int) -> None:
    """The exactness the rules rely on, in onnxruntime: DQ -> Transpose -> Q of every integer value of the type,
    at awkward scales and zero points, gives the integers back bit for bit, as the moved integers do (int8 is not
    moved, see test_int8_stays_between_its_quantize_and_dequantize, but requantized alike)."""
    dtype = helper.tensor_dtype_to_np_dtype(integer)
    info_of = np.iinfo(dtype)
    every = np.arange(info_of.min, info_of.max + 1).astype(dtype).reshape(1, -1)
    float_np = helper.tensor_dtype_to_np_dtype(float_type)
    for scale, zero in [(0.1, 0), (1 / 3, 5), (0.0123, info_of.min), (7e-5, info_of.max), (3.7, 1)]:
        nodes = [
            node("DequantizeLinear", ["q", "s", "z"], "d"),
            node("Transpose", ["d"], "m", perm=[1, 0]),
            node("QuantizeLinear", ["m", "s", "z"], "y"),
        ]
        params = [init("s", np.asarray(scale, float_np)), init("z", np.asarray(zero, dtype))]
        proto = model(nodes, [info("q", [1, every.size], integer)], [info("y", None, integer)], params, opset=21)
        (original,) = run_ort(proto, {"q": every}).values()
        assert np.array_equal(original, every.T), (scale, zero)
        if integer != TensorProto.INT8:
            out = fires(proto, "qdq-move-integers", {"Transpose": 1}, passes=PASSES, **LATE)
            (moved,) = run_ort(out, {"q": every}).values()
            assert np.array_equal(moved, every.T), (scale, zero)


def _in_int8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every zero point an int8 3 (quantize_static's QInt8 activations)."""
    for found in proto.graph.initializer:
        if found.name.endswith("_z"):
            found.CopyFrom(init(found.name, np.asarray(3, np.int8)))
    return proto


def test_int8_stays_between_its_quantize_and_dequantize() -> None:
    """onnxruntime on x86 makes int8 activations uint8 only at a Q -> DQ pair it finds adjacent: an int8 Transpose
    or Concat between them kept gpt2_dynamo_qdq's head MatMul in float, 3.6x slower. A requantization still goes."""
    for rule, build in (("qdq-move-integers", _transposed), ("qdq-concat-integers", _joined)):
        details = refused(_in_int8(build()), rule, passes=PASSES, **LATE)
        assert any("adjacent Q -> DQ pairs" in m for m in details["near_misses"]["qdq"]), details
    expected = {"QuantizeLinear": 1, "DequantizeLinear": 1}
    fires(_in_int8(_requantized()), "qdq-requantize-same", expected, passes=PASSES, **LATE)


def test_a_transposed_dequantized_k_loads_in_onnxruntime_at_its_full_level(tmp_path: Path) -> None:
    # onnxruntime 1.32 propagates the DequantizeLinear over the Transpose with a QuantizeLinear whose output_dtype
    # contradicts its zero point at opset 21 and up: the original does not load at ORT_ENABLE_ALL, the output does.
    source, target = tmp_path / "k.onnx", tmp_path / "out.onnx"
    onnx.save(_transposed_for_attention(), source)
    with pytest.raises(Exception, match="output_dtype INT8 does not match y_zero_point type UINT8"):
        census_of_file(source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert [n.op_type for n in onnx.load(target).graph.node] == [
        "QuantizeLinear",
        "Transpose",
        "DequantizeLinear",
        "Attention",
    ]
    census_of_file(target)


def _rotated_halves(opset: int, dtype: Any = np.int8) -> onnx.ModelProto:
    """A QOperator model's rotary halves, computed in float: x quantized (``dtype``), dequantized once, its two
    halves sliced, the second negated and put first."""
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq"),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "d"),
        node("Slice", ["d", "zero", "half", "last"], "low"),
        node("Slice", ["d", "half", "end", "last"], "high"),
        node("Neg", ["high"], "negated"),
        node("Concat", ["negated", "low"], "y", axis=-1),
    ]
    bounds = [_const(name, [value]) for name, value in (("zero", 0), ("half", 4), ("end", 8), ("last", -1))]
    return model(nodes, [info("x", ["b", 8])], ["y"], [*_params("a", zero=3, dtype=dtype), *bounds], opset=opset)


def _loads_once_optimized(proto: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    """``graphopt run``'s output of ``proto``, which onnxruntime 1.32 fails to load at ORT_ENABLE_ALL (its Q/DQ
    propagation's QuantizeLinear "output_dtype INT8 does not match y_zero_point type UINT8"): the check passed, and
    the output loads."""
    source, target = tmp_path / "model.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    with pytest.raises(Exception, match="output_dtype INT8 does not match y_zero_point type UINT8"):
        census_of_file(source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    census_of_file(target)
    return onnx.load(target)


@pytest.mark.parametrize("opset", [21, 23])
def test_an_int8_dequantize_before_slices_loads_at_onnxruntime_s_full_level(tmp_path: Path, opset: int) -> None:
    """onnxruntime 1.32 carries an int8 DequantizeLinear across a Slice from opset 21 on and fails to load
    ("output_dtype INT8 does not match y_zero_point type UINT8"): the QOperator Llamas at --target-opset 23 did
    not load at ORT_ENABLE_ALL. Each Slice now reads the integers and gets its own DequantizeLinear."""
    written = _loads_once_optimized(_rotated_halves(opset), tmp_path)
    assert ops(written) == {"QuantizeLinear": 1, "Slice": 2, "DequantizeLinear": 2, "Neg": 1, "Concat": 1}
    assert all(n.input[0] == "xq" for n in written.graph.node if n.op_type == "Slice")


def _assert_left_before_the_move(proto: onnx.ModelProto) -> None:
    """qdq-dequantize-after-move leaves ``proto``'s DequantizeLinear where onnxruntime's propagation loads."""
    details = refused(proto, "qdq-dequantize-after-move", passes=PASSES, **LATE)
    found = details["near_misses"].get("qdq", [])
    assert any("nor one onnxruntime's Q/DQ propagation fails on" in m for m in found), found


@pytest.mark.parametrize(("opset", "dtype"), [(20, np.int8), (23, np.uint8)])
def test_a_dequantize_onnxruntime_carries_across_slices_safely_stays_before_them(opset: int, dtype: Any) -> None:
    _assert_left_before_the_move(_rotated_halves(opset, dtype))


def _moved_into_floats(op_type: str, opset: int, readers: Sequence[str] = ("Relu",)) -> onnx.ModelProto:
    """x quantized to int8, dequantized, moved by ``op_type`` (MOVES) and read by ``readers``: float ops, "Twice"
    (an Add of the moved value to itself) or "Quantize" (a QuantizeLinear with the DQ's parameters)."""
    move, constants, shape = MOVES[op_type]
    kinds = {
        "Relu": lambda i: node("Relu", ["m"], f"y{i}"),
        "Twice": lambda i: node("Add", ["m", "m"], f"y{i}"),
        "Quantize": lambda i: node("QuantizeLinear", ["m", "a_s", "a_z"], f"y{i}"),
    }
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq"),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "d"),
        move,
        *(kinds[kind](i) for i, kind in enumerate(readers)),
    ]
    params = [*_params("a", zero=3, dtype=np.int8), *constants]
    outputs = [
        info(f"y{i}", None, TensorProto.INT8 if kind == "Quantize" else TensorProto.FLOAT)
        for i, kind in enumerate(readers)
    ]
    return model(nodes, [info("x", shape)], outputs, params, opset=opset)


PROPAGATED = ["Reshape", "Transpose", "Squeeze", "Unsqueeze"]


@pytest.mark.parametrize("opset", [21, 23])
@pytest.mark.parametrize("op_type", PROPAGATED)
def test_an_int8_dequantize_before_a_move_read_by_a_float_op_moves_after_it(
    tmp_path: Path, op_type: str, opset: int
) -> None:
    """onnxruntime 1.32 carries an int8 DequantizeLinear across a Reshape, Transpose, Squeeze or Unsqueeze too (not
    only a Slice) from opset 21 on, and fails to load: BLOOM's ALiBi bias split by heads before a fused Attention
    (bloom's QDQ files at opset 23). The move now reads the integers."""
    written = _loads_once_optimized(_moved_into_floats(op_type, opset), tmp_path)
    assert [n.op_type for n in written.graph.node] == ["QuantizeLinear", op_type, "DequantizeLinear", "Relu"]


@pytest.mark.parametrize(
    "readers", [("Relu", "Relu"), ("Twice",), ("Relu", "Quantize")], ids=["two readers", "read twice", "one a Q"]
)
@pytest.mark.parametrize("op_type", PROPAGATED)
def test_a_move_with_more_than_one_edge_out_keeps_its_dequantize(
    tmp_path: Path, op_type: str, readers: Sequence[str]
) -> None:
    """onnxruntime's propagation crosses a move only to its one edge out: with two (two readers, one reading it
    twice, or a QuantizeLinear beside a float op) the original loads at opset 23, and the rule leaves it."""
    proto = _moved_into_floats(op_type, 23, readers)
    onnx.save(proto, tmp_path / "moved.onnx")
    census_of_file(tmp_path / "moved.onnx")
    _assert_left_before_the_move(proto)


def _sliced(
    opset: int, per_axis: bool = False, read_too: bool = False, negated: bool = False, domain: str = ""
) -> onnx.ModelProto:
    """x[2, 8] quantized to int8 (per row with ``per_axis``, in ``domain``), dequantized and sliced to its first half
    "y", a graph output (``read_too``: also negated, a second output; ``negated``: "y" is the negated half, the
    half itself no output)."""
    axis = {"axis": 0} if per_axis else {}
    scale, zero = ([SCALE, 2 * SCALE], [3, -3]) if per_axis else (SCALE, 3)
    half = "half_values" if negated else "y"
    nodes = [
        node("QuantizeLinear", ["x", "a_s", "a_z"], "xq", domain=domain, **axis),
        node("DequantizeLinear", ["xq", "a_s", "a_z"], "d", domain=domain, **axis),
        node("Slice", ["d", "zero", "half", "last"], half),
        *([node("Neg", [half], "y")] if negated else []),
        *([node("Neg", ["y"], "z")] if read_too else []),
    ]
    bounds = [_const(name, [value]) for name, value in (("zero", 0), ("half", 4), ("last", -1))]
    params = [*_params("a", scale, zero, dtype=np.int8), *bounds]
    proto = model(nodes, [info("x", [2, 8])], ["y", *(["z"] if read_too else [])], params, opset=opset)
    if domain:
        proto.opset_import.append(helper.make_opsetid(domain, 1))
    return proto


def test_an_int8_dequantize_before_a_sliced_graph_output_moves_after_it(tmp_path: Path) -> None:
    """onnxruntime's propagation also puts its pair on the edge to a graph output that nothing else reads."""
    source, target = tmp_path / "sliced.onnx", tmp_path / "out.onnx"
    onnx.save(_sliced(21), source)
    with pytest.raises(Exception, match="output_dtype INT8 does not match y_zero_point type UINT8"):
        census_of_file(source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert [n.op_type for n in onnx.load(target).graph.node] == ["QuantizeLinear", "Slice", "DequantizeLinear"]
    census_of_file(target)


@pytest.mark.parametrize(
    "proto",
    [
        _sliced(23, per_axis=True, negated=True),
        _sliced(23, read_too=True),
        _sliced(23, negated=True, domain="com.microsoft"),
    ],
    ids=["per axis", "a graph output read by a node too", "com.microsoft"],
)
def test_a_dequantize_onnxruntime_does_not_carry_across_a_slice_stays_before_it(
    tmp_path: Path, proto: onnx.ModelProto
) -> None:
    """Where onnxruntime's propagation does not go, the original loads, and the rule leaves the DequantizeLinear."""
    source = tmp_path / "sliced.onnx"
    onnx.save(proto, source)
    census_of_file(source)
    _assert_left_before_the_move(proto)


def test_moves_that_end_in_an_integer_kernel_keep_the_dequantize_before_them() -> None:
    # K^T reshaped, then added: onnxruntime runs the Add from its DequantizeLinear as an integer kernel, which a
    # Q -> DQ parted by integer moves would cost it (int8 is made uint8 only at adjacent pairs).
    proto = _read_by_an_add(_transposed_for_attention())
    nodes = list(proto.graph.node)
    nodes[-1:-1] = [node("Reshape", ["m", "same"], "r")]
    nodes[-1].input[0] = "r"
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    proto.graph.initializer.append(_const("same", [1, 2, 4, 8]))
    details = refused(proto, "qdq-dequantize-after-move", passes=PASSES, **LATE)
    found = details["near_misses"].get("qdq", [])
    assert any("the move is not read by fused float ops alone" in m for m in found), found


IDS = {"ids": np.asarray([[5, 0, 2], [1, 1, 4]], np.int64)}


@pytest.mark.parametrize("zero", [-128, 0, 3, 127])
def test_a_gathered_int8_table_becomes_uint8_and_gives_every_value_back(zero: int) -> None:
    """onnxruntime dequantizes an int8 table read through a Gather whole on every run (t5_encoder_ts_qdq's 8000 x 256
    embedding: 0.3 ms of 3); the rule gathers the rows first, from the table made uint8 (q + 128, its zero point
    too), which onnxruntime's x86 integer kernels read after it. Every int8 value, bit for bit in onnxruntime."""
    every = np.arange(-128, 128, dtype=np.int8).reshape(64, 4)
    proto = _gathered_table(every, zero)
    ids = {"ids": np.arange(64, dtype=np.int64).reshape(16, 4)}
    out = fires(proto, "qdq-gather-table-uint8", {"Gather": 1, "DequantizeLinear": 1}, ids, passes=PASSES, **LATE)
    (table,) = (t for t in out.graph.initializer if t.dims == [64, 4])
    assert table.data_type == TensorProto.UINT8
    (gather,) = (n for n in out.graph.node if n.op_type == "Gather")
    assert gather.input[0] == table.name
    (original,) = run_ort(proto, ids).values()
    (rewritten,) = run_ort(out, ids).values()
    assert original.size == every.size
    assert np.array_equal(original.view(np.uint32), rewritten.view(np.uint32))


@pytest.mark.parametrize("opset", [17, 23])
def test_a_table_read_elsewhere_too_stays_int8_and_its_rows_become_uint8(opset: int) -> None:
    """A tied embedding (GPT-2's table is its head's weight too): a uint8 copy beside the int8 table would grow the
    file, so the rows are gathered from the int8 table, dequantized and requantized to uint8 (the same numbers, for
    onnxruntime's x86 integer kernels after them); bit for bit in onnxruntime. At opset 23 the rows' DequantizeLinear
    names its float type (output_dtype), which the new QuantizeLinear does not take."""
    proto = _gathered_table(opset=opset)
    if opset >= 23:
        proto.graph.node[-1].attribute.extend([helper.make_attribute("output_dtype", TensorProto.FLOAT)])
    proto.graph.node.append(node("Transpose", ["d"], "head", perm=[1, 0]))
    proto.graph.output.append(info("head", None))
    expected = {"DequantizeLinear": 3, "Gather": 1, "QuantizeLinear": 1, "Transpose": 1}
    out = fires(proto, "qdq-gather-table-uint8", expected, IDS, passes=PASSES, **LATE)
    onnx.checker.check_model(out, full_check=True)
    assert [t.data_type for t in out.graph.initializer if t.dims == [6, 4]] == [TensorProto.INT8]
    (quantize,) = (n for n in out.graph.node if n.op_type == "QuantizeLinear")
    (zero,) = (t for t in out.graph.initializer if t.name == quantize.input[2])
    assert zero.data_type == TensorProto.UINT8
    for original, rewritten in zip(run_ort(proto, IDS).values(), run_ort(out, IDS).values(), strict=True):
        assert np.array_equal(original.view(np.uint32), rewritten.view(np.uint32))


def test_a_dequantized_table_that_is_a_graph_output_stays_int8() -> None:
    """The whole dequantized table is an output too: its int8 table stays for it, so the rows are requantized."""
    proto = _gathered_table()
    proto.graph.output.append(info("d", None))
    expected = {"DequantizeLinear": 3, "Gather": 1, "QuantizeLinear": 1}
    out = fires(proto, "qdq-gather-table-uint8", expected, IDS, passes=PASSES, **LATE)
    assert [t.data_type for t in out.graph.initializer if t.dims == [6, 4]] == [TensorProto.INT8]


def test_a_per_column_table_gathered_by_rows_becomes_uint8() -> None:
    """Per-axis zero points move by 128 each; the rows' axis is where the Gather carries the columns."""
    proto = _per_channel_table(gathered_axis=0)
    out = fires(proto, "qdq-gather-table-uint8", {"Gather": 1, "DequantizeLinear": 1}, IDS, passes=PASSES, **LATE)
    (original,) = run_ort(proto, IDS).values()
    (rewritten,) = run_ort(out, IDS).values()
    assert np.array_equal(original.view(np.uint32), rewritten.view(np.uint32))


def _as_input(name: str) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        (found,) = (t for t in proto.graph.initializer if t.name == name)
        proto.graph.input.append(helper.make_tensor_value_info(name, found.data_type, list(found.dims)))
        proto.graph.initializer.remove(found)
        return proto

    return change


def _uint8_table(proto: onnx.ModelProto) -> onnx.ModelProto:
    for index, found in enumerate(proto.graph.initializer):
        if found.name in ("t", "w_z", "b_z"):
            values = onnx.numpy_helper.to_array(found).astype(np.int16) + 128
            proto.graph.initializer[index].CopyFrom(init(found.name, values, np.uint8))
    return proto


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (set_const("w_z", 4), "the zero points differ"),  # the table's and the rows' quantizations
        (lambda p: _last_zero(p, 4), "the zero points differ"),  # the rows' Q and their last DQ
        (set_const("w_s", SCALE * 1.01), "the scales differ"),
        (_uint8_table, "the table is not int8"),
        (_as_input("t"), "not a constant table"),
    ],
    ids=["table-zero", "last-zero", "table-scale", "uint8-table", "table-an-input"],
)
def test_a_gathered_table_that_is_not_an_exact_int8_round_trip_stays(
    change: Callable[[onnx.ModelProto], onnx.ModelProto], reason: str
) -> None:
    proto = change(_gathered_table())
    _, details = fuse(proto, PASSES, **LATE)
    assert "qdq-gather-table-uint8" not in details["applied"], details
    assert any(reason in m for m in details["near_misses"]["qdq"]), details["near_misses"]


def _last_zero(proto: onnx.ModelProto, zero: int) -> onnx.ModelProto:
    """The rows' last DequantizeLinear reads a zero point of its own."""
    proto.graph.initializer.append(init("c_z", np.asarray(zero, np.int8)))
    proto.graph.node[-1].input[2] = "c_z"
    return proto


def test_a_per_column_table_gathered_along_its_columns_stays() -> None:
    """A Gather along the quantized axis would need the scales gathered too."""
    _, details = fuse(_per_channel_table(gathered_axis=1), PASSES, **LATE)
    assert "qdq-gather-table-uint8" not in details["applied"], details
    assert any("does not carry" in m for m in details["near_misses"]["qdq"]), details["near_misses"]


def test_the_default_pipeline_gathers_an_int8_table_before_dequantizing_it(tmp_path: Path) -> None:
    """graphopt run on the embedding: exit 0 with the check passed, the Gather reads the uint8 table, no
    DequantizeLinear reads a table any more."""
    out = tmp_path / "out.onnx"
    result = invoke("run", _written(tmp_path, _gathered_table()), "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "numerics: passed" in result.stderr
    written = onnx.load(out)
    tables = {t.name: t.data_type for t in written.graph.initializer if t.dims == [6, 4]}
    assert [n.op_type for n in written.graph.node] == ["Gather", "DequantizeLinear"]
    assert tables == {written.graph.node[0].input[0]: TensorProto.UINT8}
