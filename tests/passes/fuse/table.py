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

A rule that fires on float16 or statically quantized (QDQ) models has its case at that precision too
(tests/passes/fuse/test_precision.py, by precision_tests): the case's model made float16 by onnxruntime's converter
or quantized by its quantize_static, after each perturbation is made in float32, so the same perturbations refuse it
there; test_through_qdq.py fires the rules that see through Q/DQ on their quantized cases (fires_through_qdq).

A family's test file holds its CASES, EXPORTED and BEFORE_EXPORTS and takes the table's tests in with
``globals().update(table_tests(CASES, EXPORTED))``; test_contract.py checks that every registered rule has its
case in its family's file.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from graphopt.errors import InputError
from graphopt.passes.fuse import registered_rules
from tests.numerics import assert_same_outputs, make_feeds, run_ort
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
from tests.precision_models import VARIANTS
from tests.precision_tools import Calibration, quantized_through_files, static_options

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


def float32_case(
    build: Callable[..., onnx.ModelProto],
    op_type: str,
    casts: int,
    low_opset: Perturb | str,
    settings: dict[str, Any],
    feeds: Callable[[], Mapping[str, np.ndarray]] | None = None,
) -> Case:
    """The case of a rule computing a float16 ``op_type`` in float32 between Casts (graphopt/passes/fuse/rules/
    _float32.py): ``build()`` its float16 model, ``build(TensorProto.FLOAT)`` the float32 one it leaves, ``casts``
    the Casts the rule writes."""
    return Case(
        build,
        {op_type: 1, "Cast": casts},
        f"n/a: one node, the {op_type} itself",
        Perturb(
            lambda proto: build(TensorProto.FLOAT),
            None,
            feeds=make_feeds,
            note=f"the {op_type} in float32: nothing to compute in float32",
        ),
        "n/a: the rule needs element types only, which every input declares",
        low_opset,
        settings=settings,
        feeds=feeds,
        passes="shape-infer,fuse,dce",
    )


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


TS_MLP = "/model/encoder/layer.0/"
# exported_mlp's arguments for the TorchScript bert fixture's first MLP, its GELU as the erf formula
ERF_MLP = {
    "fixture": "bert_ts",
    "start": f"{TS_MLP}attention/output/LayerNorm/LayerNormalization_output_0",
    "until": f"{TS_MLP}output/dense/Add_output_0",
}
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


# -- the cases at another precision: float16, and statically quantized (Q/DQ pairs) --------------------------

Draws = Callable[[int], Mapping[str, np.ndarray]]
QDQ = ("QuantizeLinear", "DequantizeLinear")
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
# float16 keeps 11 bits: a fused op that sums in another order moves an output of a few units by some ulps.
FLOAT16_TOLERANCE = 1e-2
THROUGH_QDQ: dict[str, Any] = {"fuse_through_qdq": True}
PRECISIONS = ("float16", "qdq", "dyn8", "int4")
# The precisions whose tool quantizes the weights only (the activations stay float, or are quantized at run time).
WEIGHT_QUANTIZERS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "dyn8": VARIANTS["dynamic int8"],
    "int4": VARIANTS["int4"],
}
# A rule's declaration at dyn8 or int4 where the quantizer takes none of its case's weights (quantize_dynamic takes a
# MatMul's, a Conv's or a Gather's constant; the int4 quantizer a MatMul's 2-D one): its float32 case is its case there.
QUANTIZER_LEAVES_IT = "n/a: the quantizer takes none of its case's weights: its float32 case is its case here"


def draws(case: Case, proto: onnx.ModelProto) -> Draws:
    """``case``'s inputs for ``proto`` by seed (its fixed feeds, where it has them, at every seed)."""
    if case.feeds is not None:
        fixed = case.feeds
        return lambda seed: fixed()
    return lambda seed: make_feeds(proto, seed)


def as_float16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every float32 value float16, its inputs and outputs too (onnxruntime's converter, which
    deployment tools use; interior values keep their names, so a perturbation made in float32 stays where it was)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():  # constants beyond float16's range are clipped to it, as in a deployed model
        warnings.simplefilter("ignore")
        return convert_float_to_float16(copied(proto), keep_io_types=False)


