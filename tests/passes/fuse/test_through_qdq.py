"""Fusions through Q/DQ: the float fusions (activation, norm, rotary, attention, with their onnxruntime
forms) fire on a statically quantized model as on its float original (graphopt/passes/rewrite/qdq.py).

Each case of the families' tables is quantized as deployment tools do it (onnxruntime's quantize_static,
QDQ format, uint8 activations and int8 weights, calibrated on two draws): every activation between the
quantized ops goes through QuantizeLinear -> DequantizeLinear, and their constants through
DequantizeLinear. The rule fires; the fused op reads the dequantized values and its result is quantized
where the original quantized it, with the original's scales and zero points; no Q/DQ node is new; and
the result is no further from the float model than the quantized one is (the pairs inside the pattern
go: the fused op computes in float). A pair whose quantized value or dequantized value has a reader
outside the pattern keeps it from firing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, version_converter

from graphopt.numerics.compare import relative_l2
from graphopt.runtime.census import census_of_file
from tests.cli_helpers import invoke
from tests.numerics import make_feeds, run_ort
from tests.passes.fuse import test_activation, test_attention, test_norm, test_rotary
from tests.passes.fuse.table import (
    QDQ,
    Case,
    assert_no_further,
    assert_quantization_kept,
    draws,
    fires_through_qdq,
    interior_quantized,
    original_sources,
    producers_of,
    quantized,
)
from tests.passes.fuse_helpers import fuse, ops
from tests.passes.fuse_models import layer_norm, ort_attention, skip_norm

pytest.importorskip("onnxruntime.quantization")

FAMILIES = {
    "activation": test_activation.CASES,
    "attention": test_attention.CASES,
    "norm": test_norm.CASES,
    "rotary": test_rotary.CASES,
}
# Rules whose quantized case does not fire, and why (each a limit of the transparency, not a refusal).
NOT_THROUGH_QDQ = {
    "hardsigmoid": "Clip's bounds are quantized as activations of another Clip input: the pattern reads them bare",
    "hardswish": "as hardsigmoid",
    "hardswish-as-hardsigmoid": "as hardsigmoid",
    "rotary-embedding": "its cos / sin are a constant 2-D table, which stays quantized (DQ of a matrix)",
    "ort-rotary-embedding": "as rotary-embedding",
    "attention-kv-cache": "the present outputs are the quantized caches (DQ of the Concats' Q), which an Attention's "
    "float present_key and present_value would not reproduce: the Concats stay",
    "attention-float32": "a quantized model computes in float32, and the rule reads float16 Attention only",
    "rmsnorm-float32": "as attention-float32",
    "rotary-embedding-float32": "as attention-float32",
    "mha-float32": "as attention-float32",
    "gelu-float32": "as attention-float32",
    "softmax-float32": "as attention-float32",
    "logsoftmax-float32": "as attention-float32",
    "ort-gelu-float32": "as attention-float32",
    "ort-fastgelu-float32": "as attention-float32",
    "gqa-float32": "as attention-float32",
    "groupnorm": "its gamma is a [C, 1, 1] constant, which stays quantized (DQ of rank 3): groupnorm-plain fuses the "
    "normalization and the affine Mul / Add stay",
    "groupnorm-no-bias": "as groupnorm",
    "groupnorm-18": "as groupnorm (groupnorm-18-plain fuses the normalization)",
    "groupnorm-18-no-bias": "as groupnorm-18",
    "ort-attention": "onnxruntime's Attention packs the projection weights, which stay quantized (int8 matrices)",
    "ort-attention-packed": "as ort-attention",
    "ort-group-query-attention": "the case's cache plumbing (Shape, Reshape, Add) comes out otherwise once quantized; "
    "GroupQueryAttention through Q/DQ is not measured yet",
    "ort-group-query-attention-any-length": "as ort-group-query-attention",
    "layernorm-residual-sum": "a Sum for an Add is no fused op: through the pair it would only drop the quantization "
    "before the norm (test_the_residual_sum_keeps_the_quantization_before_its_norm)",
}


def _cases() -> Iterator[tuple[str, Case]]:
    for family, cases in FAMILIES.items():
        for name, case in cases.items():
            if name not in NOT_THROUGH_QDQ:
                yield pytest.param(name, case, id=f"{family}-{name}")


@pytest.mark.parametrize(("name", "case"), list(_cases()))
def test_the_rule_fires_through_qdq_and_keeps_the_quantization(name: str, case: Case) -> None:
    fires_through_qdq(case, name)


def _gelu_qdq() -> onnx.ModelProto:
    case = test_activation.CASES["gelu-none"]
    proto = case.build()
    return quantized(proto, draws(case, proto))


def _inner_pair(proto: onnx.ModelProto, op_type: str) -> tuple[onnx.NodeProto, onnx.NodeProto]:
    """The Q and DQ after the GELU's ``op_type`` node."""
    node = next(n for n in proto.graph.node if n.op_type == op_type)
    q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == node.output[0])
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    return q, dq


