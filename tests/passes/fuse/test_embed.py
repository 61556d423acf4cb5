"""The embed rules' table: onnxruntime's EmbedLayerNormalization. Each rule fires on its model and refuses its
perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an
export too, and the family's own tests follow its table."""

from __future__ import annotations

import onnx
import pytest

from tests.passes.fuse.table import NO_GATE, Case, Exported, Perturb, set_attr, set_shape, table_tests
from tests.passes.fuse_helpers import fires_ort, refused
from tests.passes.fuse_models import (
    embed,
)

CASES: dict[str, Case] = {
    "ort-embedlayernorm": Case(
        lambda: embed("row"),
        {"EmbedLayerNormalization": 1, "Cast": 1},
        "typed",
        Perturb(set_attr("y", axis=1), "not over the last axis"),
        Perturb(set_shape("input_ids", None), "not 2-D int32 / int64 of known shape"),
        NO_GATE,
        {"target": "ort", "enable": ["embed"]},
        passes="shape-infer,fuse,dce",
    ),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "ort-embedlayernorm",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


@pytest.mark.parametrize("extra", ["none", "segment", "row"])
def test_bert_embeddings_become_embedlayernorm(extra: str) -> None:
    expected = {"EmbedLayerNormalization": 1, "Cast": 1 + (extra == "segment")}
    out = fires_ort(embed(extra), "ort-embedlayernorm", expected, passes="shape-infer,fuse,dce")
    assert [n.op_type for n in out.graph.node][-1] == "EmbedLayerNormalization"


def test_int32_ids_need_no_cast() -> None:
    fires_ort(
        embed(ids_type=onnx.TensorProto.INT32),
        "ort-embedlayernorm",
        {"EmbedLayerNormalization": 1},
        "shape-infer,fuse,dce",
    )


def test_embedlayernorm_refusals() -> None:
    for extra in ("reader", "output"):
        refused(embed(extra), "ort-embedlayernorm", target="ort", enable=["embed"])
    details = refused(embed(axis=1), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not over the last axis" in " ".join(details["near_misses"]["embed"])
    details = refused(embed("position-input"), "ort-embedlayernorm", target="ort", enable=["embed"])
    assert "not provably 0 .. S-1" in " ".join(details["near_misses"]["embed"])
    refused(embed(), "ort-embedlayernorm", enable=["embed"])  # target onnx
    refused(embed(), "ort-embedlayernorm", target="ort")  # off by default: slower in onnxruntime
