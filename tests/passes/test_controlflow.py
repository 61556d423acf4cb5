"""Control flow: If nodes decided by shapes and constants, inside bodies too, to a fixed point.

The model here is built like silero-VAD's TorchScript export: a sample-rate input chosen by
``If(sr == 16000)``, shape checks (``Equal(Shape(x)[1], 512)``, ``Greater``), Ifs nested in
branches, ``x.squeeze(-1)`` as an If whose branches differ in rank, and LSTMCell's
``if input.dim() != 2`` whose not-taken branch declares the rank. Every test runs the
default pipeline and compares outputs in onnxruntime.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphopt.api import optimize
from graphopt.ir import DataType, TensorType
from tests.numerics import run_ort
from tests.passes.test_constcache import info, tensor

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def body(
    name: str, nodes: list[onnx.NodeProto], outputs: list[onnx.ValueInfoProto], inits: Sequence[onnx.TensorProto] = ()
) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], outputs, list(inits))


def if_node(cond: str, outputs: list[str], then: onnx.GraphProto, other: onnx.GraphProto) -> onnx.NodeProto:
    return helper.make_node("If", [cond], outputs, then_branch=then, else_branch=other)


def model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def counts(proto: onnx.ModelProto) -> tuple[int, int, Counter[str]]:
    """Nodes of the main graph, nodes with those in bodies, and op types with bodies."""
    found: Counter[str] = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            found[node.op_type] += 1
            for attr in node.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                    walk(sub)

    walk(proto.graph)
    return len(proto.graph.node), sum(found.values()), found


def same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    want, got = run_ort(original, feeds), run_ort(optimized, feeds)
    assert want.keys() == got.keys()
    for name, array in want.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-6, err_msg=name)


# -- the silero-VAD-like model ---------------------------------------------------------------


def _features(
    p: str, samples: int, frame: int, weight: np.ndarray
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """One rate's path, on ``{p}_x``: frames of ``frame`` when the chunk has ``samples``
    (an If on ``Shape(x)[1]``), projected by ``weight`` (in a branch nested two deep, whose
    If tests the frames' last dim) or averaged when the chunk is short (``Greater``)."""
    full = body(
        f"{p}_full",
        [helper.make_node("Reshape", [f"{p}_x", f"{p}_target"], [f"{p}_fr_t"])],
        [info(f"{p}_fr_t")],
        [tensor(f"{p}_target", [0, -1, frame], np.int64)],
    )
    padded = body(
        f"{p}_pad",
        [
            helper.make_node("Pad", [f"{p}_x", f"{p}_pads"], [f"{p}_padded"]),
            helper.make_node("Reshape", [f"{p}_padded", f"{p}_target"], [f"{p}_fr_e"]),
        ],
        [info(f"{p}_fr_e")],
        [tensor(f"{p}_pads", [0, 0, 0, samples], np.int64), tensor(f"{p}_target", [0, -1, frame], np.int64)],
    )
    project = body(
        f"{p}_mm",
        [helper.make_node("MatMul", [f"{p}_frames", f"{p}_w"], [f"{p}_feat_a"])],
        [info(f"{p}_feat_a")],
        [tensor(f"{p}_w", weight)],
    )
    negate = body(
        f"{p}_mm2",
        [helper.make_node("MatMul", [f"{p}_frames", f"{p}_w"], [f"{p}_feat_b"])],
        [info(f"{p}_feat_b")],
        [tensor(f"{p}_w", -weight)],
    )
    long_chunk = body(
        f"{p}_long",
        [
            helper.make_node("Shape", [f"{p}_frames"], [f"{p}_fs"]),
            helper.make_node("Gather", [f"{p}_fs", f"{p}_two"], [f"{p}_fl"], axis=0),
            helper.make_node("Equal", [f"{p}_fl", f"{p}_frame"], [f"{p}_fok"]),
            if_node(f"{p}_fok", [f"{p}_feat_i"], project, negate),
        ],
        [info(f"{p}_feat_i")],
        [tensor(f"{p}_two", 2, np.int64), tensor(f"{p}_frame", frame, np.int64)],
    )
    short_chunk = body(
        f"{p}_short",
        [
            helper.make_node("ReduceMean", [f"{p}_frames"], [f"{p}_mean"], axes=[2], keepdims=1),
            helper.make_node("Expand", [f"{p}_mean", f"{p}_width"], [f"{p}_feat_s"]),
        ],
        [info(f"{p}_feat_s")],
        [tensor(f"{p}_width", [1, 1, weight.shape[1]], np.int64)],
    )
    nodes = [
        helper.make_node("Shape", [f"{p}_x"], [f"{p}_shape"]),
        helper.make_node("Gather", [f"{p}_shape", "one"], [f"{p}_n"], axis=0),
        helper.make_node("Equal", [f"{p}_n", f"{p}_samples"], [f"{p}_is_full"]),
        if_node(f"{p}_is_full", [f"{p}_frames"], full, padded),
        helper.make_node("Greater", [f"{p}_n", f"{p}_frame_len"], [f"{p}_is_long"]),
        if_node(f"{p}_is_long", [f"{p}_feat"], long_chunk, short_chunk),
        helper.make_node("ReduceMean", [f"{p}_feat"], [f"{p}_pooled"], axes=[1], keepdims=0),
    ]
    return nodes, [tensor(f"{p}_samples", samples, np.int64), tensor(f"{p}_frame_len", frame, np.int64)]


def vad() -> onnx.ModelProto:
    """input[batch, 512], sr, state[2, batch, 16], frames[batch, 16, frames] (1 in every valid run)."""
    rng = np.random.default_rng(0)
    unsqueezed = body("unsq", [helper.make_node("Unsqueeze", ["input", "ax0"], ["x_u"])], [info("x_u")])
    kept = body("keep", [helper.make_node("Identity", ["input"], ["x_k"])], [info("x_k")])
    nodes16, inits16 = _features("k16", 512, 128, 0.1 * rng.standard_normal((128, 16)))
    rate16 = body(
        "sr16",
        [
            helper.make_node("Identity", ["x"], ["k16_x"]),
            *nodes16,
            helper.make_node("Gather", ["state", "zero"], ["k16_h"], axis=0),
            helper.make_node("Add", ["k16_pooled", "k16_h"], ["k16_mixed"]),
        ],
        [info("k16_mixed")],
        inits16,
    )
    nodes8, inits8 = _features("k8", 256, 64, 0.1 * rng.standard_normal((64, 16)))
    every_other = [
        tensor("s0", [0], np.int64),
        tensor("s_end", [1 << 62], np.int64),
        tensor("s_ax", [1], np.int64),
        tensor("s_step", [2], np.int64),
    ]
    rate8 = body(
        "sr8",
        [
            helper.make_node("Slice", ["x", "s0", "s_end", "s_ax", "s_step"], ["k8_x"]),
            *nodes8,
            helper.make_node("Gather", ["state", "one"], ["k8_h"], axis=0),
            helper.make_node("Add", ["k8_pooled", "k8_h"], ["k8_mixed"]),
        ],
        [info("k8_mixed")],
        [*inits8, *every_other],
    )
    # x.squeeze(-1) of [batch, 16, frames]: an If whose branches differ in rank...
    squeezed = body("sq", [helper.make_node("Squeeze", ["ctx", "ax2"], ["sq_t"])], [info("sq_t", F, ["batch", 16])])
    unsqueezed_ctx = body(
        "sq_no", [helper.make_node("Identity", ["ctx"], ["sq_e"])], [info("sq_e", F, ["batch", 16, "frames"])]
    )
    # ... then LSTMCell's "if input.dim() != 2: input = input.unsqueeze(0)", the rank declared by the export.
    batched = body(
        "cell_b", [helper.make_node("Unsqueeze", ["cell_in", "ax0"], ["cell_u"])], [info("cell_u", F, [1, "b", 16])]
    )
    as_is = body("cell_k", [helper.make_node("Identity", ["cell_in"], ["cell_i"])], [info("cell_i", F, ["b", 16])])
    # Branches that compute the same thing under a condition on values: Relu of one outer value,
    # and the state input passed on (an Identity, and in the other branch an Identity of one).
    relu_a = body("relu_a", [helper.make_node("Relu", ["cell_x"], ["act_a"])], [info("act_a")])
    relu_b = body("relu_b", [helper.make_node("Relu", ["cell_x"], ["act_b"])], [info("act_b")])
    state_a = body("state_a", [helper.make_node("Identity", ["state"], ["st_a"])], [info("st_a")])
    state_b = body(
        "state_b",
        [
            helper.make_node("Identity", ["state"], ["st_b0"]),
            helper.make_node("Identity", ["st_b0"], ["st_b"]),
        ],
        [info("st_b")],
    )
    nodes = [
        helper.make_node("Shape", ["input"], ["in_shape"]),
        helper.make_node("Size", ["in_shape"], ["rank"]),
        helper.make_node("Equal", ["rank", "one"], ["is_1d"]),
        if_node("is_1d", ["x"], unsqueezed, kept),
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        if_node("is16k", ["mixed"], rate16, rate8),
        helper.make_node("Unsqueeze", ["mixed", "ax2"], ["mixed3"]),
        helper.make_node("Add", ["mixed3", "frames"], ["ctx"]),
        helper.make_node("Shape", ["ctx"], ["ctx_shape"]),
        helper.make_node("Gather", ["ctx_shape", "two"], ["ctx_last"], axis=0),
        helper.make_node("Equal", ["ctx_last", "one"], ["last_is_1"]),
        if_node("last_is_1", ["cell_in"], squeezed, unsqueezed_ctx),
        helper.make_node("Shape", ["cell_in"], ["cell_shape"]),
        helper.make_node("Size", ["cell_shape"], ["cell_rank"]),
        helper.make_node("Equal", ["cell_rank", "two"], ["is_2d"]),
        helper.make_node("Not", ["is_2d"], ["not_2d"]),
        if_node("not_2d", ["cell_x"], batched, as_is),
        helper.make_node("ReduceMax", ["cell_x"], ["peak"], keepdims=0),
        helper.make_node("Greater", ["peak", "zero_f"], ["positive"]),
        if_node("positive", ["act"], relu_a, relu_b),
        if_node("positive", ["state_out"], state_a, state_b),
        helper.make_node("MatMul", ["act", "head"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["output"]),
    ]
    inits = [
        tensor("one", 1, np.int64),
        tensor("two", 2, np.int64),
        tensor("zero", 0, np.int64),
        tensor("ax0", [0], np.int64),
        tensor("ax2", [2], np.int64),
        tensor("sr16k", 16000, np.int64),
        tensor("zero_f", 0.0),
        tensor("head", rng.standard_normal((16, 1))),
    ]
    inputs = [
        info("input", F, ["batch", 512]),
        info("sr", I64, []),
        info("state", F, [2, "batch", 16]),
        info("frames", F, ["batch", 16, "frames"]),
    ]
    outputs = [info("output", F, ["batch", 1]), info("state_out", F, [2, "batch", 16])]
    return model(nodes, inputs, outputs, inits)


def vad_feeds(rate: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rate)
    return {
        "input": rng.standard_normal((3, 512)).astype(np.float32),
        "sr": np.array(rate, np.int64),
        "state": rng.standard_normal((2, 3, 16)).astype(np.float32),
        "frames": rng.standard_normal((3, 16, 1)).astype(np.float32),
    }


def test_a_vad_like_model_keeps_only_the_if_on_the_sample_rate() -> None:
    original = vad()
    assert counts(original)[:2] == (23, 76) and counts(original)[2]["If"] == 12
    optimized = optimize(original, check=False).model
    top, total, ops = counts(optimized)
    # The rate is an input and squeeze(-1) tests a dim the input leaves open: those two Ifs
    # stay. Every other test, nested ones included, is decided, and the two Ifs on a value
    # whose branches agree become one branch (before: 5 If, 19 / 38 nodes).
    assert ops["If"] == 2 and (top, total) == (12, 25)
    # The state input passed on to an output: an Identity carries the output's name.
    assert [o.name for o in optimized.graph.output] == ["output", "state_out"]
    for rate in (16000, 8000):
        same_outputs(original, optimized, vad_feeds(rate))


def test_an_if_decided_only_once_another_is_inlined() -> None:
    # "a" is Unsqueeze(x) or x: its rank is known only once the first If is inlined, and then
    # the second If's rank test is decided too.
    first = body("first", [helper.make_node("Unsqueeze", ["x", "ax0"], ["u"])], [info("u")])
    other = body("other", [helper.make_node("Identity", ["x"], ["i"])], [info("i")])
    squeeze = body("squeeze", [helper.make_node("Squeeze", ["a", "ax0"], ["s"])], [info("s")])
    keep = body("keep", [helper.make_node("Neg", ["a"], ["k"])], [info("k")])
    nodes = [
        helper.make_node("Constant", [], ["yes"], value=tensor("", True, np.bool_)),
        if_node("yes", ["a"], first, other),
        helper.make_node("Shape", ["a"], ["shape"]),
        helper.make_node("Size", ["shape"], ["rank"]),
        helper.make_node("Equal", ["rank", "three"], ["is_3d"]),
        if_node("is_3d", ["y"], squeeze, keep),
    ]
    inits = [tensor("ax0", [0], np.int64), tensor("three", 3, np.int64)]
    original = model(nodes, [info("x", F, ["n", 4])], [info("y", F, ["n", 4])], inits)
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2] == Counter({"Unsqueeze": 1, "Squeeze": 1})
    same_outputs(original, optimized, {"x": np.arange(12, dtype=np.float32).reshape(3, 4)})


def test_an_if_nested_in_a_branch_of_an_if_on_the_same_condition_is_decided() -> None:
    # Inside If(c)'s then branch c is true, inside its else branch false, whatever c is.
    def inner(name: str, when_true: str, when_false: str) -> onnx.GraphProto:
        yes = body(f"{name}_yes", [helper.make_node(when_true, ["x"], [f"{name}_t"])], [info(f"{name}_t")])
        no = body(f"{name}_no", [helper.make_node(when_false, ["x"], [f"{name}_f"])], [info(f"{name}_f")])
        return body(name, [if_node("c", [f"{name}_out"], yes, no)], [info(f"{name}_out")])

    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        if_node("c", ["y"], inner("then", "Relu", "Neg"), inner("else", "Abs", "Sigmoid")),
    ]
    original = model(nodes, [info("x", F, [3, 4])], [info("y", F, [3, 4])], [tensor("zero", 0.0)])
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2] == Counter({"ReduceSum": 1, "Greater": 1, "If": 1, "Relu": 1, "Sigmoid": 1})
    for sign in (1.0, -1.0):
        x = sign * np.abs(np.random.default_rng(2).standard_normal((3, 4))).astype(np.float32)
        same_outputs(original, optimized, {"x": x})


