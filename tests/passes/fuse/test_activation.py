"""The activation rules' table: GELU, SiLU / Swish, HardSigmoid / HardSwish and onnxruntime's activations. Each rule
fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the
exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import onnx

from tests.passes.fuse.table import (
    ELEMENTWISE,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    at_opset,
    below,
    constant_at,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    target_opset,
    weights,
)
from tests.passes.fuse_fixtures import exported_silu
from tests.passes.fuse_helpers import info, init, model, node
from tests.passes.fuse_models import bias_gelu, erf_gelu, hardswish, tanh_gelu


def _hardsigmoid(opset: int = 17) -> onnx.ModelProto:
    clip = node("Clip", ["a", "lo", "hi"], "c") if opset >= 11 else node("Clip", ["a"], "c", min=0.0, max=6.0)
    return model(
        [node("Add", ["x", "three"], "a"), clip, node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
        opset=opset,
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


CASES: dict[str, Case] = {
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
}

EXPORTED: dict[str, Exported | str] = {
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