def _with_output(proto: onnx.ModelProto, extra: onnx.NodeProto | None, value: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    if extra is not None:
        out.graph.node.append(extra)
    out.graph.output.append(helper.make_tensor_value_info(value, onnx.TensorProto.UNDEFINED, None))
    return out


def test_gelu_fires_through_its_pairs() -> None:
    out, details = fuse(_gelu_qdq(), "shape-infer,fuse", target_opset=20, fuse_through_qdq=True)
    assert details["applied"] == {"gelu-none": 1}
    assert Counter(n.op_type for n in out.graph.node)["Gelu"] == 1


@pytest.mark.parametrize(
    "reader",
    ["quantized", "dequantized", "float"],
    ids=["second-dq-of-the-quantized-value", "dequantized-value-read-outside", "float-value-read-outside"],
)
def test_a_pair_inside_the_pattern_read_outside_keeps_it_unfused(reader: str) -> None:
    """The Erf's quantized value read by a second DequantizeLinear (a graph output), its dequantized value read
    by an Identity, or its float value read by one: the pair stays for that reader and GELU does not fire."""
    qdq = _gelu_qdq()
    q, dq = _inner_pair(qdq, "Erf")
    if reader == "quantized":
        extra = helper.make_node("DequantizeLinear", [q.output[0], *q.input[1:]], ["erf_again"])
        proto = _with_output(qdq, extra, "erf_again")
    elif reader == "dequantized":
        proto = _with_output(qdq, helper.make_node("Identity", [dq.output[0]], ["erf_read"]), "erf_read")
    else:
        proto = _with_output(qdq, helper.make_node("Identity", [q.input[0]], ["erf_read"]), "erf_read")
    out, details = fuse(proto, "shape-infer,fuse", target_opset=20, fuse_through_qdq=True)
    assert Counter(n.op_type for n in out.graph.node)["Gelu"] == 0
    assert not details["applied"].get("gelu-none")
    names_before = Counter(n.op_type for n in proto.graph.node)
    names_after = Counter(n.op_type for n in out.graph.node)
    assert names_after["QuantizeLinear"] == names_before["QuantizeLinear"]


@pytest.mark.parametrize(("name", "case"), list(_cases()))
def test_a_second_reader_of_the_quantized_interior_value_keeps_the_rule_from_firing(name: str, case: Case) -> None:
    """The table's perturbation ``interior`` on the quantized model: the interior value's quantized form gets a
    second DequantizeLinear, a graph output. The pair stays for it, so the pattern cannot drop it: no fusion."""
    found = interior_quantized(case)
    if isinstance(found, str):
        pytest.skip(found)
    qdq, q = found
    extra = helper.make_node("DequantizeLinear", [q.output[0], *q.input[1:]], ["interior_again"])
    _, details = fuse(_with_output(qdq, extra, "interior_again"), case.passes, **case.settings, fuse_through_qdq=True)
    assert not details["applied"].get(name), details["applied"]


def test_gelu_fires_through_a_value_quantized_twice() -> None:
    """Q, DQ, Q, DQ on one edge (what stays when a Reshape to its own shape goes from between two pairs, as the
    noop pass does on whisper's attention): both pairs are inside the pattern and go with it."""
    qdq = _gelu_qdq()
    q, dq = _inner_pair(qdq, "Erf")
    readers = [n for n in qdq.graph.node if dq.output[0] in n.input]
    again = [
        helper.make_node("QuantizeLinear", [dq.output[0], *q.input[1:]], ["erf_q2"], name="erf_q2"),
        helper.make_node("DequantizeLinear", ["erf_q2", *q.input[1:]], ["erf_dq2"], name="erf_dq2"),
    ]
    for reader in readers:
        reader.input[:] = ["erf_dq2" if i == dq.output[0] else i for i in reader.input]
    qdq.graph.node.extend(again)
    out, details = fuse(qdq, "shape-infer,fuse", target_opset=20, fuse_through_qdq=True)
    assert details["applied"] == {"gelu-none": 1}
    assert not {"erf_q2", "erf_dq2"} & {n.name for n in out.graph.node}


def test_gelu_fires_where_its_constant_was_quantized_as_an_activation() -> None:
    """A TorchScript export's constants are Constant nodes, which quantize_static quantizes as activations
    (Constant -> Q -> DQ); once cse merges one with an equal constant read elsewhere, it is read as a constant."""
    qdq = _gelu_qdq()
    one = next(n for n in qdq.graph.node if n.output[0] == "one_DequantizeLinear_Output")
    requantized = [
        helper.make_node("Constant", [], ["one_float"], value=numpy_helper.from_array(np.array(1.0, np.float32))),
        helper.make_node("QuantizeLinear", ["one_float", "one_scale", "one_zero_point"], ["one_q"]),
        helper.make_node("DequantizeLinear", ["one_q", "one_scale", "one_zero_point"], [one.output[0]]),
        helper.make_node("Identity", ["one_float"], ["one_read"]),
    ]
    qdq.graph.node.remove(one)
    for found in reversed(requantized):
        qdq.graph.node.insert(0, found)
    proto = _with_output(qdq, None, "one_read")
    out, details = fuse(proto, "shape-infer,fuse", target_opset=20, fuse_through_qdq=True)
    assert details["applied"] == {"gelu-none": 1}
    assert Counter(n.op_type for n in out.graph.node)["Gelu"] == 1


@pytest.mark.parametrize(("flag", "gelus"), [((), 1), (("--no-fuse-through-qdq",), 0)])
def test_the_cli_fuses_through_qdq_unless_told_not_to(tmp_path: Path, flag: tuple[str, ...], gelus: int) -> None:
    source, target = tmp_path / "gelu_qdq.onnx", tmp_path / "out.onnx"
    onnx.save(_gelu_qdq(), source)
    result = invoke("run", source, "-o", target, "--target-opset", "20", "--no-check", "--quiet", *flag)
    assert result.exit_code == 0, result.output
    assert Counter(n.op_type for n in onnx.load(target).graph.node)["Gelu"] == gelus


def _clipping(proto: onnx.ModelProto, op_type: str) -> onnx.ModelProto:
    """``proto`` (quantized) with the grid of the pair after its ``op_type`` node starting at 0: the original
    clips the negative half of that value, a Relu the fused op would drop. The two are other programs in float
    (the check's float reference keeps such a Relu)."""
    _, dequantize = _inner_pair(proto, op_type)
    for tensor in proto.graph.initializer:
        if tensor.name == dequantize.input[2]:
            lowest = numpy_helper.to_array(tensor)
            lowest = np.full_like(lowest, np.iinfo(lowest.dtype).min)
            tensor.CopyFrom(numpy_helper.from_array(lowest, tensor.name))
    return proto


def _clipping_gelu_qdq() -> onnx.ModelProto:
    """The QDQ GELU with its Erf's negative half clipped (_clipping)."""
    return _clipping(_gelu_qdq(), "Erf")


def _run_with_the_check(model: onnx.ModelProto, tmp_path: Path) -> tuple[str, dict, Counter[str], str | None]:
    """graphopt's run on ``model`` at opset 20 with the check: its console, its report, its output's ops and the
    mark the output carries (metadata graphopt.fuse_through_qdq), the output checked to be a fixed point (a run on
    it changes nothing)."""
    source, target, report = tmp_path / "model.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(model, source)
    result = invoke("run", source, "-o", target, "--target-opset", "20", "--report", report)
    assert result.exit_code == 0, result.output
    ops = Counter(n.op_type for n in onnx.load(target).graph.node)
    again = invoke("run", target, "-o", tmp_path / "again.onnx", "--target-opset", "20", "--no-check")
    assert again.exit_code == 0
    assert Counter(n.op_type for n in onnx.load(tmp_path / "again.onnx").graph.node) == ops
    found = json.loads(report.read_text())
    assert found["numerics"]["status"] == "passed"
    metadata = {p.key: p.value for p in onnx.load(target).metadata_props}
    return result.output, found, ops, metadata.get("graphopt.fuse_through_qdq")


def test_fusions_through_qdq_the_check_refuses_are_withdrawn_and_every_pair_kept(tmp_path: Path) -> None:
    output, found, ops, mark = _run_with_the_check(_clipping_gelu_qdq(), tmp_path)
    assert "through Q/DQ: 1 fusions withdrawn, every Q/DQ pair kept: the check refused them" in output
    assert found["through_qdq"]["withdrawn"] == 1 and mark == "off: the check refused it"
    original = Counter(n.op_type for n in _clipping_gelu_qdq().graph.node)
    assert ops["Gelu"] == 0
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (
        original["QuantizeLinear"],
        original["DequantizeLinear"],
    )
    source = tmp_path / "model.onnx"
    fused = invoke("run", source, "-o", tmp_path / "fused.onnx", "--target-opset", "20", "--no-check")
    assert fused.exit_code == 0 and "withdrawn" not in fused.output  # unchecked, nothing refuses the fusion


def _side_by_side(blocks: dict[str, onnx.ModelProto]) -> onnx.ModelProto:
    """Quantized blocks side by side, each with its own inputs and outputs (its names prefixed with its key), at
    the lowest opset among them."""
    prefixed = [onnx.compose.add_prefix(block, f"{name}_") for name, block in blocks.items()]
    graph = helper.make_graph(
        [n for block in prefixed for n in block.graph.node],
        "blocks",
        [i for block in prefixed for i in block.graph.input],
        [o for block in prefixed for o in block.graph.output],
        [t for block in prefixed for t in block.graph.initializer],
    )
    opset = min(o.version for block in prefixed for o in block.opset_import if o.domain in ("", "ai.onnx"))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _quantized_case(family: str, name: str, proto: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """The case's model (or ``proto``, drawn as the case draws) quantized."""
    case = FAMILIES[family][name]
    proto = case.build() if proto is None else proto
    return quantized(proto, draws(case, proto))


def _clipping_gelu_beside_a_layernorm() -> onnx.ModelProto:
    """The clipping GELU (the check refuses its fusion through Q/DQ) and a LayerNorm (the check passes its own)."""
    return _side_by_side({"gelu": _clipping_gelu_qdq(), "norm": _quantized_case("norm", "layernorm")})


def test_only_the_family_the_check_refuses_keeps_its_pairs(tmp_path: Path) -> None:
    output, found, ops, mark = _run_with_the_check(_clipping_gelu_beside_a_layernorm(), tmp_path)
    assert "check failed: optimize again without the activation fusions through Q/DQ" in output
    assert "through Q/DQ: 1 fusions withdrawn, the activation fusions' Q/DQ pairs kept, the other families' fused" in (
        output
    )
    assert found["through_qdq"]["families"] == ["activation"] and found["through_qdq"]["every_pair_kept"] is False
    assert mark == "off for activation: the check refused them"
    assert (ops["Gelu"], ops["LayerNormalization"]) == (0, 1)


def test_two_families_the_check_refuses_keep_their_pairs_and_a_third_still_fuses(tmp_path: Path) -> None:
    """No one family withheld is enough (each refused fusion fails the check without the other): the family whose
    withdrawal came nearest stays withheld, the others are tried beside it, and the attention the check passes
    stays fused (before, every family's pairs were kept)."""
    model = _side_by_side(
        {
            "gelu": _clipping_gelu_qdq(),
            "norm": _clipping(
                _quantized_case("norm", "layernorm", version_converter.convert_version(layer_norm(), 20)), "Div"
            ),
            "attention": _quantized_case("attention", "attention"),
        }
    )
    source, target, report = tmp_path / "model.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(model, source)
    result = invoke("run", source, "-o", target, "--target-opset", "23", "--report", report)
    assert result.exit_code == 0, result.output
    found = json.loads(report.read_text())
    assert found["numerics"]["status"] == "passed"
    assert found["through_qdq"]["families"] == ["activation", "norm"]
    assert found["through_qdq"]["every_pair_kept"] is False
    out = onnx.load(target)
    ops = Counter(n.op_type for n in out.graph.node)
    assert (ops["Gelu"], ops["LayerNormalization"], ops["Attention"]) == (0, 0, 1)
    assert {p.key: p.value for p in out.metadata_props}["graphopt.fuse_through_qdq"] == (
        "off for activation, norm: the check refused them"
    )
    again = invoke("run", target, "-o", tmp_path / "again.onnx", "--target-opset", "23", "--no-check")
    assert again.exit_code == 0
    assert Counter(n.op_type for n in onnx.load(tmp_path / "again.onnx").graph.node) == ops


def _masked_attention(fill: float) -> onnx.ModelProto:
    """Attention over q, k, v (1, 2, 8, 4) with the additive mask ``Where(keep, 0, fill)`` of a padding mask and
    the IsNaN guard after the Softmax, as the TorchScript (-inf) and dynamo (float32's lowest) exports write it."""
    shape = [1, 2, 8, 4]
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["keep_2d"], to=onnx.TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["keep_2d", "mask_axes"], ["keep"]),
        helper.make_node("Where", ["keep", "zero", "fill"], ["mask"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("IsNaN", ["probs"], ["probs_nan"]),
        helper.make_node("Where", ["probs_nan", "zero", "probs"], ["probs_guarded"]),
        helper.make_node("MatMul", ["probs_guarded", "v"], ["y"]),
    ]
    constants = {
        "mask_axes": np.array([1, 2], np.int64),
        "zero": np.array(0.0, np.float32),
        "fill": np.array(fill, np.float32),
        "scale": np.array(0.5, np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "masked_attention",
        [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name in "qkv"]
        + [helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(array, name) for name, array in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _padded_feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {name: rng.standard_normal((1, 2, 8, 4)).astype(np.float32) for name in "qkv"}
    return feeds | {"attention_mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.int64)}


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the quantizer's scale of a range to -inf
@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min)], ids=["-inf", "lowest"])
def test_the_attention_reads_the_quantized_mask_dequantized(fill: float) -> None:
    """The mask's Where is outside the pattern: its quantization stays and the Attention reads its
    DequantizeLinear, as the Add did. Read through to the boolean (-inf) or rebuilt with the fill raised
    (float32's lowest), the pair went unread: the T5 encoders' mask, whose calibrated grid saturates the
    fill at padded keys, moved 0.45 from the original at opset 23 while --target ort kept it."""
    proto = _masked_attention(fill)
    qdq = quantized(proto, _padded_feeds)
    mask_q = next(n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "mask")
    out, _ = fuse(qdq, "shape-infer,fuse,dce", target_opset=23, fuse_through_qdq=True)
    (attention,) = [n for n in out.graph.node if n.op_type == "Attention"]
    mask_dq = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == mask_q.output[0])
    read = set(original_sources(attention, producers_of(out), {n.name for n in qdq.graph.node}))
    assert mask_dq.output[0] in read and not {"keep", "mask"} & read, sorted(read)
    kept = {n.name: list(n.input) for n in out.graph.node if n.op_type in QDQ}
    assert kept[mask_q.name] == list(mask_q.input) and kept[mask_dq.name] == list(mask_dq.input)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_the_attention_keeps_the_guard_of_a_mask_quantized_on_an_infinite_grid() -> None:
    """quantize_static calibrates a -inf mask to an infinite scale (the TorchScript Llamas and GPT-2): the
    dequantized mask is NaN where it was 0, every row of the Softmax NaN, and the export's IsNaN guard zeroes the
    attention. The Attention reading that mask gives NaN there; the guard stays after it, so the fused model
    computes what the quantized one does (zeros), not the attention of the unquantized mask."""
    qdq = quantized(_masked_attention(-np.inf), _padded_feeds)
    out, _ = fuse(qdq, "shape-infer,fuse,dce", target_opset=23, fuse_through_qdq=True)
    assert Counter(n.op_type for n in out.graph.node)["Attention"] == 1
    inputs = _padded_feeds(7)
    expected, found = run_ort(qdq, inputs)["y"], run_ort(out, inputs)["y"]
    assert not expected.any()
    np.testing.assert_array_equal(found, expected)


def test_a_quantized_mask_at_the_lowest_float_weighs_a_fully_masked_query_as_the_export() -> None:
    """The dynamo exports fill float32's lowest, which the quantized mask's lowest step dequantizes to again;
    onnxruntime's Attention reads that value as -inf and zeroes a query whose keys it all masks, where the
    export weighs them alike. Raised one step (a Max on the dequantized mask), it is an ordinary number again."""
    qdq = quantized(_masked_attention(float(np.finfo(np.float32).min)), _padded_feeds)
    out, _ = fuse(qdq, "shape-infer,fuse,dce", target_opset=23, fuse_through_qdq=True)
    assert Counter(n.op_type for n in out.graph.node)["Attention"] == 1
    inputs = _padded_feeds(7) | {"attention_mask": np.zeros((1, 8), np.int64)}
    expected, found = run_ort(qdq, inputs)["y"], run_ort(out, inputs)["y"]
    assert relative_l2(found, expected) < 0.05


def _quantized_residual() -> onnx.ModelProto:
    """A residual sum quantized before its decomposed RMSNorm reads it, and read further on (a Relu, standing for
    the next block's residual)."""
    proto = skip_norm("decomposed", carry=True)
    return quantized(proto)


def test_a_quantized_residual_sum_stays_out_of_the_norm() -> None:
    """Fused into SkipSimplifiedLayerNormalization, the residual sum read further on would be the fused op's, computed
    without the pairs inside the match (the bias Add's), and the norm would read it unquantized while the other
    readers read it quantized: the residual moved 0.9% from the original's at the calibration's scale, 3% where the
    quantization clips. The norm fuses alone, reading the sum dequantized as the original does; the Adds stay."""
    qdq = _quantized_residual()
    out, details = fuse(qdq, "shape-infer,fuse,dce", target="ort", fuse_through_qdq=True)
    assert details["applied"] == {"ort-rmsnorm": 1}
    norm = next(n for n in out.graph.node if n.op_type == "SimplifiedLayerNormalization")
    assert producers_of(out)[norm.input[0]].op_type == "DequantizeLinear"
    for scale in (1, 10):  # 10: the sum clips
        feeds = {name: scale * x for name, x in make_feeds(qdq, 7).items()}
        assert np.array_equal(run_ort(out, feeds)["carried"], run_ort(qdq, feeds)["carried"])


def test_the_residual_sum_keeps_the_quantization_before_its_norm() -> None:
    """LayerNormalization(Add(a, skip)) quantized between the Add and the norm: a Sum read through that pair would
    drop a quantization the original computes, for no fused kernel (onnxruntime fuses no SkipLayerNormalization
    across the pair anyway; on a QDQ BERT the outputs moved 4.7% and ran no faster). Every pair stays, the Add too,
    and the outputs are the original's to the bit."""
    case = test_norm.CASES["layernorm-residual-sum"]
    proto = case.build()
    qdq = quantized(proto, draws(case, proto))
    producers = producers_of(qdq)
    assert any(n.op_type == "QuantizeLinear" and producers.get(n.input[0], n).op_type == "Add" for n in qdq.graph.node)
    out, details = fuse(qdq, case.passes, **case.settings, fuse_through_qdq=True)
    assert "layernorm-residual-sum" not in details["applied"]
    assert ops(out)["QuantizeLinear"] == ops(qdq)["QuantizeLinear"]
    assert ops(out)["Add"] == ops(qdq)["Add"]
    feeds = make_feeds(qdq, 7)
    expected, found = run_ort(qdq, feeds), run_ort(out, feeds)
    assert all(np.array_equal(found[name], value) for name, value in expected.items())


@pytest.mark.parametrize("windows", [4, 32])
def test_a_windowed_attention_through_qdq_fuses_over_many_biased_pairs(windows: int) -> None:
    # Swin's windows make the attention's batch windows * batch, 64 (batch, head) pairs per image with a bias.
    # Quantized, whether onnxruntime's integer QLinearMatMuls of the written form or the float Attention run
    # faster depends on the machine (Swin's QDQ exports: the Attention 0.787 and 0.648 of the variant's time on
    # an AMD EPYC, 0.973 and 0.811 as written; the other way round on an Intel one): it fuses, as the float
    # model does, and --tune undoes it where it measures slower.
    proto = ort_attention(windows=windows)
    qdq = quantized(proto)
    out, details = fuse(qdq, target_opset=23, fuse_through_qdq=True)
    assert ops(out)["Attention"] == 1, details["near_misses"]
    assert_quantization_kept(qdq, out)
    assert_no_further(proto, qdq, out, make_feeds(proto, 7))


def test_bloom_s_merged_heads_attention_through_int8_pairs_loads_at_onnxruntime_s_full_level(tmp_path: Path) -> None:
    """BLOOM's ALiBi bias is split back by heads with a Reshape of its int8 DequantizeLinear and added to the mask
    before the fused Attention. onnxruntime 1.32 carries that DequantizeLinear across the Reshape from opset 21 on
    and fails to load (output_dtype INT8 against a uint8 zero point): the runtime guard undid the fusion on bloom's
    QDQ files at opset 23. The Reshape now reads the integers; the Attention stays and the output loads."""
    source, target, report = tmp_path / "model.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(_quantized_case("attention", "attention-merged-heads"), source)
    result = invoke("run", source, "-o", target, "--target-opset", "23", "--report", report)
    assert result.exit_code == 0, result.output
    found = json.loads(report.read_text())
    assert found["numerics"]["status"] == "passed"
    assert not found["runtime_guard"].get("undone"), found["runtime_guard"]
    assert Counter(n.op_type for n in onnx.load(target).graph.node)["Attention"] == 1
    census_of_file(target)
