"""Quantized decoders get the fusions of their float32 form (issue 34 items 4 and 5).

The Llama fixtures (with and without a KV cache) are quantized as people deploy them: int4
weights (MatMulNBits, the int4 quantizer's op) and dynamic int8 (onnxruntime's
``quantize_dynamic``: DynamicQuantizeLinear, MatMulInteger and the scale Mul). Both are read
through onnxruntime's com.microsoft ops, so the fusions downstream of a projection (the head
split, RMSNorm, the rotary cache, the attention itself) need those ops' shapes; the CLI's own
check judges the numerics at each model's precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse_helpers import fuse, info, init, model, node, ops
from tests.precision_models import VARIANTS
from tests.precision_tools import Calibration, static_options

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exports"

# The fused ops the float32 fixture gets at each target, which its quantized forms must get too.
FUSED = (
    "Attention",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "QuickGelu",
)
TARGETS = {"default": (), "opset 23": ("--target-opset", "23"), "ort": ("--target", "ort")}


def _fused_ops(path: Path) -> dict[str, int]:
    found = ops(onnx.load(str(path)))
    return {op: found[op] for op in FUSED if found[op]}


def _run(source: Path, out: Path, target: str) -> dict[str, int]:
    done = invoke("run", source, "-o", out, *TARGETS[target])
    assert done.exit_code == 0, done.stderr
    assert "numerics: passed" in done.stderr, done.stderr
    return _fused_ops(out)


def _quantized_like_float32(tmp_path: Path, fixture: str, precision: str, target: str) -> None:
    float32 = FIXTURES / f"{fixture}.onnx"
    quantized = tmp_path / "quantized.onnx"
    onnx.save(VARIANTS[precision](onnx.load(str(float32))), quantized)
    expected = _run(float32, tmp_path / "float32.opt.onnx", target)
    assert _run(quantized, tmp_path / "quantized.opt.onnx", target) == expected


@pytest.mark.parametrize(
    ("fixture", "precision", "target"),
    [("llama_kv_ts", "int4", "opset 23"), ("llama_kv_ts", "int4", "ort"), ("llama_ts", "dynamic int8", "ort")],
)
def test_a_quantized_decoder_gets_the_fusions_of_its_float32_form(
    tmp_path: Path, fixture: str, precision: str, target: str
) -> None:
    """Before the com.microsoft ops had shapes: the int4 KV decoder got one RMSNormalization and
    nothing else; the dynamic int8 decoder one MultiHeadAttention of two."""
    _quantized_like_float32(tmp_path, fixture, precision, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("precision", ["int4", "dynamic int8"])
@pytest.mark.parametrize("fixture", ["llama_ts", "llama_kv_ts", "llama_kv_dynamo"])
def test_every_quantized_decoder_gets_the_fusions_of_its_float32_form(
    tmp_path: Path, fixture: str, precision: str, target: str
) -> None:
    _quantized_like_float32(tmp_path, fixture, precision, target)


# -- what must not fuse ----------------------------------------------------------------------------

HIDDEN, HEADS = 32, 2


def _int4_projection(x: str, out: str, weight: str, n: int = HIDDEN) -> list[onnx.NodeProto]:
    return [
        node(
            "MatMulNBits",
            [x, f"{weight}_q4", f"{weight}_scales"],
            out,
            domain="com.microsoft",
            K=HIDDEN,
            N=n,
            bits=4,
            block_size=32,
        )
    ]


def _int4_weights(weight: str, n: int = HIDDEN) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(len(weight))
    return [
        numpy_helper.from_array(rng.integers(0, 255, (n, 1, 16)).astype(np.uint8), f"{weight}_q4"),
        numpy_helper.from_array(np.full(n, 0.05, np.float32), f"{weight}_scales"),
    ]


def _rms_after_int4(x_shape: list[int | str] | None) -> onnx.ModelProto:
    """x -> MatMulNBits -> a decomposed RMSNorm (x * 1/sqrt(mean(x^2) + eps) * gamma)."""
    nodes = [
        *_int4_projection("x", "h", "w"),
        node("Pow", ["h", "two"], "sq"),
        node("ReduceMean", ["sq"], "ms", axes=[-1], keepdims=1),
        node("Add", ["ms", "eps"], "mse"),
        node("Sqrt", ["mse"], "rms"),
        node("Div", ["one", "rms"], "inv"),
        node("Mul", ["h", "inv"], "normed"),
        node("Mul", ["normed", "gamma"], "y"),
    ]
    params = [
        *_int4_weights("w"),
        init("two", 2.0),
        init("eps", 1e-6),
        init("one", 1.0),
        init("gamma", np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)),
    ]
    proto = model(nodes, [info("x", x_shape)], ["y"], params, opset=17)
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto


def _fused_rms(x_shape: list[int | str] | None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The RMSNorm model fused at opset 23; the outputs the same in onnxruntime."""
    proto = _rms_after_int4(x_shape)
    out, details = fuse(proto, target_opset=23)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 5, HIDDEN)).astype(np.float32)}
    assert_same_outputs(proto, out, feeds, rtol=1e-4, atol=1e-5)
    return out, details


def test_an_rms_norm_after_an_int4_projection_fuses() -> None:
    """Before MatMulNBits had a shape rule: "x has no known float type and rank"."""
    out, details = _fused_rms(["batch", "sequence", HIDDEN])
    assert details["applied"].get("rmsnorm", 0) == 1, details
    found = ops(out)
    assert found["MatMulNBits"] == found["RMSNormalization"] == 1 and found["ReduceMean"] == 0, found


def test_an_rms_norm_after_an_int4_projection_of_unknown_rank_is_a_near_miss() -> None:
    """MatMulNBits of an input of unknown rank has an output of unknown rank: the last axis the
    norm reduces is not provably the one RMSNormalization takes, so the norm stays and says why."""
    out, details = _fused_rms(None)
    assert "rmsnorm" not in details["applied"] and ops(out)["RMSNormalization"] == 0, details
    assert any("no known float type and rank" in m for m in details["near_misses"]["norm"]), details


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the quantizer on a constant's empty range
@pytest.mark.parametrize("fixture", ["gpt2_ts", "llama_ts"])
def test_a_qoperator_model_folds_its_shapes_as_its_float32_form(tmp_path: Path, fixture: str) -> None:
    """quantize_static's QOperator format (QLinearMatMul, onnxruntime's QLinearAdd, QLinearMul, ...): their shapes
    known, the shape computations after them fold as in the float32 export (before: gpt2_ts kept 23 Shape nodes
    and 270 nodes, 139 now; the float32 export's output keeps 3)."""
    from onnxruntime import quantization

    float32 = FIXTURES / f"{fixture}.onnx"
    proto = onnx.load(str(float32))
    quantized = tmp_path / "qoperator.onnx"
    calibration = Calibration(make_feeds(proto, seed) for seed in range(2))
    quantization.quantize_static(str(float32), str(quantized), calibration, **static_options("qop"))
    done = invoke("run", quantized, "-o", tmp_path / "out.onnx")
    assert done.exit_code == 0, done.stderr
    assert "numerics: passed" in done.stderr
    assert invoke("run", float32, "-o", tmp_path / "float32.onnx").exit_code == 0
    shapes = [ops(onnx.load(str(tmp_path / name)))["Shape"] for name in ("out.onnx", "float32.onnx")]
    assert shapes[0] == shapes[1]
