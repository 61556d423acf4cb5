"""The table's cases at the precisions deployed models have: every rule that fires on a float16 or a statically
quantized (QDQ) copy of a real export also fires on its case made float16 (onnxruntime's converter, every float
value float16) or quantized (onnxruntime's quantize_static), and each of the case's perturbations, made in float32
and then converted, refuses it there too, naming the same reason (or the one REASONS has where Q/DQ changes it). A
float16 model's outputs keep their values within float16's rounding (FLOAT16_TOLERANCE); a refused quantized model
keeps every scale and zero point, and its outputs are no further from the float model than the quantized one's.

FLOAT16 and QDQ list the rules that fire on the reduced-precision variants of the real exports (float16 with
float32 inputs and outputs, QDQ int8; bert, gpt2, vit, resnet18 and convnext from TorchScript, llama, t5's encoder
and whisper's from dynamo; default, --target ort, --target-opset 23, and through Q/DQ with --fuse-through-qdq):
None where the case runs at that precision, else why it does not. The rules of test_through_qdq's families fire
through Q/DQ there; here they meet the perturbations.
"""

from __future__ import annotations

import importlib

import pytest

from tests.passes.fuse import test_through_qdq
from tests.passes.fuse.table import Case, as_float16, precision_tests, same_weights
from tests.passes.fuse_helpers import fuse

# The families whose rules fire on the variants (each family's test file holds its CASES).
FAMILIES = ("activation", "arith", "attention", "conv", "gather", "norm", "qdq", "rotary", "shape")
CASES: dict[str, Case] = {
    name: case
    for family in FAMILIES
    for name, case in importlib.import_module(f"tests.passes.fuse.test_{family}").CASES.items()
}
# test_through_qdq's cases: the rule fires through Q/DQ there.
THROUGH_QDQ = {
    n for cases in test_through_qdq.FAMILIES.values() for n in cases if n not in test_through_qdq.NOT_THROUGH_QDQ
}

# A rule not marked through_qdq fires in a quantized model only where no pair is inside its pattern.
NO_PAIR_INSIDE = (
    "n/a: not a rule that sees through Q/DQ; it fires on the QDQ variants where no pair is inside its pattern "
    "(an int64 mask's Unsqueezes, gpt2's Reshapes of unquantized values), and quantize_static leaves its case "
    "unquantized: its QDQ case is its float32 case"
)
# The rules that fire on both the float16 and the QDQ variants (their cases run at both precisions).
BOTH = (
    "attention-4d",
    "attention-heads-3d",
    "gelu-none",
    "gelu-tanh",
    "layernorm-residual-sum",
    "ort-biasgelu",
    "ort-fastgelu",
    "ort-gelu",
    "ort-multihead-attention",
    "ort-quickgelu",
    "ort-rmsnorm",
    "rmsnorm",
)
FLOAT16: dict[str, str | None] = {
    **dict.fromkeys(BOTH),
    "conv-mul": None,
    "div-mul-constants": None,
    "gather-consecutive-rows": None,
    "layout-chain-static": None,
    "ort-rotary-embedding": None,
    "ort-rotary-embedding-3d": None,
    "reshape-chain": None,
    "reshape-through-elementwise": "its case's Reshapes are matmul-add-gemm-projection's, which is measured on float32 "
    "only (its near miss: not a float32 MatMul); gpt2's float16 Gemm carries them instead",
    "rotary-embedding": None,
    "unsqueeze-unsqueeze": None,
}
QDQ: dict[str, str | None] = {
    **dict.fromkeys(BOTH),
    "layout-chain-static": NO_PAIR_INSIDE,
    "ort-skiprmsnorm-decomposed": None,
    "qdq-requantize-same": "n/a: its case is a quantized model already",
    "unsqueeze-unsqueeze": NO_PAIR_INSIDE,
}
# Where a perturbation refuses a rule through Q/DQ for another reason than in float32, by (precision, rule, kind).
REASONS: dict[tuple[str, str, str], str | None] = {
    # An interior value made a graph output keeps its pair whole (the output reads the float value): the pattern
    # does not see through it, so nothing matches and no near miss is said.
    **{("qdq", name, "output"): None for name, why in QDQ.items() if why is None},
    # The constant skip is quantized as a weight (int8 behind its DequantizeLinear): not a float operand.
    ("qdq", "layernorm-residual-sum", "attr"): "do not provably have one 3-D float shape",
}


@pytest.fixture(autouse=True)
def _same_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    same_weights(monkeypatch)


globals().update(precision_tests(CASES, {"float16": FLOAT16, "qdq": QDQ}, THROUGH_QDQ, REASONS))


def test_the_float16_mlp_names_the_type_that_keeps_its_projection_float32_only() -> None:
    """reshape-through-elementwise's case in float16: the Gemm projection it would carry the Reshapes through is
    not made (measured on float32 only), and the near miss says so by the type."""
    case = CASES["reshape-through-elementwise"]
    _, details = fuse(as_float16(case.build()), case.passes, **case.settings)
    assert "reshape-through-elementwise" not in details["applied"]
    assert any("not a float32 MatMul" in m for m in details["near_misses"]["matmul"]), details["near_misses"]
