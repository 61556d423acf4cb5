"""The embed rules' table: onnxruntime's EmbedLayerNormalization. Each rule fires on its model and refuses its
perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an
export too, and the family's own tests follow its table."""

from __future__ import annotations

from tests.passes.fuse.table import NO_GATE, Case, Exported, Perturb, set_attr, set_shape, table_tests
from tests.passes.fuse_models import embed

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
