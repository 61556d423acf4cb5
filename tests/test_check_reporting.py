""" "Not checked" is never silent, and the check keeps to a memory budget (issues 24, 27, 28).

A model the check cannot verify gets one bounded line on stderr (under --quiet too) with the
remedy, a count in batch and merged totals, and exit 1 under --require-check. A model whose
original would need more memory than the check's budget is refused before it runs (from the
sizes the graph declares) or stopped when it runs (an address-space limit on the check's
child process), never left to exhaust the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli_helpers import invoke

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
REASON_LIMIT = 300


def _save(
    path: Path,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),
    domains: tuple[str, ...] = (),
) -> Path:  # type: ignore[assignment]
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domains)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), str(path))
    return path


def _custom_op_model(path: Path) -> Path:
    """Relu, then an op of a custom domain that onnxruntime does not know: it cannot run at any binding."""
    return _save(
        path,
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Mystery", ["a"], ["y"], domain="com.example")],
        [helper.make_tensor_value_info("x", FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["batch", 4])],
        domains=("com.example",),
    )


def _reshape_model(path: Path) -> Path:
    """A Reshape to a fixed [2, 50]: the original fails at every binding the check tries."""
    return _save(
        path,
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 50])],
        [numpy_helper.from_array(np.array([2, 50], np.int64), "shape")],
    )


def _relu_model(path: Path) -> Path:
    return _save(
        path,
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["batch", 4])],
    )


def _doubling_model(path: Path, doublings: int = 12) -> Path:
    """A 4 MiB weight concatenated with itself ``doublings`` times: 16 GiB at twelve (issue 27 item 9)."""
    nodes, current = [], "w"
    for step in range(doublings):
        nodes.append(helper.make_node("Concat", [current, current], [f"c{step}"], axis=0))
        current = f"c{step}"
    nodes.append(helper.make_node("ReduceSum", [current], ["s"], keepdims=0))
    nodes.append(helper.make_node("Add", ["x", "s"], ["y"]))
    weight = np.ones((1024, 1024), np.float32)
    return _save(
        path,
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [1])],
        [helper.make_tensor_value_info("y", FLOAT, [1])],
        [numpy_helper.from_array(weight, "w")],
    )


def _not_checked_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "not checked" in line]


def _reason(line: str) -> str:
    return line.split("numerics not checked: ", 1)[1]


def test_a_custom_op_onnxruntime_lacks_is_one_bounded_line_under_quiet(tmp_path: Path) -> None:
    source = _custom_op_model(tmp_path / "custom.onnx")
    result = invoke("-q", "run", source, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    lines = _not_checked_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"graphopt: warning: {source}: numerics not checked: ")
    assert "com.example:Mystery" in lines[0] and "[ONNXRuntimeError]" not in lines[0]
    assert len(_reason(lines[0])) <= REASON_LIMIT
    assert (tmp_path / "out.onnx").exists()


def test_a_model_failing_at_every_binding_names_the_remedy_in_300_characters(tmp_path: Path) -> None:
    source = _reshape_model(tmp_path / "reshape.onnx")
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.stderr
    (line,) = _not_checked_lines(result.stderr)[-1:]
    reason = _reason(line)
    assert len(reason) <= REASON_LIMIT, reason
    assert "--dim batch=" in reason and "--inputs data.npz" in reason, reason
    assert "cannot be reshaped" in reason and "onnxruntime_src" not in reason, reason
    numerics = json.loads((tmp_path / "r.json").read_text())["numerics"]
    assert numerics["reason"] == reason
    assert len(numerics["attempts"]) >= 2  # every binding tried, with onnxruntime's message, stays in the report


def test_require_check_exits_1_and_writes_nothing_when_not_checked(tmp_path: Path) -> None:
    source = _custom_op_model(tmp_path / "custom.onnx")
    result = invoke("-q", "run", source, "-o", tmp_path / "out.onnx", "--require-check")
    assert result.exit_code == 1, result.stderr
    (line,) = _not_checked_lines(result.stderr)
    assert line.startswith(f"graphopt: error: {source}: numerics not checked (--require-check): ")
    assert not (tmp_path / "out.onnx").exists()


def test_require_check_passes_a_checked_model(tmp_path: Path) -> None:
    source = _relu_model(tmp_path / "relu.onnx")
    result = invoke("-q", "run", source, "-o", tmp_path / "out.onnx", "--require-check")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""


def test_require_check_with_no_check_is_bad_usage(tmp_path: Path) -> None:
    source = _relu_model(tmp_path / "relu.onnx")
    result = invoke("run", source, "--no-check", "--require-check")
    assert result.exit_code == 2
    assert "--require-check" in result.stderr and not (tmp_path / "relu.opt.onnx").exists()


def test_check_optimized_says_it_runs_no_numerics_check(tmp_path: Path) -> None:
    help_text = " ".join(invoke("run", "--help").output.split())
    assert "--check-optimized" in help_text and "runs no numerics check" in help_text
    result = invoke("run", _relu_model(tmp_path / "relu.onnx"), "--check-optimized", "--require-check")
    assert result.exit_code == 2 and "--require-check" in result.stderr


def test_batch_totals_count_models_not_checked_and_require_check_gates(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    _custom_op_model(models / "custom.onnx")
    _relu_model(models / "relu.onnx")
    result = invoke("run", models, "-o", tmp_path / "out/", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["totals"]["not_checked"] == 1 and report["totals"]["failures"] == 0
    assert len(_not_checked_lines(result.stderr)) >= 1
    assert "1 not checked" in " ".join(result.stderr.split())

    quiet = invoke("-q", "run", models, "-o", tmp_path / "out2/", "--require-check")
    assert quiet.exit_code == 1
    (line,) = _not_checked_lines(quiet.stderr)
    assert f"{models / 'custom.onnx'}: numerics not checked (--require-check)" in line
    assert not (tmp_path / "out2" / "custom.onnx").exists() and (tmp_path / "out2" / "relu.onnx").exists()


def test_merged_totals_count_models_not_checked(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    _custom_op_model(models / "custom.onnx")
    _relu_model(models / "relu.onnx")
    for shard in (1, 2):
        result = invoke(
            "-q",
            "run",
            models,
            "-o",
            tmp_path / "out/",
            "--shard",
            f"{shard}/2",
            "--report",
            tmp_path / f"s{shard}.json",
        )
        assert result.exit_code == 0, result.stderr
    merged = invoke("report", "merge", tmp_path / "s1.json", tmp_path / "s2.json", "-o", tmp_path / "all.json")
    assert merged.exit_code == 0, merged.stderr
    assert json.loads((tmp_path / "all.json").read_text())["totals"]["not_checked"] == 1
    assert "1 not checked" in merged.stderr


def test_check_command_require_check(tmp_path: Path) -> None:
    source = _custom_op_model(tmp_path / "custom.onnx")
    result = invoke("-q", "check", source, source)
    assert result.exit_code == 0
    (line,) = _not_checked_lines(result.stderr)
    assert len(_reason(line)) <= REASON_LIMIT
    gated = invoke("-q", "check", source, source, "--require-check")
    assert gated.exit_code == 1
    (line,) = _not_checked_lines(gated.stderr)
    assert line.startswith(f"graphopt: error: {source}: numerics not checked (--require-check): ")


def test_a_constant_doubled_to_16_gib_is_refused_by_the_memory_budget(tmp_path: Path) -> None:
    source = _doubling_model(tmp_path / "doubling.onnx")
    result = invoke("-q", "check", source, source)
    assert result.exit_code == 0, result.stderr
    (line,) = _not_checked_lines(result.stderr)
    assert "exceeds the check's memory budget of 8 GB (--check-memory GB)" in line, line


def test_check_memory_overrides_the_budget(tmp_path: Path) -> None:
    source = _doubling_model(tmp_path / "doubling.onnx", doublings=3)  # 32 MiB at the end
    assert invoke("-q", "check", source, source).stderr == ""
    tight = invoke("-q", "run", source, "-o", tmp_path / "out.onnx", "--check-memory", "0.01")
    (line,) = _not_checked_lines(tight.stderr)
    assert "memory budget of 0.01 GB" in line, line
    bad = invoke("check", source, source, "--check-memory", "0")
    assert bad.exit_code == 2


def test_a_blow_up_the_graph_does_not_declare_is_stopped_at_the_budget(tmp_path: Path) -> None:
    """ConstantOfShape of a size computed from the input's shape: no declared shape tells the
    estimate, so only the limit on the check's process can stop its 8 GB."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("ReduceSum", ["shape"], ["sum"], keepdims=1),
        helper.make_node("Mul", ["sum", "big"], ["count"]),
        helper.make_node("ConstantOfShape", ["count"], ["zeros"], value=helper.make_tensor("v", FLOAT, [1], [0.0])),
        helper.make_node("ReduceSum", ["zeros"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    source = _save(
        tmp_path / "bomb.onnx",
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [2])],
        [helper.make_tensor_value_info("y", FLOAT, [2])],
        [numpy_helper.from_array(np.array([2**30], np.int64), "big")],
    )
    result = invoke("-q", "check", source, source, "--check-memory", "1")
    assert result.exit_code == 0, result.stderr
    (line,) = _not_checked_lines(result.stderr)
    assert "out of the check's memory budget of 1 GB" in line, line


