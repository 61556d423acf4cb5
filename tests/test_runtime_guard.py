"""The runtime guard: a rewrite that costs onnxruntime a fusion it formed on the original is
undone (found by bisecting the rewrites that applied), and the report and the console say so.

Each case has a rule that costs a fusion: a test-only rule added through the fuse pass's API
(add_rule), or mul-conv as it was before it learned to leave a GELU's closing 0.5 alone. With
--no-runtime-guard the rewrite stays and onnxruntime's fusion is gone, so each test fails
without the guard.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.ir import Node
from graphopt.passes.fuse import Match, Rule, add_rule, const, op, optional, remove_rule, var
from graphopt.passes.fuse.rules import conv as conv_rules
from graphopt.passes.rewrite.engine import Site
from graphopt.runtime import census as census_module
from graphopt.runtime import guard as guard_module
from graphopt.runtime.census import Census, census_of_file
from graphopt.runtime.guard import undoable
from graphopt.schemas import schema
from tests.cli_helpers import at_batch_one, invoke

RNG = np.random.default_rng(0)


def _init(name: str, values: object) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.float32), name)


def gelu_before_conv(path: Path, channels: int = 4) -> Path:
    """Conv, the erf GELU as exporters write it (its closing 0.5 last), Conv: onnxruntime fuses
    the GELU into one Gelu kernel at ORT_ENABLE_ALL. Opset 17: no Gelu op to fuse it into."""
    c = channels
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["h", "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["g"]),
        helper.make_node("Conv", ["g", "w2", "b2"], ["y"]),
    ]
    weights = [
        _init("w1", RNG.standard_normal((c, c, 1, 1))),
        _init("b1", RNG.standard_normal(c)),
        _init("w2", RNG.standard_normal((c, c, 1, 1))),
        _init("b2", RNG.standard_normal(c)),
        _init("sqrt2", np.sqrt(2.0)),
        _init("one", 1.0),
        _init("half", 0.5),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _half_into_conv(b: object, m: Match, plan: object) -> object:
    """Conv(x * 0.5, W, B) -> Conv(x, W * 0.5, B): a rewrite that takes GELU's closing 0.5."""
    conv: Node = m.node("conv")
    weight = Site.array(m.value("w"))
    assert weight is not None
    inputs = [m.value("x"), b.constant(weight * np.float32(0.5), "half_weight"), *conv.inputs[2:]]  # type: ignore[attr-defined]
    return b.op("Conv", *inputs, **dict(conv.attributes))  # type: ignore[attr-defined]


HALF_INTO_CONV = Rule(
    name="test-half-into-conv",
    family="test",
    pattern=op.Conv(op.Mul(var("x"), const(0.5)), const(name="w"), optional(var("b")), name="conv"),
    build=_half_into_conv,
)


@pytest.fixture
def half_into_conv() -> Iterator[Rule]:
    add_rule(HALF_INTO_CONV)
    yield HALF_INTO_CONV
    remove_rule(HALF_INTO_CONV.name)


def _report(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())


