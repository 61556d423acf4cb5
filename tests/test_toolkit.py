"""The rewrite toolkit: names, the builder, replacements, constness, facts, settings, verification."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.api import optimize, pass_context
from graphopt.errors import InputError
from graphopt.facts import infer_model
from graphopt.io import onnx_io
from graphopt.ir import DataType, Graph, GraphError, Model, Node, Tensor, TensorType, Value
from graphopt.ir.constness import constant_array, is_constant
from graphopt.ir.rewrite import PROVENANCE_KEY, Builder, Namer, replace_value
from graphopt.passes.base import Pass, PassContext, PassResult, get_pass, register
from graphopt.settings import Settings
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs, run_ort

README = Path(__file__).resolve().parents[1] / "graphopt" / "passes" / "README.md"


def _model(nodes: list[Node], inputs: list[Value], outputs: list[Value], inits: list[Value] = ()) -> Model:  # type: ignore[assignment]
    return Model(Graph(inputs, outputs, nodes, inits), opset_imports={"": 18})


def _x(name: str = "x", shape: tuple[Any, ...] = (2, 3)) -> Value:
    return Value(name, TensorType(DataType.FLOAT, shape))


def _weight(name: str, array: np.ndarray) -> Value:
    return Value(name, TensorType(DataType.from_numpy(array.dtype), array.shape), Tensor.from_array(array, name))


# -- names ------------------------------------------------------------------------------------


def test_fresh_names_are_unique_across_bodies_and_functions() -> None:
    x = _x()
    inner = Node("Relu", [x], ["relu_out"])
    body = Graph([], [inner.outputs[0]], [inner])
    model = _model([Node("Neg", [x], ["relu_out_1"])], [x], [])
    model.graph.append(
        Node("Identity", [x], ["r"], [graphopt.ir.Attr("then_branch", graphopt.ir.AttrKind.GRAPH, body)])
    )
    names = Namer(model)
    assert names.fresh("relu_out") == "relu_out_2"
    assert names.fresh("relu_out") == "relu_out_3"
    assert names.fresh("x") == "x_1"
    assert names.fresh("new") == "new"


def test_builder_names_every_output_and_verify_rejects_unnamed_reads() -> None:
    x = _x()
    model = _model([], [x], [])
    b = Builder(model.graph, Namer(model))
    y = b.op("Relu", x)
    assert y.name and y.producer is not None and y.producer.name
    model.graph.outputs = [y]
    model.graph.verify()
    unnamed = Node("Neg", [x], [""])
    model.graph.append(unnamed)
    model.graph.append(Node("Abs", [unnamed.outputs[0]], ["z"]))
    with pytest.raises(GraphError, match="no name"):
        model.graph.verify()


def test_verify_rejects_a_body_value_shadowing_an_outer_name() -> None:
    x = _x()
    inner = Node("Relu", [x], ["x"])  # the same name as the outer input
    body = Graph([], [inner.outputs[0]], [inner])
    cond = Value("c", TensorType(DataType.BOOL, ()))
    node = Node(
        "If",
        [cond],
        ["y"],
        [
            graphopt.ir.Attr("then_branch", graphopt.ir.AttrKind.GRAPH, body),
            graphopt.ir.Attr("else_branch", graphopt.ir.AttrKind.GRAPH, Graph([], [x])),
        ],
    )
    graph = Graph([x, cond], [node.outputs[0]], [node])
    with pytest.raises(GraphError, match="duplicate value name 'x'"):
        graph.verify()


def test_adding_an_initializer_under_a_taken_name_is_an_error() -> None:
    graph = Graph([], [], [], [_weight("w", np.ones(2, np.float32))])
    with pytest.raises(GraphError, match="already exists"):
        graph.add_initializer(_weight("w", np.zeros(2, np.float32)))


# -- the builder ------------------------------------------------------------------------------


def test_builder_infers_attribute_kinds_types_and_provenance() -> None:
    x = _x(shape=(2, 3))
    model = _model([], [x], [])
    ctx = PassContext(Settings(provenance=True))
    b = ctx.builder(model, model.graph, tag="my-rule")
    w = b.constant(np.ones((3, 4), np.float32), "w")
    y = b.op("Gemm", x, w, alpha=0.5, transB=0)
    t = b.op("Transpose", y, perm=[1, 0])
    node = y.producer
    assert node is not None and node.attributes["alpha"].kind == graphopt.ir.AttrKind.FLOAT
    assert node.attributes["transB"].kind == graphopt.ir.AttrKind.INT
    assert t.producer is not None and t.producer.attributes["perm"].kind == graphopt.ir.AttrKind.INTS
    assert w.type == TensorType(DataType.FLOAT, (3, 4)) and is_constant(w)
    assert y.type == TensorType(DataType.FLOAT, (2, 4)) and t.type == TensorType(DataType.FLOAT, (4, 2))
    assert node.metadata_props[PROVENANCE_KEY] == "my-rule"
    with pytest.raises(TypeError, match="kind"):
        b.op("Relu", x, strange=object())


@pytest.mark.parametrize("opset", [11, 18])
def test_builder_gives_int_lists_as_inputs_from_opset_13_and_as_attributes_before(opset: int) -> None:
    x = _x(shape=(2, 6))
    model = Model(Graph([x], [], [], []), opset_imports={"": opset})
    b = PassContext().builder(model, model.graph)
    split = b.listed("Split", x, "split", [2, 4], as_input=opset >= 13, axis=1, outputs=2)
    squeezed = b.listed("Unsqueeze", split.outputs[1], "axes", [0], as_input=opset >= 13).outputs[0]
    if opset >= 13:
        assert "split" not in split.attributes and constant_array(split.inputs[1], 10).tolist() == [2, 4]
    else:
        assert len(split.inputs) == 1 and split.attributes["split"].value == [2, 4]
    assert [v.type for v in split.outputs] == [TensorType(DataType.FLOAT, (2, 2)), TensorType(DataType.FLOAT, (2, 4))]
    assert squeezed.type == TensorType(DataType.FLOAT, (1, 2, 4))


def test_provenance_is_off_by_default() -> None:
    x = _x()
    model = _model([], [x], [])
    y = PassContext().builder(model, model.graph, tag="my-rule").op("Relu", x)
    assert y.producer is not None and PROVENANCE_KEY not in y.producer.metadata_props


# -- replacing --------------------------------------------------------------------------------


def test_replace_value_hands_the_output_name_over() -> None:
    x = _x()
    relu = Node("Relu", [x], ["r"])
    neg = Node("Neg", [relu.outputs[0]], ["out"])
    model = _model([relu, neg], [x], [neg.outputs[0]])
    replace_value(neg.outputs[0], relu.outputs[0], Namer(model))
    model.graph.remove(neg)
    assert [v.name for v in model.graph.outputs] == ["out"] and model.graph.outputs[0] is relu.outputs[0]
    model.graph.verify()


def test_replace_value_adds_an_identity_where_outputs_would_merge() -> None:
    x = _x()
    a = Node("Relu", [x], ["a"])
    b = Node("Relu", [x], ["b"])
    model = _model([a, b], [x], [a.outputs[0], b.outputs[0]])
    replace_value(b.outputs[0], a.outputs[0], Namer(model))
    model.graph.remove(b)
    assert [v.name for v in model.graph.outputs] == ["a", "b"]
    assert model.graph.outputs[1].producer is not None and model.graph.outputs[1].producer.op_type == "Identity"
    model.graph.verify()
    # And a graph input never takes an output's name.
    c = Node("Neg", [x], ["c"])
    model.graph.append(c)
    model.graph.outputs = [*model.graph.outputs, c.outputs[0]]
    replace_value(c.outputs[0], x, Namer(model))
    model.graph.remove(c)
    assert [v.name for v in model.graph.outputs] == ["a", "b", "c"] and x.name == "x"
    model.graph.verify()


# -- constness, tensors, bodies ---------------------------------------------------------------


def test_an_initializer_that_is_an_input_is_not_a_constant() -> None:
    s = _weight("s", np.array([2, 12], np.int64))
    fixed = _weight("f", np.array([2, 12], np.int64))
    graph = Graph([s], [], [], [s, fixed])
    assert constant_array(s) is None and not is_constant(s)
    assert constant_array(fixed) is not None and graph.is_input(s)


def test_reshape_by_a_feedable_initializer_declares_a_shape_that_holds(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = numpy_helper.from_array(np.array([2, 12], np.int64), "s")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g", [x, s], [y], [shape])
    source = tmp_path / "reshape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "-q")
    assert result.exit_code == 0, result.output
    out = onnx.load(tmp_path / "out.onnx")
    declared = [
        d.dim_value if d.HasField("dim_value") else None for d in out.graph.output[0].type.tensor_type.shape.dim
    ]
    fed = run_ort(out, {"x": np.ones((4, 6), np.float32), "s": np.array([3, 8], np.int64)})["y"]
    assert fed.shape == (3, 8)
    assert all(d is None or d == n for d, n in zip(declared, fed.shape, strict=True)), declared


def test_tensor_values_are_read_only() -> None:
    tensor = Tensor.from_array(np.arange(4, dtype=np.float32))
    with pytest.raises(ValueError, match="read-only"):
        tensor.numpy()[0] = 7


def test_an_unattached_body_leaves_no_uses_on_outer_values() -> None:
    x = _x()
    model = _model([], [x], [])
    inner = Node("Relu", [x], ["inner"])
    Graph([], [inner.outputs[0]], [inner])  # built for an If that is never inserted
    assert not x.uses()
    model.graph.verify()


def test_functions_have_their_own_opsets(tmp_path: Path) -> None:
    body = helper.make_function(
        "local", "f", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], [helper.make_opsetid("", 13)]
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("f", ["x"], ["y"], domain="local")], "g", [x], [y])
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)], functions=[body]
    )
    model = onnx_io.from_proto(proto)
    assert model.opset_in(model.graph) == 18
    assert model.opset_in(model.functions[0].body) == 13
    assert model.opset_in(model.graph, "local") == 1


def test_levels_ignore_constant_producers() -> None:
    x = _x(shape=(2, 4))
    w_init = _weight("w0", np.ones((4, 4), np.float32))
    const = Node(
        "Constant",
        [],
        ["w1"],
        [graphopt.ir.Attr("value", graphopt.ir.AttrKind.TENSOR, Tensor.from_array(np.ones((4, 4), np.float32)))],
    )
    transposed = Node(
        "Transpose",
        [_weight("w2t", np.ones((4, 4), np.float32))],
        ["w2"],
        [graphopt.ir.Attr("perm", graphopt.ir.AttrKind.INTS, [1, 0])],
    )
    q = Node("MatMul", [x, w_init], ["q"])
    k = Node("MatMul", [x, const.outputs[0]], ["k"])
    v = Node("MatMul", [x, transposed.outputs[0]], ["v"])
    graph = Graph(
        [x], [q.outputs[0], k.outputs[0], v.outputs[0]], [const, transposed, q, k, v], [w_init, transposed.inputs[0]]
    )  # type: ignore[list-item]
    assert graph.levels(ignore_constants=True) == [[q, k, v]]
    assert len(graph.levels()) == 2


# -- facts --------------------------------------------------------------------------------------


def test_facts_follow_shape_plumbing_and_forget_on_mutation(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([4, 64], np.int64), "tail"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = onnx_io.from_proto(
        helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 18)])
    )
    facts = pass_context().facts(model)
    target = next(n for n in model.graph if n.op_type == "Concat").outputs[0]
    assert [str(d) for d in facts.sym(target)] == ["batch", "4", "64"]  # type: ignore[union-attr]
    concat = target.producer
    assert concat is not None
    concat.set_input(1, model.graph.add_initializer(_weight("tail2", np.array([8, 32], np.int64))))
    assert [str(d) for d in facts.sym(target)] == ["batch", "8", "32"]  # type: ignore[union-attr]


@pytest.mark.parametrize(("fmod", "expected"), [(0, ["0", "0", "None", "2"]), (1, ["0", "0", "None", "-1"])])
def test_facts_take_an_integer_mod_of_dims(fmod: int, expected: list[str]) -> None:
    # 3 * batch and 18 leave nothing over 3 whatever batch is; batch - 10 is unknown; -4 takes the
    # divisor's sign (-4 % 3 == 2) or, with fmod, the dividend's (-1).
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Mul", ["s", "three"], ["tripled"]),
        helper.make_node("Sub", ["s", "ten"], ["lowered"]),
        helper.make_node("Concat", ["tripled", "lowered"], ["dims"], axis=0),
        helper.make_node("Mod", ["dims", "three"], ["rest"], fmod=fmod),
    ]
    inits = [
        numpy_helper.from_array(np.array(3, np.int64), "three"),
        numpy_helper.from_array(np.array(10, np.int64), "ten"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    rest = helper.make_tensor_value_info("rest", TensorProto.INT64, None)
    model = onnx_io.from_proto(
        helper.make_model(
            helper.make_graph(nodes, "g", [x], [rest], inits), opset_imports=[helper.make_opsetid("", 18)]
        )
    )
    facts = pass_context().facts(model)
    infer_model(facts)
    assert [str(d) for d in facts.sym(model.graph.outputs[0]) or ()] == expected


def test_facts_handle_deep_plumbing_without_recursion() -> None:
    x = _x(shape=(3, 5))
    shape = Node("Shape", [x], ["s0"])
    nodes = [shape]
    for i in range(5000):
        nodes.append(Node("Identity", [nodes[-1].outputs[0]], [f"s{i + 1}"]))
    model = _model(nodes, [x], [nodes[-1].outputs[0]])
    for node in nodes:
        node.outputs[0].type = TensorType(DataType.INT64, (2,))
    assert pass_context().facts(model).sym(nodes[-1].outputs[0]) == (3, 5)


# -- settings and options ---------------------------------------------------------------------


class Flavour(enum.Enum):
    PLAIN = "plain"
    SPICY = "spicy"


@register
class _Typed(Pass):
    name = "test-typed-options"
    description = "a pass with typed options, for the validation tests"

    @dataclass
    class Options:
        target: Literal["onnx", "ort"] = field(default="onnx", metadata={"help": "target"})
        flavour: Flavour = field(default=Flavour.PLAIN, metadata={"help": "flavour"})
        caps: dict[str, int] = field(default_factory=dict, metadata={"help": "caps"})
        ops: list[str] = field(default_factory=list, metadata={"help": "ops"})

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        return PassResult(False, {"target": self.options.target, "flavour": self.options.flavour.value})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"target": "foo"}, "'onnx' | 'ort'"),
        ({"flavour": "sour"}, "'plain' | 'spicy'"),
        ({"caps": {"a": "x"}}, "caps"),
        ({"caps": ["a"]}, "caps"),
        ({"ops": "Relu"}, "ops"),
    ],
)
def test_typed_options_are_validated(config: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        get_pass("test-typed-options").from_config(config)


def test_passes_listing_shows_an_enum_default_by_its_value() -> None:
    result = invoke("passes", "--json")
    assert result.exit_code == 0, result.output
    (typed,) = [p for p in json.loads(result.stdout)["passes"] if p["name"] == "test-typed-options"]
    assert {o["name"]: o["default"] for o in typed["options"]}["flavour"] == "plain"


def test_typed_options_convert_enums_from_config() -> None:
    step = get_pass("test-typed-options").from_config({"flavour": "spicy", "target": "ort", "caps": {"a": 1}})
    assert step.options.flavour is Flavour.SPICY and step.options.target == "ort"


def test_an_option_type_the_validator_does_not_know_is_a_programming_error() -> None:
    class _Bad(Pass):
        name = "test-bad-annotation"

        @dataclass
        class Options:
            where: Path = field(default=Path("."), metadata={"help": "a path"})

    with pytest.raises(TypeError, match="not supported"):
        register(_Bad)


def _relu_model(tmp_path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Relu", ["i"], ["y"])]
    path = tmp_path / "relu.onnx"
    onnx.save(
        helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)]), path
    )
    return path


@register
class _SettingsEcho(Pass):
    name = "test-settings-echo"
    description = "reports the run's settings"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        return PassResult(False, {"settings": ctx.settings.as_dict()})


def test_a_setting_reaches_the_api_the_cli_and_the_config(tmp_path: Path) -> None:
    path = _relu_model(tmp_path)
    via_api = optimize(str(path), "test-settings-echo", provenance=True, check=False)
    assert via_api.report["passes"][0]["details"]["settings"]["provenance"] is True
    result = invoke(
        "run",
        path,
        "--passes",
        "test-settings-echo",
        "--provenance",
        "--no-check",
        "--json",
        "-q",
        "-o",
        tmp_path / "a.onnx",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passes"][0]["details"]["settings"]["provenance"] is True
    config = tmp_path / "pipeline.toml"
    config.write_text('[settings]\nprovenance = true\n\n[[pipeline]]\npass = "test-settings-echo"\n')
    via_config = optimize(str(path), config=config, check=False)
    assert via_config.report["passes"][0]["details"]["settings"]["provenance"] is True
    config.write_text('[settings]\nprovenance = "yes"\n\n[[pipeline]]\npass = "test-settings-echo"\n')
    bad = invoke("run", path, "--config", config, "-q")
    assert bad.exit_code == 2 and "provenance" in bad.output


def test_settings_fields_all_have_help() -> None:
    assert all(f.metadata.get("help") for f in dataclasses.fields(Settings))


# -- verification at the pass ------------------------------------------------------------------


@register
class _Corrupter(Pass):
    name = "test-corrupt-uses"
    description = "leaves a use list stale"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        node = model.graph.topological()[-1]
        node._inputs[0] = Value("ghost")  # bypasses the mutation API: reads a value defined nowhere
        node._inputs_view = None
        return PassResult(True)


@register
class _NumpyDetails(Pass):
    name = "test-numpy-details"
    description = "returns details that are not JSON"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        return PassResult(False, {"count": np.int64(3)})


@pytest.mark.parametrize(
    ("pass_name", "message"), [("test-corrupt-uses", "invalid"), ("test-numpy-details", "not JSON")]
)
def test_a_pass_that_breaks_the_ir_or_its_details_is_rolled_back(tmp_path: Path, pass_name: str, message: str) -> None:
    path = _relu_model(tmp_path)
    result = optimize(str(path), f"noop,{pass_name},dce", verify=True, check=False)
    failures = result.report["failures"]
    assert [f["pass"] for f in failures] == [pass_name] and message in failures[0]["error"]
    result.model.graph.verify()
    assert [n.op_type for n in result.model.graph] == ["Relu"]


# -- the guide's example -----------------------------------------------------------------------


def test_the_rewrite_guide_example_runs(tmp_path: Path) -> None:
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "class MatMulAddToGemm" in c]
    exec(compile(code, str(README), "exec"), {})
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b"),
    ]
    nodes = [helper.make_node("MatMul", ["a", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [a], [y], inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    source = tmp_path / "mm.onnx"
    onnx.save(proto, source)
    result = optimize(str(source), "shape-infer,example-matmul-add-to-gemm", verify=True, check=False)
    assert not result.report["failures"]
    assert [n.op_type for n in result.model.graph] == ["Gemm"]
    assert [v.name for v in result.model.graph.outputs] == ["y"]
    out = tmp_path / "gemm.onnx"
    graphopt.save(result.model, out)
    assert_same_outputs(source, out)
