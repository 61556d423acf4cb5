"""The expose rules' table: a graph output exposed from inside a fused region. Each rule fires on its model and
refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its
case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

from tests.numerics import make_feeds
from tests.passes.fuse.table import NO_GATE, Case, Exported, Perturb, set_attr, set_shape, table_tests
from tests.passes.fuse_models import projections

CASES: dict[str, Case] = {
    "gemm-as-matmul": Case(
        projections,
        {"MatMul": 3},
        "n/a: one node, the Gemm (an Add reading its MatMul sibling stops it: test_fuse_shatter)",
        Perturb(lambda p: set_attr("q", "v", transA=1)(set_shape("x", [64, 64])(p)), "transA=1", make_feeds),
        Perturb(set_shape("x", None), None, note="x's depth, so no provable bare MatMul sibling"),
        NO_GATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "gemm-as-matmul",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))