def _ops(path: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


def test_a_rule_that_costs_the_gelu_fusion_is_undone(tmp_path: Path, half_into_conv: Rule) -> None:
    source = gelu_before_conv(tmp_path / "m.onnx")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    result = invoke("run", source, "-o", out, "--report", report)
    assert result.exit_code == 0, result.stderr
    guard = _report(report)["runtime_guard"]
    assert guard["status"] == "undone"  # type: ignore[index]
    (undone,) = guard["undone"]  # type: ignore[index]
    assert (undone["pass"], undone["rule"], undone["kind"], undone["before"], undone["after"]) == (
        "fuse",
        "test-half-into-conv",
        "Gelu",
        1,
        0,
    )
    assert undone["at"] == "g"  # the GELU's output in the original
    assert guard["census"]["output"]["Gelu"] == 1  # type: ignore[index]
    assert (
        "ort fusion kept: the rule test-half-into-conv was undone because onnxruntime no longer forms Gelu at g"
        in result.stderr
    )
    assert _ops(out)["Mul"] == 2  # the closing 0.5 stays
    assert census_of_file(out).count("Gelu") == 1
    jsonschema.validate(_report(report), schema("report"))
    # The report's pipeline is the one that ran: the rule disabled on every fuse step.
    fuse_steps = [s for g in _report(report)["pipeline"] if "steps" in g for s in g["steps"] if s["pass"] == "fuse"]  # type: ignore[attr-defined, index]
    assert fuse_steps and all("test-half-into-conv" in s["options"]["disable"] for s in fuse_steps)


def test_without_the_guard_the_rule_costs_the_fusion(tmp_path: Path, half_into_conv: Rule) -> None:
    source = gelu_before_conv(tmp_path / "m.onnx")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    result = invoke("run", source, "-o", out, "--report", report, "--no-runtime-guard")
    assert result.exit_code == 0, result.stderr
    assert "runtime_guard" not in _report(report)
    assert "runtime guard" not in result.stderr
    assert _ops(out)["Mul"] == 1
    assert census_of_file(out).count("Gelu") == 0


def test_the_actual_mul_conv_rule_without_its_gelu_check_is_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mul-conv before 1750151 folded the closing 0.5 into the Conv (convnext measured slower):
    the guard finds it with no code about GELU."""
    monkeypatch.setattr(conv_rules, "awaits_a_gelu_half", lambda value: False)
    source = gelu_before_conv(tmp_path / "m.onnx", channels=8)
    unguarded = graphopt.optimize(source, runtime_guard=False)
    assert unguarded.model.graph.nodes and sum(n.op_type == "Mul" for n in unguarded.model.graph.nodes) == 1
    result = graphopt.optimize(source)
    guard = result.report["runtime_guard"]
    assert [(u.get("rule"), u["kind"]) for u in guard["undone"]] == [("mul-conv", "Gelu")]
    assert sum(n.op_type == "Mul" for n in result.model.graph.nodes) == 2
    assert guard["reruns"] >= 1 and result.report["seconds"]["runtime_guard"] > 0


def relu_conv(path: Path) -> Path:
    """Relu(Conv(x)): onnxruntime fuses it into one Conv kernel with the activation."""
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["h"], ["y"])],
        "relu_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])],
        [_init("w", RNG.standard_normal((3, 3, 3, 3))), _init("b", RNG.standard_normal(3))],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


RELU_AS_MAX = Rule(
    name="test-relu-as-max",
    family="test",
    pattern=op.Relu(var("x")),
    build=lambda b, m, plan: b.op("Max", m.value("x"), b.constant(np.zeros((), np.float32))),
)


def test_fused_conv_lost_names_the_rule_and_the_site(tmp_path: Path) -> None:
    source = relu_conv(tmp_path / "m.onnx")
    add_rule(RELU_AS_MAX)
    try:
        unguarded = graphopt.optimize(source, runtime_guard=False)
        result = graphopt.optimize(source)
    finally:
        remove_rule(RELU_AS_MAX.name)
    assert [n.op_type for n in unguarded.model.graph.nodes] == ["Conv", "Max"]
    assert [n.op_type for n in result.model.graph.nodes] == ["Conv", "Relu"]
    (undone,) = result.report["runtime_guard"]["undone"]
    assert undone["message"] == (
        "ort fusion kept: the rule test-relu-as-max was undone because onnxruntime no longer forms FusedConv at y"
        " (1 -> 0)"
    )


def test_a_run_with_nothing_lost_says_so(tmp_path: Path) -> None:
    source = gelu_before_conv(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    result = invoke("run", source, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    guard = json.loads(result.stdout)["runtime_guard"]
    assert guard["status"] == "kept" and guard["undone"] == [] and guard["reruns"] == 0
    assert guard["census"]["original"] == guard["census"]["output"]
    assert "runtime guard: onnxruntime fuses the output as it fused the original" in result.stderr


def test_the_output_is_saved_once_and_its_census_read_from_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's census of the output loads the file the run writes (a save of its own cost
    resnet18 a second 45 MB write): onnxruntime sees the original and the staged output."""
    source = relu_conv(tmp_path / "m.onnx")
    loaded = tmp_path / "loaded.txt"

    def census(path: object, names: object = None) -> Census:  # in the census children: a file keeps the record
        with loaded.open("a") as record:
            record.write(f"{path}\n")
        return Census()

    monkeypatch.setattr(guard_module, "census_of_file", census)
    out = tmp_path / "out" / "o.onnx"
    result = invoke("run", source, "-o", out, "--no-check")
    assert result.exit_code == 0, result.stderr
    paths = sorted(Path(line) for line in loaded.read_text().splitlines())
    assert paths[0] == source
    assert paths[1].name == "o.onnx" and paths[1].parent.parent.parent == out.parent  # the staged output
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx"]
    # The API's run: the census reads the file the numerics check reads.
    loaded.unlink()
    assert graphopt.optimize(source).numerics.status == "passed"  # type: ignore[union-attr]
    assert sorted(Path(line).name for line in loaded.read_text().splitlines()) == ["m.onnx", "optimized.onnx"]


def test_an_undone_rewrite_leaves_one_weights_file(tmp_path: Path, half_into_conv: Rule) -> None:
    """The output is saved before the guard's census and again once a rewrite is undone: the
    first save's weights (named after their contents) are not committed beside the second's."""
    source = gelu_before_conv(tmp_path / "m.onnx", channels=32)  # weights of 4 KB: external
    out = tmp_path / "out" / "o.onnx"
    result = invoke("run", source, "-o", out, "--external-data", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["runtime_guard"]["status"] == "undone"
    written = sorted(p.name for p in out.parent.iterdir())
    assert len(written) == 2 and written[0] == "o.onnx" and written[1].endswith(".data"), written
    assert _ops(out)["Mul"] == 2  # the undone rule's output, not the first save's
    assert census_of_file(out).count("Gelu") == 1


def test_the_census_writes_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime saves the runtime graph the census reads; its weights, never read, go to the
    null device rather than to disk (gpt2's 22 MB cost its census 0.09 s of 0.26)."""
    source = gelu_before_conv(tmp_path / "m.onnx", channels=128)  # 2 x 64 KB of weights
    kept = tmp_path / "census"

    @contextlib.contextmanager
    def folder() -> Iterator[Path]:
        kept.mkdir()
        yield kept

    monkeypatch.setattr(census_module, "scratch_folder", folder)
    assert census_of_file(source).count("Gelu") == 1
    written = [p for p in kept.iterdir() if p.is_file() and not p.is_symlink()]
    assert [p.name for p in written] == ["runtime.onnx"]
    assert written[0].stat().st_size < 4096


def test_only_the_default_pipeline_is_guarded(tmp_path: Path) -> None:
    source = gelu_before_conv(tmp_path / "m.onnx")
    assert "runtime_guard" not in graphopt.optimize(source, "shape-infer,cleanup").report
    assert "runtime_guard" not in graphopt.optimize(source, runtime_guard=False).report
    assert graphopt.optimize(source, target="ort").report["runtime_guard"]["status"] == "kept"


def test_a_model_onnxruntime_cannot_load_is_not_guarded(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Mystery", ["h"], ["y"], domain="com.example")],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    source = tmp_path / "m.onnx"
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    onnx.save(proto, source)
    guard = graphopt.optimize(source).report["runtime_guard"]
    assert guard["status"] == "not taken"
    assert guard["reason"].startswith("the original: onnxruntime cannot load it at ORT_ENABLE_ALL: ")


def _requantized_pool(path: Path) -> Path:
    """x -> Q -> DQ -> MaxPool -> Q -> DQ -> Relu at opset 23, int8: every value between ops quantized."""
    grid = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"), numpy_helper.from_array(np.int8(0), "zero")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"]),
        helper.make_node("MaxPool", ["xd"], ["r"], kernel_shape=[2]),
        helper.make_node("QuantizeLinear", ["r", "scale", "zero"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "scale", "zero"], ["rd"]),
        helper.make_node("Relu", ["rd"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "requantized_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 7])],
        grid,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    return path


# Drops the Q/DQ pair after a MaxPool of dequantized values (exact: the largest of a window stays on the grid).
# onnxruntime then propagates the first pair over the MaxPool itself, and at opset 21 and up the QuantizeLinear it
# inserts for an int8 grid refuses to load (onnxruntime 1.32; llama_ts_qdq's rotary fusion at --target-opset 23
# tripped it the same way across a Reshape, which qdq-dequantize-after-move now repairs; a MaxPool it leaves).
UNQUANTIZED_POOL = Rule(
    name="test-unquantized-pool",
    family="test",
    pattern=op.DequantizeLinear(
        op.QuantizeLinear(op.MaxPool(var("x"), name="pool"), var("scale"), var("zero")), var("scale"), var("zero")
    ),
    build=lambda b, m, plan: b.op("MaxPool", m.value("x"), kernel_shape=[2]),
)


def test_a_rewrite_whose_output_onnxruntime_cannot_load_is_undone(tmp_path: Path) -> None:
    source = _requantized_pool(tmp_path / "m.onnx")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    add_rule(UNQUANTIZED_POOL)
    try:
        unguarded = graphopt.optimize(source, runtime_guard=False)
        result = invoke("run", source, "-o", out, "--report", report)
    finally:
        remove_rule(UNQUANTIZED_POOL.name)
    assert [n.op_type for n in unguarded.model.graph.nodes].count("QuantizeLinear") == 1
    assert result.exit_code == 0, result.stderr
    guard = _report(report)["runtime_guard"]
    assert guard["status"] == "undone"  # type: ignore[index]
    (undone,) = guard["undone"]  # type: ignore[index]
    assert (undone["rule"], undone["kind"]) == ("test-unquantized-pool", "session")
    assert "ort session kept: the rule test-unquantized-pool was undone because onnxruntime cannot load it" in (
        result.stderr
    )
    assert _ops(out)["QuantizeLinear"] == 2
    census_of_file(out)  # onnxruntime loads it at ORT_ENABLE_ALL
    jsonschema.validate(_report(report), schema("report"))


def _int8_before_a_max_pool(path: Path, reached: bool = True) -> Path:
    """x quantized to int8, dequantized, max-pooled, negated, at opset 20 (``reached``: else x goes through
    Relu(-|x|) first, 0 everywhere, so that the check says "not checked")."""
    grid = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"), numpy_helper.from_array(np.int8(3), "zero")]
    unreached = [
        helper.make_node("Abs", ["x"], ["magnitude"]),
        helper.make_node("Neg", ["magnitude"], ["negative"]),
        helper.make_node("Relu", ["negative"], ["zeros"]),
    ]
    nodes = [
        *([] if reached else unreached),
        helper.make_node("QuantizeLinear", ["x" if reached else "zeros", "scale", "zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"]),
        helper.make_node("MaxPool", ["xd"], ["pooled"], kernel_shape=[2, 2]),
        helper.make_node("Neg", ["pooled"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pooled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 7, 7])],
        grid,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def test_an_output_onnxruntime_cannot_load_that_no_rewrite_explains_is_a_warning(tmp_path: Path) -> None:
    # An int8 DequantizeLinear before a MaxPool at opset 21: onnxruntime 1.32 carries it across and fails to load
    # ("output_dtype INT8 does not match y_zero_point type UINT8"); the opset the user asked for trips it, no rewrite.
    source, out = _int8_before_a_max_pool(tmp_path / "m.onnx"), tmp_path / "out.onnx"
    census_of_file(source)
    result = invoke("run", source, "--target-opset", "21", "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    assert (
        f"graphopt: warning: {source}: the output is written, but onnxruntime cannot load it at ORT_ENABLE_ALL"
        in result.stderr
    )
    assert "UINT8; no rewrite of the pipeline explains it" in result.stderr
    with pytest.raises(Exception, match="output_dtype INT8 does not match y_zero_point type UINT8"):
        census_of_file(out)


def test_an_unloadable_output_that_is_not_written_gets_no_warning(tmp_path: Path) -> None:
    source, out = _int8_before_a_max_pool(tmp_path / "m.onnx", reached=False), tmp_path / "out.onnx"
    result = invoke("run", source, "--target-opset", "21", "-o", out, "-q", "--require-check")
    assert result.exit_code == 1, result.stderr
    assert "numerics not checked (--require-check)" in result.stderr
    assert "the output is written" not in result.stderr and not out.exists()


def test_a_rotary_or_attention_fused_through_qdq_takes_the_integer_kernels_it_replaces() -> None:
    # The TorchScript QDQ Llamas: each RotaryEmbedding written through Q/DQ takes Muls and an Add onnxruntime ran as
    # QLinearMul and QLinearAdd, each attention its scale's QLinearMul and its MatMuls' QLinearMatMul (25 -> 13
    # with 8 rotaries and 4 attentions; Phi-3's 29 -> 13). Counted lost, the guard undid cse and dce for them (908
    # nodes where 796 run; Phi-3 at --target ort 973 where 528 run, 1.05x the variant's time against 0.72x).
    sites = [f"q{i}" for i in range(8)]
    fused = Census({"QLinear": sites[:1], "RotaryEmbedding": ["r"], "Attention": ["a"]})
    assert census_module.losses(Census({"QLinear": sites[:7]}), fused) == []
    (lost,) = census_module.losses(Census({"QLinear": sites}), fused)
    assert (lost.kind, lost.before, lost.after) == ("QLinear", 8, 1)


def test_a_failed_check_writes_nothing_with_the_guard_on(tmp_path: Path) -> None:
    """The guard keeps a rewrite that costs no fusion, here a wrong one: the check still fails
    the run, and neither the model nor the census's files are left behind."""
    source = gelu_before_conv(tmp_path / "m.onnx")
    out = tmp_path / "out" / "m.onnx"
    add_rule(DOUBLES_A_CONV)
    try:
        result = invoke("run", source, "-o", out, "--json")
    finally:
        remove_rule(DOUBLES_A_CONV.name)
    assert result.exit_code == 1, result.stderr
    assert json.loads(result.stdout)["runtime_guard"]["status"] == "kept"
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def _doubled(b: object, m: Match, plan: object) -> object:
    conv: Node = m.node("conv")
    weight = Site.array(m.value("w"))
    assert weight is not None
    return b.op("Conv", m.value("x"), b.constant(weight * np.float32(2), "doubled"), *conv.inputs[2:])  # type: ignore[attr-defined]


DOUBLES_A_CONV = Rule(
    name="test-doubles-a-conv",
    family="test",
    pattern=op.Conv(var("x", lambda v: v.producer is None), const(name="w"), optional(var("b")), name="conv"),
    build=_doubled,
)


def test_skip_layer_normalization_is_counted_not_guarded(tmp_path: Path) -> None:
    """onnxruntime's CPU SkipLayerNormalization measured slower than the Add and the norm it
    replaces, and layernorm-residual-sum keeps it from forming: the guard must not undo that."""
    hidden = 16
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["a"]),
            helper.make_node("Add", ["a", "x"], ["sum"]),
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1),
        ],
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, hidden])],
        [
            _init("w", RNG.standard_normal((hidden, hidden))),
            _init("gamma", np.ones(hidden)),
            _init("beta", np.zeros(hidden)),
        ],
    )
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    result = graphopt.optimize(source)
    guard = result.report["runtime_guard"]
    assert guard["census"]["original"]["SkipLayerNormalization"] == 1
    assert "SkipLayerNormalization" not in guard["census"]["output"]
    assert guard["status"] == "kept" and guard["undone"] == []
    assert "Sum" in [n.op_type for n in result.model.graph.nodes]


