"""Regressions for pass failures found by mutating valid models (benchmarks/fuzz_passes.py),
and a property test that runs every pass over mutants of random graphs (slow).

Each model below is a mutant graphopt loads: a pass must skip what it cannot reason about,
never raise (the pipeline would roll it back and the run exit 0 with the pass undone) nor
take the process down. Each test runs ``graphopt run --strict`` (exit 3 on a pass failure;
the tests verify the IR after every pass) and checks the pass ran without an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphopt.api import optimize
from graphopt.errors import InputError
from graphopt.io import load
from graphopt.ir.clone import clone_model
from graphopt.passes.base import all_passes
from tests.cli_helpers import invoke
from tests.numerics import assert_same_outputs
from tests.reliability.mutate import mutants
from tests.reliability.random_graphs import random_models

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "mutant", inputs, outputs, initializers or [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_strict(model: onnx.ModelProto, tmp_path: Path, passes: str) -> None:
    """``graphopt run --strict`` exits 0 and every pass of ``passes`` ran without an error."""
    path = tmp_path / "mutant.onnx"
    onnx.save(model, path)
    report_path = tmp_path / "report.json"
    out = tmp_path / "out.onnx"
    result = invoke("run", path, "-o", out, "--passes", passes, "--strict", "--no-check", "-q", "--report", report_path)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["failures"] == []
    ran = {run["pass"] for run in report["passes"] if "error" not in run}
    assert set(passes.split(",")) <= ran


def _x(shape: list[int | str] | None = None, name: str = "x") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, FLOAT, [2, 3] if shape is None else shape)


def _y(shape: list[int | str] | None = None, name: str = "y") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, FLOAT, shape)


def test_shape_infer_unsqueeze_with_a_repeated_axis(tmp_path: Path) -> None:
    # The rule drew more dims than x has from an iterator: StopIteration, a RuntimeError.
    axes = numpy_helper.from_array(np.array([0, 0], np.int64), "axes")
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])
    _run_strict(_model([node], [_x()], [_y()], [axes]), tmp_path, "shape-infer")


def test_shape_infer_and_cse_constant_without_an_output(tmp_path: Path) -> None:
    # Constant's tensor was read as node.outputs[0]: IndexError in shape-infer (the weights
    # moved out of onnx's copy) and in cse (the constant's name).
    weights = numpy_helper.from_array(np.ones(3, np.float32), "w")
    nodes = [helper.make_node("Constant", [], [], value=weights), helper.make_node("Relu", ["x"], ["y"])]
    _run_strict(_model(nodes, [_x()], [_y()]), tmp_path, "shape-infer,cse")


def test_shape_infer_reads_past_an_element_type_onnx_cannot_name(tmp_path: Path) -> None:
    # onnx infers SequenceEmpty(dtype=-1) as a sequence of element type -1; reading that
    # back raised InputError inside the pass.
    nodes = [helper.make_node("SequenceEmpty", [], ["s"], dtype=-1), helper.make_node("Relu", ["x"], ["y"])]
    _run_strict(_model(nodes, [_x()], [_y()]), tmp_path, "shape-infer")


def test_noop_slice_with_a_stray_int_attribute(tmp_path: Path) -> None:
    # Since opset 10 Slice takes its starts as an input; a `starts` attribute that is an
    # int, not a list, was iterated: TypeError.
    starts = numpy_helper.from_array(np.array([0], np.int64), "starts")
    ends = numpy_helper.from_array(np.array([1], np.int64), "ends")
    node = helper.make_node("Slice", ["x", "starts", "ends"], ["y"], starts=5)
    _run_strict(_model([node], [_x()], [_y()], [starts, ends]), tmp_path, "noop")


def test_noop_transpose_with_an_int_perm(tmp_path: Path) -> None:
    node = helper.make_node("Transpose", ["x"], ["y"], perm=1)
    _run_strict(_model([node], [_x()], [_y()]), tmp_path, "noop")


def test_unwind_transpose_whose_perm_is_no_permutation(tmp_path: Path) -> None:
    # The pass took every rank-preserving Transpose for a DimShuffle: ProblemError.
    node = helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 7])
    _run_strict(_model([node], [_x()], [_y([3, 2])]), tmp_path, "unwind")


def test_unwind_node_whose_inputs_are_all_left_out(tmp_path: Path) -> None:
    # A Relu with its input left blank: the rank of its output was max() of nothing.
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]), helper.make_node("Relu", [""], ["y"])]
    _run_strict(_model(nodes, [_x()], [_y(), _y([3, 2], "t")]), tmp_path, "unwind")


def test_unwind_softmax_with_an_extra_input(tmp_path: Path) -> None:
    # LogSoftmax keeps its input's layout; a second input (of another rank) was paired with
    # the first: ProblemError "differ in shape".
    nodes = [
        helper.make_node("LogSoftmax", ["x", "w"], ["s"]),
        helper.make_node("Transpose", ["s"], ["y"], perm=[2, 1, 0]),
    ]
    inputs = [_x([2, 2, 2]), _x([2, 2], "w")]
    _run_strict(_model(nodes, inputs, [_y([2, 2, 2])]), tmp_path, "unwind")


def test_const_cache_if_without_its_condition(tmp_path: Path) -> None:
    # inline_constant_ifs read node.inputs[0] of an If whose condition was dropped: IndexError.
    branch = helper.make_graph([helper.make_node("Relu", ["x"], ["b"])], "branch", [], [_y(None, "b")])
    node = helper.make_node("If", [], ["y"], then_branch=branch, else_branch=branch)
    _run_strict(_model([node], [_x()], [_y()]), tmp_path, "const-cache")


def test_const_cache_node_with_a_blank_input_does_not_end_the_process(tmp_path: Path) -> None:
    # The evaluator asked onnx's inference for the region's sizes in process; on a
    # RegexFullMatch whose input is left blank onnx's C++ code ended the process (SIGSEGV).
    pattern = r"(\W|^)[\w.\-]{0,25}@(yahoo|gmail)\.com(\W|$)"
    nodes = [helper.make_node("RegexFullMatch", [""], [name], pattern=pattern) for name in ("y", "twin")]
    text = helper.make_tensor_value_info("x", TensorProto.STRING, [2, 2])
    out = helper.make_tensor_value_info("y", TensorProto.BOOL, [2, 2])
    _run_strict(_model(nodes, [text], [out], opset=20), tmp_path, "const-cache")


def test_fuse_matmul_without_its_weight(tmp_path: Path) -> None:
    # The kronecker rule's predicate read node.inputs[1] of a MatMul with one input: IndexError.
    nodes = [helper.make_node("MatMul", ["x"], ["y"])]
    _run_strict(_model(nodes, [_x()], [_y()]), tmp_path, "fuse")


def test_every_pass_takes_a_body_that_reuses_an_outer_name(tmp_path: Path) -> None:
    # onnx and onnxruntime take a Loop body whose iteration input is named like an outer value
    # (x); the IR saw a duplicate name, so with the IR verified every pass was rolled back.
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Relu", ["v"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("x", INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         _x([2], "v")],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _y([2], "v_out")],
    )  # fmt: skip
    nodes = [
        helper.make_node("Constant", [], ["n"], value=numpy_helper.from_array(np.array(2, np.int64))),
        helper.make_node("Loop", ["n", "", "x"], ["y"], body=body),
    ]
    _run_strict(_model(nodes, [_x([2])], [_y([2])]), tmp_path, "shape-infer,noop,dce,cse,strip-value-info")
    assert_same_outputs(tmp_path / "mutant.onnx", tmp_path / "out.onnx")


def _run_in_child(model: onnx.ModelProto, tmp_path: Path, passes: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "mutant.onnx"
    onnx.save(model, path)
    command = [sys.executable, "-c", "from graphopt.cli import main; main()", "run", str(path)]
    command += ["-o", str(tmp_path / "out.onnx"), "--passes", passes, "--strict", "--no-check", "-q"]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "GRAPHOPT_VERIFY": "1"})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="onnx's inference is isolated in a forked child")
def test_shape_infer_survives_onnx_inference_crashing(tmp_path: Path) -> None:
    # onnx's C++ inference sizes num_outputs chunks and then reads one per output without a
    # bounds check: a Split with more outputs than num_outputs failed an assertion (or read
    # past the vector) and killed graphopt.
    node = helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=2)
    outputs = [_y(name=n) for n in ("a", "b", "c")]
    done = _run_in_child(_model([node], [_x([2, 6])], outputs, opset=18), tmp_path, "shape-infer")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("node", "shape"),
    [
        (helper.make_node("Einsum", ["x"], ["y"], equation=3), [2, 3]),
        (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=0.5), [1, 4, 2, 2]),
    ],
    ids=["einsum-int-equation", "depth-to-space-float-blocksize"],
)
def test_shape_infer_attribute_of_another_kind(tmp_path: Path, node: onnx.NodeProto, shape: list[int]) -> None:
    # The rules read attributes by name whatever their kind: int.decode(), a float block
    # size in dim arithmetic: AttributeError.
    _run_strict(_model([node], [_x(shape)], [_y()]), tmp_path, "shape-infer")


def test_unwind_graph_output_listed_twice(tmp_path: Path) -> None:
    # The Transpose becomes a view of x; each listing of its output was restored on its own:
    # two values named t.
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 1]), helper.make_node("Relu", ["x"], ["y"])]
    _run_strict(_model(nodes, [_x()], [_y([2, 3], "t"), _y([2, 3], "t"), _y()]), tmp_path, "unwind")


def test_cse_does_not_merge_into_an_omitted_output(tmp_path: Path) -> None:
    # Two equal Transposes, the first with its output left out (an empty name): its nameless
    # value took the place of the second's, and Sub read a value without a name.
    nodes = [
        helper.make_node("Transpose", ["x"], [""], perm=[1, 0]),
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
        helper.make_node("Sub", ["t", "t"], ["y"]),
    ]
    _run_strict(_model(nodes, [_x()], [_y([3, 2])]), tmp_path, "cse")


@pytest.mark.slow
# Derandomized: the CI gate sees the same 150 mutants every run; benchmarks/fuzz_passes.py explores.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(random_models(), st.integers(0, 2**32 - 1))
def test_every_pass_takes_every_mutant_graphopt_loads(model: onnx.ModelProto, seed: int) -> None:
    passes = [name for name in all_passes() if not name.startswith("test-")]
    with tempfile.TemporaryDirectory() as folder:
        for what, mutant in mutants(model, seed, 2):
            path = Path(folder) / "mutant.onnx"
            onnx.save(mutant, path)
            try:
                loaded = load(path, opaque_ops="quiet")
            except InputError:
                continue  # refused as bad input: nothing for a pass to handle
            for pipeline in [*passes, None]:
                result = optimize(clone_model(loaded), pipeline, verify=True, check=False)
                assert result.report["failures"] == [], (
                    what,
                    result.report["failures"],
                    [r.traceback for r in result.pipeline_run.failures],
                )
