"""bfloat16 models get the fusions onnx's standard ops take bfloat16 for, as float16 models do; where the op takes
no bfloat16 (onnxruntime's CPU contrib kernels; HardSwish below opset 22) the near miss names the type.

onnxruntime's CPU provider runs no bfloat16 arithmetic, so the fused model is judged as onnx's checker types it
and as its float32 program computes it (numerics/reference.py: every bfloat16 value float32, the weights keeping
their bfloat16 values), against the original's float32 program.
"""

from __future__ import annotations

import warnings

import onnx
import pytest

from graphopt.numerics.reference import float_reference
from tests.numerics import assert_same_outputs
from tests.passes.fuse.table import Case, Perturb, copied, draws
from tests.passes.fuse.table import _run as run_case
from tests.passes.fuse.test_precision import CASES
from tests.passes.fuse_fixtures import FIXTURES, fixture_feeds
from tests.passes.fuse_helpers import fuse
from tests.precision_tools import bfloat16_of_float16

# The rules that fire on the bfloat16 copies of the real exports (BERT, GPT-2, ViT, Whisper's and T5's encoders,
# the Llama with and without a KV cache, --target-opset 23), and the lowerings and clean-ups around them.
FIRES = (
    "attention-4d",
    "attention-heads-3d",
    "gather-consecutive-rows",
    "gelu-none",
    "gelu-tanh",
    "layernorm-residual-sum",
    "rmsnorm",
    "rotary-embedding-interleaved",
    "unsqueeze-unsqueeze",
)
# onnxruntime's CPU contrib kernels take float32 and float16 only.
CPU_KERNELS = (
    ("ort-multihead-attention", "attention", "MultiHeadAttention"),
    ("ort-biasgelu", "activation", "BiasGelu"),
    ("ort-rotary-embedding-interleaved", "rotary", "RotaryEmbedding"),
)
# bfloat16 relative rounding, twice: the float16 converter rounds first, then bfloat16 does.
BFLOAT16_TOLERANCE = 2 * 2.0**-8


def as_bfloat16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` made float16 by onnxruntime's converter with float32 inputs and outputs (onnxruntime takes no
    bfloat16 feeds), then bfloat16."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():  # constants beyond float16's range are clipped to it
        warnings.simplefilter("ignore")
        return bfloat16_of_float16(convert_float_to_float16(copied(proto), keep_io_types=True))


def _float32_outputs(proto: onnx.ModelProto, case: Case, base: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    program = float_reference(proto)
    assert program is not None
    return program, draws(case, base)(0)


@pytest.mark.parametrize("name", FIRES)
def test_the_rule_fires_in_bfloat16(name: str) -> None:
    case = CASES[name]
    base = case.build()
    proto = as_bfloat16(base)
    out, details = run_case(case, proto, Perturb(copied, None))
    assert details["applied"].get(name, 0) >= 1, details
    made = {op: count for op, count in case.expected.items() if op not in {n.op_type for n in proto.graph.node}}
    assert {op: sum(n.op_type == op for n in out.graph.node) for op in made} == made
    onnx.checker.check_model(out, full_check=True)  # every op takes its types at the model's opset
    before, feeds = _float32_outputs(proto, case, base)
    after, _ = _float32_outputs(out, case, base)
    assert_same_outputs(before, after, feeds, rtol=BFLOAT16_TOLERANCE, atol=BFLOAT16_TOLERANCE)


@pytest.mark.parametrize(("name", "family", "contrib"), CPU_KERNELS)
def test_an_onnxruntime_contrib_fusion_refuses_bfloat16_naming_it(name: str, family: str, contrib: str) -> None:
    case = CASES[name]
    _, details = run_case(case, as_bfloat16(case.build()), Perturb(copied, None))
    assert name not in details["applied"]
    said = f"onnxruntime's CPU {contrib} takes float32 or float16, not bfloat16"
    assert any(said in miss for miss in details["near_misses"][family]), details


def test_a_fusion_into_an_op_without_bfloat16_at_the_opset_is_refused_naming_the_type_and_opset() -> None:
    """HardSwish takes bfloat16 from opset 22: at the case's opset 14 the rewrite would make an invalid model."""
    case = CASES["hardswish"]
    proto = as_bfloat16(case.build())
    out, details = run_case(case, proto, Perturb(copied, None))
    assert "hardswish" not in details["applied"]
    assert any("HardSwish takes no bfloat16 at opset 14" in miss for miss in details["near_misses"]["activation"])
    onnx.checker.check_model(out, full_check=True)
    for found in proto.opset_import:
        if found.domain in ("", "ai.onnx"):
            found.version = 22
    out, details = run_case(case, proto, Perturb(copied, None))
    assert details["applied"]["hardswish"] == 1
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.parametrize("fixture", ["bert_dynamo", "gpt2_dynamo", "llama_dynamo", "llama_kv_dynamo"])
def test_a_bfloat16_export_gets_one_attention_per_block_at_opset_23(fixture: str) -> None:
    """The exporters' masks fill with the type's lowest value: bfloat16's -3.39e38 (numpy's finfo knows no
    bfloat16), which the fused Attention's mask raises one step, as for float32."""
    exported = onnx.load(str(FIXTURES / f"{fixture}.onnx"))
    proto = as_bfloat16(exported)
    out, details = fuse(proto, "shape-infer,fuse,dce", target_opset=23)
    blocks = sum(n.op_type == "Softmax" for n in exported.graph.node)
    assert blocks and sum(n.op_type == "Attention" for n in out.graph.node) == blocks, details
    onnx.checker.check_model(out, full_check=True)
    feeds = fixture_feeds(proto, 2, 5, "tail")
    before, after = float_reference(proto), float_reference(out)
    assert before is not None and after is not None
    assert_same_outputs(before, after, feeds, rtol=BFLOAT16_TOLERANCE, atol=BFLOAT16_TOLERANCE)