def test_a_loss_no_rewrite_explains_costs_one_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving out every rewrite first: a kind lost however the pipeline runs is reported after
    one rerun, not after a bisection over the rewrites that applied."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["i"]),
            helper.make_node("Add", ["one", "one"], ["two"]),
            helper.make_node("Mul", ["i", "two"], ["m"]),
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        "rewrites",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [_init("one", 1.0)],
    )
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)

    def census(path: object, names: object = None) -> Census:  # the original alone has a Gelu kernel
        return Census({"Gelu": ["g"]} if Path(str(path)) == source else {})

    monkeypatch.setattr(guard_module, "census_of_file", census)  # the census children are forked
    guard = graphopt.optimize(source, check=False).report["runtime_guard"]
    assert len(undoable(graphopt.optimize(source, check=False, runtime_guard=False).pipeline_run.runs)) >= 2
    assert guard["status"] == "lost" and guard["reruns"] == 1
    (lost,) = guard["lost"]
    assert lost["message"] == (
        "ort fusion lost: onnxruntime no longer forms Gelu at g (1 -> 0); no rewrite of the pipeline explains it"
    )


def test_a_loss_kept_for_a_fusion_it_brings_names_the_rewrite(corpus_dir: Path, tmp_path: Path) -> None:
    """fold batches the ensemble's Gemm + Relu branches (at batch 1, where it folds), which
    onnxruntime fused one by one, into Convs it fuses instead: undoing fold would cost those, so
    it stays, and the message says so rather than that no rewrite explains the loss."""
    source = at_batch_one(corpus_dir / "wide_ensemble.onnx", tmp_path)
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "--no-check", "--json")
    assert result.exit_code == 0, result.stderr
    guard = json.loads(result.stdout)["runtime_guard"]
    assert guard["status"] == "lost" and guard["undone"] == []
    # Every rewrite left out, 3 to bisect the 5 that applied, fold alone: what fold alone keeps
    # is its trade's, searched past no further (a sixth rerun left out all but fold).
    assert guard["reruns"] == 5
    messages = [loss["message"] for loss in guard["lost"]]
    assert messages[0].startswith("ort fusion lost: onnxruntime no longer forms FusedGemm at ")
    assert (
        "; the pass fold costs it and stays, since without it onnxruntime no longer forms FusedConv at " in messages[0]
    )
    assert messages[1:] == [
        "ort fusion lost: onnxruntime adds NCHWc reorders at Relu_out_1 (0 -> 2); no rewrite explains it but the pass"
        " fold, which stays"
    ]
    assert messages[0] in result.stderr


