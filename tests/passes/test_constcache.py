"""The const-cache pass: what folds, what must not, and what a user sees in the written file.

Each test builds a small model, runs the pass (with cleanup, as the default pipeline's
"simplify" group does), writes the result and compares outputs in onnxruntime.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.api import optimize
from graphopt.io.onnx_write import save
from tests.numerics import assert_same_outputs, make_feeds, run_ort

F = TensorProto.FLOAT
I64 = TensorProto.INT64
SIMPLIFY = "const-cache,noop,dce,cse"


def tensor(name: str, values: Any, dtype: Any = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def info(name: str, elem_type: int = F, shape: Sequence[int | str] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def model_proto(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 18,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def optimized(
    tmp_path: Path, proto: onnx.ModelProto, passes: str = SIMPLIFY, **settings: Any
) -> tuple[Path, Path, Any]:
    """Write ``proto``, run ``passes`` on it; the paths of both files and the pass details."""
    original = tmp_path / "original.onnx"
    onnx.save(proto, original)
    result = optimize(original, f"shape-infer,{passes}", **settings, check=False)
    written = tmp_path / "optimized.onnx"
    save(result.model, written)
    details = [r["details"] for r in result.report["passes"] if r["pass"] == "const-cache"]
    return original, written, details


def ops(path: Path) -> Counter[str]:
    found: Counter[str] = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            found[node.op_type] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(onnx.load(path).graph)
    return found


def largest_initializer(path: Path) -> int:
    return max((numpy_helper.to_array(t).nbytes for t in onnx.load(path).graph.initializer), default=0)


# -- the brief's worked cases (compile time) ------------------------------------------------


def test_expand_of_a_weight_never_stores_the_expanded_tensor_but_folds_what_follows(tmp_path: Path) -> None:
    # Expand(W[256] -> [4096, 256]) -> Mul(3) -> Add(X[4096, 256])
    w = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    nodes = [
        helper.make_node("Expand", ["W", "shape"], ["e"]),
        helper.make_node("Mul", ["e", "three"], ["m"]),
        helper.make_node("Add", ["m", "X"], ["y"]),
    ]
    inits = [tensor("W", w), tensor("shape", [4096, 256], np.int64), tensor("three", 3.0)]
    proto = model_proto(nodes, [info("X", shape=[4096, 256])], [info("y", shape=[4096, 256])], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert largest_initializer(written) < 1 << 20
    assert ops(written)["Mul"] == 0
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(written).graph.initializer}
    assert any(a.shape == (256,) and np.allclose(a, w * 3) for a in stored.values())
    assert_same_outputs(original, written)


def test_expand_to_a_dynamic_shape_folds_the_weight_and_keeps_n_dynamic(tmp_path: Path) -> None:
    # Expand(W, Shape(X[N, 256])) -> Mul(2)
    w = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["X"], ["s"]),
        helper.make_node("Expand", ["W", "s"], ["e"]),
        helper.make_node("Mul", ["e", "two"], ["y"]),
    ]
    proto = model_proto(
        nodes, [info("X", shape=["N", 256])], [info("y", shape=["N", 256])], [tensor("W", w), tensor("two", 2.0)]
    )
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Expand": 1, "Shape": 1})
    stored = [numpy_helper.to_array(t) for t in onnx.load(written).graph.initializer]
    assert any(np.allclose(a, w * 2) for a in stored if a.shape == (256,))
    output = onnx.load(written).graph.output[0]
    assert output.type.tensor_type.shape.dim[0].dim_param == "N"
    assert_same_outputs(original, written)


# -- what never folds -----------------------------------------------------------------------


def test_random_ops_and_training_dropout_never_fold(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("RandomNormal", [], ["r"], shape=[4], seed=1.0),
        helper.make_node("Add", ["r", "W"], ["noisy"]),
        helper.make_node("Dropout", ["W", "ratio", "training"], ["dropped"]),
        helper.make_node("Transpose", ["W2"], ["w2t"]),
        helper.make_node("MatMul", ["x", "w2t"], ["det"]),
    ]
    inits = [
        tensor("W", np.ones(4)),
        tensor("ratio", 0.5),
        tensor("training", True, np.bool_),
        tensor("W2", np.arange(12).reshape(3, 4)),
    ]
    outputs = [info("noisy", shape=[4]), info("dropped", shape=[4]), info("det", shape=[2, 3])]
    proto = model_proto(nodes, [info("x", shape=[2, 4])], outputs, inits)
    original, written, _ = optimized(tmp_path, proto, passes="cleanup,simplify")  # the default groups
    found = ops(written)
    assert found["RandomNormal"] == 1 and found["Dropout"] == 1 and found["Add"] == 1
    assert found["Transpose"] == 0
    feeds = make_feeds(original)
    assert np.array_equal(run_ort(original, feeds)["det"], run_ort(written, feeds)["det"])


def test_dequantize_of_a_quantized_weight_folds_only_with_fold_qdq(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("DequantizeLinear", ["Wq", "scale", "zero"], ["w"]),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    inits = [
        tensor("Wq", np.arange(16).reshape(4, 4), np.int8),
        tensor("scale", 0.1),
        tensor("zero", 0, np.int8),
    ]
    proto = model_proto(nodes, [info("x", shape=[2, 4])], [info("y", shape=[2, 4])], inits)
    _, kept, _ = optimized(tmp_path, proto)
    assert ops(kept)["DequantizeLinear"] == 1
    original, folded, _ = optimized(tmp_path, proto, fold_qdq=True)
    assert ops(folded)["DequantizeLinear"] == 0
    assert_same_outputs(original, folded)


def test_an_initializer_that_is_also_an_input_is_never_frozen(tmp_path: Path) -> None:
    nodes = [helper.make_node("Transpose", ["W"], ["wt"]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    inputs = [info("x", shape=[2, 4]), info("W", shape=[3, 4])]
    proto = model_proto(nodes, inputs, [info("y", shape=[2, 3])], [tensor("W", np.ones((3, 4)))])
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written)["Transpose"] == 1
    feeds = {"x": np.ones((2, 4), np.float32), "W": np.full((3, 4), 2.0, np.float32)}
    assert np.array_equal(run_ort(original, feeds)["y"], run_ort(written, feeds)["y"])


# -- folding, guards and the report ---------------------------------------------------------


def test_a_constant_region_folds_to_its_live_outputs(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Transpose", ["W"], ["wt"]),
        helper.make_node("Mul", ["wt", "two"], ["w2"]),
        helper.make_node("Add", ["w2", "one"], ["w3"]),
        helper.make_node("MatMul", ["x", "w3"], ["y"]),
    ]
    inits = [tensor("W", np.arange(12).reshape(3, 4)), tensor("two", 2.0), tensor("one", 1.0)]
    proto = model_proto(nodes, [info("x", shape=["n", 4])], [info("y", shape=["n", 3])], inits)
    original, written, details = optimized(tmp_path, proto)
    assert ops(written) == Counter({"MatMul": 1})
    assert details[0]["folded"] == {"regions": 1, "nodes": 3}
    assert len(onnx.load(written).graph.initializer) == 1
    assert_same_outputs(original, written)


def test_a_refused_region_keeps_its_largest_prefix_and_is_reported(tmp_path: Path) -> None:
    # Cast -> Tile to 1 MiB: the Cast folds, the Tile stays and the report says why.
    nodes = [
        helper.make_node("Cast", ["W"], ["w32"], to=F),
        helper.make_node("Tile", ["w32", "reps"], ["tiled"]),
        helper.make_node("Add", ["x", "tiled"], ["y"]),
    ]
    inits = [tensor("W", np.ones((1, 256)), np.float16), tensor("reps", [1024, 1], np.int64)]
    proto = model_proto(nodes, [info("x", shape=[1024, 256])], [info("y", shape=[1024, 256])], inits)
    original, written, details = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Tile": 1, "Add": 1})
    (refused,) = details[0]["refused"]
    assert refused["folded_prefix"] == 1 and "max_growth_bytes" in refused["reason"]
    assert refused["new_bytes"] == 1024 * 256 * 4 and refused["net_bytes"] > 1 << 19
    assert_same_outputs(original, written)


def test_float16_weights_stay_float16_by_default(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "bert_fp16_weights.onnx"
    result = optimize(source, f"shape-infer,cleanup,{SIMPLIFY}", check=False)
    written = tmp_path / "out.onnx"
    save(result.model, written)
    assert written.stat().st_size <= 1.1 * source.stat().st_size
    # Every 2-D weight keeps its Cast (biases and norms, +512 bytes each, fold).
    assert ops(written)["Cast"] >= 28
    refused = next(r for r in result.report["passes"] if r["pass"] == "const-cache")["details"]["refused"]
    assert any("max_growth_bytes" in r["reason"] for r in refused)
    assert_same_outputs(source, written)


# -- constants ------------------------------------------------------------------------------


def test_constants_in_bodies_become_initializers_and_a_constant_if_is_inlined(tmp_path: Path) -> None:
    then_graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=tensor("", [1.0, 2.0])),
            helper.make_node("Add", ["x", "c"], ["t"]),
        ],
        "then",
        [],
        [info("t", shape=[2])],
    )
    else_graph = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [info("e", shape=[2])])
    nodes = [
        helper.make_node("Greater", ["a", "b"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph),
    ]
    inits = [tensor("a", 2.0), tensor("b", 1.0)]
    proto = model_proto(nodes, [info("x", shape=[2])], [info("y", shape=[2])], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Add": 1})
    assert_same_outputs(original, written)


def test_equal_initializers_are_stored_once(tmp_path: Path) -> None:
    weight = np.arange(64, dtype=np.float32).reshape(8, 8)
    nodes = [helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])]
    proto = model_proto(
        nodes, [info("x", shape=[2, 8])], [info("y", shape=[2, 8])], [tensor("A", weight), tensor("B", weight)]
    )
    original, written, details = optimized(tmp_path, proto, passes="const-cache")
    assert details[0]["deduplicated"] == 1
    assert len(onnx.load(written).graph.initializer) == 1
    assert_same_outputs(original, written)


# -- symbolic shapes ------------------------------------------------------------------------


def _measured(dims: dict[str, int]) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``Unsqueeze(Gather(Shape(x), i))`` for each ``name: i``, as exporters measure dims: the nodes write
    ``name1``, and their initializers."""
    nodes = [helper.make_node("Shape", ["x"], ["s"])]
    inits = [tensor("ax", [0], np.int64)]
    for name, index in dims.items():
        nodes += [
            helper.make_node("Gather", ["s", f"i{index}"], [name], axis=0),
            helper.make_node("Unsqueeze", [name, "ax"], [f"{name}1"]),
        ]
        inits.append(tensor(f"i{index}", index, np.int64))
    return nodes, inits


