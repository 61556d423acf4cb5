"""The arith rules' table: chains of constant arithmetic folded into one op. Each rule fires on its model and refuses
its perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on
an export too, and the family's own tests follow its table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from tests.passes.fuse.table import NO_ATTR, NO_GATE, Case, Exported, Perturb, set_attr, set_shape, table_tests, weights
from tests.passes.fuse_helpers import fires, info, init, model, node, refused

# -- builders for rules the other test files build inline ---------------------------------------------


def _chain(outer: str, inner: str) -> Callable[[], onnx.ModelProto]:
    def build() -> onnx.ModelProto:
        return model(
            [node(inner, ["x", "a"], "m"), node(outer, ["m", "b"], "y")],
            [info("x", [2, 3])],
            ["y"],
            [init("a", weights(3) + 3.0), init("b", weights(2, 1) + 3.0)],
        )

    return build


def _constant_row() -> onnx.ModelProto:
    fill = helper.make_tensor("k", TensorProto.INT64, [1], [1])
    return model(
        [
            node("ConstantOfShape", ["shape"], "f", value=fill),
            node("Gather", ["table", "f"], "g", axis=0),
            node("Add", ["e", "g"], "y"),
        ],
        [info("e", [4, 4, 4])],
        ["y"],
        [init("table", weights(4, 4)), init("shape", np.array([4, 4], np.int64))],
    )


# (outer, inner) -> the op the chain becomes
_CHAIN_RESULTS = {
    ("Mul", "Mul"): "Mul",
    ("Add", "Add"): "Add",
    ("Add", "Sub"): "Add",
    ("Sub", "Add"): "Add",
    ("Sub", "Sub"): "Sub",
    ("Div", "Div"): "Div",
    ("Div", "Mul"): "Mul",
    ("Mul", "Div"): "Mul",
}


def _arith_cases() -> dict[str, Case]:
    return {
        f"{inner.lower()}-{outer.lower()}-constants": Case(
            _chain(outer, inner),
            {result: 1},
            "m",
            NO_ATTR,
            Perturb(set_shape("x", None), "could widen x's rank"),
            NO_GATE,
        )
        for (outer, inner), result in _CHAIN_RESULTS.items()
    }


CASES: dict[str, Case] = {
    **_arith_cases(),
    "add-constant-row": Case(
        _constant_row,
        {"Add": 1},
        "g",
        Perturb(set_attr("g", axis=1), "not over rows"),
        Perturb(set_shape("e", ["a", 4, 4]), "do not provably have one shape"),
        NO_GATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "add-add-constants",
        "add-constant-row",
        "add-sub-constants",
        "div-div-constants",
        "div-mul-constants",
        "mul-div-constants",
        "mul-mul-constants",
        "sub-add-constants",
        "sub-sub-constants",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_constant_chains_combine_for_floats_only() -> None:
    def chain(dtype: int, np_type: Any) -> onnx.ModelProto:
        return model(
            [node("Mul", ["x", "a"], "m"), node("Div", ["m", "b"], "y")],
            [info("x", [2, 3], dtype)],
            [info("y", None, dtype)],
            [init("a", 3.0, np_type), init("b", 2.0, np_type)],
        )

    fires(chain(TensorProto.FLOAT, np.float32), "mul-div-constants", {"Mul": 1})
    refused(chain(TensorProto.INT64, np.int64), "mul-div-constants")


def test_scalar_constants_of_a_scalar_combine_into_a_scalar() -> None:
    """The combined constant keeps the constants' rank: a 0-d x scaled twice stays 0-d (a 1-D constant
    would widen the output, and the rewrite was refused for it)."""
    proto = model(
        [node("Mul", ["x", "two"], "a"), node("Mul", ["a", "three"], "y")],
        [info("x", [])],
        ["y"],
        [init("two", np.float32(2.0)), init("three", np.float32(3.0))],
    )
    out = fires(proto, "mul-mul-constants", {"Mul": 1})
    (mul,) = out.graph.node
    merged = next(t for t in out.graph.initializer if t.name in mul.input)
    assert list(merged.dims) == []
