"""The fuse rules' table, shared by the families' test files (tests/passes/fuse/test_<family>.py): what a case
is, how it is perturbed, and the tests every rule's case runs.

Every fuse rule, table-driven: it fires on its model (numerics equal in onnxruntime, graph outputs keep their
names), and it does not fire when the model is perturbed one way: an interior value gets an extra reader, an
interior value becomes a graph output, an attribute (or, for a rule that reads none, a constant) is wrong, a shape
it needs is not provable, or the opset is below the rule's gate. A refusal keeps the numerics and, where the engine
reports near misses, names its reason. A lowering rule (it fires only where --target-opset is below its op's
since-version) reads the opset column as a target that has the op; a refusal leaves the op at a target that lacks
it, so the conversion stops naming the op (bad input), and the near miss is asked of the engine.

A rule that a perturbation does not apply to says why in its CASE (a string instead of the perturbation);
``python -m tests.passes.fuse.test_contract`` prints the coverage matrix.

A rule newer than the exporter fixtures (tests/fixtures/exports) has a second case in its family's EXPORTED: the
same perturbations on an exporter-written graph, cut after the rule's first match, at the values the rule's
pattern binds there (fuse_exported), or why no fixture has the spelling.

A family's test file holds its CASES, EXPORTED and BEFORE_EXPORTS and takes the table's tests in with
``globals().update(table_tests(CASES, EXPORTED))``; test_contract.py checks that every registered rule has its
case in its family's file.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from graphopt.errors import InputError
from graphopt.passes.fuse import registered_rules
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse_exported import (
    Change,
    Found,
    constant_of,
    cut_feeds,
    first_layer,
    fixture_inputs,
    locate,
    untyped_cut,
    with_constant,
)
from tests.passes.fuse_fixtures import FIXTURES
from tests.passes.fuse_helpers import fires, fuse, info, init, lowering_misses, node, ops

RNG = np.random.default_rng(2)
F16 = TensorProto.FLOAT16


def weights(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Perturb:
    """A change that must stop the rule, and the near miss it reports (None: the pattern no
    longer matches structurally, so there is nothing to report)."""

    change: Change
    reason: str | None
    feeds: Callable[[onnx.ModelProto], Mapping[str, np.ndarray]] | None = None  # default: the base model's
    note: str = ""  # what the perturbation is, where the column's name does not say it
    settings: Mapping[str, Any] | None = None  # run settings over the case's (a lowering's target opset)
    # A lowering refused leaves this op at a target opset that lacks it: the conversion stops.
    stops: str | None = None


@dataclass(frozen=True)
class Case:
    """One rule's model, where it fires, and its perturbations (a string: why one does not apply)."""

    build: Callable[[], onnx.ModelProto]
    expected: dict[str, int]
    interior: str
    wrong_attr: Perturb | str
    unprovable: Perturb | str
    low_opset: Perturb | str
    settings: dict[str, Any] = field(default_factory=dict)
    feeds: Callable[[], Mapping[str, np.ndarray]] | None = None
    passes: str = "shape-infer,fuse"


# -- perturbations ----------------------------------------------------------------------------------


def copied(proto: onnx.ModelProto) -> onnx.ModelProto:
    return copy.deepcopy(proto)


