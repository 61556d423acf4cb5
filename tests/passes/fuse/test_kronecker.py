"""The kronecker rules' table: the Kronecker product's MatMul. Each rule fires on its model and refuses its
perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an
export too, and the family's own tests follow its table."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from graphopt.api import optimize
from graphopt.passes.fuse.rules import kronecker as rule
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


def test_a_float16_weight_with_an_outlier_sends_no_split_to_the_full_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """vit_small_timm's float16 weights: ordinary entries ~0.02 beside one of ~8. Their minors were within 8 float16
    ulps of the outlier, so every split of every weight was factored in full at every fuse round (93 of the 129 s
    of its run). A minor is judged by the products it compares: no split reaches the full test; a float16 Kronecker
    product with an outlier still factors."""
    rng = np.random.default_rng(0)
    plain = (0.02 * rng.standard_normal((256, 256))).astype(np.float16)
    plain[17, 40] = 8.0
    factored: list[object] = []
    full_test = rule._factor
    monkeypatch.setattr(rule, "_factor", lambda *args: factored.append(args) or full_test(*args))
    assert rule.kronecker_factors(plain) is None
    assert not factored
    a, b = 0.1 * rng.standard_normal((16, 8)), 0.1 * rng.standard_normal((16, 32))
    a[3, 2] = 40.0
    product = np.kron(a, b).astype(np.float16)
    found = rule.kronecker_factors(product)
    assert found is not None
    within = 8 * float(np.finfo(np.float16).eps) * float(np.abs(product).max())  # the rule's own tolerance
    np.testing.assert_allclose(np.kron(found.a, found.b).astype(np.float32), product.astype(np.float32), atol=within)


def test_a_weight_is_screened_once_however_many_rounds_the_pass_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pattern's test read every MatMul weight at every fuse round (bert_small: its 16 weights 192 times, a
    quarter of its run); a weight's answer is kept while its values are."""
    screened: list[object] = []
    sampled = rule._sampled_splits
    monkeypatch.setattr(rule, "_sampled_splits", lambda w: screened.append(w) or sampled(w))
    plain = kronecker(weights(256, 256), ["b", 5, 256])
    result = optimize(plain, check=False, runtime_guard=False)
    assert sum(run.name == "fuse" for run in result.pipeline_run.runs) > 1
    assert len(screened) == 1
    assert Counter(n.op_type for n in result.model.graph.node) == {"MatMul": 1}