def typed(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` in the element types of ``proto``'s graph inputs (float32 draws for a float16 model)."""
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in proto.graph.input}
    return {name: np.asarray(value).astype(types.get(name, np.asarray(value).dtype)) for name, value in feeds.items()}


def quantized(proto: onnx.ModelProto, feeds: Draws | None = None, sixteen_bit: bool = False) -> onnx.ModelProto:
    """``proto`` as onnxruntime's quantize_static writes it (QDQ, int8 activations and weights, calibrated on two
    draws of ``feeds``, by default ``make_feeds``' of ``proto``); ``sixteen_bit``: int16 activations in
    onnxruntime's own QuantizeLinear and DequantizeLinear (com.microsoft), as it writes them for QNN below opset 21."""
    from onnxruntime.quantization import quantize_static

    draw = feeds if feeds is not None else lambda seed: make_feeds(proto, seed)
    calibration = Calibration(draw(seed) for seed in range(2))
    options = static_options("qdq16" if sixteen_bit else "qdq")
    return quantized_through_files(
        proto, lambda source, target: quantize_static(source, target, calibration, **options)
    )


FLOAT32_ONLY = "quantize_static takes float32 models"


def float32_only(proto: onnx.ModelProto) -> bool:
    """Whether ``proto``'s float constants are float32 (quantize_static takes no other)."""
    return all(t.data_type == TensorProto.FLOAT for t in proto.graph.initializer if t.data_type in FLOATS)


def _relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


def assert_no_further(float_model: onnx.ModelProto, qdq: onnx.ModelProto, out: onnx.ModelProto, feeds: Any) -> None:
    """``out`` is no further from the float model than the quantized (or float16) one is (within a tenth: one draw of
    a tiny model, whose output's last rounding both share; the exported attention moves 1.05x). ``feeds`` are the
    float model's, rounded to each model's input types."""
    truth = run_ort(float_model, feeds)
    original, optimized = run_ort(qdq, typed(qdq, feeds)), run_ort(out, typed(out, feeds))
    for output, expected in truth.items():
        moved = _relative_l2(optimized[output], expected)
        assert moved <= 1.1 * _relative_l2(original[output], expected) + 1e-6, output


def assert_quantization_kept(qdq: onnx.ModelProto, out: onnx.ModelProto) -> None:
    """No Q/DQ node is new, and each kept keeps its domain, scale and zero point."""
    before = {n.name: (n.domain, *n.input[1:]) for n in qdq.graph.node if n.op_type in QDQ}
    after = {n.name: (n.domain, *n.input[1:]) for n in out.graph.node if n.op_type in QDQ}
    assert after.items() <= before.items()
    scales = {t.name: numpy_helper.to_array(t).tolist() for t in qdq.graph.initializer}
    kept = {t.name: numpy_helper.to_array(t).tolist() for t in out.graph.initializer}
    assert all(kept[i] == scales[i] for _, *inputs in after.values() for i in inputs if i in kept and i in scales)


# The ops the rules fuse into (each case's expected counts name the rest of its graph too).
FUSED = frozenset(
    {
        "Attention",
        "BiasGelu",
        "FastGelu",
        "Gelu",
        "GroupNormalization",
        "LayerNormalization",
        "MultiHeadAttention",
        "QuickGelu",
        "RMSNormalization",
        "RotaryEmbedding",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "Softmax",
        "Swish",
    }
)


def producers_of(proto: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: n for n in proto.graph.node for out in n.output}


def original_sources(
    node: onnx.NodeProto, producers: Mapping[str, onnx.NodeProto], originals: set[str]
) -> Iterator[str]:
    """The values ``node`` reads, followed back through the nodes the rewrite made (a Reshape of Q to 3-D)."""
    for value in node.input:
        source = producers.get(value)
        if source is not None and source.name not in originals and source.op_type not in QDQ:
            yield from original_sources(source, producers, originals)
        elif value:
            yield value


def fires_through_qdq(case: Case, name: str, sixteen_bit: bool = False) -> None:
    """The case's model quantized (``sixteen_bit``: see :func:`quantized`): its rule's ops are there; no Q/DQ is new
    and each keeps its domain, scale and zero point; the fused ops read dequantized values (or what the original read
    unquantized) and their results are quantized where the original's were; the outputs no further from the float
    model than the quantized one's."""
    proto = case.build()
    if not float32_only(proto):
        pytest.skip(FLOAT32_ONLY)
    feeds = draws(case, proto)
    qdq = quantized(proto, feeds, sixteen_bit)
    out, details = fuse(qdq, case.passes, **case.settings, **THROUGH_QDQ)
    assert details["applied"].get(name, 0) >= 1, details
    found = ops(out)
    assert {op: found[op] for op in case.expected} == case.expected, details["near_misses"]
    assert_quantization_kept(qdq, out)
    originals = {n.name for n in qdq.graph.node}
    producers = producers_of(out)
    read_before = {i for n in qdq.graph.node if n.op_type not in QDQ for i in n.input}
    for made in out.graph.node:
        if made.name in originals or made.op_type not in FUSED:
            continue
        for value in original_sources(made, producers, originals):
            source = producers.get(value)
            if source is not None and source.op_type not in QDQ and value not in read_before:
                raise AssertionError(f"{made.op_type} reads {value!r} of {source.op_type}, which no op read before")
    assert_no_further(proto, qdq, out, feeds(7))


def interior_quantized(case: Case) -> tuple[onnx.ModelProto, onnx.NodeProto] | str:
    """``case``'s model quantized and the QuantizeLinear of its interior value, or why there is none."""
    proto = case.build()
    if not float32_only(proto):
        return FLOAT32_ONLY
    qdq = quantized(proto, draws(case, proto))
    q = next((n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == case.interior), None)
    return (qdq, q) if q is not None else f"the quantizer leaves {case.interior!r} unquantized"


def convert(precision: str, proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` at ``precision``, other than "qdq" (whose calibration needs the case's draws): float16, every value
    (onnxruntime's converter); "dyn8", quantize_dynamic's integer MatMuls; "int4", 4-bit MatMulNBits weights."""
    return as_float16(proto) if precision == "float16" else WEIGHT_QUANTIZERS[precision](copied(proto))


def _assert_outputs_kept(
    precision: str, float_model: onnx.ModelProto, proto: onnx.ModelProto, out: onnx.ModelProto, feeds: Any
) -> None:
    """A float16 model's outputs the same within float16's rounding; a quantized one's no further from the float
    model's than before."""
    if precision == "float16":
        assert_same_outputs(proto, out, typed(proto, feeds), rtol=FLOAT16_TOLERANCE, atol=FLOAT16_TOLERANCE)
    else:
        assert_no_further(float_model, proto, out, feeds)


def _fires_converted(case: Case, name: str, precision: str) -> None:
    """The rule fires on the case's model made float16, or with its weights quantized (dyn8, int4; the quantizer
    takes one of the case's weights, else the float32 case stands for it): the ops it fuses into are there, the
    outputs kept (``_assert_outputs_kept``)."""
    base = case.build()
    proto = convert(precision, base)
    before, unconverted = ops(proto), ops(base)
    if precision in WEIGHT_QUANTIZERS:
        assert before != unconverted, f"the quantizer leaves the case as it is: declare {QUANTIZER_LEAVES_IT!r}"
    out, details = _run(case, proto, Perturb(copied, None))
    assert details["applied"].get(name, 0) >= 1, details
    after = ops(out)
    # The ops the rule makes: in neither model before it ran (the quantizers rewrite the case's MatMuls).
    made = {op: count for op, count in case.expected.items() if op not in before and op not in unconverted}
    assert {op: after[op] for op in made} == made, after
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    _assert_outputs_kept(precision, base, proto, out, draws(case, base)(0))


def _refuses_at(name: str, case: Case, kind: str, precision: str, reason: str | None) -> None:
    """The rule does not apply to ``case``'s model perturbed ``kind`` (in float32, as the table has it) and then made
    ``precision``: the outputs as close as the precision keeps them, the near miss ``reason`` said, and a statically
    quantized model keeps its scales and zero points."""
    base = case.build()
    perturb = perturbation(case, kind)
    assert isinstance(perturb, Perturb) and perturb.stops is None
    perturbed = perturb.change(base)
    feeds = perturb.feeds(perturbed) if perturb.feeds is not None else draws(case, base)(0)
    if precision == "qdq":
        proto = quantized(perturbed, lambda seed: feeds)
        out, details = _run(case, proto, Perturb(copied, None, settings={**(perturb.settings or {}), **THROUGH_QDQ}))
        assert_quantization_kept(proto, out)
    else:
        proto = convert(precision, perturbed)
        out, details = _run(case, proto, perturb)
    _assert_outputs_kept(precision, perturbed, proto, out, feeds)
    assert name not in details["applied"], details
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    family = next(r.family for r in registered_rules() if r.name == name)
    if reason is not None:
        found = details["near_misses"].get(family, [])
        assert any(reason in m for m in found), found


@dataclass(frozen=True)
class NamesType:
    """A rule that does not fire on its case made float16: its near miss ``reason`` names the type (an onnxruntime
    kernel float32 only, or a rewrite measured on float32 only); said by ``family`` where another family's refusal
    keeps the rule from matching."""

    reason: str
    family: str | None = None


def _refuses_float16(case: Case, name: str, refusal: NamesType) -> None:
    """The rule does not fire on the case made float16, the outputs the same, and the near miss names the type."""
    proto = as_float16(case.build())
    out, details = _run(case, proto, Perturb(copied, None))
    assert name not in details["applied"], details
    assert_same_outputs(proto, out, typed(proto, draws(case, proto)(0)), rtol=FLOAT16_TOLERANCE, atol=FLOAT16_TOLERANCE)
    family = refusal.family or next(r.family for r in registered_rules() if r.name == name)
    found = details["near_misses"].get(family, [])
    assert any(refusal.reason in m for m in found), found


# What a rule's declaration at a precision says: None, its case runs there; a Case, this case runs there in its place
# (the spelling the variants have, where quantizing the table's case keeps the rule from matching); NamesType, the
# rule refuses its case made float16 and names the type; QUANTIZER_LEAVES_IT (dyn8, int4), the quantizer leaves its case
# as it is (checked); another string, why no case runs there.
Declared = Mapping[str, str | NamesType | Case | None]


def case_at(cases: Mapping[str, Case], declared: Declared, name: str) -> Case:
    """The case rule ``name`` runs at the precision ``declared`` describes."""
    why = declared[name]
    return why if isinstance(why, Case) else cases[name]


def precision_tests(
    cases: Mapping[str, Case],
    declared: Mapping[str, Declared],
    fired_through_qdq: Set[str],
    reasons: Mapping[tuple[str, str, str], str | None],
) -> dict[str, Callable[..., None]]:
    """The table's tests at each precision ``declared`` names, for the rules it lists there, by test name. None or a
    Case: the case runs at that precision: the rule fires (through Q/DQ: where ``fired_through_qdq``, whose rules
    another test fires so, does not name it), and each perturbation refuses it, naming the case's reason or the one
    ``reasons`` has for (precision, rule, kind). NamesType: the rule refuses the case made float16, naming the type.
    QUANTIZER_LEAVES_IT (dyn8, int4): the quantizer leaves the case as it is (checked). Another string: why the case
    does not run at that precision. A test with nothing to run is left out."""

    def runs(why: object) -> bool:
        return why is None or isinstance(why, Case)

    converted = [
        pytest.param(name, precision, id=f"{name}-{precision}")
        for precision in ("float16", *WEIGHT_QUANTIZERS)
        for name, why in declared[precision].items()
        if runs(why)
    ]
    qdq = [name for name, why in declared["qdq"].items() if runs(why) and name not in fired_through_qdq]
    typed_refusals = {name: why for name, why in declared["float16"].items() if isinstance(why, NamesType)}
    left_as_they_are = [
        pytest.param(name, precision, id=f"{name}-{precision}")
        for precision in WEIGHT_QUANTIZERS
        for name, why in declared[precision].items()
        if why == QUANTIZER_LEAVES_IT
    ]
    refusals = [
        pytest.param(name, kind, precision, id=f"{name}-{precision}-{kind}")
        for precision in PRECISIONS
        for name, why in declared[precision].items()
        if runs(why)
        for kind in KINDS
        if isinstance(found := perturbation(case_at(cases, declared[precision], name), kind), Perturb)
        and found.stops is None
    ]

    @pytest.mark.parametrize(("name", "precision"), converted)
    def test_the_rule_fires_at_the_precision(name: str, precision: str) -> None:
        _fires_converted(case_at(cases, declared[precision], name), name, precision)

    @pytest.mark.parametrize("name", list(typed_refusals))
    def test_the_rule_refuses_float16_naming_the_type(name: str) -> None:
        _refuses_float16(cases[name], name, typed_refusals[name])

    @pytest.mark.parametrize(("name", "precision"), left_as_they_are)
    def test_the_quantizer_takes_none_of_the_cases_weights(name: str, precision: str) -> None:
        base = cases[name].build()
        assert ops(convert(precision, base)) == ops(base)

    @pytest.mark.parametrize("name", qdq)
    def test_the_rule_fires_through_qdq(name: str) -> None:
        fires_through_qdq(case_at(cases, declared["qdq"], name), name)

    @pytest.mark.parametrize(("name", "kind", "precision"), refusals)
    def test_the_rule_refuses_the_perturbed_model_at_the_precision(name: str, kind: str, precision: str) -> None:
        case = case_at(cases, declared[precision], name)
        perturb = perturbation(case, kind)
        assert isinstance(perturb, Perturb)
        _refuses_at(name, case, kind, precision, reasons.get((precision, name, kind), perturb.reason))

    tests = {
        "test_the_rule_fires_at_the_precision": (test_the_rule_fires_at_the_precision, converted),
        "test_the_rule_refuses_float16_naming_the_type": (
            test_the_rule_refuses_float16_naming_the_type,
            typed_refusals,
        ),
        "test_the_quantizer_takes_none_of_the_cases_weights": (
            test_the_quantizer_takes_none_of_the_cases_weights,
            left_as_they_are,
        ),
        "test_the_rule_fires_through_qdq": (test_the_rule_fires_through_qdq, qdq),
        "test_the_rule_refuses_the_perturbed_model_at_the_precision": (
            test_the_rule_refuses_the_perturbed_model_at_the_precision,
            refusals,
        ),
    }
    return {name: test for name, (test, params) in tests.items() if params}
