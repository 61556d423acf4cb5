"""The pipeline: configs, groups to a fixpoint, max_steps, and rollback of failing passes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import pytest

from graphopt.errors import InputError
from graphopt.ir import DataType, Graph, Model, Node, TensorType, Value
from graphopt.passes.base import Pass, PassContext, PassResult, get_pass, option_specs, register
from graphopt.passes.pipeline import Group, Pipeline, default_pipeline, load_pipeline_config, pipeline_from_names


def _relu_chain(length: int) -> Model:
    x = Value("x", TensorType(DataType.FLOAT, (2,)))
    nodes, current = [], x
    for i in range(length):
        node = Node("Relu", [current], [f"r{i}"])
        nodes.append(node)
        current = node.outputs[0]
    return Model(Graph([x], [current], nodes))


@register
class _PopOne(Pass):
    """Removes the last node, one per run (a pass that needs several group iterations)."""

    name = "test-pop-one"
    description = "Bypass the last Relu"

    @dataclass
    class Options:
        keep: int = field(default=1, metadata={"help": "Relus to keep"})

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        if len(graph) <= self.options.keep:
            return PassResult(False)
        last = graph.topological()[-1]
        last.outputs[0].replace_all_uses_with(last.inputs[0], outputs=True)  # type: ignore[arg-type]
        graph.remove(last)
        return PassResult(True, {"removed": 1})


@register
class _Vandal(Pass):
    name = "test-vandal"
    description = "Wrecks the graph, then raises"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        model.graph.remove(model.graph.nodes, safe=False)
        model.graph.outputs = []
        raise ValueError("vandalized")


def test_group_iterates_to_a_fixpoint_within_max_steps() -> None:
    model = _relu_chain(6)
    pipeline = Pipeline([Group("g", [get_pass("test-pop-one")()], max_steps=3)])
    run = pipeline.run(model)
    assert len(model.graph) == 3 and [r.iteration for r in run.runs] == [0, 1, 2]
    run = pipeline.run(model)
    assert len(model.graph) == 1
    assert [r.changed for r in run.runs] == [True, True, False]


def test_failing_pass_in_a_group_keeps_the_others_work() -> None:
    model = _relu_chain(4)
    pipeline = pipeline_from_names("test-pop-one,test-vandal,test-pop-one")
    pipeline = Pipeline([Group("g", pipeline.steps, max_steps=8)])
    run = pipeline.run(model)
    model.graph.verify()
    assert len(model.graph) == 1 and model.graph.outputs[0].name == "r0"
    assert {r.error for r in run.failures} == {"ValueError: vandalized"}
    # Every recorded before/after matches the model the next pass saw.
    for earlier, later in zip(run.runs, run.runs[1:]):
        assert earlier.after.nodes == later.before.nodes


def test_top_level_failure_is_rolled_back() -> None:
    model = _relu_chain(3)
    run = pipeline_from_names("test-vandal").run(model)
    assert len(model.graph) == 3 and run.failures[0].name == "test-vandal"
    model.graph.verify()


def test_stop_after_counts_pass_executions() -> None:
    model = _relu_chain(5)
    run = Pipeline([Group("g", [get_pass("test-pop-one")()])]).run(model, stop_after=2)
    assert len(run.runs) == 2 and len(model.graph) == 3


def test_configs_in_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[[pipeline]]\npass = "shape-infer"\n\n[[pipeline]]\ngroup = "g"\nmax_steps = 2\n'
        'steps = [{ pass = "test-pop-one", options = { keep = 2 } }, { pass = "dce" }]\n'
    )
    pipeline = load_pipeline_config(toml)
    assert pipeline.pass_names() == ["shape-infer", "test-pop-one", "dce"]
    assert pipeline.describe()[1]["steps"][0] == {"pass": "test-pop-one", "options": {"keep": 2}}
    as_json = tmp_path / "p.json"
    as_json.write_text(json.dumps({"pipeline": pipeline.describe()}))
    assert load_pipeline_config(as_json, max_steps=5).describe()[1]["max_steps"] == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[pipeline]]\npass = "test-pop-one"\noptions = { keep = "two" }\n', "must be int"),
        ('[[pipeline]]\npass = "test-pop-one"\noptions = { kept = 1 }\n', "unknown option 'kept'"),
        ('[[pipeline]]\ngroup = "g"\nsteps = []\n', "$.pipeline[0]"),
        ("pipeline = 3\n", "$.pipeline"),
        ("not toml at all [", "not valid TOML"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "p.toml"
    config.write_text(text)
    with pytest.raises(InputError) as raised:
        load_pipeline_config(config)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_options_are_listed_with_help() -> None:
    (spec,) = option_specs(get_pass("test-pop-one"))
    assert (spec.name, spec.type, spec.default, spec.help) == ("keep", "int", 1, "Relus to keep")


def test_builtin_pass_table_names_the_family_that_registers_each_pass() -> None:
    from graphopt.passes.base import BUILTIN_PASSES, all_passes

    registered = {name: cls.__module__ for name, cls in all_passes().items() if cls.__module__.startswith("graphopt.")}
    assert set(registered) == set(BUILTIN_PASSES)
    for name, module in registered.items():
        assert module.startswith(BUILTIN_PASSES[name] + "."), name


def test_a_run_imports_only_the_families_its_pipeline_names() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from graphopt.passes.pipeline import pipeline_from_names; "
        "pipeline_from_names('dce'); print('graphopt.passes.fuse' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_pass_declared_with_class_keywords_takes_its_description_from_its_docstring() -> None:
    @dataclass
    class CountOptions:
        limit: int = 3

    class Count(Pass, name="count-keywords", options=CountOptions):
        """Count nodes.

        Longer text that the listing leaves out."""

        def run(self, model: Model, ctx: PassContext) -> PassResult:
            return PassResult(False, {"nodes": len(model.graph)})

    assert (Count.name, Count.Options, Count.description) == ("count-keywords", CountOptions, "Count nodes.")
    assert option_specs(Count)[0].name == "limit"


def test_a_plugin_cannot_take_a_builtin_pass_name_even_before_the_builtin_is_imported() -> None:
    import subprocess
    import sys

    code = "from graphopt.passes.base import Pass, register\n@register\nclass Shadow(Pass, name='fold'):\n    pass\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "already registered" in result.stderr


def _dead_neg_model(tmp_path: Path) -> Path:
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["dead"])],
        "g",
        [helper.make_tensor_value_info("x", 1, [2])],
        [helper.make_tensor_value_info("y", 1, [2])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_pass_option_is_a_flag_an_api_keyword_and_a_config_setting(tmp_path: Path) -> None:
    from graphopt.api import optimize
    from tests.cli_helpers import invoke

    source = _dead_neg_model(tmp_path)
    ops = [n.op_type for n in optimize(source, "dce", dce_keep_ops=["Neg"], check=False).model.graph.nodes]
    assert ops == ["Relu", "Neg"]
    result = invoke("run", source, "--passes", "dce", "--dce-keep-ops", "Neg", "--no-check", "-o", tmp_path / "a.onnx")
    assert result.exit_code == 0, result.output
    assert [n.op_type for n in onnx.load(tmp_path / "a.onnx").graph.node] == ["Relu", "Neg"]
    config = tmp_path / "c.toml"
    config.write_text('[settings]\ndce_keep_ops = ["Neg"]\n\n[[pipeline]]\npass = "dce"\n')
    assert [n.op_type for n in optimize(source, config=config, check=False).model.graph.nodes] == ["Relu", "Neg"]
    assert [n.op_type for n in optimize(source, "dce", check=False).model.graph.nodes] == ["Relu"]


def test_the_options_of_one_optimize_call_do_not_carry_over_to_the_next(tmp_path: Path) -> None:
    """One Pipeline object given to two calls: the second runs without the first's option
    (configure used to set it on the caller's passes, so the dead Neg stayed)."""
    from graphopt.api import optimize

    source = _dead_neg_model(tmp_path)
    pipeline = pipeline_from_names("dce")
    kept = optimize(source, pipeline, dce_keep_ops=["Neg"], check=False)
    assert [n.op_type for n in kept.model.graph.nodes] == ["Relu", "Neg"]
    assert [n.op_type for n in optimize(source, pipeline, check=False).model.graph.nodes] == ["Relu"]
    assert pipeline.describe() == pipeline_from_names("dce").describe()


def test_the_late_rules_run_in_the_last_simplify_only() -> None:
    """The default pipeline's settle group runs the fuse pass's late rules; the name
    ``simplify`` in a pass list means the group that does not."""

    def fuse_late(steps: list[dict[str, Any]]) -> list[bool]:
        return [
            s.get("options", {}).get("late", False)
            for g in steps
            for s in g.get("steps", [])
            if s.get("pass") == "fuse"
        ]

    assert fuse_late(default_pipeline().describe()) == [False, True]
    assert fuse_late(pipeline_from_names("simplify").describe()) == [False]
