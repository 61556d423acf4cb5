"""A rule's negative-table case on a graph an exporter wrote (tests/fixtures/exports): the fixture cut after the
first place the rule fires, and the values the perturbations change found through the rule's own pattern (the
names its bindings give them), not by the names the exporter gave them, which the next export changes.

A rule that other rules' output feeds (attention-heads-3d reads the Attention attention-4d writes) is located on
the fixture after the rest of the library has run; the values it names there are the exporter's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from graphopt.api import optimize, pass_context
from graphopt.io.onnx_io import from_proto
from graphopt.ir import Node, Value
from graphopt.passes.fuse import registered_rules
from graphopt.passes.pipeline import pipeline_from_config
from graphopt.passes.rewrite.engine import RuleSet, RunStats, Site, find_matches
from graphopt.settings import Settings
from tests.numerics import run_ort
from tests.passes.fuse_fixtures import FIXTURES, fixture_feeds

Change = Callable[[onnx.ModelProto], onnx.ModelProto]


@dataclass(frozen=True)
class Found:
    """Where a rule first matches (in the graph's order): the name of the value each binding stands for (a node
    binding: its first output), the root's output, and the outputs of the matched nodes a rewrite removes (not
    the root's, not an exported entry's), nearest the root first."""

    names: Mapping[str, str]
    root: str
    interior: tuple[str, ...]


def locate(proto: onnx.ModelProto, rule: str, settings: Mapping[str, Any]) -> Found:
    """Where ``rule`` first matches ``proto`` run at ``settings``: as exported, else once every other rule has
    run (a rule that reads another's fused op)."""
    run = {k: v for k, v in settings.items() if k != "enable"}
    for others in ([], [{"pass": "fuse", "options": {"disable": [rule]}}]):
        steps = pipeline_from_config([{"pass": "shape-infer"}, *others])
        found = optimize(from_proto(proto), steps, strict=True, **run, check=False).model
        graph = found.graph
        opset = max(found.opset_in(graph), run.get("target_opset", 0))
        named = Settings(target_opset=run.get("target_opset", 0))  # a rule may be written at a named opset only
        site = Site(found, graph, opset, run.get("target", "onnx"), pass_context(named))
        chosen = RuleSet(r for r in registered_rules() if r.name == rule)
        matches = find_matches(graph, chosen, site, RunStats())
        if matches:
            break
    else:
        raise LookupError(f"{rule} does not match this model")
    order = graph.positions()
    m = min(matches, key=lambda m: order[id(m.root)])
    names: dict[str, str] = {}
    for key, bound in m.bindings.items():
        if isinstance(key, str) and isinstance(bound, Node):
            names[key] = bound.outputs[0].name
        elif isinstance(key, str) and isinstance(bound, Value):
            names[key] = bound.name
    exported = {id(m.bindings.get(name)) for name in m.rule.exports}
    removed = [n for n in m.nodes if n is not m.root and id(n) not in exported]
    interior = tuple(v.name for n in reversed(removed) for v in n.outputs if v.name in _value_names(proto))
    return Found(names, m.root.outputs[0].name, interior)


def _value_names(proto: onnx.ModelProto) -> set[str]:
    return {o for n in proto.graph.node for o in n.output}


def _typed(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with the value infos onnx's shape inference gives (the exporter's own, where it wrote them)."""
    return shape_inference.infer_shapes(proto)


def cut(proto: onnx.ModelProto, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """The part of ``proto`` that computes ``outputs`` from ``inputs``."""
    return onnx.utils.Extractor(_typed(proto)).extract_model(inputs, outputs)


@functools.cache
def _first_layer(fixture: str, rule: str, frozen: tuple[tuple[str, Any], ...]) -> onnx.ModelProto:
    proto = onnx.load(str(FIXTURES / f"{fixture}.onnx"))
    root = locate(proto, rule, dict(frozen)).root
    if root not in _value_names(proto) or root in {o.name for o in proto.graph.output}:
        return proto  # the root is another rule's node (or an output): the whole export
    return cut(proto, [i.name for i in proto.graph.input], [root])


def first_layer(fixture: str, rule: str, settings: Mapping[str, Any]) -> onnx.ModelProto:
    """The export ``fixture`` up to the first place ``rule`` fires (its root's output the graph's output)."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))
    return copy.deepcopy(_first_layer(fixture, rule, frozen))


def fixture_inputs(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The fixtures' own inputs (ids and a padded mask at batch 2, sequence 6; pixels)."""
    return fixture_feeds(proto, 2, 6, "tail")


def constant_of(proto: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of constant ``name``: an initializer, or a Constant node's output."""
    for tensor in proto.graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    for made in proto.graph.node:
        if made.op_type == "Constant" and made.output[0] == name:
            return numpy_helper.to_array(made.attribute[0].t)
    raise LookupError(f"{name} is not a constant")


def with_constant(proto: onnx.ModelProto, name: str, values: np.ndarray) -> onnx.ModelProto:
    """``proto`` with constant ``name`` (an initializer or a Constant node's) holding ``values``."""
    out = copy.deepcopy(proto)
    kept = np.asarray(values, constant_of(proto, name).dtype)
    del out.graph.value_info[:]  # the shapes the exporter declared may no longer hold
    for tensor in out.graph.initializer:
        if tensor.name == name:
            tensor.CopyFrom(numpy_helper.from_array(kept, name))
    for made in out.graph.node:
        if made.op_type == "Constant" and made.output[0] == name:
            del made.attribute[:]
            made.attribute.append(helper.make_attribute("value", numpy_helper.from_array(kept)))
    return out


def untyped_cut(proto: onnx.ModelProto, values: list[str], undeclared: bool = False) -> onnx.ModelProto:
    """``proto`` with ``values`` graph inputs of unknown rank (their element types kept): what computed them is
    gone; ``undeclared``: the shapes the exporter declared elsewhere (values, graph outputs) too."""
    outputs = [o.name for o in proto.graph.output]
    out = cut(proto, [*(i.name for i in proto.graph.input if i.name not in values), *values], outputs)
    untyped = [*(i for i in out.graph.input if i.name in values), *(out.graph.output if undeclared else [])]
    for declared in untyped:
        declared.CopyFrom(helper.make_tensor_value_info(declared.name, declared.type.tensor_type.elem_type, None))
    if undeclared:
        del out.graph.value_info[:]
    return out


def cut_feeds(base: onnx.ModelProto, values: list[str]) -> Callable[[onnx.ModelProto], Mapping[str, np.ndarray]]:
    """The inputs of :func:`untyped_cut`'s model: the base's, and ``values`` as the base computes them."""

    def make(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
        given = fixture_inputs(base)
        probe = copy.deepcopy(base)
        probe.graph.output.extend(helper.make_empty_tensor_value_info(v) for v in values if v not in given)
        computed = {**given, **run_ort(probe, given)}
        return {i.name: computed[i.name] for i in proto.graph.input}

    return make
