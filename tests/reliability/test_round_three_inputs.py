"""Round three, the input side (issue 40): what graphopt reads is checked before it is trusted.

Reports given to `report merge` (shard sizes checked before anything is built, contents
that contradict themselves or each other refused), layout problems given to `unwind`
(sizes checked before allocation, the solver within its budget), inputs read only from
regular files, deep nesting answered as bad input, and messages that say what is wrong.
Each test failed before its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.errors import InputError
from graphopt.io import load
from graphopt.io.opset import convert_opset
from tests.cli_helpers import error_lines, invoke, mlp
from tests.reliability.test_bad_input import assert_one_line_error
from tests.test_check_reporting import _custom_op_model

# -- report merge: shard sizes (N9) and contents (N15, N16) --------------------------------------


def _run_report(tmp_path: Path, name: str, *options: str) -> dict[str, Any]:
    """The report of a folder run of one small model, models/m1.onnx (no check: fast)."""
    models = tmp_path / "models"
    if not (models / "m1.onnx").exists():
        mlp(models / "m1.onnx")
    report = tmp_path / f"{name}.json"
    result = invoke("run", models, "-o", tmp_path / f"out-{name}/", "--no-check", "--report", report, *options)
    assert result.exit_code == 0, result.stderr
    return dict(json.loads(report.read_text()))


def _merge(tmp_path: Path, *reports: dict[str, Any]) -> str:
    """`report merge` of ``reports`` written to files: its one error line (exit 2)."""
    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"shard{i + 1}.json")
        paths[-1].write_text(json.dumps(report))
    return assert_one_line_error(invoke("report", "merge", *paths))


def _shard(report: dict[str, Any], shard: str) -> dict[str, Any]:
    return {**report, "shard": shard}


def test_merge_names_the_missing_shards_of_a_huge_matrix_without_building_them(tmp_path: Path) -> None:
    """A report claiming shard 1/1000000: the refusal names five missing shards and counts
    the rest (it listed all 999,999, and 1/99999999999 exhausted the machine's memory)."""
    report = _run_report(tmp_path, "one")
    for count in (1_000_000, 99_999_999_999):
        started = time.perf_counter()
        line = _merge(tmp_path, _shard(report, f"1/{count}"))
        assert time.perf_counter() - started < 2
        named = ", ".join(f"{i}/{count}" for i in range(2, 7))
        assert f"shard {named} and {count - 6} more are missing" in line


def test_merge_counts_a_model_once_whatever_the_spelling_of_its_path(tmp_path: Path) -> None:
    report = _run_report(tmp_path, "one")
    (row,) = report["models"]
    path = row["input"]["path"]
    respelled = path.replace("/models/", "/./models/")
    other = _shard(report, "2/2") | {"models": [row | {"input": row["input"] | {"path": respelled}}]}
    line = _merge(tmp_path, _shard(report, "1/2"), other)
    assert f"{respelled} is in both" in line and "each model once" in line


@pytest.mark.parametrize("shard", ["1/0", "0/3", "4/3", "1/²", "-1/3"])
def test_merge_refuses_a_shard_out_of_range(tmp_path: Path, shard: str) -> None:
    line = _merge(tmp_path, _shard(_run_report(tmp_path, "one"), shard))
    assert f"shard '{shard}' is not i/n with 1 <= i <= n" in line and "shard1.json" in line


def test_merge_reads_a_shard_written_with_a_leading_zero_as_the_same_shard(tmp_path: Path) -> None:
    report = _run_report(tmp_path, "one")
    line = _merge(tmp_path, _shard(report, "1/2"), _shard(report, "01/2"))
    assert "shard 1/2 is given twice" in line


def test_merge_refuses_reports_of_another_graphopt_version(tmp_path: Path) -> None:
    report = _run_report(tmp_path, "one")
    line = _merge(tmp_path, report | {"graphopt_version": "0.0.1"})
    assert "shard1.json was written by graphopt '0.0.1'" in line


def test_merge_refuses_shards_that_ran_different_pipelines(tmp_path: Path) -> None:
    first = _run_report(tmp_path, "first")
    second = _run_report(tmp_path, "second", "--passes", "cleanup")
    (row,) = second["models"]
    second["models"] = [row | {"input": row["input"] | {"path": row["input"]["path"].replace("m1", "m2")}}]
    line = _merge(tmp_path, _shard(first, "1/2"), _shard(second, "2/2"))
    assert "shard1.json and " in line and "shard2.json ran different pipelines" in line


@pytest.mark.parametrize(
    ("status", "exit_code", "numerics"),
    [("check failed", 0, None), ("ok", 1, None), ("ok", 0, "failed"), ("ok", 7, None)],
)
def test_merge_refuses_a_row_whose_status_and_exit_code_disagree(
    tmp_path: Path, status: str, exit_code: int, numerics: str | None
) -> None:
    """A forged "check failed" with exit code 0 was merged as no failure (totals count by exit code)."""
    report = _run_report(tmp_path, "one")
    (row,) = report["models"]
    row = row | {"status": status, "exit_code": exit_code}
    if numerics is not None:
        row["numerics"] = {"status": numerics, "reason": "forged"}
    line = _merge(tmp_path, report | {"models": [row]})
    assert f"shard1.json: {row['input']['path']}: " in line and "as graphopt never reports" in line


def test_merge_answers_a_report_nested_100000_deep_as_bad_input(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"graphopt_version": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = assert_one_line_error(invoke("report", "merge", deep))
    assert "deep.json: not a graphopt report (nested deeper than Python's JSON parser reads)" in line


# -- unwind: sizes before allocation (N10, N16), the solver within its budget (N10) --------------


def _problem(tmp_path: Path, ops: list[dict[str, Any]], pairs: list[dict[str, Any]] | None = None) -> Path:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps({"ops": ops, "pairs": pairs or []}))
    return path


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([{"op": "Source", "id": "B", "shape": [12000, 12000]}], "a tensor of 144000000 elements"),
        ([{"op": "Sink", "id": "A", "shape": [100000, 100000]}], "a tensor of 10000000000 elements"),
        ([{"op": "Sink", "id": "A", "shape": [2**62]}], f"a tensor of {2**62} elements"),
        ([{"op": "Source", "id": "B", "shape": [1] * 100}], "a shape of rank 100"),
        (
            [{"op": "Source", "id": "B", "shape": [1000, 1000]}, {"op": "Sink", "id": "A", "shape": [1000, 1000]}],
            "the problem would hold 2000000 elements",
        ),
        (
            [{"op": "Source", "id": "B", "shape": [4]}, {"op": "Expand", "in": "B", "id": "E", "shape": [10**7, 4]}],
            "a tensor of 40000000 elements",
        ),
    ],
)
def test_unwind_refuses_a_problem_over_the_size_limits_before_allocating(
    tmp_path: Path, ops: list[dict[str, Any]], message: str
) -> None:
    """A 63-byte problem passed 1.5 GB (12000 x 12000); 2**62 and rank 100 were exit 3."""
    line = assert_one_line_error(invoke("unwind", _problem(tmp_path, ops)))
    assert "problem.json: $.ops[" in line and message in line


