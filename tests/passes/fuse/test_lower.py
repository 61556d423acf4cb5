"""The lower rules' table: lowerings of newer ops to a target opset that lacks them. Each rule fires on its model and
refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its
case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphopt.errors import InputError
from tests.passes.fuse.table import (
    LOWERED_NODE,
    Case,
    Exported,
    Perturb,
    at_opset,
    not_below,
    refused_lowering,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    weights,
)
from tests.passes.fuse_helpers import fuse, info, init, model, node
from tests.passes.fuse_models import (
    LOWERED,
    rand_weight,
)


def _lowered(key: str) -> Callable[[], onnx.ModelProto]:
    """test_fuse_shatter's opset-23 (Split: 18) model of ``key`` (a copy: the table's is shared)."""
    return lambda: copy.deepcopy(LOWERED[key][0])


def _per_group(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The opset-18 GroupNormalization: the model at opset 20, scale and bias per group."""
    return set_const("b", weights(2))(set_const("g", weights(2))(at_opset(20)(proto)))


def _opset13_split(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The Split at opset 17: sizes as an input (8 does not split evenly in 3)."""
    out = set_attr("a", num_outputs=None)(at_opset(17)(proto))
    out.graph.node[0].input.append("sizes")
    out.graph.initializer.append(init("sizes", np.array([3, 3, 2], np.int64)))
    return out


INT_STASH = set_attr("y", stash_type=TensorProto.INT64)


def _lowering_cases() -> dict[str, Case]:
    """The lowering rules fire only below the op's since-version (--target-opset): the opset
    column is a target opset that has the op (or an older form of it), and a refusal stops the
    conversion to the target, which lacks the op."""

    def lowering(
        key: str, expected: dict[str, int], wrong_attr: Perturb | str, unprovable: Perturb | str, gate: Perturb
    ) -> Case:
        return Case(
            _lowered(key), expected, LOWERED_NODE, wrong_attr, unprovable, gate, {"target_opset": LOWERED[key][1]}
        )

    def norm(op_type: str, key: str, expected: dict[str, int], since: int) -> Case:
        return lowering(
            key,
            expected,
            refused_lowering(op_type, INT_STASH, "stash_type 7 is not a float", note="stash_type int64"),
            refused_lowering(
                op_type,
                lambda p: set_shape("x", None)(set_attr("y", axis=2)(p)),
                "a positive axis on an input of unknown rank",
                note="axis=2",
            ),
            not_below(since),
        )

    statistics = {"ReduceMean": 2, "Sub": 1, "Mul": 2, "Add": 2, "Sqrt": 1, "Div": 1}
    return {
        "lower-layernorm": norm("LayerNormalization", "layernorm", statistics, 17),
        "lower-gelu": lowering(
            "gelu",
            {"Div": 1, "Erf": 1, "Add": 1, "Mul": 2},
            "n/a: both approximations lower (the tanh one: test_fuse_shatter)",
            "n/a: element-wise; it needs x's float type only, which a Gelu input has",
            not_below(20),
        ),
        "lower-rmsnorm": norm(
            "RMSNormalization", "rmsnorm", {"Mul": 2, "ReduceMean": 1, "Add": 1, "Sqrt": 1, "Div": 1}, 23
        ),
        "lower-groupnorm": lowering(
            "groupnorm",
            {**statistics, "Reshape": 4, "Shape": 1},
            refused_lowering("GroupNormalization", INT_STASH, "is not a float", note="stash_type int64"),
            refused_lowering("GroupNormalization", set_shape("x", None), "not provably of rank 3 or more"),
            Perturb(
                _per_group,
                "the target opset has this (opset 18) GroupNormalization",
                settings={"target_opset": 19},
                note="the opset-18 form, per group, --target-opset 19",
            ),
        ),
        "lower-attention": lowering(
            "attention-gqa-mask",
            {"Reshape": 6, "Transpose": 4, "Expand": 2, "MatMul": 2, "Mul": 1, "Add": 1, "Softmax": 1},
            refused_lowering("Attention", set_attr("y", softcap=1.0), "softcap", note="softcap=1"),
            refused_lowering("Attention", set_shape("q", None), "not provably all 3-D or all 4-D"),
            not_below(23),
        ),
        "lower-split": lowering(
            "split",
            {"Slice": 3},
            "n/a: any axis and number of outputs lower",
            refused_lowering("Split", set_shape("x", [2, "n"]), "the split axis is not static"),
            Perturb(
                _opset13_split,
                "an opset-13 Split converts as it is",
                settings={"target_opset": 16},
                note="an opset-13 Split, --target-opset 16",
            ),
        ),
    }


CASES: dict[str, Case] = {
    **_lowering_cases(),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "lower-attention",
        "lower-gelu",
        "lower-groupnorm",
        "lower-layernorm",
        "lower-rmsnorm",
        "lower-split",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_a_model_that_cannot_be_converted_is_bad_input_naming_the_op() -> None:
    # No rule lowers RotaryEmbedding (LayerNormalization, which this used to test, now lowers).
    proto = model(
        [node("RotaryEmbedding", ["x", "cos", "sin"], "y")],
        [info("x", [1, 2, 3, 4])],
        ["y"],
        [init("cos", rand_weight(3, 2)), init("sin", rand_weight(3, 2))],
        opset=23,
    )
    with pytest.raises(InputError, match="RotaryEmbedding"):
        fuse(proto, target_opset=22)