@pytest.mark.parametrize("command", ["run", "check"])
def test_require_check_is_documented(command: str) -> None:
    assert "--require-check" in invoke(command, "--help").output


def test_a_model_within_the_budget_is_checked_and_one_over_it_is_refused(tmp_path: Path) -> None:
    """40 MB of weights inside the file: loading takes twice that (the estimate says so), and the
    limit on the check's process leaves room for onnxruntime's parsing at a budget just above."""
    source = _save(
        tmp_path / "m40.onnx",
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["batch", 1000])],
        [helper.make_tensor_value_info("y", FLOAT, ["batch", 10000])],
        [numpy_helper.from_array(np.ones((1000, 10000), np.float32), "w")],
    )
    within = invoke("-q", "check", source, source, "--check-memory", "0.09", "--require-check")
    assert within.exit_code == 0 and within.stderr == "", within.stderr
    over = invoke("-q", "check", source, source, "--check-memory", "0.07")
    (line,) = _not_checked_lines(over.stderr)
    assert "needs about 0.08 GB (its constants, twice), which exceeds the check's memory budget of 0.07 GB" in line


def test_a_scalar_string_input_counts_in_the_estimate(tmp_path: Path) -> None:
    """The check feeds a rank-0 string input as a Python str, which has no nbytes."""
    source = _save(
        tmp_path / "strings.onnx",
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.STRING, [])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, [])],
    )
    result = invoke("-q", "check", source, source)
    assert result.exit_code == 0 and "internal error" not in result.stderr, result.stderr


