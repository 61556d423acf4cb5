"""Building small models for the fuse rules and running the fuse pass on them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.api import optimize, pass_context
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from graphopt.passes.fuse import registered_rules
from graphopt.passes.pipeline import pipeline_from_config
from graphopt.passes.rewrite.engine import RuleSet, RunStats, Site, find_matches
from graphopt.settings import Settings
from tests.numerics import assert_same_outputs

F = TensorProto.FLOAT


def init(name: str, values: Any, dtype: Any = None) -> onnx.TensorProto:
    """An initializer; plain Python numbers become float32, arrays keep their dtype."""
    if dtype is None and not isinstance(values, np.ndarray):
        dtype = np.float32
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def info(name: str, shape: Sequence[int | str] | None, elem_type: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def node(op_type: str, inputs: Sequence[str], outputs: Sequence[str] | str, **attrs: Any) -> onnx.NodeProto:
    outs = [outputs] if isinstance(outputs, str) else list(outputs)
    domain = attrs.pop("domain", "")
    return helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs)


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[str | onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    outs = [info(o, None) if isinstance(o, str) else o for o in outputs]
    graph = helper.make_graph(list(nodes), "g", list(inputs), outs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def fuse(
    proto: onnx.ModelProto, passes: str = "shape-infer,fuse", enable: Sequence[str] = (), **settings: Any
) -> tuple[onnx.ModelProto, dict]:
    """Run ``passes`` on ``proto`` (the fuse pass with the rules ``enable`` names on too); the
    result and the fuse runs' details merged."""
    steps = [
        {"pass": p, "options": {"enable": list(enable)}} if p == "fuse" else {"pass": p} for p in passes.split(",")
    ]
    result = optimize(from_proto(proto), pipeline_from_config(steps), strict=True, **settings, check=False)
    applied: Counter[str] = Counter()
    misses: dict[str, list[str]] = {}
    for run in result.report["passes"]:
        if run["pass"] == "fuse":
            applied.update(run["details"]["applied"])
            for family, found in run["details"]["near_misses"].items():
                misses.setdefault(family, []).extend(found["examples"])
    return to_proto(result.model), {"applied": dict(applied), "near_misses": misses}


def lowering_misses(proto: onnx.ModelProto, goal: int) -> list[str]:
    """The lowering rules' near misses on ``proto`` at target opset ``goal``, none matching.

    Where a lowering refuses, the op stays and the fuse pass's conversion to ``goal`` stops
    (bad input naming the op), so the run's report is lost: the engine is asked directly."""
    ir = optimize(from_proto(proto), "shape-infer", strict=True, check=False).model
    stats = RunStats()
    lowering = RuleSet(r for r in registered_rules() if r.family == "lower")
    assert find_matches(ir.graph, lowering, Site(ir, ir.graph, goal, "onnx", pass_context(Settings())), stats) == []
    return stats.near_misses.get("lower", [])


def ops(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in proto.graph.node)


def fires(
    proto: onnx.ModelProto,
    rule: str,
    expected: dict[str, int],
    feeds: Mapping[str, np.ndarray] | None = None,
    **settings: Any,
) -> onnx.ModelProto:
    """``rule`` applies, the op counts are ``expected``, outputs keep their names and values (on ``feeds``, else
    seeded inputs)."""
    out, details = fuse(proto, **settings)
    assert details["applied"].get(rule, 0) >= 1, details
    assert dict(ops(out)) == expected
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert_same_outputs(proto, out, feeds, rtol=1e-4, atol=1e-4)
    return out


def fires_ort(
    proto: onnx.ModelProto, rule: str, expected: dict[str, int], passes: str = "shape-infer,fuse"
) -> onnx.ModelProto:
    """``fires`` for a ``--target ort`` rule (enabled, were it off by default): the result imports com.microsoft."""
    out = fires(proto, rule, expected, target="ort", passes=passes, enable=[rule])
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    return out


def refused(proto: onnx.ModelProto, rule: str, **settings: Any) -> dict[str, Any]:
    """``rule`` does not apply; outputs keep their names and values; the run's details."""
    out, details = fuse(proto, **settings)
    assert rule not in details["applied"], details
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4)
    return details


def expose(nodes: list[onnx.NodeProto], outputs: list[Any], value: str, how: str) -> None:
    """Make ``value`` visible outside a would-be match: "reader" adds a Relu reading it (and
    its output), "output" makes it a graph output, anything else leaves it alone."""
    if how == "reader":
        nodes.append(node("Relu", [value], f"{value}_read"))
        outputs.append(f"{value}_read")
    elif how == "output":
        outputs.append(value)