# -- what must stay --------------------------------------------------------------------------


def _relu_or_neg(cond_nodes: list[onnx.NodeProto], extra_inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    then = body("then", [helper.make_node("Relu", ["x"], ["t"])], [info("t")])
    other = body("else", [helper.make_node("Neg", ["x"], ["e"])], [info("e")])
    nodes = [*cond_nodes, if_node("c", ["y"], then, other)]
    return model(nodes, [info("x", F, ["n", 4]), *extra_inputs], [info("y", F, ["n", 4])])


def test_a_condition_on_input_values_keeps_the_if() -> None:
    original = _relu_or_neg(
        [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Greater", ["s", "k"], ["c"])],
        [info("k", F, [])],
    )
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2]["If"] == 1
    rng = np.random.default_rng(0)
    for bound in (-100.0, 100.0):  # both branches taken
        same_outputs(
            original, optimized, {"x": rng.standard_normal((3, 4)).astype(np.float32), "k": np.array(bound, np.float32)}
        )


def test_a_condition_on_a_dim_the_input_leaves_open_keeps_the_if() -> None:
    # n > 2 for n = 3 and not for n = 1: nothing about n is known but that it is a size.
    original = _relu_or_neg(
        [
            helper.make_node("Shape", ["x"], ["shape"], end=1),
            helper.make_node("Squeeze", ["shape"], ["n"]),
            helper.make_node("Constant", [], ["two"], value_int=2),
            helper.make_node("Greater", ["n", "two"], ["c"]),
        ],
        [],
    )
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2]["If"] == 1
    for n in (1, 3):
        same_outputs(original, optimized, {"x": np.linspace(-1, 1, 4 * n, dtype=np.float32).reshape(n, 4)})


