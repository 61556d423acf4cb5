"""One run reaches the fixed point: a second run, and so the --check-optimized gate, changes nothing, with the
default pipeline, ``--target ort`` and ``--target-opset 23``.

Through the command line on the exporter fixtures (tests/fixtures/exports) and the corpus, and as a property over
generated graphs: random_graphs.py's, and projections of one input (Q / K / V MatMul + Add pairs), which the late
fuse rules turn into Gemms that fold can batch only after them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from tests.cli_helpers import invoke
from tests.conftest import CORPUS_MODELS
from tests.passes.test_fuse_exports import FIXTURES
from tests.passes.test_fuse_float16 import float16
from tests.precision_tools import Calibration, static_options
from tests.reliability.random_graphs import random_models

# The command-line options of each configuration, and the same as optimize(check=False) keywords.
CONFIGURATIONS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "default": ([], {}),
    "ort": (["--target", "ort"], {"target": "ort"}),
    "opset23": (["--target-opset", "23"], {"target_opset": 23}),
}
EXPORTS = sorted(path.stem for path in FIXTURES.glob("*.onnx"))


def run_then_gate(source: Path, out: Path, options: list[str]) -> tuple[int, str]:
    """``graphopt run SOURCE -o OUT``, then the gate on OUT with the same options: its exit code and stderr."""
    result = invoke("run", source, "-o", out, "--no-check", "-q", *options)
    assert result.exit_code == 0, result.stderr
    gate = invoke("run", out, "--check-optimized", *options)
    return gate.exit_code, gate.stderr


@pytest.mark.parametrize("exporter", ["dynamo", "ts"])
def test_a_vit_export_passes_the_gate_after_one_run(tmp_path: Path, exporter: str) -> None:
    """The late fuse rules make the Q / K / V projections Gemms after fold has run: fold batches them in the
    same run, so the gate finds nothing left (it said "not optimized: nodes 44 -> 43 (by fold)")."""
    out = tmp_path / "vit.onnx"
    assert run_then_gate(FIXTURES / f"vit_{exporter}.onnx", out, []) == (0, f"{out}: optimized\n")


def _decoder_steps(proto: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Two decoding steps of the llama_kv_ts fixture (a vocabulary of 8), to calibrate on."""
    rng = np.random.default_rng(0)
    sizes = {"batch": 1, "sequence": 4, "past_sequence": 3, "total_sequence": 7}

    def step() -> dict[str, np.ndarray]:
        feeds = {}
        for value in proto.graph.input:
            shape = [d.dim_value or sizes[d.dim_param] for d in value.type.tensor_type.shape.dim]
            if value.name == "input_ids":
                feeds[value.name] = rng.integers(0, 8, shape).astype(np.int64)
            elif value.name == "attention_mask":
                feeds[value.name] = np.ones(shape, np.int64)
            elif value.name == "position_ids":
                feeds[value.name] = np.arange(3, 3 + shape[1], dtype=np.int64)[None].repeat(shape[0], 0)
            else:
                feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
        return feeds

    return [step(), step()]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the quantizer on a constant's empty range
def test_a_qoperator_decoder_passes_the_gate_after_one_run_at_opset_23(tmp_path: Path) -> None:
    """The QOperator KV decoder's attention output: its batch dim is unknown to graphopt's rules, and the input
    file names it (onnx's unk__ name). The settle group forgot that declaration, which the written file keeps, so
    only a second run proved the head merge's Reshape of the output an identity (the gate: "not optimized: nodes
    161 -> 154"). The settle group now sees the types the written file declares."""
    quantization = pytest.importorskip("onnxruntime.quantization")

    source, quantized = FIXTURES / "llama_kv_ts.onnx", tmp_path / "qoperator.onnx"
    steps = Calibration(_decoder_steps(onnx.load(str(source))))
    quantization.quantize_static(str(source), str(quantized), steps, **static_options("qop"))
    out = tmp_path / "out.onnx"
    code, said = run_then_gate(quantized, out, CONFIGURATIONS["opset23"][0])
    # the quantizer calibrated the attention mask's -inf: loading the file says so, then the gate passes
    assert (code, said.splitlines()[-1]) == (0, f"{out}: optimized"), said
    assert "have a scale that is infinite, NaN or zero" in said


