"""The cleanup passes (noop, dce, cse): each rule fires where it should and nowhere else,
graph interfaces survive, and onnxruntime computes the same outputs afterwards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.api import pass_context
from graphopt.io.onnx_io import load
from graphopt.io.onnx_write import save
from graphopt.ir import Model
from graphopt.ir.stats import model_stats
from graphopt.passes.base import PassResult, get_pass
from tests.numerics import assert_same_outputs

F = TensorProto.FLOAT
I64 = TensorProto.INT64
INT64_MAX = 2**63 - 1


# -- building and running -------------------------------------------------------------------


def tensor(name: str, values: Any, dtype: Any = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def const(name: str, values: Any, dtype: Any = np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=tensor("", values, dtype))


def info(name: str, elem_type: int = F, shape: Sequence[int | str] | None = ("batch", 4, 5)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def write(
    tmp_path: Path,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto] = (),
    outputs: Sequence[onnx.ValueInfoProto] = (),
    initializers: Sequence[onnx.TensorProto] = (),
    value_info: Sequence[onnx.ValueInfoProto] = (),
    functions: Sequence[onnx.FunctionProto] = (),
    opset: int = 21,
) -> Path:
    inputs = inputs or [info("x")]
    outputs = outputs or [info("y", shape=None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers, value_info=value_info)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("local", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, ir_version=10)
    path = tmp_path / "original.onnx"
    onnx.save(model, path)
    return path


def run_passes(model: Model, names: Sequence[str], **options: Any) -> dict[str, PassResult]:
    """Run each pass once (with ``options`` for all of them), verifying every graph after."""
    results = {}
    for name in names:
        cls = get_pass(name)
        step = cls.from_config(options) if options else cls()
        results[name] = step.run(model, pass_context())
        model.graph.verify()
        for function in model.functions:
            function.body.verify()
    return results


def optimize(path: Path, *names: str, **options: Any) -> tuple[Model, dict[str, PassResult], Path]:
    """Load, run the passes, save; check numerics against the original and return the IR."""
    model = load(path)
    results = run_passes(model, names, **options)
    out = path.with_name("optimized.onnx")
    save(model, out)
    assert_same_outputs(path, out)
    return model, results, out


def ops(model: Model) -> Counter[str]:
    return Counter(node.op_type for graph in model.all_graphs() for node in graph)


def output_names(path: Path) -> list[str]:
    return [o.name for o in onnx.load(path).graph.output]


# -- noop -------------------------------------------------------------------------------------

# Each case: graph nodes reading "x" (float[batch, 4, 5]) and writing "y", extra initializers,
# the rule expected to fire (None: nothing may change).
NOOP_CASES: dict[str, tuple[list[onnx.NodeProto], list[onnx.TensorProto], str | None]] = {
    "identity": ([helper.make_node("Identity", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])], [], "identity"),
    "dropout": (
        [helper.make_node("Dropout", ["x", "r"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("r", 0.5)],
        "dropout-inference",
    ),
    "dropout-training-false": (
        [helper.make_node("Dropout", ["x", "r", "m"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("r", 0.5), tensor("m", False, np.bool_)],
        "dropout-inference",
    ),
    "dropout-mask-used": (
        [
            helper.make_node("Dropout", ["x"], ["t", "mask"]),
            helper.make_node("Cast", ["mask"], ["fmask"], to=F),
            helper.make_node("Add", ["t", "fmask"], ["y"]),
        ],
        [],
        None,
    ),
    "cast-same": (
        [helper.make_node("Cast", ["x"], ["t"], to=F), helper.make_node("Relu", ["t"], ["y"])],
        [],
        "cast-to-same-type",
    ),
    "cast-other": (
        [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.DOUBLE), helper.make_node("Cast", ["t"], ["y"], to=F)],
        [],
        None,
    ),
    "cast-unknown-type": (  # "r" has no recorded type, so Cast's input type is unknown
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Cast", ["r"], ["t"], to=F),
            helper.make_node("Relu", ["t"], ["y"]),
        ],
        [],
        None,
    ),
    "reshape-same": (
        [helper.make_node("Reshape", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [0, -1, 5], np.int64)],
        "reshape-to-same-shape",
    ),
    "reshape-other": (
        [helper.make_node("Reshape", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [0, 5, 4], np.int64)],
        None,
    ),
    "transpose-identity": (
        [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 1, 2]), helper.make_node("Relu", ["t"], ["y"])],
        [],
        "transpose-identity",
    ),
    "transpose-real": (
        [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]), helper.make_node("Relu", ["t"], ["y"])],
        [],
        None,
    ),
    "pad-zero": (
        [helper.make_node("Pad", ["x", "p"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("p", [0] * 6, np.int64)],
        "pad-nothing",
    ),
    "pad-real": (
        [helper.make_node("Pad", ["x", "p"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("p", [0, 0, 1, 0, 0, 0], np.int64)],
        None,
    ),
    "squeeze-nothing": (
        [helper.make_node("Squeeze", ["x", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("a", np.zeros(0), np.int64)],
        None,  # batch might be 1 at run time, and empty axes squeeze every dim of 1
    ),
    "unsqueeze-nothing": (
        [helper.make_node("Unsqueeze", ["x", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("a", np.zeros(0), np.int64)],
        "unsqueeze-nothing",
    ),
    "unsqueeze-real": (
        [helper.make_node("Unsqueeze", ["x", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("a", [0], np.int64)],
        None,
    ),
    "slice-all": (
        [helper.make_node("Slice", ["x", "s", "e", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [0, 0], np.int64), tensor("e", [INT64_MAX, 5], np.int64), tensor("a", [0, -1], np.int64)],
        "slice-everything",
    ),
    "slice-part": (
        [helper.make_node("Slice", ["x", "s", "e", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [0], np.int64), tensor("e", [4], np.int64), tensor("a", [2], np.int64)],
        None,
    ),
    "expand-ones": (
        [helper.make_node("Expand", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [1, 5], np.int64)],
        "expand-to-own-shape",
    ),
    "expand-grows-rank": (
        [helper.make_node("Expand", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [2, 1, 1, 1], np.int64)],
        None,
    ),
    "tile-once": (
        [helper.make_node("Tile", ["x", "r"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("r", [1, 1, 1], np.int64)],
        "tile-once",
    ),
    "tile-twice": (
        [helper.make_node("Tile", ["x", "r"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("r", [1, 2, 1], np.int64)],
        None,
    ),
    "resize-by-ones": (
        [helper.make_node("Resize", ["x", "", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [1.0, 1.0, 1.0])],
        "resize-to-own-size",
    ),
    "resize-to-own-sizes": (  # only the axes given; the symbolic batch is not resized
        [helper.make_node("Resize", ["x", "", "", "n"], ["t"], axes=[-1, 1]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("n", [5, 4], np.int64)],
        "resize-to-own-size",
    ),
    "resize-to-other-sizes": (
        [helper.make_node("Resize", ["x", "", "", "n"], ["t"], axes=[1, 2]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("n", [4, 6], np.int64)],
        None,
    ),
    "resize-by-two": (
        [helper.make_node("Resize", ["x", "", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [1.0, 2.0, 1.0])],
        None,
    ),
    "resize-shifting-half-a-pixel": (  # the spec's tf_half_pixel_for_nn reads index x + 0.5, rounded up here
        [
            helper.make_node(
                "Resize",
                ["x", "", "s"],
                ["t"],
                coordinate_transformation_mode="tf_half_pixel_for_nn",
                nearest_mode="round_prefer_ceil",
            ),
            helper.make_node("Relu", ["t"], ["y"]),
        ],
        [tensor("s", [1.0, 1.0, 1.0])],
        None,
    ),
    "resize-linear-of-an-input": (  # its neighbours weigh 0: onnx's reference clips an infinite input there
        [helper.make_node("Resize", ["x", "", "s"], ["t"], mode="linear"), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("s", [1.0, 1.0, 1.0])],
        None,
    ),
    "resize-linear-of-a-constant": (  # BEiT's relative position bias, interpolated to its own size
        [
            helper.make_node("Resize", ["c", "", "", "n"], ["t"], mode="linear"),
            helper.make_node("Add", ["x", "t"], ["y"]),
        ],
        [tensor("c", np.arange(20).reshape(1, 4, 5)), tensor("n", [1, 4, 5], np.int64)],
        "resize-to-own-size",
    ),
    "resize-linear-of-an-infinite-constant": (
        [
            helper.make_node("Resize", ["c", "", "", "n"], ["t"], mode="linear"),
            helper.make_node("Add", ["x", "t"], ["y"]),
        ],
        [tensor("c", np.full((1, 4, 5), np.inf)), tensor("n", [1, 4, 5], np.int64)],
        None,
    ),
    "concat-single": (
        [helper.make_node("Concat", ["x"], ["t"], axis=1), helper.make_node("Relu", ["t"], ["y"])],
        [],
        "single-input",
    ),
    "concat-two": (
        [helper.make_node("Concat", ["x", "x"], ["t"], axis=1), helper.make_node("Relu", ["t"], ["y"])],
        [],
        None,
    ),
    "add-zero": (
        [helper.make_node("Add", ["z", "x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("z", np.zeros((4, 1)))],
        "add-zero",
    ),
    "add-zero-broadcasts": (  # the zeros would grow x's shape
        [helper.make_node("Add", ["x", "z"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("z", np.zeros((2, 1, 4, 5)))],
        None,
    ),
    "add-nonzero": (
        [helper.make_node("Add", ["x", "z"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("z", [0.0, 0.0, 0.0, 0.0, 1.0])],
        None,
    ),
    "sub-zero": (
        [helper.make_node("Sub", ["x", "z"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("z", 0.0)],
        "sub-zero",
    ),
    "zero-sub": (
        [helper.make_node("Sub", ["z", "x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("z", 0.0)],
        None,
    ),
    "mul-one": (
        [const("o", np.ones(5)), helper.make_node("Mul", ["x", "o"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [],
        "mul-one",
    ),
    "mul-two": (
        [helper.make_node("Mul", ["x", "o"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("o", 2.0)],
        None,
    ),
    "div-one": (
        [helper.make_node("Div", ["x", "o"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("o", 1.0)],
        "div-one",
    ),
    "one-div": (
        [helper.make_node("Div", ["o", "x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [tensor("o", 1.0)],
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(NOOP_CASES))
def test_noop_rule(tmp_path: Path, case: str) -> None:
    nodes, initializers, rule = NOOP_CASES[case]
    # Record the types only of graph inputs and outputs: the rules must not need more.
    path = write(tmp_path, nodes, initializers=initializers)
    model, results, _ = optimize(path, "noop")
    removed = results["noop"].details["removed"]
    if rule is None:
        assert removed == {}
        assert sum(ops(model).values()) == len(nodes)
    else:
        assert removed == {rule: 1}
        assert sum(ops(model).values()) == len(nodes) - 1


@pytest.mark.parametrize(
    ("op_type", "constant", "rule"),
    [
        ("And", np.ones((1, 5), bool), "and-true"),
        ("And", np.array([True, False, True, True, True]), None),
        ("Or", np.zeros(5, bool), "or-false"),
        ("Or", np.ones(5, bool), None),
        ("And", np.ones((2, 1, 4, 5), bool), None),  # broadcasting the constant would grow x's shape
    ],
)
def test_boolean_neutral_operand(tmp_path: Path, op_type: str, constant: np.ndarray, rule: str | None) -> None:
    # An exporter's mask starts as all-true ones and'ed with the causal condition.
    nodes = [helper.make_node(op_type, ["c", "x"], ["t"]), helper.make_node("Not", ["t"], ["y"])]
    bools = [info("x", TensorProto.BOOL)]
    path = write(tmp_path, nodes, bools, [info("y", TensorProto.BOOL, None)], [tensor("c", constant, bool)])
    model, results, _ = optimize(path, "noop")
    assert results["noop"].details["removed"] == ({rule: 1} if rule else {})
    assert sum(ops(model).values()) == (1 if rule else 2)


def test_noop_removes_identity_chain_in_one_sweep(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Identity", ["a"], ["b"]),
        helper.make_node("Dropout", ["b"], ["c"]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    model, results, _ = optimize(write(tmp_path, nodes), "noop")
    assert results["noop"].details["removed"] == {"identity": 2, "dropout-inference": 1}
    assert ops(model) == {"Relu": 1}


def test_noop_keeps_graph_output_names(tmp_path: Path) -> None:
    # y = Identity(Relu(x)): Relu's output takes the name y. z = Identity(x): x is a graph
    # input and cannot be renamed, so that Identity stays.
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["y"]),
        helper.make_node("Identity", ["x"], ["z"]),
    ]
    path = write(tmp_path, nodes, outputs=[info("y"), info("z")])
    model, _, out = optimize(path, "noop")
    assert ops(model) == {"Relu": 1, "Identity": 1}
    assert output_names(out) == ["y", "z"]


def test_noop_keeps_identity_between_two_graph_outputs(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    path = write(tmp_path, nodes, outputs=[info("r"), info("y")])
    model, _, out = optimize(path, "noop")
    assert ops(model) == {"Relu": 1, "Identity": 1}
    assert output_names(out) == ["r", "y"]


def test_noop_keeps_dropout_in_training_mode(tmp_path: Path) -> None:
    nodes = [helper.make_node("Dropout", ["x", "r", "m"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    path = write(tmp_path, nodes, initializers=[tensor("r", 0.5), tensor("m", True, np.bool_)])
    model = load(path)
    assert run_passes(model, ["noop"])["noop"].changed is False
    assert ops(model)["Dropout"] == 1


def test_noop_squeeze_with_static_shape(tmp_path: Path) -> None:
    nodes = [helper.make_node("Squeeze", ["x", "a"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    path = write(tmp_path, nodes, [info("x", shape=[2, 4, 5])], initializers=[tensor("a", np.zeros(0), np.int64)])
    model, results, _ = optimize(path, "noop")
    assert results["noop"].details["removed"] == {"squeeze-nothing": 1}
    assert ops(model) == {"Relu": 1}


def test_noop_reads_attribute_operands_of_old_opsets(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Slice", ["x"], ["a"], starts=[0], ends=[INT64_MAX], axes=[1]),
        helper.make_node("Pad", ["a"], ["b"], pads=[0] * 6),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, opset=9), "noop")
    assert results["noop"].details["removed"] == {"slice-everything": 1, "pad-nothing": 1}
    assert ops(model) == {"Relu": 1}


def test_noop_does_not_treat_fed_initializer_as_constant(tmp_path: Path) -> None:
    # An initializer listed as a graph input is a default the caller may override.
    nodes = [helper.make_node("Add", ["x", "z"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    path = write(tmp_path, nodes, [info("x"), info("z", shape=[5])], initializers=[tensor("z", np.zeros(5))])
    model = load(path)
    assert run_passes(model, ["noop"])["noop"].changed is False


def test_noop_in_if_branch_and_function(tmp_path: Path) -> None:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Neg", ["i"], ["o"])], "then", [], [info("o")]
    )
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["o2"])], "else", [], [info("o2")])
    function = helper.make_function(
        "local",
        "Twice",
        ["a"],
        ["b"],
        [helper.make_node("Identity", ["a"], ["c"]), helper.make_node("Add", ["c", "c"], ["b"])],
        [helper.make_opsetid("", 21)],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["f"], then_branch=branch, else_branch=other),
        helper.make_node("Twice", ["f"], ["y"], domain="local"),
    ]
    path = write(tmp_path, nodes, [info("x"), info("cond", TensorProto.BOOL, [])], functions=[function])
    model, results, _ = optimize(path, "noop")
    assert results["noop"].details["removed"] == {"identity": 2}
    assert ops(model)["Identity"] == 0


# -- dce --------------------------------------------------------------------------------------


def test_dce_removes_dead_chain_and_unused_initializers(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Add", ["x", "w"], ["dead1"]),
        helper.make_node("Relu", ["dead1"], ["dead2"]),
        helper.make_node("Mul", ["x", "v"], ["y"]),
    ]
    inputs = [info("x"), info("unused")]
    path = write(tmp_path, nodes, inputs, initializers=[tensor("w", 1.0), tensor("v", 2.0), tensor("u", 3.0)])
    model, results, out = optimize(path, "dce")
    assert results["dce"].details == {"nodes": {"Add": 1, "Relu": 1}, "initializers": 2}
    assert ops(model) == {"Mul": 1}
    assert [i.name for i in onnx.load(out).graph.input] == ["x", "unused"]  # the interface stays


def test_dce_keeps_graph_outputs_and_values_used_only_in_a_branch(tmp_path: Path) -> None:
    # "n" is read only inside the then-branch; "a" only by a dead node inside it; "k" is an
    # output nothing else reads.
    branch = helper.make_graph(
        [helper.make_node("Relu", ["a"], ["dead"]), helper.make_node("Neg", ["n"], ["o"])], "then", [], [info("o")]
    )
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["o2"])], "else", [], [info("o2")])
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["n"]),
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("Exp", ["x"], ["k"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other),
    ]
    inputs = [info("x"), info("cond", TensorProto.BOOL, [])]
    model, results, out = optimize(write(tmp_path, nodes, inputs, [info("y"), info("k")]), "dce")
    assert results["dce"].details["nodes"] == {"Abs": 1, "Relu": 1}
    assert ops(model) == {"Sigmoid": 1, "Exp": 1, "If": 1, "Neg": 1, "Abs": 1}
    assert output_names(out) == ["y", "k"]


def test_dce_counts_nodes_inside_a_dead_branch_owner(tmp_path: Path) -> None:
    branch = helper.make_graph([helper.make_node("Neg", ["x"], ["o"])], "then", [], [info("o")])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["o2"])], "else", [], [info("o2")])
    nodes = [
        helper.make_node("If", ["cond"], ["dead"], then_branch=branch, else_branch=other),
        helper.make_node("Relu", ["x"], ["y"]),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, [info("x"), info("cond", TensorProto.BOOL, [])]), "dce")
    assert results["dce"].details["nodes"] == {"If": 1, "Neg": 1, "Abs": 1}
    assert ops(model) == {"Relu": 1}


def test_dce_drops_functions_nothing_calls(tmp_path: Path) -> None:
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("local", 1)]
    inner = helper.make_function("local", "Inner", ["a"], ["b"], [helper.make_node("Abs", ["a"], ["b"])], opsets)
    outer = helper.make_function(
        "local", "Outer", ["a"], ["b"], [helper.make_node("Inner", ["a"], ["b"], domain="local")], opsets
    )
    # "Outer" is called only by a dead node, so "Inner" (called only by "Outer") goes as
    # well; "Used" calls "Dead" from a dead node of its own.
    used = helper.make_function(
        "local",
        "Used",
        ["a"],
        ["b"],
        [helper.make_node("Dead", ["a"], ["unused"], domain="local"), helper.make_node("Neg", ["a"], ["b"])],
        opsets,
    )
    dead = helper.make_function("local", "Dead", ["a"], ["b"], [helper.make_node("Exp", ["a"], ["b"])], opsets)
    nodes = [
        helper.make_node("Outer", ["x"], ["dead"], domain="local"),
        helper.make_node("Used", ["x"], ["y"], domain="local"),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, functions=[used, inner, outer, dead]), "dce")
    assert results["dce"].details["functions"] == ["local::Inner", "local::Outer", "local::Dead"]
    assert results["dce"].details["nodes"] == {"Outer": 1, "Dead": 1}
    assert [f.name for f in model.functions] == ["Used"]


def test_dce_keep_ops_option(tmp_path: Path) -> None:
    nodes = [helper.make_node("Abs", ["x"], ["dead"]), helper.make_node("Relu", ["x"], ["y"])]
    model, results, _ = optimize(write(tmp_path, nodes), "dce", keep_ops=["Abs"])
    assert results["dce"].changed is False
    assert ops(model) == {"Abs": 1, "Relu": 1}


# -- cse --------------------------------------------------------------------------------------


def test_cse_merges_duplicate_chains(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Add", ["x", "w"], ["a1"]),
        helper.make_node("Add", ["x", "w"], ["a2"]),
        helper.make_node("Transpose", ["a1"], ["t1"], perm=[0, 2, 1]),
        helper.make_node("Transpose", ["a2"], ["t2"], perm=[0, 2, 1]),
        helper.make_node("Sub", ["t1", "t2"], ["y"]),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, initializers=[tensor("w", 1.5)]), "cse")
    assert results["cse"].details["nodes"] == {"Add": 1, "Transpose": 1}
    assert ops(model) == {"Add": 1, "Transpose": 1, "Sub": 1}


@pytest.mark.parametrize(("op", "merged"), [("Add", True), ("Mul", True), ("Sub", False), ("Max", False)])
def test_cse_swaps_operands_of_commutative_ops_only(tmp_path: Path, op: str, merged: bool) -> None:
    nodes = [
        helper.make_node(op, ["x", "w"], ["a"]),
        helper.make_node(op, ["w", "x"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["y"], axis=0),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, initializers=[tensor("w", [1.0, 2.0, 3.0, 4.0, 5.0])]), "cse")
    assert results["cse"].changed is merged
    assert ops(model)[op] == (1 if merged else 2)


@pytest.mark.parametrize(
    ("first", "second"),
    [({"perm": [0, 2, 1]}, {"perm": [1, 0, 2]}), ({"alpha": 0.0}, {"alpha": -0.0})],
    ids=["perm", "signed-zero"],
)
def test_cse_keeps_nodes_whose_attributes_differ(tmp_path: Path, first: dict[str, Any], second: dict[str, Any]) -> None:
    op = "Transpose" if "perm" in first else "Elu"
    nodes = [
        helper.make_node(op, ["x"], ["a"], **first),
        helper.make_node(op, ["x"], ["b"], **second),
        helper.make_node("Concat", ["a", "b"], ["y"], axis=0),
    ]
    model = load(write(tmp_path, nodes))
    assert run_passes(model, ["cse"])["cse"].changed is False


def test_cse_merges_equal_constants_in_both_spellings(tmp_path: Path) -> None:
    nodes = [
        const("c1", [1.0, 2.0, 3.0, 4.0, 5.0]),
        const("c2", [1, 2, 3, 4, 5], np.int64),  # same bytes per element count, other type
        helper.make_node("Cast", ["c2"], ["c2f"], to=F),
        helper.make_node("Mul", ["x", "w1"], ["a"]),
        helper.make_node("Mul", ["x", "w2"], ["b"]),
        helper.make_node("Mul", ["x", "c1"], ["c"]),
        helper.make_node("Sum", ["a", "b", "c", "c2f", "w3"], ["y"]),
    ]
    same = [1.0, 2.0, 3.0, 4.0, 5.0]
    initializers = [tensor("w1", same), tensor("w2", same), tensor("w3", [1.0, 2.0, 3.0, 4.0, 6.0])]
    model, results, _ = optimize(write(tmp_path, nodes, initializers=initializers), "cse")
    # w2 and c1 become w1; then the three Muls are one.
    assert results["cse"].details == {"nodes": {"Constant": 1, "Mul": 2}, "constants": 2}
    assert sorted(model.graph.initializers) == ["w1", "w3"]
    assert ops(model) == {"Constant": 1, "Cast": 1, "Mul": 1, "Sum": 1}


def test_cse_compares_large_tensors_whole(tmp_path: Path) -> None:
    # w3 differs from w1 in one element that the probe slices (start, middle, end) skip.
    base = np.arange(10_000, dtype=np.float32)
    changed = base.copy()
    changed[3000] = -1.0
    nodes = [helper.make_node("Sum", ["w1", "w2", "w3"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    initializers = [tensor("w1", base), tensor("w2", base), tensor("w3", changed)]
    inputs = [info("x", shape=[10_000])]
    model, results, _ = optimize(write(tmp_path, nodes, inputs, initializers=initializers), "cse")
    assert results["cse"].details["constants"] == 1
    assert sorted(model.graph.initializers) == ["w1", "w3"]


def test_cse_never_merges_random_ops(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("RandomNormalLike", ["x"], ["r1"], seed=1.0),
        helper.make_node("RandomNormalLike", ["x"], ["r2"], seed=1.0),
        helper.make_node("RandomUniform", [], ["u1"], shape=[5]),
        helper.make_node("RandomUniform", [], ["u2"], shape=[5]),
        helper.make_node("Sum", ["r1", "r2", "u1", "u2"], ["y"]),
    ]
    model = load(write(tmp_path, nodes))
    assert run_passes(model, ["cse"])["cse"].changed is False
    assert ops(model) == {"RandomNormalLike": 2, "RandomUniform": 2, "Sum": 1}


def test_cse_never_merges_calls_of_random_functions(tmp_path: Path) -> None:
    opsets = [helper.make_opsetid("", 21)]
    noisy = helper.make_function("local", "Noisy", ["a"], ["b"], [helper.make_node("Bernoulli", ["a"], ["b"])], opsets)
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["p"]),
        helper.make_node("Noisy", ["p"], ["n1"], domain="local"),
        helper.make_node("Noisy", ["p"], ["n2"], domain="local"),
        helper.make_node("Add", ["n1", "n2"], ["y"]),
    ]
    model = load(write(tmp_path, nodes, functions=[noisy]))
    assert run_passes(model, ["cse"])["cse"].changed is False


def test_cse_and_graph_outputs(tmp_path: Path) -> None:
    # r1 and r2 are both outputs: both stay. n2 is an output but n1 is not: n1's node
    # stays under n2's name.
    nodes = [
        helper.make_node("Relu", ["x"], ["r1"]),
        helper.make_node("Relu", ["x"], ["r2"]),
        helper.make_node("Neg", ["x"], ["n1"]),
        helper.make_node("Neg", ["x"], ["n2"]),
        helper.make_node("Abs", ["n1"], ["y"]),
    ]
    path = write(tmp_path, nodes, outputs=[info("r1"), info("r2"), info("n2"), info("y")])
    model, results, out = optimize(path, "cse")
    assert results["cse"].details["nodes"] == {"Neg": 1}
    assert ops(model) == {"Relu": 2, "Neg": 1, "Abs": 1}
    assert output_names(out) == ["r1", "r2", "n2", "y"]


def test_cse_keeps_nodes_with_subgraphs_and_fed_initializers(tmp_path: Path) -> None:
    def branch(op: str, out: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["x"], [out])], op, [], [info(out)])

    nodes = [
        helper.make_node("If", ["cond"], ["i1"], then_branch=branch("Neg", "o1"), else_branch=branch("Abs", "o2")),
        helper.make_node("If", ["cond"], ["i2"], then_branch=branch("Neg", "o3"), else_branch=branch("Abs", "o4")),
        helper.make_node("Add", ["i1", "i2"], ["s"]),
        helper.make_node("Add", ["s", "w1"], ["t"]),
        helper.make_node("Add", ["t", "w2"], ["y"]),
    ]
    inputs = [info("x"), info("cond", TensorProto.BOOL, []), info("w2", shape=[])]
    path = write(tmp_path, nodes, inputs, initializers=[tensor("w1", 1.0), tensor("w2", 1.0)])
    model = load(path)
    assert run_passes(model, ["cse"])["cse"].changed is False
    assert ops(model)["If"] == 2 and sorted(model.graph.initializers) == ["w1", "w2"]


def test_cleanup_inside_a_loop_body(tmp_path: Path) -> None:
    # The body reads the outer x and w; it holds an Identity, a duplicate Mul and a dead Neg.
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["xi"]),
            helper.make_node("Mul", ["xi", "w"], ["m1"]),
            helper.make_node("Mul", ["x", "w"], ["m2"]),
            helper.make_node("Neg", ["m1"], ["dead"]),
            helper.make_node("Add", ["m1", "m2"], ["s"]),
            helper.make_node("Add", ["acc", "s"], ["acc_out"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [info("i", I64, []), info("cond", TensorProto.BOOL, []), info("acc")],
        [info("cond_out", TensorProto.BOOL, []), info("acc_out")],
    )
    nodes = [
        const("n", 3, np.int64),
        const("c", True, np.bool_),
        helper.make_node("Loop", ["n", "c", "x"], ["y"], body=body),
    ]
    model, results, _ = optimize(write(tmp_path, nodes, initializers=[tensor("w", 0.5)]), "noop", "dce", "cse")
    assert results["noop"].details["removed"] == {"identity": 1}  # cond_out is a body output
    assert results["dce"].details["nodes"] == {"Neg": 1}
    assert results["cse"].details["nodes"] == {"Mul": 1}
    assert ops(model) == {"Constant": 2, "Loop": 1, "Mul": 1, "Add": 2, "Identity": 1}


# -- all three on the corpus -----------------------------------------------------------------


def cleanup_to_fixpoint(model: Model, max_rounds: int = 8) -> int:
    for rounds in range(1, max_rounds + 1):
        if not any(r.changed for r in run_passes(model, ["noop", "dce", "cse"]).values()):
            return rounds
    raise AssertionError(f"cleanup did not settle in {max_rounds} rounds")


# Node counts after noop + dce + cse, measured when the passes were written: the original
# counts are 478, 549 and 144; onnxsim, which also folds constants, gets 303, 336 and 142.
CLEANED_NODES = {"bert_small": 338, "gpt2_small": 371, "inception_v1": 142}


@pytest.mark.parametrize("name", sorted(CLEANED_NODES))
def test_cleanup_on_corpus(corpus_dir: Path, tmp_path: Path, name: str) -> None:
    source = corpus_dir / f"{name}.onnx"
    model = load(source)
    before = model_stats(model).nodes
    rounds = cleanup_to_fixpoint(model)
    after = model_stats(model).nodes
    print(f"{name}: {before} -> {after} nodes in {rounds} rounds")
    assert after <= CLEANED_NODES[name] < before
    out = tmp_path / f"{name}.onnx"
    save(model, out)
    assert_same_outputs(source, out)


def test_passes_that_run_again_read_each_weight_once() -> None:
    """cse and const-cache hash weights to find duplicates; a fixpoint group runs them again
    and again, and on a 2 GB model re-hashing every round cost more than the rest together."""
    from graphopt.api import optimize
    from graphopt.io.onnx_io import from_proto
    from graphopt.ir import ArraySource

    reads: Counter[str] = Counter()

    class CountingSource(ArraySource):
        def read(self) -> np.ndarray:
            reads[self.name] += 1
            return super().read()

    same = np.ones((64, 64), np.float32)
    other = same.copy()
    other.flat[1250] = 2  # between the probe's slices: only a full read tells the two apart
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["x", "w2"], ["b"])],
        "twins",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 64]) for n in ("a", "b")],
        [numpy_helper.from_array(same, "w1"), numpy_helper.from_array(other, "w2")],
    )
    model = from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    for value in model.graph.initializers.values():
        source = CountingSource(value.const.numpy().copy())
        source.name = value.name
        value.const.source = source
    optimize(model, "cse,const-cache,cse,const-cache,cse", check=False)
    assert reads and max(reads.values()) <= 2  # one probe read, one full read