def test_branches_that_agree_on_one_output_only_keep_the_if() -> None:
    # Both branches return Relu(x) first; the second output differs: which branch runs matters.
    then = body(
        "then",
        [helper.make_node("Relu", ["x"], ["t0"]), helper.make_node("Neg", ["x"], ["t1"])],
        [info("t0"), info("t1")],
    )
    other = body(
        "else",
        [helper.make_node("Relu", ["x"], ["e0"]), helper.make_node("Abs", ["x"], ["e1"])],
        [info("e0"), info("e1")],
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        if_node("c", ["y0", "y1"], then, other),
    ]
    original = model(
        nodes, [info("x", F, [3, 4])], [info("y0", F, [3, 4]), info("y1", F, [3, 4])], [tensor("zero", 0.0)]
    )
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2]["If"] == 1
    for sign in (1.0, -1.0):
        same_outputs(
            original,
            optimized,
            {"x": sign * np.abs(np.random.default_rng(1).standard_normal((3, 4))).astype(np.float32)},
        )


# -- inlining: names, initializers, outputs, types -----------------------------------------


def test_inlined_branches_reusing_names_get_fresh_ones_and_outputs_keep_theirs() -> None:
    # Sibling branches may reuse a name ("t", the initializer "w"); inlined side by side they
    # would clash. One If passes the graph input x on (an Identity: a body may not return an
    # outer value itself) to the graph output "y1".
    def scaled(name: str, scale: float) -> onnx.GraphProto:
        return body(name, [helper.make_node("Mul", ["x", "w"], ["t"])], [info("t")], [tensor("w", scale)])

    passed = body("passed", [helper.make_node("Identity", ["x"], ["p"])], [info("p", F, [2, 3])])
    unused = body("unused", [helper.make_node("Neg", ["x"], ["n"])], [info("n")])
    nodes = [
        helper.make_node("Constant", [], ["yes"], value=tensor("", True, np.bool_)),
        if_node("yes", ["a"], scaled("first", 2.0), scaled("other", 0.0)),
        if_node("yes", ["b"], scaled("second", 3.0), scaled("another", 0.0)),
        helper.make_node("Add", ["a", "b"], ["y0"]),
        if_node("yes", ["y1"], passed, unused),
    ]
    original = model(nodes, [info("x", F, [2, 3])], [info("y0", F, [2, 3]), info("y1", F, [2, 3])])
    optimized = optimize(original, check=False).model
    onnx.checker.check_model(optimized, full_check=True)
    assert counts(optimized)[2] == Counter({"Mul": 2, "Add": 1, "Identity": 1})
    assert [o.name for o in optimized.graph.output] == ["y0", "y1"]
    assert [i.name for i in optimized.graph.input] == ["x"]
    same_outputs(original, optimized, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_an_inlined_value_keeps_the_type_declared_for_the_if_and_gains_what_the_branch_knows(tmp_path: Path) -> None:
    # "a" is declared [2, 3] where its branch says nothing; the branch declares "b" [2, 3]
    # where the If's output has no shape.
    def relu(name: str, out: str, shape: Sequence[int] | None) -> onnx.GraphProto:
        return body(name, [helper.make_node("Relu", ["x"], [out])], [info(out, F, shape)])

    nodes = [
        helper.make_node("Constant", [], ["yes"], value=tensor("", True, np.bool_)),
        if_node("yes", ["a"], relu("first", "t", None), relu("other", "e", None)),
        if_node("yes", ["b"], relu("second", "u", [2, 3]), relu("another", "f", None)),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    original = model(nodes, [info("x", F, ["n", 3])], [info("y", F, ["n", 3])])
    original.graph.value_info.extend([info("a", F, [2, 3]), info("b", F, None)])
    path = tmp_path / "m.onnx"
    onnx.save(original, path)
    optimized = optimize(path, "const-cache", check=False).model
    types = {v.name: str(v.type) for v in optimized.graph.values()}
    assert (types["t"], types["u"]) == (str(TensorType(DataType.FLOAT, (2, 3))),) * 2


def test_an_if_in_a_function_is_inlined_unless_its_branch_holds_initializers() -> None:
    # A function body holds no initializers: a branch with one stays where it is.
    def function_model(initializer: bool) -> onnx.ModelProto:
        double = (
            body("then", [helper.make_node("Mul", ["a", "w"], ["t"])], [info("t")], [tensor("w", 2.0)])
            if initializer
            else body("then", [helper.make_node("Add", ["a", "a"], ["t"])], [info("t")])
        )
        negate = body("else", [helper.make_node("Neg", ["a"], ["e"])], [info("e")])
        yes = helper.make_node("Constant", [], ["yes"], value=tensor("", True, np.bool_))
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
        function = helper.make_function(
            "local", "Pick", ["a"], ["b"], [yes, if_node("yes", ["b"], double, negate)], opsets[:1]
        )
        call = helper.make_node("Pick", ["x"], ["y"], domain="local")
        graph = helper.make_graph([call], "g", [info("x", F, [3])], [info("y", F, [3])])
        return helper.make_model(graph, opset_imports=opsets, functions=[function], ir_version=8)

    for initializer, kept in ((True, ["Constant", "If"]), (False, ["Add"])):
        original = function_model(initializer)
        optimized = optimize(original, check=False).model
        assert [n.op_type for n in optimized.functions[0].node] == kept
        same_outputs(original, optimized, {"x": np.array([1.0, -2.0, 3.0], np.float32)})


# -- loops of no or one iteration ------------------------------------------------------------


def _accumulate(trips: Sequence[onnx.NodeProto] | None, condition: str = "") -> onnx.ModelProto:
    """Loop(trips, condition, acc = start): acc += x * i and a scan output of Relu(acc) per
    iteration; the body reads x from outside and passes its condition on."""
    loop_body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["i_f"], to=F),
            helper.make_node("Mul", ["x", "i_f"], ["xi"]),
            helper.make_node("Add", ["acc_in", "xi"], ["acc_more"]),
            helper.make_node("Add", ["acc_more", "x"], ["acc_out"]),
            helper.make_node("Relu", ["acc_out"], ["per_step"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [info("i", I64, []), info("cond_in", BOOL, []), info("acc_in", F, [2, 3])],
        [info("cond_out", BOOL, []), info("acc_out", F, [2, 3]), info("per_step", F, [2, 3])],
    )
    nodes = [
        *(trips or []),
        helper.make_node(
            "Loop", ["trips" if trips is not None else "", condition, "start"], ["acc", "steps"], body=loop_body
        ),
    ]
    inits = [tensor("yes", True, np.bool_), tensor("no", False, np.bool_)]
    return model(
        nodes,
        [info("x", F, [2, 3]), info("start", F, [2, 3]), info("n", I64, []), info("go", BOOL, [])],
        [info("acc", F, [2, 3]), info("steps", F, ["k", 2, 3])],
        inits,
    )


def _x_and(n: int) -> dict[str, np.ndarray]:
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    return {"x": x, "start": x[::-1].copy(), "n": np.array(n, np.int64), "go": np.array(n > 0)}


def test_a_loop_of_one_iteration_becomes_its_body() -> None:
    # The trip count is the constant 1, or a difference of dims that is 1 (x is [2, 3]).
    one = [helper.make_node("Constant", [], ["trips"], value=tensor("", 1, np.int64))]
    from_dims = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("ReduceMax", ["shape"], ["longest"], keepdims=0),
        helper.make_node("ReduceMin", ["shape"], ["shortest"], keepdims=0),
        helper.make_node("Sub", ["longest", "shortest"], ["trips"]),
    ]
    for original in (_accumulate(one, "yes"), _accumulate(one), _accumulate(from_dims, "yes")):
        optimized = optimize(original, check=False).model
        assert counts(optimized)[2]["Loop"] == 0 and counts(optimized)[2]["Unsqueeze"] == 1
        same_outputs(original, optimized, _x_and(0))


def test_a_loop_that_runs_no_iteration_passes_its_values_on() -> None:
    zero = [helper.make_node("Constant", [], ["trips"], value=tensor("", 0, np.int64))]
    for original in (_accumulate(zero, "yes"), _accumulate(None, "no")):
        original.graph.output.pop()  # the scan output unread: its empty stack has a shape not known here
        optimized = optimize(original, check=False).model
        assert counts(optimized)[2] == Counter({"Identity": 1})  # the input "start" goes out as "acc"
        assert [o.name for o in optimized.graph.output] == ["acc"]
        same_outputs(original, optimized, _x_and(0))


def test_a_loop_whose_trip_count_or_condition_is_an_input_stays() -> None:
    # Trip count n; or one trip while "go", which may be false: then it runs none.
    one = [helper.make_node("Constant", [], ["trips"], value=tensor("", 1, np.int64))]
    for original in (_accumulate([helper.make_node("Identity", ["n"], ["trips"])], "yes"), _accumulate(one, "go")):
        optimized = optimize(original, check=False).model
        assert counts(optimized)[2]["Loop"] == 1
        for n in (0, 1, 3):
            same_outputs(original, optimized, _x_and(n))


def test_a_loop_of_one_iteration_whose_body_returns_its_inputs_as_they_are() -> None:
    # The condition (true: the Loop has none) goes out as the scan output and the carried
    # value passes through: no node in the body reads them, only its outputs do.
    loop_body = helper.make_graph(
        [],
        "body",
        [info("i", I64, []), info("cond_in", BOOL, []), info("acc_in", F, [2])],
        [info("cond_in", BOOL, []), info("acc_in", F, [2]), info("cond_in", BOOL, [])],
    )
    nodes = [
        helper.make_node("Constant", [], ["one"], value=tensor("", 1, np.int64)),
        helper.make_node("Loop", ["one", "", "x"], ["acc", "steps"], body=loop_body),
    ]
    original = model(nodes, [info("x", F, [2])], [info("acc", F, [2]), info("steps", BOOL, [1])])
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2]["Loop"] == 0
    same_outputs(original, optimized, {"x": np.array([1.0, -2.0], np.float32)})