@pytest.mark.slow
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
@pytest.mark.parametrize("name", EXPORTS)
def test_every_export_passes_the_gate_after_one_run(tmp_path: Path, name: str, configuration: str) -> None:
    code, stderr = run_then_gate(FIXTURES / f"{name}.onnx", tmp_path / "out.onnx", CONFIGURATIONS[configuration][0])
    assert code == 0, stderr


# The float16 copies onnxruntime's converter makes (float32 inputs and outputs): the float32 rules write Cast pairs
# that the late islands family then joins, which a second run must find nothing more to do with.
@pytest.mark.slow
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
@pytest.mark.parametrize("name", EXPORTS)
def test_every_float16_export_passes_the_gate_after_one_run(tmp_path: Path, name: str, configuration: str) -> None:
    source = tmp_path / "float16.onnx"
    onnx.save(float16(onnx.load(FIXTURES / f"{name}.onnx"), keep_io_types=True), source)
    code, stderr = run_then_gate(source, tmp_path / "out.onnx", CONFIGURATIONS[configuration][0])
    assert code == 0, stderr


# test_gate.py runs the corpus in the default configuration (in the default suite).
@pytest.mark.slow
@pytest.mark.parametrize("configuration", ["ort", "opset23"])
@pytest.mark.parametrize("name", CORPUS_MODELS)
def test_every_corpus_model_passes_the_gate_after_one_run(
    corpus_dir: Path, tmp_path: Path, name: str, configuration: str
) -> None:
    options = CONFIGURATIONS[configuration][0]
    code, stderr = run_then_gate(corpus_dir / f"{name}.onnx", tmp_path / "out.onnx", options)
    assert code == 0, stderr


# -- the property over generated graphs ------------------------------------------------------------------------


@st.composite
def projections(draw: st.DrawFn) -> onnx.ModelProto:
    """x (batch, tokens, hidden) read by 2-4 projections MatMul(x, W) + b of one width, each split into heads
    (Reshape, Transpose) as attention does, or through a Relu."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    tokens, hidden = draw(st.sampled_from([5, 17, 65])), draw(st.sampled_from([8, 32]))
    width, heads = draw(st.sampled_from([8, 32])), draw(st.sampled_from([1, 2]))
    nodes, inits, outputs = [], [], []
    for i in range(draw(st.integers(2, 4))):
        inits += [
            numpy_helper.from_array(rng.standard_normal((hidden, width)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]),
            helper.make_node("Add", [f"p{i}", f"b{i}"], [f"q{i}"]),
        ]
        if draw(st.booleans()):
            inits.append(numpy_helper.from_array(np.array([-1, tokens, heads, width // heads], np.int64), f"s{i}"))
            nodes += [
                helper.make_node("Reshape", [f"q{i}", f"s{i}"], [f"h{i}"]),
                helper.make_node("Transpose", [f"h{i}"], [f"y{i}"], perm=[0, 2, 1, 3]),
            ]
        else:
            nodes.append(helper.make_node("Relu", [f"q{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", tokens, hidden])
    graph = helper.make_graph(nodes, "projections", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def optimized(proto: onnx.ModelProto, configuration: str) -> onnx.ModelProto:
    result = optimize(from_proto(proto), **CONFIGURATIONS[configuration][1], check=False)
    assert result.report["failures"] == [], result.report["failures"]
    return to_proto(result.model)


def ops(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(random_models(), projections()), st.sampled_from(list(CONFIGURATIONS)))
def test_a_second_run_changes_no_generated_graph(proto: onnx.ModelProto, configuration: str) -> None:
    once = optimized(proto, configuration)
    twice = optimized(once, configuration)
    assert ops(twice) == ops(once)
    serialized = [m.SerializeToString(deterministic=True) for m in (once, twice)]
    assert serialized[0] == serialized[1], "the second run changed names or attributes"
