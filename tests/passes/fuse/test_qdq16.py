"""16-bit QDQ: quantize_static's int16 activations, written (below opset 21, where the standard ops take no
int16) as onnxruntime's own QuantizeLinear and DequantizeLinear of the com.microsoft domain, the format QNN's
NPUs read. Those ops have the standard's contract, so the fusions see through their pairs as through int8's,
the quantization keeps its domain, and the constant folder leaves their dequantized constants quantized."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.cli_helpers import invoke
from tests.numerics import make_feeds, run_ort
from tests.passes.fuse import test_activation, test_attention, test_norm, test_qdq, test_rotary
from tests.passes.fuse.table import LATE, QDQ, draws, fires_through_qdq, quantized
from tests.passes.fuse_helpers import fuse

pytest.importorskip("onnxruntime.quantization")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "exports"
CASES = {
    "gelu-none": test_activation.CASES["gelu-none"],
    "layernorm": test_norm.CASES["layernorm"],
    "rmsnorm": test_norm.CASES["rmsnorm"],
    "softmax": test_norm.CASES["softmax"],
    "attention-4d": test_attention.CASES["attention-4d"],
    "ort-multihead-attention": test_attention.CASES["ort-multihead-attention"],
    "rotary-embedding-interleaved": test_rotary.CASES["rotary-embedding-interleaved"],
}


def _contrib_qdq(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in proto.graph.node if n.domain == "com.microsoft" and n.op_type in QDQ)


@pytest.mark.parametrize("name", list(CASES))
def test_the_rule_fires_through_sixteen_bit_pairs(name: str) -> None:
    fires_through_qdq(CASES[name], name, sixteen_bit=True)


def test_the_fixtures_hold_int16_activations_in_onnxruntimes_own_ops() -> None:
    """What the tests above run on: every Q/DQ of the com.microsoft domain, the activations' zero points int16."""
    case = CASES["gelu-none"]
    proto = case.build()
    qdq = quantized(proto, draws(case, proto), sixteen_bit=True)
    assert _contrib_qdq(qdq)["QuantizeLinear"] > 0
    assert not any(n.op_type in QDQ and n.domain == "" for n in qdq.graph.node)
    zeros = {t.name: t.data_type for t in qdq.graph.initializer}
    assert {zeros[n.input[2]] for n in qdq.graph.node if n.op_type == "QuantizeLinear"} == {onnx.TensorProto.INT16}


def test_the_constant_folder_keeps_a_sixteen_bit_constant_quantized() -> None:
    """A norm's weight and bias behind onnxruntime's DequantizeLinear: folded, they would be float tensors where an
    NPU reads quantized ones (bert_ts's 16-bit variant lost 47 of them, its weights growing 20 KB)."""
    case = CASES["layernorm"]
    proto = case.build()
    qdq = quantized(proto, draws(case, proto), sixteen_bit=True)
    out, _ = fuse(qdq, "shape-infer,const-cache,dce")
    assert _contrib_qdq(out) == _contrib_qdq(qdq)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the quantizer on a constant's empty range
def test_a_sixteen_bit_bert_gets_one_attention_per_block(tmp_path: Path) -> None:
    """The BERT export fixture in 16-bit QDQ at opset 23 and for onnxruntime, checked by the CLI."""
    float32 = onnx.load(str(FIXTURES / "bert_ts.onnx"))
    source = tmp_path / "bert16.onnx"
    onnx.save(quantized(float32, sixteen_bit=True), source)
    blocks = sum(n.op_type == "Softmax" for n in float32.graph.node)
    for flags, fused in ((("--target-opset", "23"), "Attention"), (("--target", "ort"), "MultiHeadAttention")):
        out = tmp_path / f"{fused}.onnx"
        done = invoke("run", source, "-o", out, *flags)
        assert done.exit_code == 0, done.stderr
        assert "numerics: passed" in done.stderr
        written = onnx.load(str(out))
        assert sum(n.op_type == fused for n in written.graph.node) == blocks
        assert not any(n.op_type.endswith("QuantizeLinear") and n.domain == "" for n in written.graph.node)


def _sixteen_bit(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (test_qdq's uint8 Q/DQ around one op) with int16 zero points in onnxruntime's own ops."""
    for n in proto.graph.node:
        if n.op_type in QDQ:
            n.domain = "com.microsoft"
    for index, tensor in enumerate(proto.graph.initializer):
        if tensor.name.endswith("_z"):
            zero = numpy_helper.to_array(tensor).astype(np.int16) - 131
            proto.graph.initializer[index].CopyFrom(numpy_helper.from_array(zero, tensor.name))
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto


@pytest.mark.parametrize(
    ("build", "rule", "left"),
    [
        (test_qdq._transposed, "qdq-move-integers", 1),
        (test_qdq._requantized, "qdq-requantize-same", 1),
        (test_qdq._transposed_for_attention, "qdq-dequantize-after-move", 1),  # builds its DequantizeLinear
    ],
)
def test_the_cleanup_moves_and_drops_sixteen_bit_pairs_exactly(
    build: Callable[[], onnx.ModelProto], rule: str, left: int
) -> None:
    """Q(Transpose(DQ(q))) -> Transpose(q), Q(DQ(q)) -> q and Transpose(DQ(q)) -> DQ(Transpose(q)) before an
    Attention, on int16 steps in onnxruntime's ops: exact, and the DequantizeLinear built keeps the domain."""
    original = _sixteen_bit(build())
    out, details = fuse(original, test_qdq.PASSES, **LATE)
    assert details["applied"].get(rule) == 1, details
    assert _contrib_qdq(out) == Counter({"QuantizeLinear": left, "DequantizeLinear": left})
    feeds = make_feeds(original, 3)
    assert np.array_equal(run_ort(out, feeds)["y"], run_ort(original, feeds)["y"])
