"""The activation rules' table: GELU, SiLU / Swish, HardSigmoid / HardSwish, Softsign and onnxruntime's
activations. Each rule fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a
rule newer than the exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.ir.node import CONTRIB_DOMAIN as MS
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs
from tests.passes.fuse.table import (
    BOTH_DYNAMIC,
    ELEMENTWISE,
    ERF_MLP,
    FLOAT16_TOLERANCE,
    LATE,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    as_float16,
    at_opset,
    below,
    constant_at,
    exported_mlp,
    float32_case,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    target_opset,
    weights,
)
from tests.passes.fuse_fixtures import exported_silu
from tests.passes.fuse_helpers import fires, fires_ort, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    bias_gelu,
    erf_gelu,
    hardswish,
    tanh_gelu,
)


def _hardsigmoid(opset: int = 17) -> onnx.ModelProto:
    clip = node("Clip", ["a", "lo", "hi"], "c") if opset >= 11 else node("Clip", ["a"], "c", min=0.0, max=6.0)
    return model(
        [node("Add", ["x", "three"], "a"), clip, node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
        opset=opset,
    )


def _softsign(one_first: bool = False, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Softsign written out: x / (|x| + 1), or x / (1 + |x|) with ``one_first``."""
    dtype = {TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}.get(elem_type, np.float32)
    return model(
        [
            node("Abs", ["x"], "a"),
            node("Add", ["one", "a"] if one_first else ["a", "one"], "s"),
            node("Div", ["x", "s"], "y"),
        ],
        [info("x", [2, 5], elem_type)],
        [info("y", None, elem_type)],
        [init("one", 1.0, dtype)],
    )


def _gelu_cases(ort: bool) -> dict[str, Case]:
    settings = {"target": "ort"} if ort else {}
    opset = 17 if ort else 20
    gate: Perturb | str = (
        Perturb(at_opset(20), None, note="above its max: standard Gelu takes it") if ort else below(20)
    )
    return {
        ("ort-gelu" if ort else "gelu-none"): Case(
            lambda: erf_gelu(opset),
            {"Gelu": 1},
            "e",
            Perturb(set_const("sqrt2", 1.5), None, note="a constant"),
            ELEMENTWISE,
            gate,
            settings,
        ),
        ("ort-fastgelu" if ort else "gelu-tanh"): Case(
            lambda: tanh_gelu(opset),
            {"FastGelu" if ort else "Gelu": 1},
            "t",
            Perturb(set_const("k", 0.05), None, note="a constant"),
            ELEMENTWISE,
            gate,
            settings,
        ),
    }