def test_a_scan_over_one_slice_becomes_its_body() -> None:
    # acc += x_t; y_t = 2 acc, scanned along axis 0 of a [1, 2] input and axis 1 of a [2, 1]
    # one (stacked at axis 1); over [3, 2] it stays.
    def scan(name: str, xs: str, axis: int) -> onnx.NodeProto:
        scan_body = helper.make_graph(
            [
                helper.make_node("Add", ["acc_in", "x_t"], ["acc_out"]),
                helper.make_node("Add", ["acc_out", "acc_out"], ["y_t"]),
            ],
            "body",
            [info("acc_in", F, [2]), info("x_t", F, [2])],
            [info("acc_out", F, [2]), info("y_t", F, [2])],
        )
        attrs = {"scan_input_axes": [axis], "scan_output_axes": [axis]}
        return helper.make_node(
            "Scan", ["start", xs], [f"{name}_acc", f"{name}_ys"], body=scan_body, num_scan_inputs=1, **attrs
        )

    nodes = [scan("a", "rows", 0), scan("b", "columns", 1), scan("c", "three", 0)]
    inputs = [info("start", F, [2]), info("rows", F, [1, 2]), info("columns", F, [2, 1]), info("three", F, [3, 2])]
    shapes = {"a_acc": [2], "a_ys": [1, 2], "b_acc": [2], "b_ys": [2, 1], "c_acc": [2], "c_ys": [3, 2]}
    outputs = [info(name, F, shape) for name, shape in shapes.items()]
    original = model(nodes, inputs, outputs)
    optimized = optimize(original, check=False).model
    assert counts(optimized)[2]["Scan"] == 1
    rng = np.random.default_rng(3)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in inputs
    }
    same_outputs(original, optimized, feeds)
