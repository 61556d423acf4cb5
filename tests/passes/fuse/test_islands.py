"""The islands rules' table: a Cast to float16 and back between two ops the float32 rules compute in float32
(graphopt/passes/fuse/rules/islands.py). Each rule fires on its model and refuses its perturbations
(tests/passes/fuse/table.py says how); the family's own tests follow its table, and test_float32.py runs the whole
pipeline on the float16 Llama export."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphopt.passes.fuse.rules.islands import NARROWED, WIDENED
from tests.passes.fuse.table import LATE, NO_GATE, Case, Perturb, set_attr, table_tests
from tests.passes.fuse_helpers import fires, info, init, model, node, refused

PASSES = "shape-infer,fuse,dce"
_UNTYPED = "n/a: the rule reads the Casts' names and target types only, which every model has"


def _island(
    move: str = "", names: tuple[str, str] = (NARROWED, WIDENED), read: bool = False
) -> Callable[[], onnx.ModelProto]:
    """x -> Relu -> Cast to float16 -> [``move`` ->] Cast to float32 -> Relu, the Casts named ``names``: what the
    float32 rules leave between two ops they computed in float32 (their own Casts by default); ``read``: the float16
    value is a graph output too."""

    def build() -> onnx.ModelProto:
        narrow, widen = (node("Cast", [a], b, to=to) for a, b, to in (("r", "n", F16), ("m" if move else "n", "w", F)))
        narrow.name, widen.name = names[0] + "_0", names[1] + "_0"
        nodes = [node("Relu", ["x"], "r"), narrow, widen, node("Relu", ["w"], "y")]
        initializers = []
        if move == "Transpose":
            nodes.insert(2, node("Transpose", ["n"], "m", perm=[1, 0]))
        elif move == "Reshape":
            nodes.insert(2, node("Reshape", ["n", "shape"], "m"))
            initializers.append(init("shape", np.array([2, 6], np.int64)))
        outputs = [info("y", None, F), *([info("n", None, F16)] if read else [])]
        return model(nodes, [info("x", [3, 4], F)], outputs, initializers)

    return build


F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _exact_in_float16() -> dict[str, np.ndarray]:
    """Inputs float16 holds exactly: the round trip the rules drop changes nothing there, so the outputs compare."""
    return {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float16).astype(np.float32)}


def _case(move: str, expected: dict[str, int]) -> Case:
    return Case(
        _island(move),
        expected,
        "n/a: the match is the Cast to float32 alone; what it reads stays for its other readers (test below)",
        Perturb(set_attr("n", to=TensorProto.BFLOAT16), None, note="the Cast down is to bfloat16"),
        _UNTYPED,
        NO_GATE,
        LATE,
        _exact_in_float16,
        passes=PASSES,
    )


CASES: dict[str, Case] = {
    "float32-island": _case("", {"Relu": 2}),
    "float32-island-moved": _case("Transpose", {"Relu": 2, "Transpose": 1}),
}

EXPORTED: dict[str, str] = {
    name: "its Casts are the float32 rules' own, which no export has; test_float32.py runs the whole pipeline on "
    "the float16 Llama export (tests/fixtures/exports/llama_fp16_dynamo.onnx), its Attention reading the "
    "RotaryEmbeddings' float32 results (test_a_float16_llama_layer_computes_its_norms_attention_and_rotary_in_float32)"
    for name in CASES
}

BEFORE_EXPORTS: frozenset[str] = frozenset()

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_a_models_own_round_trip_through_float16_stays() -> None:
    """A Cast to float16 and back that the model has is a rounding it asked for: neither rule takes it."""
    for move in ("", "Transpose"):
        proto = _island(move, names=("model_narrow", "model_widen"))()
        details = refused(proto, "float32-island-moved" if move else "float32-island", fuse_late=True)
        assert not details["applied"], details


def test_an_island_through_a_reshape() -> None:
    """The Reshape keeps its target shape, on the float32 value."""
    expected = {"Relu": 2, "Reshape": 1}
    fires(_island("Reshape")(), "float32-island-moved", expected, _exact_in_float16(), passes=PASSES, fuse_late=True)


@pytest.mark.parametrize("move", ["", "Transpose"])
def test_the_float16_value_stays_for_its_other_readers(move: str) -> None:
    """The island forms; the graph output that reads the float16 value still gets it from its Cast."""
    rule = "float32-island-moved" if move else "float32-island"
    expected = {"Relu": 2, "Cast": 1, **({move: 1} if move else {})}
    out = fires(_island(move, read=True)(), rule, expected, _exact_in_float16(), passes=PASSES, fuse_late=True)
    producers = {o: n for n in out.graph.node for o in n.output}
    assert producers["n"].op_type == "Cast"
    assert producers[producers["y"].input[0]].op_type != "Cast"
