"""The kronecker rules' table: the Kronecker product's MatMul. Each rule fires on its model and refuses its
perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an
export too, and the family's own tests follow its table."""

from __future__ import annotations

import numpy as np

from tests.passes.fuse.table import NO_GATE, ONE_NODE, Case, Exported, Perturb, nudged, set_shape, table_tests, weights
from tests.passes.fuse_models import kronecker

CASES: dict[str, Case] = {
    "kronecker-matmul": Case(
        lambda: kronecker(np.kron(weights(8, 6), weights(32, 48)), ["b", 5, 256]),
        {"Reshape": 2, "MatMul": 2},
        ONE_NODE,
        Perturb(nudged("w", (3, 5), 1e-3), None, note="a constant: one weight entry off the product"),
        Perturb(set_shape("x", None), "x has no known rank"),
        NO_GATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "kronecker-matmul",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))
