"""The default pipeline stays linear in the graph's size (issue 40, "linear again").

The noop sweep once sorted the whole graph for every match it tried: a 20,000-node Identity
chain took 419 s, against about 1.3 s when each match is ordered by its own nodes (the slowest
shape here, the Transposed Conv chain, 5.5 s on a quiet 2-core machine; 21 s at a load average
of 20). The bound is out of reach of a quadratic pass and left room for a loaded CI machine.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

from graphopt.api import optimize

SIZE = 20_000
BOUND_SECONDS = 60.0
pytestmark = pytest.mark.timed

# The scale benchmark's own graph shapes (benchmarks/scale.py), so the test and the figures in
# BENCHMARKS.md measure the same graphs.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
scale = importlib.import_module("scale")


@pytest.mark.parametrize("shape", ["chain", "fan_in", "fan_out", "transposed_convs"])
def test_default_pipeline_is_linear_on_20k_nodes(shape: str) -> None:
    model = getattr(scale, shape)(SIZE)
    start = time.perf_counter()
    # The pipeline's own time: the runtime guard's onnxruntime session loads are onnxruntime's.
    result = optimize(model, check=False, runtime_guard=False)
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_SECONDS, f"{shape}: {elapsed:.1f} s for {SIZE} nodes"
    assert len(result.model.graph) <= SIZE
