"""The fold pass: sibling ops become one op on the corpus and on random graphs, the fold
index locates every original output, numerics hold in onnxruntime, and the cost model
refuses folds that do not pay (saying why)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.api import optimize
from tests.cli_helpers import at_batch_one, invoke
from tests.numerics import assert_same_outputs, make_feeds, run_ort


def _fold(source: Path | onnx.ModelProto, tmp_path: Path, **settings: Any) -> tuple[Path, dict[str, Any]]:
    if isinstance(source, onnx.ModelProto):
        path = tmp_path / "model.onnx"
        onnx.save(source, path)
        source = path
    result = optimize(source, "shape-infer,fold", **settings, check=False)
    target = tmp_path / "folded.onnx"
    graphopt.save(result.model, target)
    (run,) = [p for p in result.report["passes"] if p["pass"] == "fold"]
    assert run.get("error") is None, run
    return target, run["details"]


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _initializer_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.dims) for t in onnx.load(str(path)).graph.initializer}


# -- the corpus -------------------------------------------------------------------------------


def test_wide_ensemble_branches_become_one_batched_chain(corpus_dir: Path, tmp_path: Path) -> None:
    source = at_batch_one(corpus_dir / "wide_ensemble.onnx", tmp_path)
    folded, details = _fold(source, tmp_path)
    ops = _ops(folded)
    assert ops["MatMul"] + ops["Gemm"] <= 3
    assert ops["Conv"] == 3  # one grouped Conv per layer, 8 groups
    convs = [n for n in onnx.load(str(folded)).graph.node if n.op_type == "Conv"]
    assert all(helper.get_node_attr_value(n, "group") == 8 for n in convs)
    assert ops["Split"] == 1  # the chain is cut into branches once, at its end
    assert [f["reads"] for f in details["folds"]] == ["pack"] + ["direct"] * 7
    assert_same_outputs(source, folded)


def test_bert_qkv_projections_fold_into_one_matmul_add_split(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "bert_small.onnx"
    folded, details = _fold(source, tmp_path, fold_tolerance=0.05)  # a predicted cost within 5% is taken
    shapes = _initializer_shapes(folded)
    matmuls = [n for n in onnx.load(str(folded)).graph.node if n.op_type == "MatMul"]
    wide = [n for n in matmuls if shapes.get(n.input[1]) == (256, 768)]
    assert len(wide) == 4  # one per layer
    assert _ops(folded)["Split"] == 4
    assert len(matmuls) == len([n for n in onnx.load(str(source)).graph.node if n.op_type == "MatMul"]) - 8
    assert sorted(f["how"] for f in details["folds"]) == ["elementwise"] * 4 + ["shared-input"] * 4
    assert_same_outputs(source, folded)


def test_folds_that_cost_more_than_the_tolerance_are_refused_with_the_predicted_cost(
    corpus_dir: Path, tmp_path: Path
) -> None:
    _, details = _fold(corpus_dir / "bert_small.onnx", tmp_path)  # by default, nothing predicted to cost
    assert details["folds"] == []
    refused = details["refused"]
    assert len(refused) == 4
    assert all(min(r["predicted_gain_us"].values()) <= 0 and "copies" in r["reason"] for r in refused)
    # inception's folds would cut Splits out of onnxruntime's blocked Conv layout: refused by default
    _, details = _fold(corpus_dir / "inception_v1.onnx", tmp_path)
    assert details["folds"] == [] and len(details["refused"]) == 9


def test_inception_parallel_1x1_convs_fold(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "inception_v1.onnx"
    folded, details = _fold(source, tmp_path, fold_force=True)
    convs = [f for f in details["folds"] if f["op"] == "Conv"]
    assert len(convs) == 9 and all(f["how"] == "shared-input" and len(f["members"]) == 3 for f in convs)
    assert _ops(source)["Conv"] - _ops(folded)["Conv"] == 18
    assert_same_outputs(source, folded)


def test_every_original_output_is_found_through_the_fold_index(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "wide_ensemble.onnx"
    folded, details = _fold(source, tmp_path, fold_force=True)
    _assert_index_locates_outputs(source, folded, details)


def test_fold_index_of_concat_layouts(tmp_path: Path) -> None:
    model = _sibling_model(np.random.default_rng(3), widths=[3, 5, 2], branches=2, depth=2)
    path = tmp_path / "siblings.onnx"
    onnx.save(model, path)
    folded, details = _fold(path, tmp_path, fold_force=True)
    assert {f["layout"] for f in details["folds"]} == {"concat", "rows"}
    _assert_index_locates_outputs(path, folded, details)


def _with_all_outputs(path: Path, names: list[str]) -> onnx.ModelProto:
    model = onnx.load(str(path))
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in known)
    return model


def _assert_index_locates_outputs(source: Path, folded: Path, details: dict[str, Any]) -> None:
    original = onnx.load(str(source))
    names = [o for n in original.graph.node for o in n.output if o]
    feeds = make_feeds(original)
    expected = run_ort(_with_all_outputs(source, names), feeds)
    folds = {f["id"]: f for f in details["folds"]}
    kept = [n for n in names if n not in details["index"]]
    got = run_ort(_with_all_outputs(folded, kept + [f["tensor"] for f in folds.values()]), feeds)
    assert details["index"], "nothing folded"
    for name in names:
        if name not in details["index"]:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
            continue
        fold_id, position = details["index"][name]
        fold = folds[fold_id]
        tensor = got[fold["tensor"]]
        low, high = fold["ranges"][position]
        if fold["layout"] == "rows":
            piece = tensor[0, low:high, :, 0].T.reshape(expected[name].shape)
        else:
            piece = np.take(tensor, range(low, high), axis=fold["axis"])
        np.testing.assert_allclose(piece, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_siblings_inside_an_if_body_fold(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)

    def weight(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), name)

    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]) for i in range(3)]
        + [helper.make_node("Add", ["m0", "m1"], ["s"]), helper.make_node("Add", ["s", "m2"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [2, 5])],
        [weight(f"w{i}") for i in range(3)],
    )
    else_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w_else"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [2, 5])],
        [weight("w_else")],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        "if_siblings",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folded, details = _fold(model, tmp_path, fold_force=True)
    (fold,) = details["folds"]
    assert fold["graph"] == "then" and fold["how"] == "shared-input" and len(fold["members"]) == 3
    body = onnx.load(str(folded)).graph.node[0].attribute[0].g
    assert Counter(n.op_type for n in body.node)["MatMul"] == 1
    for cond in (True, False):
        feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32), "cond": np.array(cond)}
        np.testing.assert_allclose(run_ort(folded, feeds)["y"], run_ort(tmp_path / "model.onnx", feeds)["y"], rtol=1e-5)


# -- random graphs ----------------------------------------------------------------------------


def _sibling_model(rng: np.random.Generator, widths: list[int], branches: int, depth: int) -> onnx.ModelProto:
    """Shared-input siblings (MatMul + bias Add + Relu of different widths on one input) and
    ``branches`` stacked MLP branches of ``depth`` layers on inputs of one shape."""
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs: list[str] = []

    def weight(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    for i, width in enumerate(widths):
        nodes += [
            helper.make_node("MatMul", ["x", weight(f"w{i}", (4, width))], [f"m{i}"]),
            helper.make_node("Add", [weight(f"b{i}", (width,)), f"m{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"s{i}"]),
        ]
        outputs.append(f"s{i}")
    for branch in range(branches):
        current = f"y{branch}"
        for layer in range(depth):
            out = f"br{branch}_{layer}"
            nodes += [
                helper.make_node("MatMul", [current, weight(f"bw{branch}_{layer}", (6, 6))], [f"{out}_mm"]),
                helper.make_node("Add", [f"{out}_mm", weight(f"bb{branch}_{layer}", (6,))], [f"{out}_add"]),
                helper.make_node("Tanh", [f"{out}_add"], [out]),
            ]
            current = out
        outputs.append(current)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])]
    inputs += [helper.make_tensor_value_info(f"y{b}", TensorProto.FLOAT, ["batch", 6]) for b in range(branches)]
    graph = helper.make_graph(
        nodes, "siblings", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    widths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    branches=st.integers(0, 4),
    depth=st.integers(1, 3),
)
def test_random_sibling_groups_fold_with_equal_numerics(
    tmp_path: Path, seed: int, widths: list[int], branches: int, depth: int
) -> None:
    model = _sibling_model(np.random.default_rng(seed), widths, branches, depth)
    path = tmp_path / "random.onnx"
    onnx.save(model, path)
    folded, details = _fold(path, tmp_path, fold_force=True)
    groups = (len(widths) >= 2) + (branches >= 2)
    assert len({tuple(f["members"]) for f in details["folds"] if f["how"] != "elementwise"}) >= groups
    assert_same_outputs(path, folded)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), widths=st.lists(st.integers(1, 6), min_size=2, max_size=3))
def test_fold_then_the_default_pipeline_reaches_a_fixpoint(tmp_path: Path, seed: int, widths: list[int]) -> None:
    path = tmp_path / "random.onnx"
    onnx.save(_sibling_model(np.random.default_rng(seed), widths, 3, 2), path)
    first = optimize(path, fold_force=True, check=False)
    once = tmp_path / "once.onnx"
    graphopt.save(first.model, once)
    second = optimize(once, fold_force=True, check=False)
    assert not any(p["changed"] for p in second.report["passes"] if p["pass"] == "fold")
    assert second.report["summary"]["after"] == second.report["summary"]["before"]
    assert_same_outputs(path, once)


# -- options and the command line ------------------------------------------------------------


def test_fold_min_group_and_fold_ops_on_the_command_line(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "wide_ensemble.onnx"
    out = tmp_path / "out.onnx"
    result = invoke("run", source, "-o", out, "--passes", "shape-infer,fold", "--fold-min-group", "9", "--quiet")
    assert result.exit_code == 0, result.output
    assert _ops(out)["MatMul"] == 24
    result = invoke("run", source, "-o", out, "--passes", "shape-infer,fold", "--fold-ops", "MatMul", "--quiet")
    assert result.exit_code == 0, result.output
    # Without the Adds and Relus each MatMul fold packs and cuts on its own: not worth it.
    assert _ops(out)["MatMul"] == 24


def test_an_unknown_fold_op_is_reported(corpus_dir: Path) -> None:
    result = optimize(corpus_dir / "wide_ensemble.onnx", "shape-infer,fold", fold_ops=["Softmax"], check=False)
    (run,) = [p for p in result.report["passes"] if p["pass"] == "fold"]
    assert "cannot fold Softmax" in run["error"]


def test_fold_takes_or_refuses_by_the_calibrated_terms(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """costs.CALIBRATION scales the two terms of a prediction (kernels saved, copies spent):
    wide_ensemble's chain at batch 1, taken by default, is refused once its copies are scaled
    past its savings, and the refusal reports the scaled gain."""
    from graphopt.passes.fold import costs

    source = at_batch_one(corpus_dir / "wide_ensemble.onnx", tmp_path)
    _, details = _fold(source, tmp_path)
    assert len(details["folds"]) == 8 and details["refused"] == []
    monkeypatch.setattr(costs, "CALIBRATION", {level: (1.0, 100.0) for level in costs.LEVELS})
    _, details = _fold(source, tmp_path)
    (refused,) = details["refused"]
    assert details["folds"] == []
    assert all(gain < 0 for gain in refused["predicted_gain_us"].values())


# -- the batch the cost model prices ----------------------------------------------------------


def _stacked_mlps(batch: int | str, branches: int = 4, width: int = 128) -> onnx.ModelProto:
    """``branches`` MLPs (MatMul + bias Add + Relu, then MatMul + bias Add) on inputs of one
    shape [batch, width], summed: the stacked fold's family (wide_ensemble's)."""
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def constant(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(width)).astype(np.float32), name))
        return name

    for b in range(branches):
        nodes += [
            helper.make_node("MatMul", [f"x{b}", constant(f"w{b}_0", (width, width))], [f"m{b}_0"]),
            helper.make_node("Add", [f"m{b}_0", constant(f"b{b}_0", (width,))], [f"a{b}_0"]),
            helper.make_node("Relu", [f"a{b}_0"], [f"r{b}"]),
            helper.make_node("MatMul", [f"r{b}", constant(f"w{b}_1", (width, width))], [f"m{b}_1"]),
            helper.make_node("Add", [f"m{b}_1", constant(f"b{b}_1", (width,))], [f"y{b}"]),
        ]
    nodes.append(helper.make_node("Sum", [f"y{b}" for b in range(branches)], ["y"]))
    graph = helper.make_graph(
        nodes,
        "stacked_mlps",
        [helper.make_tensor_value_info(f"x{b}", TensorProto.FLOAT, [batch, width]) for b in range(branches)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_stacked_fold_is_refused_when_it_loses_at_a_batch_of_a_few_rows(tmp_path: Path) -> None:
    """A symbolic batch is priced at 1 and at 3: the grouped Conv of a stacked MatMul fold
    computes the rows as pixels, in strips of 16 in MLAS's GEMM, so at 3 rows it costs what 16
    do. Taken before, this fold ran 2.53x the unfolded model at batch 3 at ORT_DISABLE_ALL
    (1.17x at ORT_ENABLE_ALL). wide_ensemble at a fixed batch of 1 still folds (above)."""
    source = tmp_path / "dynamic.onnx"
    onnx.save(_stacked_mlps("batch"), source)
    folded, details = _fold(source, tmp_path)
    assert details["folds"] == []
    assert _ops(folded)["MatMul"] == 8 and _ops(folded)["Conv"] == 0
    (refused,) = details["refused"]
    assert refused["reason"] == "the folded kernels cost more than the kernels they replace at batch 3"
    assert refused["batch"] == 3 and refused["predicted_gain_us"]["ORT_DISABLE_ALL"] < 0