def _value_info(proto: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """``name`` as a graph output: its element type as inference has it, no shape."""
    inferred = shape_inference.infer_shapes(proto)
    for found in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        if found.name == name:
            return helper.make_tensor_value_info(name, found.type.tensor_type.elem_type, None)
    return info(name, None)


def with_reader(proto: onnx.ModelProto, value: str) -> onnx.ModelProto:
    out = copied(proto)
    out.graph.node.append(node("Identity", [value], f"{value}_read"))
    out.graph.output.append(_value_info(proto, value))
    out.graph.output[-1].name = f"{value}_read"
    return out


def with_output(proto: onnx.ModelProto, value: str) -> onnx.ModelProto:
    out = copied(proto)
    out.graph.output.append(_value_info(proto, value))
    return out


def set_attr(*outputs: str, **attrs: Any) -> Change:
    """Set attributes on the nodes producing ``outputs`` (None removes one)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        for found in out.graph.node:
            if found.output[0] in outputs:
                kept = [a for a in found.attribute if a.name not in attrs]
                del found.attribute[:]
                found.attribute.extend(kept)
                found.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items() if v is not None)
        return out

    return change


def set_shape(name: str, shape: list[Any] | None) -> Change:
    """Declare graph input ``name`` with ``shape`` (None: unknown rank)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        for found in out.graph.input:
            if found.name == name:
                found.CopyFrom(helper.make_tensor_value_info(name, found.type.tensor_type.elem_type, shape))
        return out

    return change


def set_const(name: str, values: Any) -> Change:
    """Replace initializer ``name`` (keeping its element type)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        for index, found in enumerate(out.graph.initializer):
            if found.name == name:
                dtype = helper.tensor_dtype_to_np_dtype(found.data_type)
                out.graph.initializer[index].CopyFrom(init(name, np.asarray(values, dtype)))
        return out

    return change


def training(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The BatchNormalization in training mode (its running statistics as unused outputs)."""
    out = set_attr("y", training_mode=1)(proto)
    next(n for n in out.graph.node if n.op_type == "BatchNormalization").output.extend(["running_mean", "running_var"])
    return out


def at_opset(version: int) -> Change:
    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        for found in out.opset_import:
            if found.domain in ("", "ai.onnx"):
                found.version = version
        return out

    return change


def below(version: int) -> Perturb:
    """The rule's gate: one opset below its minimum."""
    return Perturb(at_opset(version - 1), f"needs opset >= {version}")


def truncated(build: Callable[[], onnx.ModelProto], value: str) -> Callable[[], onnx.ModelProto]:
    """``build``'s model cut after ``value``, which becomes the output ``y``."""

    def cut() -> onnx.ModelProto:
        proto = build()
        kept = []
        for found in proto.graph.node:
            kept.append(found)
            if value in found.output:
                break
        for found in kept:
            found.output[:] = ["y" if o == value else o for o in found.output]
        del proto.graph.node[:]
        proto.graph.node.extend(kept)
        return proto

    return cut


def nudged(name: str, index: tuple[int, ...], by: float) -> Change:
    """Add ``by`` to one entry of initializer ``name``."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        found = next(t for t in proto.graph.initializer if t.name == name)
        values = numpy_helper.to_array(found).copy()
        values[index] += by
        return set_const(name, values)(proto)

    return change


def refused_lowering(op_type: str, change: Change, reason: str, note: str = "") -> Perturb:
    """A lowering the rule refuses: ``op_type`` stays, and the conversion to the target opset,
    which lacks it, stops naming it (bad input)."""
    return Perturb(change, reason, note=note, stops=op_type)


def not_below(since: int) -> Perturb:
    """A lowering's gate: the target opset is the op's since-version, which has the op."""
    return Perturb(copied, None, settings={"target_opset": since}, note=f"--target-opset {since}, not below")


# -- the table ----------------------------------------------------------------------------------------


NO_ATTR = "n/a: the pattern reads no attribute"
SLICE_INPUTS = "n/a: below opset 10 a Slice's bounds are attributes, which the pattern does not read (no match)"
ELEMENTWISE = "n/a: element-wise; the rule needs no shape"
NO_GATE = "n/a: no opset gate"
ONE_NODE = "n/a: one node"
LOWERED_NODE = "n/a: one node, whose outputs the lowering stands for (their names kept: fires)"
CONSTANTS_ONLY = "n/a: the rule reads constants only, whose shapes are known"


# -- cases on exporter-written graphs ------------------------------------------------------------------


@dataclass(frozen=True)
class At:
    """A perturbation of an exporter case, made at the values the rule's bindings name there (fuse_exported)."""

    change: Callable[[Found], Change]
    reason: str | None
    note: str
    cuts: tuple[str, ...] = ()  # bindings whose values become graph inputs (fed what the base computes)


def attr_at(binding: str, reason: str | None, **attrs: Any) -> At:
    """Set attributes on the node bound to ``binding``."""
    note = f"{binding} " + ", ".join(f"{k}={v}" for k, v in attrs.items())
    return At(lambda found: set_attr(found.names[binding], **attrs), reason, note)


def constant_at(binding: str, values: Callable[[np.ndarray], np.ndarray], reason: str | None, note: str) -> At:
    """Replace the constant bound to ``binding`` (an initializer or a Constant node's) by ``values`` of it."""

    def change(found: Found) -> Change:
        name = found.names[binding]
        return lambda proto: with_constant(proto, name, values(constant_of(proto, name)))

    return At(change, reason, f"the constant {binding}: {note}")


def untyped_at(bindings: tuple[str, ...], reason: str | None, undeclared: bool = False, why: str = "") -> At:
    """Cut the graph at the values bound to ``bindings``: graph inputs of unknown rank, fed what the base computes
    (``undeclared``: no shape the exporter declared is left either)."""
    note = f"{' and '.join(bindings)} of unknown rank, cut from what computed {'it' if len(bindings) == 1 else 'them'}"
    note += "; no declared shapes" if undeclared else ""
    note += f": {why}" if why else ""

    def change(found: Found) -> Change:
        return lambda proto: untyped_cut(proto, [found.names[b] for b in bindings], undeclared)

    return At(change, reason, note, bindings)


def target_opset(version: int, reason: str | None, why: str = "") -> Perturb:
    """The run's target opset (the export's own is older: the fuse pass converts it up first)."""
    note = f"--target-opset {version}" + (f": {why}" if why else "")
    return Perturb(copied, reason, settings={"target_opset": version}, note=note)


@dataclass(frozen=True)
class Exported:
    """A rule's case on exporter-written graphs: each of ``fixtures`` cut after the rule's first match (the whole
    export where the rule's root is another rule's node), run at ``settings``; ``expected``: how many of these ops
    the fused graph holds; each perturbation made at the values the rule's bindings name (a string: why one does
    not apply). The interior value read elsewhere or made a graph output is the removed value nearest the root."""

    fixtures: tuple[str, ...]
    expected: dict[str, int]
    wrong: At | str
    unprovable: At | str
    gate: Perturb | str
    settings: dict[str, Any] = field(default_factory=dict)
    interior: str = ""  # "n/a: ..." where the match removes no value but its root's
    passes: str = "shape-infer,fuse,dce"


# -- late rules (the default pipeline's last simplify): the bert dynamo fixture's MLP, exported ---------


def exported_mlp(
    until: str = "linear_5", seq: int | str = 6, fixture: str = "bert_dynamo", start: str = "layer_norm_1"
) -> onnx.ModelProto:
    """The first MLP of a bert fixture as written, MatMul + Add, GELU (the dynamo fixture's Gelu, the TorchScript
    one's erf formula), MatMul + Add (to ``until``), its input [batch, ``seq``, 32]: the export's sequence is
    dynamic, a ViT's is static."""
    # the TorchScript exporter writes no value_info, which the extractor needs
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(FIXTURES / f"{fixture}.onnx")))
    cut = onnx.utils.Extractor(proto).extract_model([start], [until])
    del cut.graph.value_info[:]  # the exporter's shapes, with the sequence dynamic
    for output in cut.graph.output:
        output.type.tensor_type.ClearField("shape")
    return set_shape(start, ["batch", seq, 32])(cut)


