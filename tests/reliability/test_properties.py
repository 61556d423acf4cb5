"""Property-based: every registered pass, and the default pipeline, on random small valid graphs.

For each drawn graph (random_graphs.py) and each pass: the pass does not fail (a rolled
back failure counts as one), the graph still verifies and passes the ONNX checker, and
either the model is byte-identical or onnxruntime computes the same outputs at two
bindings of the symbolic dim. The default pipeline is, in addition, a fixpoint: a second
run changes nothing (what the --check-optimized gate relies on).
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto, to_proto
from graphopt.passes.base import all_passes
from tests.numerics import assert_same_outputs
from tests.reliability.random_graphs import random_models

EXAMPLES = 800
PASSES = sorted(name for name in all_passes() if not name.startswith("test-"))
seen = {"examples": 0, "changed": 0}


def serialized(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def feeds_at(model: onnx.ModelProto, n: int) -> dict[str, np.ndarray]:
    """Inputs with N = n and M = n + 1 (two names, two values: a pass may not confuse them)."""
    rng = np.random.default_rng(n)
    bound = {"N": n, "M": n + 1}
    feeds = {}
    for value in model.graph.input:
        shape = [
            d.dim_value if d.HasField("dim_value") else bound[d.dim_param] for d in value.type.tensor_type.shape.dim
        ]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def optimized(proto: onnx.ModelProto, passes: str | None) -> onnx.ModelProto:
    result = optimize(from_proto(proto), passes)
    assert result.report["failures"] == [], f"{passes or 'default pipeline'}: {result.report['failures']}"
    result.model.graph.verify()
    return to_proto(result.model)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_models())
def test_passes_keep_numerics_or_leave_the_graph_alone(proto: onnx.ModelProto) -> None:
    seen["examples"] += 1
    unchanged = serialized(to_proto(from_proto(proto)))
    bindings = [feeds_at(proto, n) for n in (1, 5)]
    for passes in [*PASSES, None]:
        after = optimized(proto, passes)
        if serialized(after) == unchanged:
            continue
        seen["changed"] += 1
        onnx.checker.check_model(after, full_check=True)
        for feeds in bindings:
            assert_same_outputs(proto, after, feeds, rtol=1e-5, atol=1e-6)
        if passes is None:
            assert serialized(optimized(after, None)) == serialized(after), "the default pipeline is not a fixpoint"


def test_the_property_run_saw_every_pass_change_something() -> None:
    """The generator is worth its time: it gives every pass something to do."""
    seen_changed: dict[str, int] = {}

    @settings(max_examples=25, deadline=None, database=None)
    @given(random_models())
    def count(proto: onnx.ModelProto) -> None:
        # Each pass runs on the model as shape-infer leaves it (strip-value-info needs types to strip).
        unchanged = serialized(to_proto(from_proto(proto)))
        inferred = serialized(to_proto(optimize(from_proto(proto), "shape-infer").model))
        for name in PASSES:
            if name == "shape-infer":
                before, result = unchanged, optimize(from_proto(proto), name)
            else:
                before, result = inferred, optimize(from_proto(proto), f"shape-infer,{name}")
            if serialized(to_proto(result.model)) != before:
                seen_changed[name] = seen_changed.get(name, 0) + 1

    count()
    assert sorted(seen_changed) == PASSES, seen_changed