def _split_to_sequence(path: Path, sizes: list[int], scale: float = 1.0) -> Path:
    """A sequence output of tensors of different shapes: x[3, 4] split along axis 0 by ``sizes``."""
    return _save(
        path,
        [helper.make_node("Mul", ["x", "k"], ["xk"]), helper.make_node("SplitToSequence", ["xk", "sizes"], ["parts"])],
        [helper.make_tensor_value_info("x", FLOAT, [3, 4])],
        [helper.make_tensor_sequence_value_info("parts", FLOAT, None)],
        [
            numpy_helper.from_array(np.array(sizes, np.int64), "sizes"),
            numpy_helper.from_array(np.array(scale, np.float32), "k"),
        ],
    )


def test_a_sequence_of_tensors_of_different_shapes_is_compared(tmp_path: Path) -> None:
    """numpy cannot make one array of [1, 4] and [2, 4]: the check said "not checked"."""
    original = _split_to_sequence(tmp_path / "a.onnx", [1, 2])
    same = invoke("-q", "check", original, original, "--require-check")
    assert same.exit_code == 0 and same.stderr == "", same.stderr
    other_shapes = invoke("-q", "check", original, _split_to_sequence(tmp_path / "b.onnx", [2, 1]))
    assert other_shapes.exit_code == 1 and "sequence element 0 has shape (2, 4), not (1, 4)" in other_shapes.stderr
    other_values = invoke("-q", "check", original, _split_to_sequence(tmp_path / "c.onnx", [1, 2], scale=2.0))
    assert other_values.exit_code == 1 and "numerics failed" in other_values.stderr


def test_an_output_whose_shape_differs_fails_the_check_in_one_line(tmp_path: Path) -> None:
    """A file that declares r as [a, c, b] where Relu(x) is [a, b, c] (onnxruntime runs it; its value_info is
    wrong): graphopt trusts the declaration, folds the Reshape back to y's shape as a no-op, and q's shape
    differs. The check fails with the shape named; the console crashed on the "nan" distance of that output."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Add", ["r", "x"], ["z"]),
            helper.make_node("Shape", ["y"], ["s"]),
            helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Reshape", ["t", "s"], ["q"]),
        ],
        "g",
        [helper.make_tensor_value_info(n, FLOAT, ["a", "b", "c"]) for n in ("x", "y")],
        [helper.make_tensor_value_info(n, FLOAT, ["a", "b", "c"]) for n in ("z", "q")],
        value_info=[helper.make_tensor_value_info("r", FLOAT, ["a", "c", "b"])],
    )
    source, target = tmp_path / "declared.onnx", tmp_path / "out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output + result.stderr
    assert "shape (" in result.output and not target.exists()
