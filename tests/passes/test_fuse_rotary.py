"""Rotary graphs the rotary rules must not take, or must take right: cos / sin that broadcast along
the wrong axes of x, caches indexed differently, and types RotaryEmbedding does not have. Each
model is run in onnxruntime before and after."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.numerics import assert_same_outputs
from tests.passes.fuse_helpers import fuse
from tests.passes.fuse_models import rope_variant_model

F = TensorProto.FLOAT
D = 8


def _ints(name: str, values: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, tuple[int, list[Any]]],
    consts: list[onnx.TensorProto],
    opset: int = 23,
) -> onnx.ModelProto:
    infos = [helper.make_tensor_value_info(name, kind, shape) for name, (kind, shape) in inputs.items()]
    out = helper.make_tensor_value_info("y", inputs["x"][0], None)
    graph = helper.make_graph(nodes, "g", infos, [out], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _rotate_half() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Rotate-half RoPE of x with cos = Concat(f, f) and sin = Concat(g, g) of inputs f and g."""
    nodes = [
        helper.make_node("Concat", ["f", "f"], ["cos"], axis=-1),
        helper.make_node("Concat", ["g", "g"], ["sin"], axis=-1),
        helper.make_node("Slice", ["x", "zero", "half", "last"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "last"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["x_cos"]),
        helper.make_node("Mul", ["rot", "sin"], ["rot_sin"]),
        helper.make_node("Add", ["x_cos", "rot_sin"], ["y"]),
    ]
    return nodes, [_ints("zero", [0]), _ints("half", [D // 2]), _ints("end", [D]), _ints("last", [-1])]


def _feeds(proto: onnx.ModelProto, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in proto.graph.input:
        shape = [d.dim_value or batch for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _refused(proto: onnx.ModelProto, reason: str, batch: int = 2, **settings: Any) -> None:
    out, details = fuse(proto, passes="shape-infer,fuse,dce", **settings)
    assert not any(name.startswith(("rotary-embedding", "ort-rotary-embedding")) for name in details["applied"])
    assert any(reason in miss for miss in details["near_misses"].get("rotary", [])), details["near_misses"]
    assert_same_outputs(proto, out, _feeds(proto, batch), rtol=1e-5, atol=1e-5)


def test_a_3d_cos_broadcasts_over_heads_seq_and_d_not_batch_seq() -> None:
    # cos = Concat(f, f) of (2, 4, 8) on x (2, 2, 4, 8): numpy aligns it with x's heads, seq and d.
    nodes, consts = _rotate_half()
    shapes = {"x": (F, [2, 2, 4, D]), "f": (F, [2, 4, D // 2]), "g": (F, [2, 4, D // 2])}
    _refused(_model(nodes, shapes, consts), "over x's heads")


def test_pairs_of_a_layout_whose_seq_equals_its_heads_are_read_on_the_right_axis() -> None:
    # GPT-J's layout (batch, seq, heads, d) with seq = heads = 4, cos = repeat_interleave(c, 2) of c (batch, seq,
    # d/2) through one Unsqueeze(c, [2, 4]): the first layout tried (heads first) must not take it.
    nodes = []
    for part in ("cos", "sin"):
        nodes += [
            helper.make_node("Unsqueeze", [f"{part}_c", "pair_axes"], [f"{part}_5d"]),
            helper.make_node("Tile", [f"{part}_5d", "repeats"], [f"{part}_pairs"]),
            helper.make_node("Reshape", [f"{part}_pairs", "cos_shape"], [part]),
        ]
    nodes += [
        helper.make_node("Slice", ["x", "zero", "end", "last", "two"], ["x1"]),
        helper.make_node("Slice", ["x", "one", "end", "last", "two"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "last"], ["odd"]),
        helper.make_node("Unsqueeze", ["x1", "last"], ["even"]),
        helper.make_node("Concat", ["odd", "even"], ["stacked"], axis=-1),
        helper.make_node("Reshape", ["stacked", "x_shape"], ["rot"]),
        helper.make_node("Mul", ["x", "cos"], ["x_cos"]),
        helper.make_node("Mul", ["rot", "sin"], ["rot_sin"]),
        helper.make_node("Add", ["x_cos", "rot_sin"], ["y"]),
    ]
    consts = [
        _ints("pair_axes", [2, 4]),
        _ints("repeats", [1, 1, 1, 1, 2]),
        _ints("cos_shape", [2, 4, 1, D]),
        _ints("x_shape", [2, 4, 4, D]),
        *(_ints(n, [v]) for n, v in (("zero", 0), ("one", 1), ("two", 2), ("end", D), ("last", -1))),
    ]
    shapes = {"x": (F, [2, 4, 4, D]), "cos_c": (F, [2, 4, D // 2]), "sin_c": (F, [2, 4, D // 2])}
    proto = _model(nodes, shapes, consts)
    out, details = fuse(proto, passes="shape-infer,fuse,dce")
    assert details["applied"] == {"rotary-embedding-interleaved": 1}, details
    (rotary,) = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert {a.name: helper.get_attribute_value(a) for a in rotary.attribute} == {"interleaved": 1, "num_heads": 4}
    assert_same_outputs(proto, out, _feeds(proto, 2), rtol=1e-5, atol=1e-5)


def test_cos_shared_by_the_batch_and_sin_per_row_are_not_one_cache_layout() -> None:
    nodes, consts = _rotate_half()
    shapes = {"x": (F, ["b", 2, 4, D]), "f": (F, [1, 1, 4, D // 2]), "g": (F, ["b", 1, 4, D // 2])}
    _refused(_model(nodes, shapes, consts, opset=17), "not indexed alike", batch=3, target="ort")


@pytest.mark.parametrize("settings", [{}, {"target": "ort"}], ids=["opset23", "ort"])
def test_a_double_x_is_not_rotated_by_the_op(settings: dict[str, Any]) -> None:
    # RotaryEmbedding has no double; onnxruntime refuses the model such a rewrite writes.
    nodes, consts = _rotate_half()
    double = TensorProto.DOUBLE
    shapes = {"x": (double, [2, 2, 4, D]), "f": (double, [2, 1, 4, D // 2]), "g": (double, [2, 1, 4, D // 2])}
    _refused(_model(nodes, shapes, consts, opset=23 if not settings else 17), "float32 or float16", **settings)


def test_pairs_stacked_on_another_axis_are_not_an_interleaved_rotation() -> None:
    # Unsqueeze(-x[..., 1::2], 3) and Unsqueeze(x[..., ::2], 3) concatenated on the last axis and flattened
    # back: the halves' entries are laid side by side, not in pairs.
    proto = rope_variant_model(interleaved=True, partial=False)
    axis = onnx.numpy_helper.from_array(np.array([3], np.int64), "stack_axis")
    proto.graph.initializer.append(axis)
    for found in proto.graph.node:
        if found.op_type == "Unsqueeze" and found.input[0] in ("q_neg", "x1"):
            found.input[1] = "stack_axis"
    _refused(proto, "not stacked on a new last axis")