def _float16_node(op_type: str, contrib: bool, opset: int, elem_type: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """One node of ``elem_type`` at ``opset``: the standard Gelu, Softmax or LogSoftmax, or com.microsoft's Gelu or
    FastGelu (with its bias), as the exporters and ``--target ort`` write them."""
    dtype = np.float16 if elem_type == TensorProto.FLOAT16 else np.float32
    with_bias = op_type == "FastGelu"
    proto = model(
        [node(op_type, ["x", "bias"] if with_bias else ["x"], "y", domain=MS if contrib else "")],
        [info("x", [2, 3, 8], elem_type)],
        [info("y", None, elem_type)],
        # a bias as small as the case's inputs (see _float32_case): a large one moved FastGelu's output beyond the
        # table's 1e-4
        [init("bias", (0.05 * np.random.default_rng(1).standard_normal(8)).astype(dtype))] if with_bias else [],
        opset=opset,
    )
    if contrib:
        proto.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    return proto


def _float32_case(op_type: str, contrib: bool = False, min_opset: int = 20) -> Case:
    """The case of a rule computing a float16 op in float32 between Casts (graphopt/passes/fuse/rules/_float32.py):
    a GELU (the standard one from opset 20), a Softmax or a LogSoftmax (from opset 13)."""
    return float32_case(
        partial(_float16_node, op_type, contrib, 17 if contrib else min_opset),
        op_type,
        3 if op_type == "FastGelu" else 2,
        "n/a: the rule's root is a com.microsoft op, which has no opset"
        if contrib
        else "n/a: the rule's root is a Gelu, which no opset below 20 has"
        if op_type == "Gelu"
        else below(min_opset),
        {**LATE, "target": "ort"} if contrib else LATE,
        # small inputs: the float16 op's decomposition and the float32 kernel differ by float16's rounding, which
        # stays within the table's 1e-4 only there
        feeds=lambda: {"x": (0.05 * np.random.default_rng(0).standard_normal((2, 3, 8))).astype(np.float16)},
    )


CASES: dict[str, Case] = {
    "gelu-float32": _float32_case("Gelu"),
    "softmax-float32": _float32_case("Softmax", min_opset=13),
    "logsoftmax-float32": _float32_case("LogSoftmax", min_opset=13),
    "ort-gelu-float32": _float32_case("Gelu", contrib=True),
    "ort-fastgelu-float32": _float32_case("FastGelu", contrib=True),
    **_gelu_cases(ort=False),
    **_gelu_cases(ort=True),
    "hardsigmoid": Case(
        _hardsigmoid,
        {"HardSigmoid": 1},
        "c",
        Perturb(lambda p: set_attr("c", max=5.0)(_hardsigmoid(10)), "not to [0, 6]"),
        ELEMENTWISE,
        NO_GATE,
    ),
    "hardswish": Case(
        lambda: hardswish(14),
        {"HardSwish": 1},
        "c",
        Perturb(set_const("hi", 5.0), "not to [0, 6]", note="a constant"),
        ELEMENTWISE,
        below(14),
    ),
    "hardswish-as-hardsigmoid": Case(
        lambda: hardswish(13),
        {"Mul": 1, "HardSigmoid": 1},
        "c",
        Perturb(set_const("hi", 5.0), "not to [0, 6]", note="a constant"),
        ELEMENTWISE,
        Perturb(at_opset(14), None, note="above its max: HardSwish takes it"),
    ),
    "ort-biasgelu": Case(
        bias_gelu,
        {"BiasGelu": 1},
        "h",
        Perturb(set_const("bias", weights(1)), "not a vector over x's last axis", note="a constant"),
        Perturb(set_shape("x", None), "known rank"),
        NO_GATE,
        {"target": "ort"},
    ),
    "swish": Case(
        exported_silu,
        {"Swish": 1},
        "val_176",
        "n/a: Sigmoid and Mul have no attributes, and any scalar alpha is a Swish",
        ELEMENTWISE,
        below(24),
    ),
    "ort-quickgelu": Case(
        lambda: exported_silu(20),
        {"QuickGelu": 1},
        "val_176",
        "n/a: Sigmoid and Mul have no attributes, and any scalar alpha is a QuickGelu",
        ELEMENTWISE,
        Perturb(at_opset(24), None, note="above its max: the standard Swish takes it"),
        {"target": "ort"},
    ),
    "softsign": Case(
        _softsign,
        {"Softsign": 1},
        "s",
        Perturb(set_const("one", 2.0), None, note="a constant: x / (|x| + 2) is no Softsign"),
        ELEMENTWISE,
        "n/a: Abs, Add, Div and Softsign are all in opset 1",
    ),
}

EXPORTED: dict[str, Exported | str] = {
    **dict.fromkeys(
        ("gelu-float32", "ort-gelu-float32", "ort-fastgelu-float32"),
        "its case is what the dynamo exporter (Gelu) and --target ort (Gelu, FastGelu) write on a float16 model; "
        "test_a_float16_gelu_computes_in_float32 runs the whole pipeline on the float16 dynamo and TorchScript BERT "
        "MLP (tests/fixtures/exports/bert_*.onnx)",
    ),
    "softmax-float32": "its case is the float16 Softmax every exporter writes; "
    "test_a_float16_llama_layer_computes_its_softmax_in_float32 runs the whole pipeline on the float16 dynamo Llama "
    "export (tests/fixtures/exports/llama_fp16_dynamo.onnx)",
    "logsoftmax-float32": "n/a: no exporter fixture writes a LogSoftmax; its case is the op as written",
    "softsign": "n/a: no exporter fixture spells x / (1 + |x|) (t5_ts's one Abs is in its relative position buckets)",
    "swish": Exported(
        ("llama_dynamo", "llama_ts"),
        {"Swish": 1},
        "n/a: Sigmoid and Mul have no attributes and read no constant (any scalar alpha is a Swish)",
        "n/a: element-wise; the rule needs no shape",
        target_opset(23, "needs opset >= 24"),
        {"target_opset": 24},
    ),
    "ort-quickgelu": Exported(
        ("llama_dynamo", "llama_ts"),
        {"QuickGelu": 1},
        "n/a: Sigmoid and Mul have no attributes and read no constant (any scalar alpha is a QuickGelu)",
        "n/a: element-wise; the rule needs no shape",
        target_opset(24, None, "the standard Swish takes it"),
        {"target": "ort"},
    ),
    **{
        name: Exported(
            fixtures,
            {op_type: 1},
            constant_at("half", lambda v: v * 0.9, None, "0.45, not a GELU"),
            ELEMENTWISE,
            gate,
            settings,
        )
        for name, fixtures, op_type, gate, settings in (
            (
                "gelu-tanh",
                ("bloom_dynamo", "bloom_ts"),
                "Gelu",
                target_opset(19, "needs opset >= 20"),
                {"target_opset": 23},
            ),
            # the dynamo export is at opset 20, where the standard Gelu takes it
            (
                "ort-fastgelu",
                ("bloom_ts",),
                "FastGelu",
                target_opset(20, None, "standard Gelu takes it"),
                {"target": "ort"},
            ),
        )
    },
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "gelu-none",
        "hardsigmoid",
        "hardswish",
        "hardswish-as-hardsigmoid",
        "ort-biasgelu",
        "ort-gelu",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


@pytest.mark.parametrize(("build", "rule"), [(erf_gelu, "gelu-none"), (tanh_gelu, "gelu-tanh")])
def test_gelu_fuses_at_opset_20_and_is_a_near_miss_below(build: Callable[[int], onnx.ModelProto], rule: str) -> None:
    fires(build(20), rule, {"Gelu": 1})
    details = refused(build(17), rule)
    assert "needs opset >= 20" in details["near_misses"]["activation"][0]


def test_gelu_becomes_the_contrib_op_for_target_ort_below_opset_20() -> None:
    fires(erf_gelu(17), "ort-gelu", {"Gelu": 1}, target="ort")
    fires(tanh_gelu(17), "ort-fastgelu", {"FastGelu": 1}, target="ort")


C, A = math.sqrt(2 / math.pi), 0.044715


# tanh's argument c * (x + a * x^3), spelled out as other code writes it: (nodes, constants)
_TANH_ARGUMENTS: dict[str, tuple[list[onnx.NodeProto], dict[str, float]]] = {
    "expanded, x^3 by Pow": (
        [
            node("Mul", ["x", "c"], "cx"),
            node("Pow", ["x", "three"], "cube"),
            node("Mul", ["cube", "ca"], "cax3"),
            node("Add", ["cx", "cax3"], "arg"),
        ],
        {"c": C, "three": 3.0, "ca": C * A},
    ),
    "c x (1 + a x x), divided by 1 / c": (
        [
            node("Div", ["x", "inv_c"], "cx"),
            node("Mul", ["x", "x"], "xx"),
            node("Mul", ["a", "xx"], "axx"),
            node("Add", ["one", "axx"], "poly"),
            node("Mul", ["cx", "poly"], "arg"),
        ],
        {"inv_c": 1 / C, "a": A, "one": 1.0},
    ),
    "x minus a negated cube": (
        [
            node("Mul", ["x", "x"], "xx"),
            node("Mul", ["xx", "x"], "cube"),
            node("Mul", ["cube", "minus_a"], "neg_ax3"),
            node("Sub", ["x", "neg_ax3"], "sum"),
            node("Mul", ["c", "sum"], "arg"),
        ],
        {"minus_a": -A, "c": C},
    ),
}


def _tanh_gelu_of(argument: str, factor: float = 1.0) -> onnx.ModelProto:
    nodes, constants = _TANH_ARGUMENTS[argument]
    tail = [
        node("Tanh", ["arg"], "t"),
        node("Add", ["t", "one_"], "p"),
        node("Mul", ["x", "half"], "hx"),
        node("Mul", ["hx", "p"], "y"),
    ]
    values = {**constants, "one_": 1.0, "half": 0.5}
    inits = [init(name, value * (factor if name in ("c", "inv_c") else 1.0)) for name, value in values.items()]
    return model([*nodes, *tail], [info("x", [2, 5])], ["y"], inits, opset=20)


@pytest.mark.parametrize("argument", list(_TANH_ARGUMENTS))
def test_the_tanh_gelu_is_read_in_any_factorization_of_its_argument(argument: str) -> None:
    out = fires(_tanh_gelu_of(argument), "gelu-tanh", {"Gelu": 1})
    assert [a.s for a in out.graph.node[0].attribute] == [b"tanh"]
    refused(_tanh_gelu_of(argument, factor=1.01), "gelu-tanh")  # not sqrt(2 / pi): another function


def test_gelu_with_an_intermediate_graph_output_stays() -> None:
    proto = erf_gelu(20)
    proto.graph.output.append(info("e", None))
    refused(proto, "gelu-none")


def test_hardswish_and_hardsigmoid_decompositions_fuse() -> None:
    fires(hardswish(14), "hardswish", {"HardSwish": 1})
    sigmoid = model(
        [node("Add", ["x", "three"], "a"), node("Clip", ["a", "lo", "hi"], "c"), node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
    )
    fires(sigmoid, "hardsigmoid", {"HardSigmoid": 1})


def test_hardswish_below_opset_14_becomes_x_times_hardsigmoid() -> None:
    fires(hardswish(13), "hardswish-as-hardsigmoid", {"Mul": 1, "HardSigmoid": 1})
    refused(hardswish(14), "hardswish-as-hardsigmoid")  # HardSwish itself there
    exposed = hardswish(13)
    exposed.graph.output.append(info("c", None))
    refused(exposed, "hardswish-as-hardsigmoid")


def test_hardswish_refusals() -> None:
    details = refused(hardswish(13), "hardswish")
    assert "needs opset >= 14" in details["near_misses"]["activation"][0]
    details = refused(hardswish(14, high=5.0), "hardswish")
    assert "not to [0, 6]" in " ".join(details["near_misses"]["activation"])


def _quick_gelu(alpha: float, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """CLIP's quick GELU as exported: x * Sigmoid(alpha * x)."""
    dtype = {TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}.get(elem_type, np.float32)
    return model(
        [node("Mul", ["x", "alpha"], "ax"), node("Sigmoid", ["ax"], "s"), node("Mul", ["x", "s"], "y")],
        [info("x", [2, 7, 16], elem_type)],
        [info("y", None, elem_type)],
        [init("alpha", alpha, dtype)],
    )


def test_quick_gelu_becomes_the_contrib_op_with_its_alpha_for_target_ort() -> None:
    out = fires(_quick_gelu(1.702), "ort-quickgelu", {"QuickGelu": 1}, target="ort")
    (alpha,) = out.graph.node[0].attribute
    assert alpha.name == "alpha" and alpha.f == pytest.approx(1.702)
    refused(_quick_gelu(1.702), "ort-quickgelu")  # the standard target has no such op


def test_quick_gelu_of_float16_becomes_the_contrib_op_its_cpu_kernel_takes() -> None:
    fires(_quick_gelu(1.702, TensorProto.FLOAT16), "ort-quickgelu", {"QuickGelu": 1}, target="ort")


def test_quick_gelu_of_double_stays_naming_the_type() -> None:
    details = refused(_quick_gelu(1.702, TensorProto.DOUBLE), "ort-quickgelu", target="ort")
    assert "takes float32 or float16, not double" in " ".join(details["near_misses"]["activation"])


def test_target_opset_upgrades_first_so_gelu_fuses() -> None:
    out = fires(erf_gelu(17), "gelu-none", {"Gelu": 1}, target_opset=20)
    assert out.opset_import[0].version == 20


def _tanh_gelu_of_pow(exponent: np.ndarray) -> onnx.ModelProto:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 Pow(x, exponent)))), beside an unrelated Relu."""
    nodes = [
        node("Pow", ["x", "three"], "x3"),
        node("Mul", ["x3", "a"], "ax3"),
        node("Add", ["x", "ax3"], "s"),
        node("Mul", ["s", "k"], "u"),
        node("Tanh", ["u"], "t"),
        node("Add", ["t", "one"], "t1"),
        node("Mul", ["x", "half"], "hx"),
        node("Mul", ["hx", "t1"], "y"),
        node("Relu", ["x"], "z"),
    ]
    constants = [init("a", 0.044715), init("k", float(np.sqrt(2 / np.pi))), init("one", 1.0), init("half", 0.5)]
    return model(nodes, [info("x", [2, 3])], ["y", "z"], [init("three", exponent), *constants], opset=20)


def test_a_tanh_gelu_with_an_integer_exponent_fuses() -> None:
    fires(_tanh_gelu_of_pow(np.array(3, np.int64)), "gelu-tanh", {"Gelu": 1, "Relu": 1})


@pytest.mark.parametrize("exponent", [np.inf, np.nan])
def test_a_non_finite_exponent_is_no_gelu_and_fails_nothing(exponent: float) -> None:
    proto = _tanh_gelu_of_pow(np.array(exponent, np.float32))
    result = optimize(from_proto(proto), "shape-infer,fuse", check=False)
    assert result.report["failures"] == []
    assert "Gelu" not in {n.op_type for n in result.model.graph}


def test_gelu_of_a_biased_input_becomes_biasgelu_or_fastgelu() -> None:
    fires_ort(bias_gelu(), "ort-biasgelu", {"BiasGelu": 1})
    fires_ort(bias_gelu(approximate="tanh"), "ort-biasgelu", {"FastGelu": 1})


def test_biasgelu_refusals() -> None:
    details = refused(bias_gelu(bias_shape=(3, 8)), "ort-biasgelu", target="ort")  # not a vector
    exposed = bias_gelu()
    exposed.graph.output.append(info("h", None))
    refused(exposed, "ort-biasgelu", target="ort")
    refused(bias_gelu(), "ort-biasgelu")
    assert details["applied"] == {}


@pytest.mark.parametrize("one_first", [False, True])
def test_softsign_fuses_with_the_one_on_either_side_of_the_add(one_first: bool) -> None:
    fires(_softsign(one_first), "softsign", {"Softsign": 1})


def test_softsign_of_float16_fuses() -> None:
    fires(_softsign(elem_type=TensorProto.FLOAT16), "softsign", {"Softsign": 1})


def test_softsign_of_double_stays_naming_the_type() -> None:
    details = refused(_softsign(elem_type=TensorProto.DOUBLE), "softsign")
    assert "takes float32 or float16, not double" in " ".join(details["near_misses"]["activation"])


def test_a_gelu_whose_bias_a_projections_gemm_takes_is_no_biasgelu() -> None:
    # Swin's MLP (a static number of tokens): MatMul + BiasGelu measured 1.09x Gemm + Gelu at its first stage's
    # shapes, and no faster at any shape measured; where the Gemm cannot take the bias (batch and sequence
    # dynamic) the bias goes into BiasGelu as before.
    settings = {"target": "ort", **LATE, "passes": "shape-infer,fuse,noop,dce"}
    out, details = fuse(exported_mlp(), **settings)
    assert dict(ops(out)) == {"Reshape": 2, "Gemm": 2, "Gelu": 1}
    assert "goes into the projection's Gemm" in " ".join(details["near_misses"]["activation"])
    fires(BOTH_DYNAMIC(exported_mlp()), "ort-biasgelu", {"MatMul": 2, "Add": 1, "BiasGelu": 1}, **settings)


@pytest.mark.parametrize(
    ("mlp", "flags"),
    [({}, ()), (ERF_MLP, ("--target-opset", "23"))],
    ids=["dynamo-gelu", "torchscript-erf-at-opset-23"],
)
def test_a_float16_gelu_computes_in_float32(tmp_path: Path, mlp: dict[str, str], flags: tuple[str, ...]) -> None:
    """onnxruntime's CPU provider has no float16 Gelu kernel: it ran the op's function body, 1.9x the float32
    kernel's time (convnext_atto_dynamo_fp16: 0.99 of the variant's time, 0.68 with its Gelus in float32). The
    default pipeline writes a float16 BERT MLP's GELU in float32 between Casts, and the outputs keep their values."""
    source, target = tmp_path / "mlp16.onnx", tmp_path / "out.onnx"
    proto = as_float16(exported_mlp(**mlp))
    onnx.save(proto, source)
    result = invoke("run", source, "-o", target, *flags)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    (gelu,) = [n for n in written.graph.node if n.op_type == "Gelu"]
    producers = {out: n for n in written.graph.node for out in n.output}
    readers = [n for n in written.graph.node if gelu.output[0] in n.input]
    assert producers[gelu.input[0]].op_type == "Cast" and [n.op_type for n in readers] == ["Cast"]
    assert_same_outputs(proto, written, rtol=FLOAT16_TOLERANCE, atol=FLOAT16_TOLERANCE)
