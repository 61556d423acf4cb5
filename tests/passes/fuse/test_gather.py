"""The gather rules' table: Gather of consecutive rows and Gather before Cast. Each rule fires on its model and
refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its
case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from tests.numerics import assert_same_outputs, make_feeds, run_ort
from tests.passes.fuse.table import (
    CONSTANTS_ONLY,
    F16,
    KINDS,
    LATE,
    THROUGH_QDQ,
    Case,
    Exported,
    Perturb,
    copied,
    perturbation,
    quantized,
    set_attr,
    set_const,
    table_tests,
    weights,
    with_reader,
)
from tests.passes.fuse_helpers import fires, fuse, info, init, model, node, ops


def _rows(cast: bool) -> Callable[[], onnx.ModelProto]:
    """BERT's position embedding: the table read at Slice(0..N-1, 0, seq) (float16 + Cast)."""

    def build() -> onnx.ModelProto:
        nodes = [
            node("Shape", ["x"], "seq", start=1),
            node("Slice", ["positions", "zero", "seq", "one", "one"], "pos"),
        ]
        table = weights(8, 8)
        if cast:
            nodes.append(node("Cast", ["table"], "tc", to=TensorProto.FLOAT))
        nodes.append(node("Gather", ["tc" if cast else "table", "pos"], "y", axis=0))
        params = [
            init("table", table.astype(np.float16) if cast else table),
            init("positions", np.arange(8, dtype=np.int64).reshape(1, 8)),
            init("zero", np.array([0], np.int64)),
            init("one", np.array([1], np.int64)),
        ]
        return model(nodes, [info("x", ["b", "s"])], ["y"], params)

    return build


def _cast_table(rows: int = 256) -> onnx.ModelProto:
    """A float16 vocabulary, widened to float32 and looked up by token ids."""
    nodes = [node("Cast", ["table"], "tc", to=TensorProto.FLOAT), node("Gather", ["tc", "ids"], "y", axis=0)]
    params = [init("table", weights(rows, 8).astype(np.float16))]
    return model(nodes, [info("ids", ["b", "s"], TensorProto.INT64)], ["y"], params)


CASES: dict[str, Case] = {
    "gather-before-cast": Case(
        _cast_table,
        {"Gather": 1, "Cast": 1},
        "tc",
        Perturb(set_attr("y", axis=1), "not over rows"),
        CONSTANTS_ONLY,
        "n/a: no opset gate (Gather and Cast exist at every opset the engine runs)",
    ),
    "gather-consecutive-rows": Case(
        _rows(cast=False),
        {"Shape": 1, "Slice": 1},
        "pos",
        Perturb(set_attr("y", axis=1), "not over rows"),
        CONSTANTS_ONLY,
        "n/a: below opset 10 Slice takes attributes, which the pattern does not match",
    ),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "gather-before-cast",
        "gather-consecutive-rows",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


CONSECUTIVE_ROWS = CASES["gather-consecutive-rows"]


@pytest.mark.parametrize(
    "kind",
    ["", *(k for k in KINDS if isinstance(perturbation(CONSECUTIVE_ROWS, k), Perturb))],
    ids=lambda k: k or "as is",
)
def test_a_quantized_position_table_gives_its_consecutive_rows_by_a_slice(kind: str) -> None:
    """bert's QDQ variants: quantize_static stores the position table int8 behind a DequantizeLinear, and the
    late rule qdq-gather-table-uint8 moves the Gather before it; then the rows are read by a Slice, bit for bit
    in onnxruntime. The case's perturbations, made in float32 and then quantized, refuse it there too (the
    table's QDQ column points here: the move makes a DequantizeLinear of its own, which the table's Q/DQ check
    does not allow)."""
    perturb = perturbation(CONSECUTIVE_ROWS, kind) if kind else Perturb(copied, None)
    assert isinstance(perturb, Perturb)
    base = perturb.change(CONSECUTIVE_ROWS.build())
    feeds = make_feeds(base, 0)
    proto = quantized(base, lambda seed: feeds)
    out, details = fuse(proto, CONSECUTIVE_ROWS.passes, **THROUGH_QDQ, **LATE)
    assert details["applied"].get("qdq-gather-table-uint8") == 1, details
    assert ("gather-consecutive-rows" in details["applied"]) == (not kind), details
    if not kind:
        assert ops(out)["Gather"] == 0
    elif perturb.reason is not None:
        assert any(perturb.reason in m for m in details["near_misses"].get("gather", [])), details
    rewritten = run_ort(out, feeds)
    for name, value in run_ort(proto, feeds).items():
        assert np.array_equal(value.view(np.uint32), rewritten[name].view(np.uint32)), name


def test_a_float16_table_is_cast_after_the_slice() -> None:
    """bert_fp16_weights' position table: Gather(Cast(T16), Slice(0..N-1)) -> Cast(Slice(T16)),
    casting the rows read only; the float16 data is stored once, as it was."""
    proto = _rows(cast=True)()
    out = fires(proto, "gather-consecutive-rows", {"Shape": 1, "Slice": 1, "Cast": 1}, passes="shape-infer,fuse,dce")
    assert [n.op_type for n in out.graph.node] == ["Shape", "Slice", "Cast"]
    (table,) = [t for t in out.graph.initializer if t.data_type == F16]
    assert list(table.dims) == [1, 8, 8]
    _, details = fuse(with_reader(proto, "tc"))
    assert "gather-consecutive-rows" not in details["applied"]


def test_a_cast_table_is_looked_up_then_cast_and_a_short_one_stays() -> None:
    out = fires(_cast_table(), "gather-before-cast", {"Gather": 1, "Cast": 1})
    assert [n.op_type for n in out.graph.node] == ["Gather", "Cast"]  # the rows read are cast, not the table
    short = _cast_table(rows=16)
    out, details = fuse(short)
    assert "gather-before-cast" not in details["applied"]
    assert "fewer than 256 rows" in " ".join(details["near_misses"]["gather"])
    assert_same_outputs(short, out)


def test_positions_that_are_not_a_range_stay_a_gather() -> None:
    proto = set_const("positions", np.arange(8, dtype=np.int64)[::-1].reshape(1, 8))(_rows(cast=False)())
    out, details = fuse(proto)
    assert "gather-consecutive-rows" not in details["applied"]
    assert "not 0, 1, ..." in " ".join(details["near_misses"]["gather"])
    assert_same_outputs(proto, out)