BOTH_DYNAMIC = set_shape("layer_norm_1", ["batch", "sequence", 32])
LATE = {"fuse_late": True}


# -- the tests every case runs ----------------------------------------------------------------------

KINDS = ("reader", "output", "attr", "shape", "opset")


def _feeds(case: Case, proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    return case.feeds() if case.feeds is not None else make_feeds(proto)


def _run(case: Case, proto: onnx.ModelProto, perturb: Perturb) -> tuple[onnx.ModelProto, dict[str, Any]]:
    settings = {**case.settings, **(perturb.settings or {})}
    enable = settings.pop("enable", [])
    return fuse(proto, case.passes, enable=enable, **settings)


def perturbation(case: Case, kind: str) -> Perturb | str:
    if kind in ("reader", "output"):
        if case.interior.startswith("n/a"):
            return case.interior
        how = with_reader if kind == "reader" else with_output
        return Perturb(lambda p: how(p, case.interior), "is also read by" if kind == "reader" else "graph output")
    return {"attr": case.wrong_attr, "shape": case.unprovable, "opset": case.low_opset}[kind]


def exported_perturbation(spec: Exported, kind: str) -> At | Perturb | str:
    """The perturbation ``kind`` of an exporter case as declared (its values not yet located)."""
    if kind in ("reader", "output"):
        reason = "is also read by" if kind == "reader" else "graph output"
        return spec.interior or Perturb(copied, reason, note="the removed value nearest the root")
    return {"attr": spec.wrong, "shape": spec.unprovable, "opset": spec.gate}[kind]


# Every family's exporter cases by rule name (rule names are unique across the families).
_EXPORTED: dict[str, Exported] = {}


@functools.cache
def exported_case(name: str, fixture: str) -> Case:
    """The exporter case of rule ``name`` as a Case: its values located on the fixture cut after its first match."""
    spec = _EXPORTED[name]
    base = first_layer(fixture, name, spec.settings)
    found = locate(base, name, spec.settings)

    def perturb(at: At | str) -> Perturb | str:
        if isinstance(at, str):
            return at
        if not at.cuts:
            return Perturb(at.change(found), at.reason, note=at.note)
        return Perturb(at.change(found), at.reason, cut_feeds(base, [found.names[b] for b in at.cuts]), at.note)

    return Case(
        lambda: first_layer(fixture, name, spec.settings),
        spec.expected,
        spec.interior or found.interior[0],
        perturb(spec.wrong),
        perturb(spec.unprovable),
        spec.gate,
        spec.settings,
        lambda: fixture_inputs(base),
        spec.passes,
    )


def _fires(case: Case, name: str) -> None:
    proto = case.build()
    fires(proto, name, case.expected, _feeds(case, proto), passes=case.passes, **dict(case.settings))


def _fires_on_export(name: str, fixture: str) -> None:
    """On the export cut after its first match, the rule fires; the fused ops are there, the outputs the same."""
    case = exported_case(name, fixture)
    proto = case.build()
    out, details = _run(case, proto, Perturb(copied, None))
    assert details["applied"].get(name, 0) >= 1, details
    found = ops(out)
    assert {op: found[op] for op in case.expected} == case.expected, found
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert_same_outputs(proto, out, _feeds(case, proto), rtol=1e-4, atol=1e-4)


def _refuses(name: str, case: Case, kind: str) -> None:
    """The rule does not apply to ``case``'s model perturbed ``kind``: the outputs the same, the near miss said."""
    base = case.build()
    perturb = perturbation(case, kind)
    assert isinstance(perturb, Perturb)
    proto = perturb.change(base)
    family = next(r.family for r in registered_rules() if r.name == name)
    if perturb.stops is not None:
        with pytest.raises(InputError, match=f"op {perturb.stops} blocks it"):
            _run(case, proto, perturb)
        found = lowering_misses(proto, int(case.settings["target_opset"]))
        assert any(perturb.reason in m for m in found), found
        return
    out, details = _run(case, proto, perturb)
    assert name not in details["applied"], details
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    feeds = perturb.feeds(proto) if perturb.feeds is not None else _feeds(case, base)
    assert_same_outputs(proto, out, feeds, rtol=1e-4, atol=1e-4)
    if perturb.reason is not None:
        found = details["near_misses"].get(family, [])
        assert any(perturb.reason in m for m in found), found


def table_tests(cases: Mapping[str, Case], exported: Mapping[str, Exported | str]) -> dict[str, Callable[..., None]]:
    """The table's tests over one family's ``cases`` and ``exported``, by test name, for the family's test file to
    take in as its own; a test with nothing to run (no exporter case) is left out rather than skipped."""
    specs = {name: spec for name, spec in exported.items() if isinstance(spec, Exported)}
    _EXPORTED.update(specs)
    refusals = [
        pytest.param(name, kind, id=f"{name}-{kind}")
        for name, case in cases.items()
        for kind in KINDS
        if isinstance(perturbation(case, kind), Perturb)
    ]
    on_exports = [
        pytest.param(name, fixture, id=f"{name}-{fixture}") for name, spec in specs.items() for fixture in spec.fixtures
    ]
    export_refusals = [
        pytest.param(name, fixture, kind, id=f"{name}-{fixture}-{kind}")
        for name, spec in specs.items()
        for fixture in spec.fixtures
        for kind in KINDS
        if not isinstance(exported_perturbation(spec, kind), str)
    ]

    @pytest.mark.parametrize("name", list(cases))
    def test_the_rule_fires_on_its_model(name: str) -> None:
        _fires(cases[name], name)

    @pytest.mark.parametrize(("name", "fixture"), on_exports)
    def test_the_rule_fires_on_its_export(name: str, fixture: str) -> None:
        _fires_on_export(name, fixture)

    @pytest.mark.parametrize(("name", "kind"), refusals)
    def test_the_rule_refuses_the_perturbed_model(name: str, kind: str) -> None:
        _refuses(name, cases[name], kind)

    @pytest.mark.parametrize(("name", "fixture", "kind"), export_refusals)
    def test_the_rule_refuses_the_perturbed_export(name: str, fixture: str, kind: str) -> None:
        _refuses(name, exported_case(name, fixture), kind)

    tests = {
        "test_the_rule_fires_on_its_model": (test_the_rule_fires_on_its_model, cases),
        "test_the_rule_fires_on_its_export": (test_the_rule_fires_on_its_export, on_exports),
        "test_the_rule_refuses_the_perturbed_model": (test_the_rule_refuses_the_perturbed_model, refusals),
        "test_the_rule_refuses_the_perturbed_export": (test_the_rule_refuses_the_perturbed_export, export_refusals),
    }
    return {name: test for name, (test, params) in tests.items() if params}
