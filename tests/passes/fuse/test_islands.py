"""The islands rules' table: a Cast to float16 and back between two ops the float32 rules compute in float32
(graphopt/passes/fuse/rules/islands.py). Each rule fires on its model and refuses its perturbations
(tests/passes/fuse/table.py says how); the family's own tests follow its table, and test_float32.py runs the whole
pipeline on the float16 Llama export."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto

from graphopt.passes.fuse.rules.islands import NARROWED, WIDENED
from tests.passes.fuse.table import LATE, NO_GATE, Case, Perturb, set_attr, table_tests
from tests.passes.fuse_helpers import info, model, node, refused

_UNTYPED = "n/a: the rule reads the Casts' names and target types only, which every model has"


def _island(moved: bool = False, names: tuple[str, str] = (NARROWED, WIDENED)) -> Callable[[], onnx.ModelProto]:
    """x -> Relu -> Cast to float16 -> [Transpose ->] Cast to float32 -> Relu, the Casts named ``names``: what the
    float32 rules leave between two ops they computed in float32 (their own Casts by default)."""

    def build() -> onnx.ModelProto:
        narrow, widen = (node("Cast", [a], b, to=to) for a, b, to in (("r", "n", F16), ("m" if moved else "n", "w", F)))
        narrow.name, widen.name = names[0] + "_0", names[1] + "_0"
        nodes = [node("Relu", ["x"], "r"), narrow, widen, node("Relu", ["w"], "y")]
        if moved:
            nodes.insert(2, node("Transpose", ["n"], "m", perm=[1, 0]))
        return model(nodes, [info("x", [3, 4], F)], [info("y", None, F)])

    return build


F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _exact_in_float16() -> dict[str, np.ndarray]:
    """Inputs float16 holds exactly: the round trip the rules drop changes nothing there, so the outputs compare."""
    return {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float16).astype(np.float32)}


def _case(moved: bool, expected: dict[str, int]) -> Case:
    return Case(
        _island(moved),
        expected,
        "n",
        Perturb(set_attr("n", to=TensorProto.BFLOAT16), None, note="the Cast down is to bfloat16"),
        _UNTYPED,
        NO_GATE,
        LATE,
        _exact_in_float16,
    )


CASES: dict[str, Case] = {
    "float32-island": _case(False, {"Relu": 2}),
    "float32-island-moved": _case(True, {"Relu": 2, "Transpose": 1}),
}

EXPORTED: dict[str, str] = {
    name: "its Casts are the float32 rules' own, which no export has; test_float32.py runs the whole pipeline on "
    "the float16 Llama export (tests/fixtures/exports/llama_fp16_dynamo.onnx), its RotaryEmbedding reading the "
    "RMSNormalization's float32 result and its Attention the RotaryEmbedding's"
    for name in CASES
}

BEFORE_EXPORTS: frozenset[str] = frozenset()

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_a_models_own_round_trip_through_float16_stays() -> None:
    """A Cast to float16 and back that the model has is a rounding it asked for: neither rule takes it."""
    for moved in (False, True):
        proto = _island(moved, names=("model_narrow", "model_widen"))()
        details = refused(proto, "float32-island-moved" if moved else "float32-island", fuse_late=True)
        assert not details["applied"], details