def test_unwind_refuses_more_ops_and_pairs_than_it_reads_in_time(tmp_path: Path) -> None:
    """200,000 one-element sinks ran past 120 s (the schema check alone takes half a millisecond
    each); 20,000 here, which took 10 s in the schema check before the solver started."""
    ops = [{"op": "Source", "id": "S", "shape": [1]}] + [
        {"op": "Sink", "id": f"k{i}", "shape": [1]} for i in range(20_000)
    ]
    started = time.perf_counter()
    line = assert_one_line_error(invoke("unwind", _problem(tmp_path, ops)))
    assert "20001 ops and pairs; a problem read from JSON has at most 10000" in line
    assert time.perf_counter() - started < 5


def test_unwind_answers_json_nested_100000_deep_as_bad_input(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    line = assert_one_line_error(invoke("unwind", deep))
    assert "deep.json: nested deeper than Python's JSON parser reads" in line


def test_the_unwind_solver_answers_within_its_budget(tmp_path: Path) -> None:
    """A 300 x 300 sink read transposed against a source: the default solver took 8 s with
    a budget of 1 s (its loops read no clock); now it answers with what it has by then."""
    n = 300
    ops = [
        {"op": "Source", "id": "B", "shape": [n, n]},
        {"op": "Sink", "id": "A", "shape": [n, n]},
        {"op": "DimShuffle", "in": "A", "perm": [1, 0], "id": "At"},
    ]
    pairs = [{"a": "At", "b": "B", "value": 1}, {"a": "A", "b": "B", "value": 2}]
    result = invoke("unwind", _problem(tmp_path, ops, pairs), "--time-budget", "0.5", "--json")
    assert result.exit_code == 0, result.stderr
    solution = json.loads(result.stdout)
    # The 0.5 s budget and room for a loaded runner (1.58 s on 2 cores busy with another job); the solver that
    # read no clock took 8 s.
    assert solution["seconds"] < 3.0, solution["seconds"]
    assert solution["objective"] >= 2 * n * n  # greedy's answer at least: A as B


# -- inputs are regular files (N11) ------------------------------------------------------------


@contextlib.contextmanager
def _fed(fifo: Path) -> Iterator[None]:
    """Write a few bytes into ``fifo`` whenever a reader opens it: a command that reads it
    gets them and goes on (failing the test) instead of blocking the test run for ever."""
    done = threading.Event()

    def feed() -> None:
        while not done.is_set():
            try:
                handle = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader yet
                done.wait(0.02)
                continue
            with contextlib.suppress(OSError):
                os.write(handle, b"{}")
            os.close(handle)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield
    finally:
        done.set()
        feeder.join()


@pytest.mark.parametrize(
    "command",
    [
        ["report", "merge", "{fifo}.json"],
        ["unwind", "{fifo}.json"],
        ["check", "{model}", "{fifo}.onnx"],
        ["run", "{model}", "--inputs", "{fifo}.npz", "-o", "{out}"],
        ["run", "{fifo}.onnx", "--no-check"],
        ["inspect", "{fifo}.onnx"],
    ],
)
def test_a_fifo_given_as_an_input_is_not_a_regular_file(tmp_path: Path, command: list[str]) -> None:
    """Each blocked for ever (a FIFO model was "no such file" where it did not)."""
    model = mlp(tmp_path / "m.onnx")
    args = [a.format(fifo=tmp_path / "fifo", model=model, out=tmp_path / "out.onnx") for a in command]
    fifo = next(Path(a) for a in args if Path(a).name.startswith("fifo."))
    os.mkfifo(fifo)
    with _fed(fifo):
        line = assert_one_line_error(invoke(*args))
    assert "fifo." in line and "not a regular file but a FIFO" in line
    assert not (tmp_path / "out.onnx").exists()


# -- messages (N18) ----------------------------------------------------------------------------


def test_a_model_not_checked_under_require_check_gets_one_line_in_a_folder_run(tmp_path: Path) -> None:
    """It got two, the first saying "numerics failed"."""
    models = tmp_path / "models"
    models.mkdir()
    _custom_op_model(models / "custom.onnx")
    result = invoke("-q", "run", models, "-o", tmp_path / "out/", "--require-check")
    assert result.exit_code == 1
    (line,) = error_lines(result)
    assert line.startswith(f"graphopt: error: {models / 'custom.onnx'}: numerics not checked (--require-check): ")


def test_an_input_folder_inside_the_output_folder_is_read(tmp_path: Path) -> None:
    """`graphopt run out/models -o out/` said "no models found": everything inside -o was
    left out, where the README leaves out only an -o folder inside the input folder."""
    out = tmp_path / "out"
    mlp(out / "models" / "m.onnx")
    result = invoke("run", out / "models", "-o", f"{out}/", "--no-check")
    assert result.exit_code == 0, result.stderr
    assert (out / "m.onnx").is_file()


def test_a_json_graph_nested_too_deep_says_what_the_limit_is(tmp_path: Path) -> None:
    """It said "nested 305 levels deep, over the 160 of 31 subgraphs"."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"format": "graphopt-graph", "x": ' + "[" * 300 + "]" * 300 + "}")
    line = assert_one_line_error(invoke("inspect", deep))
    assert "JSON nested 301 levels deep; a graph may nest at most 160 levels, 31 subgraphs inside one another" in line


def _reduce_max_with_axes_as_input() -> onnx.ModelProto:
    """ReduceMax-18 reading its axes from a graph input: going back to 13 needs them constant."""
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
        helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
    ]
    node = helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _blocked_dequantize() -> onnx.ModelProto:
    """DequantizeLinear-21 with a block_size: blocked quantization does not exist before 21."""
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.INT8, [2, 4]),
        helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 2]),
    ]
    node = helper.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=1, block_size=2)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    ("proto", "target", "op"),
    [(_reduce_max_with_axes_as_input(), 13, "ReduceMax"), (_blocked_dequantize(), 20, "DequantizeLinear")],
)
def test_an_opset_refusal_names_the_op(tmp_path: Path, proto: onnx.ModelProto, target: int, op: str) -> None:
    """The converter's messages name none ("No initializer or constant input to node found")."""
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    with pytest.raises(InputError, match=rf"cannot convert the model to opset {target}: op {op} blocks it \("):
        convert_opset(load(path), target)
