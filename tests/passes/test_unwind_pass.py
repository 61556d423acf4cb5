"""The unwind pass on ONNX models: fewer Transposes, the same numbers, and no change where
there is nothing to gain."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.io import json_write
from graphopt.ir.clone import clone_model
from graphopt.passes.base import PassContext, get_pass
from graphopt.passes.pipeline import pipeline_from_names
from graphopt.settings import Settings
from tests.cli_helpers import invoke
from tests.numerics import make_feeds, run_ort
from tests.passes.test_unwind_problem import evaluation_json, graph_with_layout


def transposes(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "Transpose" for node in model.graph.node)


def run_unwind(model: graphopt.ir.Model, **options: object) -> dict:
    result = get_pass("unwind").from_config(options).run(model, PassContext(Settings()))
    model.graph.verify()
    return {"changed": result.changed, **result.details}


def same_json(a: graphopt.ir.Model, b: graphopt.ir.Model, tmp_path: Path) -> bool:
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    json_write.save(a, tmp_path / "a" / "m.json")
    json_write.save(b, tmp_path / "b" / "m.json")
    return (tmp_path / "a" / "m.json").read_text() == (tmp_path / "b" / "m.json").read_text()


def test_tf_style_nhwc_keeps_only_the_input_transpose(corpus_dir: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    result = invoke("run", corpus_dir / "tf_style_nhwc.onnx", "-o", out, "--passes", "unwind", "--report", report)
    assert result.exit_code == 0, result.output
    written = onnx.load(out)
    onnx.checker.check_model(written, full_check=True)
    assert transposes(onnx.load(corpus_dir / "tf_style_nhwc.onnx")) == 28
    assert transposes(written) == 1
    data = json.loads(report.read_text())
    assert data["numerics"]["status"] == "passed"
    details = data["passes"][0]["details"]
    assert details["transposes"] == [28, 1]
    assert details["objective"] <= details["upper_bound"] and details["solver"] == "default"


def test_tf_style_nhwc_with_input_relayout_has_no_transpose(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "tf_style_nhwc.onnx"
    model = graphopt.load(source)
    details = run_unwind(model, allow_input_relayout=True)
    assert details["transposes"] == [28, 0]
    assert details["relaid_inputs"] == {"input_1": {"layout": [0, 3, 1, 2], "shape": ["unk__0", 3, 64, 64]}}
    graphopt.save(model, tmp_path / "out.onnx")
    written = onnx.load(tmp_path / "out.onnx")
    assert transposes(written) == 0
    feeds = make_feeds(onnx.load(source))
    expected = run_ort(source, feeds)
    got = run_ort(tmp_path / "out.onnx", {"input_1": feeds["input_1"].transpose(0, 3, 1, 2)})
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "before"),
    [
        ("bert_small", "shape-infer"),
        ("gpt2_small", "shape-infer"),
        ("bert_small", ""),
        ("wide_ensemble", ""),
        ("inception_v1", ""),
        pytest.param("resnet50", "", marks=pytest.mark.slow),
        pytest.param("bert_fp16_weights", "shape-infer", marks=pytest.mark.slow),
    ],
)
def test_models_without_a_layout_problem_are_unchanged(
    corpus_dir: Path, tmp_path: Path, name: str, before: str
) -> None:
    model = graphopt.load(corpus_dir / f"{name}.onnx")
    if before:
        pipeline_from_names(before).run(model)
    original = clone_model(model)
    details = run_unwind(model)
    assert not details["changed"]
    assert same_json(original, model, tmp_path)


def _save(graph: onnx.GraphProto, path: Path, opset: int = 18) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _unwind_file(source: Path, tmp_path: Path, before: str = "", **options: object) -> tuple[onnx.ModelProto, dict]:
    model = graphopt.load(source)
    if before:
        pipeline_from_names(before).run(model)
    details = run_unwind(model, **options)
    graphopt.save(model, tmp_path / "out.onnx")
    written = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(written, full_check=True)
    feeds = make_feeds(onnx.load(source))
    expected, got = run_ort(source, feeds), run_ort(tmp_path / "out.onnx", feeds)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
    return written, details


def test_attention_head_split_keeps_its_semantic_transposes(tmp_path: Path) -> None:
    b, s, h, d = 2, 5, 4, 8
    nodes = [
        helper.make_node("Reshape", ["x", "heads"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["q4"], ["k"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["q", "k"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "q"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merged"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, h * d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, h * d])],
        [
            numpy_helper.from_array(np.array([b, s, h, d], dtype=np.int64), "heads"),
            numpy_helper.from_array(np.array([b, s, h * d], dtype=np.int64), "merged"),
        ],
    )
    source = _save(graph, tmp_path / "attention.onnx")
    model = graphopt.load(source)
    pipeline_from_names("shape-infer").run(model)
    original = clone_model(model)
    details = run_unwind(model)
    assert details["transposes"] == [3, 3] and not details["changed"]
    assert same_json(original, model, tmp_path)


def _nhwc_graph_with_axes_ops() -> onnx.GraphProto:
    rng = np.random.default_rng(0)
    c = 3
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["x_nchw", "w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["conv"], ["conv_nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Mul", ["conv_nhwc", "scale"], ["scaled"]),
        helper.make_node("Sigmoid", ["scaled"], ["act"]),
        helper.make_node("Concat", ["act", "scaled"], ["cat"], axis=3),
        helper.make_node("Softmax", ["cat"], ["soft"], axis=3),
        helper.make_node("ReduceMax", ["soft", "hw"], ["pooled"], keepdims=1),
        helper.make_node("Add", ["soft", "pooled"], ["summed"]),
        helper.make_node("Transpose", ["summed"], ["summed_nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["summed_nchw", "w2"], ["conv2"]),
        helper.make_node("Transpose", ["conv2"], ["out_nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("ReduceMean", ["out_nhwc", "hw"], ["y"], keepdims=0),
    ]
    return helper.make_graph(
        nodes,
        "nhwc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6, 5, c])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("act", TensorProto.FLOAT, ["n", 6, 5, 4]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((4, c, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "scale"),
            numpy_helper.from_array(np.array([1, 2], dtype=np.int64), "hw"),
            numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32), "w2"),
        ],
    )


def test_nhwc_graph_with_axes_ops_loses_its_transposes(tmp_path: Path) -> None:
    """Transposes around Convs, with Concat, Softmax, reductions (axes as an input at opset
    18, with and without keepdims), broadcast constants and a graph output in between."""
    source = _save(_nhwc_graph_with_axes_ops(), tmp_path / "nhwc.onnx")
    written, details = _unwind_file(source, tmp_path)
    # The input's Transpose stays, and the graph output `act` is converted back to NHWC.
    assert details["transposes"] == [4, 2]
    assert transposes(written) == 2
    assert [o.name for o in written.graph.output] == ["y", "act"]
    assert {t.name for t in written.graph.initializer} >= {"w", "w2"}
    assert "hw" not in {t.name for t in written.graph.initializer}  # both reductions read renumbered axes


def test_the_nhwc_profile_keeps_numerics(tmp_path: Path) -> None:
    """Under a channels-last profile the Convs' outputs flow on in NHWC: the Transposes that
    carry them are made before their first reader, and the numbers stay."""
    source = _save(_nhwc_graph_with_axes_ops(), tmp_path / "nhwc.onnx")
    written, details = _unwind_file(source, tmp_path, profile="nhwc")
    assert details["transposes"][1] == transposes(written)


def test_a_constant_node_read_only_by_a_transpose_is_re_laid_out(tmp_path: Path) -> None:
    nodes = [
        helper.make_node(
            "Constant", [], ["c"], value=numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))
        ),
        helper.make_node("Transpose", ["c"], ["ct"], perm=[1, 0]),
        helper.make_node("Add", ["x", "ct"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
    )
    written, details = _unwind_file(_save(graph, tmp_path / "constant.onnx"), tmp_path, "shape-infer")
    assert details["transposes"] == [1, 0]
    assert [n.op_type for n in written.graph.node] == ["Add"]


def test_transposes_that_cancel_around_elementwise_ops_go(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Add", ["r", "bias"], ["a"]),
        helper.make_node("Transpose", ["a"], ["y"], perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "cancel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
        [numpy_helper.from_array(np.arange(3, dtype=np.float32), "bias")],
    )
    written, details = _unwind_file(_save(graph, tmp_path / "cancel.onnx"), tmp_path)
    assert details["transposes"] == [2, 0] and transposes(written) == 0


def test_run_reports_the_solution_of_a_json_graphs_layout_section(tmp_path: Path) -> None:
    graph = graph_with_layout()
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    report = tmp_path / "report.json"
    result = invoke("run", path, "-o", tmp_path / "out.json", "--passes", "unwind", "--report", report, "--no-check")
    assert result.exit_code == 0, result.output
    details = json.loads(report.read_text())["passes"][0]["details"]
    assert details["layout_solution"]["objective"] == 85
    assert json.loads((tmp_path / "out.json").read_text())["layout"] == evaluation_json()


def test_the_pass_and_its_options_are_listed() -> None:
    result = invoke("passes", "--json")
    assert result.exit_code == 0
    listed = {p["name"]: p for p in json.loads(result.stdout)["passes"]}
    options = {o["name"] for o in listed["unwind"]["options"]}
    assert options == {"solver", "time_budget", "profile", "allow_input_relayout"}


def _relayout_config(tmp_path: Path) -> Path:
    config = tmp_path / "relayout.toml"
    config.write_text('[settings]\nallow_input_relayout = true\n\n[[pipeline]]\npass = "unwind"\n')
    return config


def test_run_with_input_relayout_checks_numerics_on_transposed_inputs(corpus_dir: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    config = _relayout_config(tmp_path)
    result = invoke("run", corpus_dir / "tf_style_nhwc.onnx", "-o", out, "--config", config, "--report", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["numerics"]["status"] == "passed", data["numerics"]
    assert data["passes"][0]["details"]["relaid_inputs"]["input_1"]["layout"] == [0, 3, 1, 2]
    assert transposes(onnx.load(out)) == 0
    # the same from the command line, with the default pipeline
    flagged = invoke("run", corpus_dir / "tf_style_nhwc.onnx", "-o", tmp_path / "flag.onnx", "--allow-input-relayout")
    assert flagged.exit_code == 0, flagged.output
    assert transposes(onnx.load(tmp_path / "flag.onnx")) == 0


def test_the_check_still_catches_a_relaid_model_that_computes_otherwise(corpus_dir: Path, tmp_path: Path) -> None:
    """The relaid input's feed is transposed for the optimized model only: a model whose
    input was re-laid out with the wrong permutation fails the check."""
    from graphopt.numerics import check_models

    source = corpus_dir / "tf_style_nhwc.onnx"
    model = graphopt.load(source)
    details = run_unwind(model, allow_input_relayout=True)
    graphopt.save(model, tmp_path / "relaid.onnx")
    layout = details["relaid_inputs"]["input_1"]["layout"]
    assert check_models(source, tmp_path / "relaid.onnx", input_layouts={"input_1": layout}).status == "passed"
    # (0, 3, 2, 1) gives the same shape only for a square image: H and W swapped.
    wrong = check_models(source, tmp_path / "relaid.onnx", input_layouts={"input_1": [0, 3, 2, 1]})
    assert wrong.status == "failed"
    unchecked = check_models(source, tmp_path / "relaid.onnx")
    assert unchecked.status == "failed" and "failed to run" in (unchecked.reason or "")


@pytest.mark.parametrize(
    ("layouts", "message"),
    [({"nope": [0, 1, 2, 3]}, "no input 'nope'"), ({"input_1": [0, 1, 1, 2]}, "no permutation")],
)
def test_input_layouts_that_do_not_fit_the_model_are_bad_input(
    corpus_dir: Path, layouts: dict[str, list[int]], message: str
) -> None:
    from graphopt.errors import InputError
    from graphopt.numerics import check_models

    source = corpus_dir / "tf_style_nhwc.onnx"
    with pytest.raises(InputError, match=message):
        check_models(source, source, input_layouts=layouts)


def test_input_layouts_of_passes_compose_in_run_order() -> None:
    from graphopt.ir.stats import ModelStats
    from graphopt.passes.pipeline import PassRun
    from graphopt.runner import input_layouts

    empty = ModelStats(0, 0, 0, {})

    def run(details: dict) -> PassRun:
        return PassRun("unwind", None, 0, 0.0, empty, empty, True, details)

    runs = [
        run({"relaid_inputs": {"x": {"layout": [0, 2, 3, 1]}}}),
        run({}),
        run({"relaid_inputs": {"x": {"layout": [1, 0, 3, 2]}, "y": {"layout": [1, 0]}}}),
    ]
    x = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    layouts = input_layouts(runs)
    assert np.array_equal(x.transpose(layouts["x"]), x.transpose(0, 2, 3, 1).transpose(1, 0, 3, 2))
    assert layouts["y"] == (1, 0)


def test_default_pipeline_on_tf_style_nhwc_keeps_numerics(corpus_dir: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    result = invoke("run", corpus_dir / "tf_style_nhwc.onnx", "-o", out, "--report", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["numerics"]["status"] == "passed"
    assert "unwind" in [p["pass"] for p in data["passes"]]
    assert transposes(onnx.load(out)) == 1


def test_a_transpose_whose_perm_does_not_fit_its_input_is_left_alone(tmp_path: Path) -> None:
    """onnxruntime rejects such a model; the pass must neither fail on it nor touch it."""
    node = helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 2])
    graph = helper.make_graph(
        [node],
        "bad-perm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    model = graphopt.load(path)
    original = clone_model(model)
    details = run_unwind(model)
    assert not details["changed"] and same_json(original, model, tmp_path)