def test_a_fusion_on_dead_nodes_is_no_fusion_to_keep(tmp_path: Path) -> None:
    """onnxruntime fuses a Transpose into a MatMul no output reads (it runs dead nodes as they
    are): dce removing them costs nothing, so the guard keeps dce (it undid cse, dce and noop,
    and the next run's output differed: no fixpoint)."""
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
            helper.make_node("MatMul", ["t", "w"], ["dead"]),
            helper.make_node("Relu", ["x"], ["y"]),
        ],
        "dead_fusion",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [_init("w", RNG.standard_normal((2, 3)))],
    )
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    result = graphopt.optimize(source, check=False)
    guard = result.report["runtime_guard"]
    assert guard["status"] == "kept" and guard["census"]["original"] == {}, guard
    assert [n.op_type for n in result.model.graph.nodes] == ["Relu"]
    again = graphopt.optimize(result.model, check=False).model
    assert [n.op_type for n in again.graph.nodes] == ["Relu"]


def test_a_census_killed_with_graphopt_leaves_nothing_after_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A census's child dies with graphopt (SIGKILL), before its own cleanup: the next census removes what it left
    in the temporary folder (the test suite's killed runs left about 90 such folders in /tmp per run)."""
    import tempfile
    import time

    import onnxruntime

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    source = gelu_before_conv(tmp_path / "m.onnx")
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *args, **kwargs: time.sleep(60))  # forked with it
    child = guard_module._start_censuses([(source, set())])
    deadline = time.monotonic() + 30
    while not any(scratch.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.cancel()  # as the kernel kills it with graphopt
    assert list(scratch.iterdir())  # its folders stay
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert census_of_file(source).count("Gelu") == 1
    assert list(scratch.iterdir()) == []
