"""const-cache's growth budget is the run's, not one pass instance's."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.io.onnx_io import from_proto
from graphopt.ir.model import Model
from graphopt.ir.stats import model_stats


def _two_growing_regions() -> Model:
    """x @ W1 + x @ -W1 ... : two Neg(W) folds of 60 KB each, both W kept alive by a direct reader.

    The model stores about 1.1 MB, so its 10% budget (110 KB) admits one fold and refuses the second."""
    rng = np.random.default_rng(0)
    big = numpy_helper.from_array(rng.standard_normal((250, 1000)).astype(np.float32), "big")
    w1 = numpy_helper.from_array(rng.standard_normal((120, 125)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((120, 125)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a1"]),
        helper.make_node("Neg", ["w1"], ["n1"]),
        helper.make_node("MatMul", ["x", "n1"], ["b1"]),
        helper.make_node("MatMul", ["x", "w2"], ["a2"]),
        helper.make_node("Neg", ["w2"], ["n2"]),
        helper.make_node("MatMul", ["x", "n2"], ["b2"]),
        helper.make_node("Sum", ["a1", "b1", "a2", "b2"], ["s"]),
        helper.make_node("MatMul", ["y", "big"], ["t"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 120]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 250]),
        ],
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 125]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 1000]),
        ],
        [big, w1, w2],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return from_proto(proto)


def test_the_growth_budget_spans_every_const_cache_step_of_a_run() -> None:
    model = _two_growing_regions()
    before = model_stats(model).initializer_bytes
    # Two const-cache steps, as the default pipeline has (one per simplify group).
    result = graphopt.optimize(model, "const-cache,dce,const-cache,dce", check=False)
    after = model_stats(result.model).initializer_bytes
    assert after - before <= 0.1 * before
    assert sum(n.op_type == "Neg" for n in result.model.graph.nodes) == 1
