"""The rotary rules' table: rotary embeddings. Each rule fires on its model and refuses its perturbations
(tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an export too, and
the family's own tests follow its table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.numerics import assert_same_outputs
from tests.passes.fuse.table import (
    F16,
    LATE,
    NO_GATE,
    At,
    Case,
    Exported,
    Perturb,
    at_opset,
    below,
    copied,
    float32_case,
    set_shape,
    table_tests,
    target_opset,
    untyped_at,
)
from tests.passes.fuse_exported import Change, Found, constant_of
from tests.passes.fuse_helpers import fires, fires_ort, fuse, info, init, model, node, refused
from tests.passes.fuse_models import (
    HALF,
    rope_model,
    rope_variant_model,
)


def _rope_q(**kwargs: Any) -> Callable[[], onnx.ModelProto]:
    """RoPE of q alone (with k too, k's rotation would fuse in every perturbed model)."""
    return lambda: rope_model(roped=("q",), **kwargs)


def _rope_variant_cases(ort: bool) -> dict[str, Case]:
    """The interleaved and partial rotary rules: full interleaved (GPT-J without rotary_dim),
    partial rotate-half (Phi, GPT-NeoX) and partial interleaved (GPT-J)."""
    opset, prefix = (18, "ort-") if ort else (23, "")
    # the caches (Cos, Sin of the frequencies; rotate half: of Concat(f, f), then its first half), the 3-D form's
    # Reshapes (pairs), onnxruntime's flattened caches and their row ids
    caches = {"Cos": 1, "Sin": 1}
    ort_ids = {"Reshape": 3, "Shape": 1, "ReduceProd": 1, "Range": 1} if ort else {}
    forms = {
        "interleaved": (True, False, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
        "partial": (False, True, {**caches, **ort_ids, "Concat": 1, "Slice": 2}),
        "interleaved-partial": (True, True, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
    }
    cases = {}
    for suffix, (interleaved, partial, kept) in forms.items():

        def build(i: bool = interleaved, p: bool = partial, **changes: int) -> Callable[[], onnx.ModelProto]:
            return lambda: rope_variant_model(i, p, opset, **changes)

        wrong = (
            Perturb(lambda _, b=build: b(rest_start=HALF + 1)(), "the rotated part is not", note="the rest starts late")
            if partial
            else Perturb(lambda _, b=build: b(odd_start=0)(), "not the even and odd", note="both Slices start at 0")
        )
        dynamic = ["b", "s", 2, "d"] if interleaved else ["b", 2, "s", "d"]
        cases[f"{prefix}rotary-embedding-{suffix}"] = Case(
            build(),
            {"RotaryEmbedding": 1, **kept},
            "q_neg",
            wrong,
            Perturb(set_shape("q", dynamic), "the rotated size is not static"),
            NO_GATE if ort else below(23),
            {"target": "ort"} if ort else {},
            passes="shape-infer,fuse,dce",
        )
    return cases


def _rotate_half(ort: bool, cos: str = "gathered") -> Case:
    """The rotate-half RoPE of q (rope_model, its cos / sin as ``cos`` says): the standard op at opset 23, or
    onnxruntime's at opset 18."""
    at = at_opset(18) if ort else copied
    return Case(
        lambda: at(_rope_q(cos=cos)()),
        {"RotaryEmbedding": 1},
        "q_neg",
        Perturb(
            lambda p: at(_rope_q(cos=cos, swapped=True)()), "not the two halves", note="the Slices' bounds swapped"
        ),
        Perturb(set_shape("q", ["b", 2, "s", "d"]), "the rotated size is not static"),
        NO_GATE if ort else below(23),
        {"target": "ort"} if ort else {},
        passes="shape-infer,fuse,dce",
    )


def _halves_swapped(found: Found) -> Change:
    """The rotation's two Slices read each other's bounds: x1 the second half, x2 the first."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        slices = {n.output[0]: n for n in out.graph.node if n.output[0] in (found.names["x1"], found.names["x2"])}
        first, second = slices[found.names["x1"]], slices[found.names["x2"]]
        first.input[1:3], second.input[1:3] = list(second.input[1:3]), list(first.input[1:3])
        return out

    return change


def slice_start_at(binding: str, shift: int, reason: str, note: str) -> At:
    """The Slice bound to ``binding`` starts ``shift`` later, through a constant of its own (an exporter may share
    the start with other nodes)."""

    def change(found: Found) -> Change:
        def shifted(proto: onnx.ModelProto) -> onnx.ModelProto:
            out = copied(proto)
            sliced = next(n for n in out.graph.node if n.output[0] == found.names[binding])
            start = constant_of(out, sliced.input[1]) + shift
            out.graph.initializer.append(numpy_helper.from_array(start, f"{binding}_shifted_start"))
            sliced.input[1] = f"{binding}_shifted_start"
            return out

        return shifted

    return At(change, reason, note)


EVEN_ODD_ONE_START = slice_start_at("x2", -1, "not the even and odd", "the odd entries start at 0")
REST_STARTS_LATE = slice_start_at("rest", 1, "the rotated part is not", "the rest starts one later")


def _rotary_between_split_and_merge() -> onnx.ModelProto:
    """com.microsoft RotaryEmbedding (opset 18) on the head split (4 heads of 8) of x (batch, seq, 32), merged straight
    back: what the attention rules leave of a Llama query for MultiHeadAttention / GroupQueryAttention."""
    rng = np.random.default_rng(4)
    angles = rng.uniform(0, 6, (16, 4))
    nodes = [
        helper.make_node("Reshape", ["x", "split_shape"], ["x_split"]),
        helper.make_node("Transpose", ["x_split"], ["x_heads"], perm=[0, 2, 1, 3]),
        helper.make_node("RotaryEmbedding", ["x_heads", "ids", "cos", "sin"], ["rotated"], domain="com.microsoft"),
        helper.make_node("Transpose", ["rotated"], ["rotated_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["rotated_t", "merge_shape"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([0, 0, 4, 8], np.int64), "split_shape"),
        numpy_helper.from_array(np.array([0, 0, 32], np.int64), "merge_shape"),
        numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
        numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 32]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph.initializer.extend(initializers)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _float16_rotary(elem_type: int = F16) -> onnx.ModelProto:
    """RotaryEmbedding of a float16 (batch, heads, seq, 8) x by float16 (batch, seq, 4) caches (opset 23): what
    rotary-embedding writes on a float16 decoder whose cos and sin are computed at run time."""
    rng = np.random.default_rng(3)
    dtype = np.float16 if elem_type == F16 else np.float32
    caches = [init(name, rng.uniform(-1, 1, (2, 3, 4)).astype(dtype)) for name in ("cos", "sin")]
    return model(
        [node("RotaryEmbedding", ["x", "cos", "sin"], "y")],
        [info("x", [2, 2, 3, 8], elem_type)],
        [info("y", None, elem_type)],
        caches,
        opset=23,
    )


def _rotary_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((2, 3, 32)).astype(np.float32), "ids": rng.integers(0, 16, (2, 3))}


CASES: dict[str, Case] = {
    **_rope_variant_cases(ort=False),
    **_rope_variant_cases(ort=True),
    "rotary-embedding": _rotate_half(ort=False),
    "ort-rotary-embedding-3d": Case(
        _rotary_between_split_and_merge,
        {"RotaryEmbedding": 1},
        "x_heads",
        "n/a: the pattern's attributes are the Transposes' perms, and another perm leaves no model that runs",
        Perturb(set_shape("x", None), "head split of x", note="x of unknown rank"),
        NO_GATE,
        {"target": "ort"},
        _rotary_feeds,
        passes="shape-infer,fuse,dce",
    ),
    "ort-rotary-embedding": _rotate_half(ort=True),
    "rotary-embedding-float32": float32_case(
        _float16_rotary,
        "RotaryEmbedding",
        4,
        "n/a: the rule's root is a RotaryEmbedding, which no opset below 23 has",
        LATE,
    ),
}

# The rotary rules on quantized models: the llama exports compute cos / sin at run time from the position ids,
# which quantize_static quantizes as activations (pairs the rules see through); the table's cases read constant
# tables, which stay quantized (a DequantizeLinear of a matrix, tests/passes/fuse/test_through_qdq.py).
RUNTIME_CACHES: dict[str, Case] = {
    "rotary-embedding": _rotate_half(ort=False, cos="runtime"),
    "ort-rotary-embedding": _rotate_half(ort=True, cos="runtime"),
}

EXPORTED: dict[str, Exported | str] = {
    "rotary-embedding-float32": "its case is what rotary-embedding writes on a float16 export; test_float32.py runs "
    "the whole pipeline on the float16 Llama export (tests/fixtures/exports/llama_fp16_dynamo.onnx)",
    "ort-rotary-embedding-3d": "n/a: no export writes com.microsoft RotaryEmbedding; the spelling is the attention "
    "rules' on the ort-rotary-embedding rule's output (tests/passes/test_fuse_exports.py runs the llama exports whole)",
    "ort-rotary-embedding": Exported(
        ("llama_dynamo", "llama_ts"),
        {"RotaryEmbedding": 1},
        At(_halves_swapped, "not the two halves", "the two Slices' bounds swapped"),
        untyped_at(("x",), "not a 4-D float32, float16 or bfloat16 tensor"),
        NO_GATE,
        {"target": "ort"},
    ),
    **{
        f"{prefix}rotary-embedding-{suffix}": Exported(
            fixtures,
            {"RotaryEmbedding": 1},
            wrong,
            untyped_at(("x",), "not a 4-D float32, float16 or bfloat16 tensor"),
            gate,
            settings,
        )
        for prefix, gate, settings in (
            ("ort-", NO_GATE, {"target": "ort"}),
            ("", target_opset(22, "needs opset >= 23"), {"target_opset": 23}),
        )
        for suffix, fixtures, wrong in (
            ("interleaved", ("gptj_dynamo", "gptj_ts"), EVEN_ODD_ONE_START),
            ("partial", ("phi_dynamo", "phi_ts"), REST_STARTS_LATE),
            ("interleaved-partial", ("gptj_dynamo", "gptj_ts"), REST_STARTS_LATE),
        )
    },
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "rotary-embedding",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


# -- rotary graphs the rules must not take, or must take right ------------------------------------------------
#
# cos / sin that broadcast along the wrong axes of x, caches indexed differently, and types RotaryEmbedding does
# not have. Each model is run in onnxruntime before and after.


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
    model = _model(nodes, shapes, consts, opset=23 if not settings else 17)
    _refused(model, "float32, float16 or bfloat16", **settings)


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


@pytest.mark.parametrize(
    ("cos", "left"),
    [
        ("gathered", {}),
        ("runtime", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2}),  # the caches: one half each
        ("runtime-4d", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, "Squeeze": 2}),
        ("constant", {}),
    ],
)
def test_rotate_half_rope_becomes_rotaryembedding(cos: str, left: dict[str, int]) -> None:
    out = fires(rope_model(cos), "rotary-embedding", {"RotaryEmbedding": 2, **left}, passes="shape-infer,fuse,dce")
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rope[0].input) == (4 if cos == "gathered" else 3)


def test_rotary_refusals() -> None:
    for extra in ("reader", "output"):
        refused(rope_model(extra=extra, roped=("q",)), "rotary-embedding")
    details = refused(rope_model(swapped=True), "rotary-embedding")
    assert "not the two halves" in " ".join(details["near_misses"]["rotary"])
    details = refused(rope_model("input"), "rotary-embedding")
    assert "halves of cos are not provably equal" in " ".join(details["near_misses"]["rotary"])
    details = refused(rope_model(opset=22), "rotary-embedding")
    assert "needs opset >= 23" in " ".join(details["near_misses"]["rotary"])


# The kernel's caches are 2-D (position, d/2): run-time ones are flattened once (a Reshape each, shared
# by q and k), the ids (batch, seq) counting their rows (Shape / ReduceProd / Range / Reshape, made once);
# a constant table keeps its own ids.
_RUNTIME_IDS = {"Reshape": 3, "Shape": 1, "ReduceProd": 1, "Range": 1}


@pytest.mark.parametrize(
    ("cos", "left"),
    [
        ("gathered", {}),
        ("runtime", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, **_RUNTIME_IDS}),
        ("runtime-4d", {"Concat": 1, "Cos": 1, "Sin": 1, "Slice": 2, "Squeeze": 1, **_RUNTIME_IDS}),
        ("constant", {}),
    ],
)
def test_rotate_half_rope_becomes_contrib_rotaryembedding_below_opset_23(cos: str, left: dict[str, int]) -> None:
    out = fires_ort(
        rope_model(cos, opset=18), "ort-rotary-embedding", {"RotaryEmbedding": 2, **left}, "shape-infer,fuse,dce"
    )
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert {n.domain for n in rope} == {"com.microsoft"}


def test_contrib_rotary_refusals() -> None:
    refused(rope_model(opset=18), "ort-rotary-embedding")  # target onnx
    details = refused(rope_model("input", opset=18), "ort-rotary-embedding", target="ort")
    assert "halves of cos are not provably equal" in " ".join(details["near_misses"]["rotary"])