def test_reshape_targets_from_shape_plumbing_become_constants_and_dims_keep_their_names(tmp_path: Path) -> None:
    nodes, inits = _measured({"batch": 0, "seq": 1})
    nodes += [
        helper.make_node("Concat", ["batch1", "seq1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits.append(tensor("heads", [4, 64], np.int64))
    proto = model_proto(nodes, [info("x", shape=["batch", "seq", 256])], [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Reshape": 1})
    saved = onnx.load(written)
    (target,) = [numpy_helper.to_array(t) for t in saved.graph.initializer]
    assert target.tolist() == [0, 0, 4, 64]
    dims = [d.dim_param or d.dim_value for d in saved.graph.output[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 4, 64]
    assert_same_outputs(original, written)


@pytest.mark.parametrize("zero_sized", [False, True])
def test_a_reshape_with_allowzero_takes_a_constant_target_that_copies_dims(tmp_path: Path, zero_sized: bool) -> None:
    # The dynamo exporter writes every Reshape with allowzero=1: Phi-3's attention output, x.view(b, -1, s, 32) of
    # a [b, 8, s, 32] value, stayed with its plumbing (a 0 could not copy b and s). Where no entry is a static 0,
    # clearing allowzero changes nothing: the target is [0, -1, 0, 32] and the Reshape is the identity. A static
    # 0 is a zero-sized dim there, which the rewrite keeps as it is.
    nodes, inits = _measured({"b": 0, "q": 2})
    nodes += [
        helper.make_node("Concat", ["b1", "middle", "q1", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["viewed"], allowzero=1),
        helper.make_node("Relu", ["viewed"], ["y"]),
    ]
    inits += [
        tensor("middle", [0 if zero_sized else -1], np.int64),
        tensor("tail", [32], np.int64),
    ]
    x_shape: list[int | str] = ["batch", 0 if zero_sized else 8, "seq", 32]
    proto = model_proto(nodes, [info("x", shape=x_shape)], [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    reshapes = [n for n in onnx.load(written).graph.node if n.op_type == "Reshape"]
    if zero_sized:
        assert [helper.get_attribute_value(a) for n in reshapes for a in n.attribute] == [1]
    else:
        assert ops(written) == Counter({"Relu": 1}), ops(written)
    assert_same_outputs(original, written)


def test_shape_plumbing_through_a_grid_is_followed(tmp_path: Path) -> None:
    # Dims measured from x pass through a 2 x 2 grid: a Transpose, a Slice flipping its rows, a Concat along
    # its columns, a broadcast Add of a column (TorchScript writes F.pad's computed pads through such a grid).
    # Read as a flat vector, the Slice alone would reverse every entry: (3, batch, 7, 5) instead of
    # (5, 7, batch, 3).
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Concat", ["s", "seven"], ["four"], axis=0),
        helper.make_node("Reshape", ["four", "grid"], ["rows"]),
        helper.make_node("Transpose", ["rows"], ["columns"], perm=[1, 0]),
        helper.make_node("Slice", ["columns", "last", "before_first", "first_axis", "back"], ["flipped"]),
        helper.make_node("Add", ["flipped", "zero_column"], ["added"]),
        helper.make_node("Concat", ["added", "zero_column"], ["wide"], axis=1),
        helper.make_node("Reshape", ["wide", "flat"], ["y"]),
    ]
    inits = [
        tensor("seven", [7], np.int64),
        tensor("grid", [2, 2], np.int64),
        tensor("last", [-1], np.int64),
        tensor("before_first", [-(2**63) + 1], np.int64),
        tensor("first_axis", [0], np.int64),
        tensor("back", [-1], np.int64),
        tensor("zero_column", [[0], [0]], np.int64),
        tensor("flat", [6], np.int64),
    ]
    proto = model_proto(nodes, [info("x", shape=["batch", 5, 3])], [info("y", TensorProto.INT64, [6])], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert not {"Transpose", "Slice", "Add"} & set(ops(written)), ops(written)
    assert run_ort(written, {"x": np.zeros((4, 5, 3), np.float32)})["y"].tolist() == [5, 7, 0, 4, 3, 0]
    assert_same_outputs(original, written)


@pytest.mark.parametrize("grid", [False, True], ids=["vector", "grid"])
@pytest.mark.parametrize(
    ("bounds", "runtime"),
    [
        # A start before the first entry with a negative step still takes the first entry (ONNX clamps it to 0;
        # Python's slice to "before 0", which took nothing).
        ({"start": [-9], "end": [-10], "axis": [0], "step": [-1]}, ()),
        # Steps, or axes, the facts cannot read are not the defaults (the rule had sliced forward, or along axis 0).
        ({"start": [-1], "end": [-100], "axis": [0], "step": [-1]}, ("step",)),
        ({"start": [-1], "end": [-100], "axis": [-1], "step": [-1]}, ("axis",)),
    ],
)
def test_a_slice_of_shape_plumbing_keeps_onnx_bounds(
    tmp_path: Path, bounds: dict[str, list[int]], runtime: tuple[str, ...], grid: bool
) -> None:
    nodes = [helper.make_node("Shape", ["x"], ["s"])]
    if grid:  # [[N, 3], [4, 5]]
        nodes.append(helper.make_node("Reshape", ["s", "rows"], ["grid"]))
    nodes += [
        helper.make_node("Slice", ["grid" if grid else "s", "start", "end", "axis", "step"], ["cut"]),
        helper.make_node("Reshape", ["cut", "flat"], ["y"]),
    ]
    inits = [tensor(name, v, np.int64) for name, v in bounds.items() if name not in runtime]
    inits += [tensor("rows", [2, 2], np.int64), tensor("flat", [-1], np.int64)]
    inputs = [info("x", shape=["batch", 3, 4, 5]), *(info(name, TensorProto.INT64, [1]) for name in runtime)]
    proto = model_proto(nodes, inputs, [info("y", TensorProto.INT64, None)], inits)
    if grid and runtime:  # the cut's type is [2, 2] for either axis: only its value tells them apart
        proto.graph.value_info.append(info("cut", TensorProto.INT64, [2, 2]))
    original, written, _ = optimized(tmp_path, proto)
    feeds = {"x": np.zeros((7, 3, 4, 5), np.float32), **{name: np.array(bounds[name], np.int64) for name in runtime}}
    assert run_ort(written, feeds)["y"].tolist() == run_ort(original, feeds)["y"].tolist() != []


@pytest.mark.parametrize(("name", "onnxsim_nodes"), [("bert_small", 303), ("gpt2_small", 336)])
def test_transformers_lose_their_shape_plumbing(
    corpus_dir: Path, tmp_path: Path, name: str, onnxsim_nodes: int
) -> None:
    source = corpus_dir / f"{name}.onnx"
    result = optimize(source, f"shape-infer,cleanup,{SIMPLIFY}", check=False)
    written = tmp_path / "out.onnx"
    save(result.model, written)
    found = ops(written)
    assert found["Shape"] <= 2
    assert sum(found.values()) < onnxsim_nodes
    inputs = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in onnx.load(written).graph.input}
    assert all(all(inputs[k]) for k in inputs)
    assert_same_outputs(source, written)


# -- runtime constants ----------------------------------------------------------------------


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w0, w1 = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("Constant", [], ["W0"], value=tensor("", w0))]
    h = "x"
    for i in range(3):
        nodes += [
            helper.make_node("Transpose", [f"W{i}"], [f"w{i}t"]),
            helper.make_node("MatMul", [h, f"w{i}t"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"h{i}"]),
        ]
        h = f"h{i}"
    inits = [tensor("W1", w1), *(tensor(f"b{i}", rng.standard_normal(8)) for i in range(3))]
    inputs = [info("x", shape=["n", 8]), info("W2", shape=[8, 8])]
    return model_proto(nodes, inputs, [info("h2", shape=["n", 8])], inits)


def _functions(path: Path) -> dict[str, Counter[str]]:
    return {f.name: Counter(n.op_type for n in f.node) for f in onnx.load(path).functions}


def test_mlp_with_three_kinds_of_constant_weights(tmp_path: Path) -> None:
    from graphopt.runtime import CachedSession

    original, written, _ = optimized(tmp_path, _mlp(), const_input=["W*"])
    assert _functions(written) == {"runtime_fold": Counter({"Transpose": 1})}
    entry = ops(written) - Counter({"runtime_fold": 1})
    assert entry == Counter({"MatMul": 3, "Add": 3, "Relu": 3})
    feeds = {"x": np.ones((2, 8), np.float32), "W2": np.eye(8, dtype=np.float32)}
    expected = run_ort(original, feeds)["h2"]
    session = CachedSession(written)
    assert np.allclose(session.run(None, feeds)[0], expected, atol=1e-5)
    assert session.folds == 1


def test_bias_chain_on_a_runtime_constant_stores_nothing_of_size_n(tmp_path: Path) -> None:
    b = np.random.default_rng(4).standard_normal((256, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["b"], ["bt"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Expand", ["bt", "s"], ["e"]),
        helper.make_node("Cast", ["e"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["h", "two"], ["m"]),
        helper.make_node("Cast", ["m"], ["f"], to=F),
        helper.make_node("Add", ["f", "x"], ["y"]),
    ]
    inputs = [info("x", shape=["N", 256]), info("b", shape=[256, 1])]
    proto = model_proto(nodes, inputs, [info("y", shape=["N", 256])], [tensor("two", 2.0, np.float16)])
    original, written, _ = optimized(tmp_path, proto, const_input=["b"])
    assert ops(written) - Counter({"runtime_fold": 1}) <= Counter({"Add": 1, "Expand": 1, "Shape": 1})
    assert set(_functions(written)["runtime_fold"]) <= {"Transpose", "Cast", "Mul"}
    assert largest_initializer(written) <= 16
    from graphopt.runtime import CachedSession

    feeds = {"x": np.ones((5, 256), np.float32), "b": b}
    assert np.allclose(CachedSession(written).run(None, feeds)[0], run_ort(original, feeds)["y"], atol=1e-2)


def test_cached_session_folds_once_per_content_of_the_constant_inputs(tmp_path: Path) -> None:
    from graphopt.runtime import CachedSession

    nodes = [
        helper.make_node("Add", ["a", "a"], ["aa"]),
        helper.make_node("Add", ["b", "b"], ["bb"]),
        helper.make_node("Add", ["aa", "bb"], ["ab"]),
        helper.make_node("Add", ["ab", "c"], ["d"]),
    ]
    inputs = [info("a", shape=[4]), info("b", shape=[4]), info("c", shape=[4])]
    original, written, _ = optimized(
        tmp_path, model_proto(nodes, inputs, [info("d", shape=[4])]), const_input=["a", "b"]
    )
    assert ops(written) == Counter({"runtime_fold": 1, "Add": 1})
    session = CachedSession(written)
    feeds = {"a": np.ones(4, np.float32), "b": np.full(4, 2.0, np.float32), "c": np.arange(4, dtype=np.float32)}
    assert np.array_equal(session.run(None, feeds)[0], run_ort(original, feeds)["d"])
    assert session.folds == 1
    feeds["c"] = feeds["c"] + 1
    assert np.array_equal(session.run(None, feeds)[0], run_ort(original, feeds)["d"])
    assert session.folds == 1
    feeds["a"] = feeds["a"] * 3
    assert np.array_equal(session.run(None, feeds)[0], run_ort(original, feeds)["d"])
    assert session.folds == 2


def test_cached_session_is_safe_across_threads_and_bounded_by_its_budget(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from graphopt.runtime import CachedSession

    nodes = [helper.make_node("Mul", ["a", "a"], ["aa"]), helper.make_node("Add", ["aa", "c"], ["d"])]
    inputs = [info("a", shape=[4]), info("c", shape=[4])]
    _, written, _ = optimized(tmp_path, model_proto(nodes, inputs, [info("d", shape=[4])]), const_input=["a"])
    session = CachedSession(written, cache_bytes=2 * 16)
    c = np.zeros(4, np.float32)
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda k: session.run(None, {"a": np.full(4, k % 3, np.float32), "c": c})[0], range(30))
        )
    assert all(np.array_equal(r, np.full(4, (k % 3) ** 2)) for k, r in enumerate(results))
    assert 3 <= session.folds <= 30


def test_defer_growth_keeps_the_file_compact_and_matches_onnxruntime(corpus_dir: Path, tmp_path: Path) -> None:
    from graphopt.runtime import CachedSession

    source = corpus_dir / "bert_fp16_weights.onnx"
    result = optimize(source, f"shape-infer,cleanup,{SIMPLIFY}", defer_growth=True, check=False)
    written = tmp_path / "out.onnx"
    save(result.model, written)
    assert written.stat().st_size <= 1.1 * source.stat().st_size
    assert ops(written)["Cast"] <= 2
    feeds = make_feeds(source)
    expected = run_ort(source, feeds)
    session = CachedSession(written)
    for _ in range(2):
        got = session.run(None, feeds)
        for name, array in zip(session.output_names, got, strict=True):
            assert np.allclose(array, expected[name], atol=1e-4)
    assert session.folds == 1
    assert_same_outputs(source, written)


def test_a_folded_graph_output_keeps_its_name_without_an_identity(tmp_path: Path) -> None:
    nodes = [helper.make_node("Shape", ["e"], ["s"]), helper.make_node("Transpose", ["W"], ["wt"])]
    outputs = [info("s", I64, [2]), info("wt", shape=[4, 3])]
    proto = model_proto(nodes, [info("e", shape=[0, 3])], outputs, [tensor("W", np.ones((3, 4)))])
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Constant": 2})
    assert [o.name for o in onnx.load(written).graph.output] == ["s", "wt"]
    assert_same_outputs(original, written)


def _dims_vector(nodes: list[onnx.NodeProto], *entries: str) -> None:
    """Append TorchScript's ``Concat(Unsqueeze(Gather(Shape(x), i)), ...)`` for dims (or constants) of x."""
    nodes.append(helper.make_node("Shape", ["x"], ["shape"]))
    parts = []
    for k, entry in enumerate(entries):
        if entry.startswith("i"):
            nodes.append(helper.make_node("Gather", ["shape", entry], [f"g{k}"], axis=0))
            nodes.append(helper.make_node("Unsqueeze", [f"g{k}", "ax"], [f"u{k}"]))
            parts.append(f"u{k}")
        else:
            parts.append(entry)
    nodes.append(helper.make_node("Concat", parts, ["sizes"], axis=0))


def test_expand_with_minus_one_sizes_of_its_own_dims_is_removed(tmp_path: Path) -> None:
    # x.expand(batch, -1, seq, seq) as TorchScript writes it: Where(Equal(sizes, -1), 1, sizes).
    nodes: list[onnx.NodeProto] = []
    _dims_vector(nodes, "i0", "minus_one", "i2", "i3")
    nodes += [
        helper.make_node("Equal", ["sizes", "minus_ones"], ["is_kept"]),
        helper.make_node("Where", ["is_kept", "ones", "sizes"], ["target"]),
        helper.make_node("Expand", ["x", "target"], ["expanded"]),
        helper.make_node("Relu", ["expanded"], ["y"]),
    ]
    inits = [
        tensor("i0", 0, np.int64),
        tensor("i2", 2, np.int64),
        tensor("i3", 3, np.int64),
        tensor("ax", [0], np.int64),
        tensor("minus_one", [-1], np.int64),
        tensor("minus_ones", [-1, -1, -1, -1], np.int64),
        tensor("ones", [1, 1, 1, 1], np.int64),
    ]
    proto = model_proto(nodes, [info("x", shape=["batch", 1, "seq", "seq"])], [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Relu": 1})
    assert_same_outputs(original, written)


def test_a_reshape_target_assembled_from_a_split_shape_becomes_a_constant(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Split", ["shape", "ones"], ["batch", "seq", "hidden"], axis=0),
        helper.make_node("Div", ["hidden", "heads"], ["head_dim"]),
        helper.make_node("Concat", ["batch", "seq", "heads", "head_dim"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [tensor("ones", [1, 1, 1], np.int64), tensor("heads", [4], np.int64)]
    proto = model_proto(nodes, [info("x", shape=["batch", "seq", 256])], [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Reshape": 1})
    (target,) = [numpy_helper.to_array(t) for t in onnx.load(written).graph.initializer]
    assert target.tolist() == [0, 0, 4, 64]
    assert_same_outputs(original, written)


def test_a_target_of_input_dims_and_numbers_is_measured_once_on_the_input(tmp_path: Path) -> None:
    # GPT-2's Conv1D as TorchScript writes it: flatten, Gemm, then back to (batch, seq, 12)
    # with the dims measured on the activation; the dims are the input's, read in one Shape.
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("Shape", ["h"], ["shape"]),
        helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "ax"], ["s1"]),
        helper.make_node("Concat", ["b1", "s1", "width"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "flat"], ["rows"]),
        helper.make_node("MatMul", ["rows", "w"], ["product"]),
        helper.make_node("Reshape", ["product", "target"], ["y"]),
    ]
    inits = [
        tensor("i0", 0, np.int64),
        tensor("i1", 1, np.int64),
        tensor("ax", [0], np.int64),
        tensor("width", [12], np.int64),
        tensor("flat", [-1, 8], np.int64),
        tensor("w", np.random.default_rng(0).standard_normal((8, 12))),
    ]
    proto = model_proto(nodes, [info("x", shape=["batch", "seq", 8])], [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Relu": 1, "Reshape": 2, "MatMul": 1, "Shape": 1, "Concat": 1})
    (shape,) = [n for n in onnx.load(written).graph.node if n.op_type == "Shape"]
    assert list(shape.input) == ["x"]
    dims = [d.dim_param or d.dim_value for d in onnx.load(written).graph.output[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 12]
    assert_same_outputs(original, written)


def test_a_dim_read_as_the_dynamo_exporter_reads_it_is_kept(tmp_path: Path) -> None:
    # torch.export's sym_size: Squeeze(Shape(ids, start=i, end=i + 1)), the slice shared with a Reshape
    # target. Measuring the scalar again as Gather(Shape(ids), i) added a Shape and a Gather.
    nodes = [
        helper.make_node("Shape", ["ids"], ["batch"], start=0, end=1),
        helper.make_node("Shape", ["ids"], ["seq"], start=1, end=2),
        helper.make_node("Squeeze", ["seq"], ["seq_scalar"]),
        helper.make_node("Range", ["zero", "seq_scalar", "one"], ["positions"]),
        helper.make_node("Concat", ["batch", "seq"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["rows"]),
        helper.make_node("Cast", ["positions"], ["offsets"], to=F),
        helper.make_node("Add", ["rows", "offsets"], ["y"]),
    ]
    inits = [tensor("zero", 0, np.int64), tensor("one", 1, np.int64)]
    inputs = [info("ids", TensorProto.INT64, ["batch", "seq"]), info("x", shape=["batch", "seq"])]
    proto = model_proto(nodes, inputs, [info("y", shape=None)], inits)
    original, written, _ = optimized(tmp_path, proto)
    assert ops(written)["Gather"] == 0 and sum(ops(written).values()) <= len(nodes), ops(written)
    feeds = {"ids": np.zeros((2, 3), np.int64), "x": np.ones((2, 3), np.float32)}
    assert_same_outputs(original, written, feeds)


def test_tensorflow_same_padding_of_static_images_folds_stage_after_stage(tmp_path: Path) -> None:
    # timm's Conv2dSame as the TorchScript exporter writes it: each conv's pads computed at run time from its
    # input's height and width in float arithmetic (Cast, Div, Ceil, Clip), read back through Concat and Pad.
    # The second conv's pads depend on the first conv's output size, known once the first pads are folded.
    source = Path(__file__).parent.parent / "fixtures" / "exports" / "conv_same_ts.onnx"
    result = optimize(source, check=False)
    written = tmp_path / "optimized.onnx"
    save(result.model, written)
    assert ops(written) == Counter({"Conv": 2, "Sigmoid": 1, "Mul": 1}), ops(written)
    refused = [r for d in result.report["passes"] if d["pass"] == "const-cache" for r in d["details"]["refused"]]
    assert not refused, refused
    assert_same_outputs(source, written, make_feeds(onnx.load(str(source))))


def test_a_bfloat16_region_folds_rounding_each_result_to_bfloat16(tmp_path: Path) -> None:
    """bfloat16 values are ml_dtypes arrays: a region of them folds (onnxruntime's CPU provider runs no bfloat16,
    onnx's reference evaluator does), each op's result rounded to bfloat16 as a bfloat16 runtime rounds it."""
    bfloat16 = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
    a, b = np.array([1.1, 2.3, -0.7, 3.14159]), np.array([0.3, 1.7, 2.2, -1.01])
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Mul", ["b", "b"], ["bb"]),
        helper.make_node("Sqrt", ["bb"], ["s"]),
        helper.make_node("Add", ["x", "ab"], ["y0"]),
        helper.make_node("Add", ["y0", "s"], ["y"]),
    ]
    bf = TensorProto.BFLOAT16
    proto = model_proto(
        nodes, [info("x", bf, [4])], [info("y", bf, [4])], [tensor("a", a, bfloat16), tensor("b", b, bfloat16)]
    )
    _, written, _ = optimized(tmp_path, proto)
    assert ops(written) == Counter({"Add": 2})
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(written).graph.initializer}

    def rounded(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float32).astype(bfloat16)

    a16, b16 = rounded(a), rounded(b)
    expected = {
        "ab": rounded(a16.astype(np.float32) * b16.astype(np.float32)),
        "s": rounded(np.sqrt(rounded(b16.astype(np.float32) ** 2).astype(np.float32))),
    }
    for name, values in expected.items():
        (found,) = [v for k, v in stored.items() if k.startswith(name)]
        assert found.dtype == bfloat16 and np.array_equal(found, values), (name, found, values)
