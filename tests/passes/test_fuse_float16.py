"""float16 models get the fusions float32 models get (issue 34 item 3).

The models are converted as deployment engineers convert them, with onnxruntime's own float16
tool: constants are rounded to float16 (GELU's sqrt(2/pi) becomes 0.79785), and the ops run in
float16, which onnxruntime's CPU kernels of MultiHeadAttention, SkipSimplifiedLayerNormalization,
FastGelu, BiasGelu and QuickGelu take.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnxruntime.transformers.float16 import convert_float_to_float16

from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs
from tests.passes.fuse_helpers import fuse, ops
from tests.passes.fuse_models import bias_gelu, erf_gelu, tanh_gelu

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exports"


# Two float16 spacings: the fused kernel and the decomposition round differently.
FLOAT16_TOLERANCE = 2 * 2.0**-10


def fires(proto: onnx.ModelProto, rule: str, expected: dict[str, int], **settings: object) -> None:
    """``rule`` applies, the op counts are ``expected``, the outputs agree to float16's rounding."""
    out, details = fuse(proto, **settings)
    assert details["applied"].get(rule, 0) >= 1, details
    assert dict(ops(out)) == expected
    assert_same_outputs(proto, out, rtol=FLOAT16_TOLERANCE, atol=FLOAT16_TOLERANCE)


def float16(proto: onnx.ModelProto, keep_io_types: bool = False) -> onnx.ModelProto:
    return convert_float_to_float16(proto, keep_io_types=keep_io_types)


@pytest.mark.parametrize(
    ("build", "opset", "rule", "settings", "expected"),
    [
        (tanh_gelu, 20, "gelu-tanh", {}, {"Gelu": 1}),
        (tanh_gelu, 17, "ort-fastgelu", {"target": "ort"}, {"FastGelu": 1}),
        (erf_gelu, 20, "gelu-none", {}, {"Gelu": 1}),
    ],
)
def test_a_gelu_with_float16_rounded_constants_fuses(build, opset, rule, settings, expected) -> None:  # type: ignore[no-untyped-def]
    fires(float16(build(opset)), rule, expected, **settings)


def test_a_float16_biased_gelu_becomes_bias_gelu() -> None:
    fires(float16(bias_gelu()), "ort-biasgelu", {"BiasGelu": 1}, target="ort")


@pytest.mark.parametrize(
    ("fixture", "fused", "kept_apart"),
    [
        ("bert_ts", ["MultiHeadAttention"], []),
        # onnxruntime's float16 SkipSimplifiedLayerNormalization moved the float16 Llama further from float32
        ("llama_dynamo", ["MultiHeadAttention", "RotaryEmbedding"], ["SkipSimplifiedLayerNormalization"]),
    ],
)
def test_float16_exports_get_the_ort_fusions_of_their_float32_form(
    fixture: str, fused: list[str], kept_apart: list[str], tmp_path: Path
) -> None:
    source = FIXTURES / f"{fixture}.onnx"
    converted = tmp_path / f"{fixture}_fp16.onnx"
    onnx.save(float16(onnx.load(str(source)), keep_io_types=True), str(converted))
    counts = {}
    for name, path in (("float32", source), ("float16", converted)):
        out = tmp_path / f"{name}.opt.onnx"
        done = invoke("run", str(path), "-o", str(out), "--target", "ort")
        assert done.exit_code == 0, done.stderr
        assert "numerics: passed" in done.stderr
        counts[name] = ops(onnx.load(str(out)))
    for op in fused:
        assert counts["float32"][op] > 0
        assert counts["float16"][op] == counts["float32"][op], (op, counts["float16"])
    for op in kept_apart:
        assert counts["float32"][op] > 0 and counts["float16"][op] == 0, (op, counts["float16"])
