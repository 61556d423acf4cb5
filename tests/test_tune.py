"""--tune: each rewrite that applied is timed against the output without it on onnxruntime;
a rewrite that is faster beyond noise is kept, the rest undone, all within --tune-budget.

The rewrites are test-only fuse rules with effects far past any machine's noise: removing a
MatMul by an identity matrix of 240 x 240 (kept), and putting a product by one (an Einsum) in
front of a Relu, a slow equivalent (undone). Timed at ORT_DISABLE_ALL, so onnxruntime's own rewrites hide neither.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.passes.fuse import Refuse, Rule, add_rule, const, op, remove_rule, var
from graphopt.schemas import schema
from tests.cli_helpers import invoke

SIZE = 240


def _is_identity(array: np.ndarray) -> bool:
    return array.ndim == 2 and array.shape[0] == array.shape[1] and bool(np.array_equal(array, np.eye(len(array))))


def identity_matmul(path: Path) -> Path:
    """Relu(x) @ I @ W: the identity product is wasted work."""
    eye = numpy_helper.from_array(np.eye(SIZE, dtype=np.float32), "eye")
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((SIZE, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("MatMul", ["r", "eye"], ["h"]),
            helper.make_node("Sigmoid", ["h"], ["s"]),
            helper.make_node("MatMul", ["s", "w"], ["y"]),
        ],
        "identity_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZE, SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SIZE, 8])],
        [eye, weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


DROP_IDENTITY = Rule(
    name="test-drop-identity-matmul",
    family="test",
    pattern=op.MatMul(var("x"), const(name="eye")),
    plan=lambda m, site: None if _is_identity(np.asarray(site.array(m.value("eye")))) else Refuse("not an identity"),
    build=lambda b, m, plan: b.op("Identity", m.value("x")),
)


def _slow_relu(b: object, m: object, plan: object) -> object:
    eye = b.constant(np.eye(SIZE, dtype=np.float32), "eye")  # type: ignore[attr-defined]
    product = b.op("Einsum", m.value("x"), eye, equation="ij,jk->ik")  # type: ignore[attr-defined]
    return b.op("Relu", product)  # type: ignore[attr-defined]


SLOW_RELU = Rule(
    name="test-slow-relu",
    family="test",
    pattern=op.Relu(var("x", lambda v: v.producer is None)),  # a graph input: once
    build=_slow_relu,
)


@pytest.fixture
def rules() -> Iterator[None]:
    add_rule(DROP_IDENTITY)
    add_rule(SLOW_RELU)
    yield
    remove_rule(DROP_IDENTITY.name)
    remove_rule(SLOW_RELU.name)


def _decisions(report: dict[str, object]) -> dict[str, str]:
    return {d.get("rule", d["pass"]): d["decision"] for d in report["tune"]["decisions"]}  # type: ignore[index]


def test_tune_keeps_the_faster_rewrite_and_undoes_the_slower(tmp_path: Path, rules: None) -> None:
    source = identity_matmul(tmp_path / "m.onnx")
    result = graphopt.optimize(source, tune=True, tune_level="disable", tune_budget=1.0, runtime_guard=False)
    tune = result.report["tune"]
    decided = _decisions(result.report)
    assert decided["test-drop-identity-matmul"] == "kept"
    assert decided["test-slow-relu"] == "undone"
    by_rule = {d.get("rule"): d for d in tune["decisions"]}
    assert by_rule["test-drop-identity-matmul"]["ratio"] < 1 - tune["noise"]
    assert by_rule["test-slow-relu"]["ratio"] > 1
    assert tune["status"] == "tuned" and tune["final"]["kept"] == "tuned" and tune["final"]["ratio"] <= 1
    # The identity product gone, and no Einsum before the Relu.
    assert [n.op_type for n in result.model.graph.nodes] == ["Relu", "Sigmoid", "MatMul"]
    # The report's pipeline is the tuned one: the slow rule disabled.
    fuse = [s for g in result.report["pipeline"] if "steps" in g for s in g["steps"] if s["pass"] == "fuse"]
    assert fuse and all("test-slow-relu" in s["options"]["disable"] for s in fuse)


def test_tune_report_and_console(tmp_path: Path, rules: None) -> None:
    source = identity_matmul(tmp_path / "m.onnx")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    result = invoke(
        "run", source, "-o", out, "--report", report, "--tune", "--tune-level", "disable", "--tune-budget", "1"
    )
    assert result.exit_code == 0, result.stderr
    written = json.loads(report.read_text())
    jsonschema.validate(written, schema("report"))
    assert written["tune"]["level"] == "disable" and written["tune"]["threads"] == 1
    assert "tune: test-slow-relu undone (" in result.stderr
    assert "tune: tuned output kept, tuned / untuned " in result.stderr
    assert written["seconds"]["tune"] == written["tune"]["seconds"]


def test_tune_honours_its_budget(tmp_path: Path, rules: None) -> None:
    """A budget spent before the first candidate is built leaves them all untimed (kept)."""
    source = identity_matmul(tmp_path / "m.onnx")
    result = graphopt.optimize(source, tune=True, tune_level="disable", tune_budget=1e-6, runtime_guard=False)
    tune = result.report["tune"]
    assert [d["decision"] for d in tune["decisions"]] == ["not timed", "not timed"]
    assert all(d["reason"] == "out of --tune-budget" for d in tune["decisions"])
    assert tune["status"] == "untuned" and tune["seconds"] < 1.0
    assert [n.op_type for n in result.model.graph.nodes] == ["Einsum", "Relu", "Sigmoid", "MatMul"]  # untuned


def test_tune_is_off_by_default_and_checks_its_numbers(tmp_path: Path) -> None:
    source = identity_matmul(tmp_path / "m.onnx")
    assert "tune" not in graphopt.optimize(source, runtime_guard=False).report
    result = invoke("run", source, "-o", tmp_path / "o.onnx", "--tune", "--tune-budget", "0")
    assert result.exit_code == 2 and "--tune-budget must be positive" in result.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_time_models_times_at_the_dims_given_or_the_first_binding_that_runs(tmp_path: Path) -> None:
    """benchmarks/calibrate.py times at the cost model's sizes: a dim it fixes reaches the feeds
    (a Reshape to [2, 4] runs only at batch 2, which the check's first binding does not draw).
    Without it, the first of the check's bindings at which the model runs is timed (a QDQ T5
    encoder runs at none past 16 tokens: tune was not taken)."""
    from graphopt.runtime.tune import time_models

    shape = numpy_helper.from_array(np.array([2, 4], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "fixed_batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [shape],
    )
    path = tmp_path / "fixed_batch.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)

    assert "cannot run" in str(time_models([path], "all", 1, 0.0, {"batch": 3}))
    timed = time_models([path, path], "all", 1, 0.0, {"batch": 2})
    assert isinstance(timed, list) and len(timed) == 2 and len(timed[0]) >= 7
    found = time_models([path, path], "all", 1, 0.0)
    assert isinstance(found, list) and len(found) == 2 and len(found[0]) >= 7


def test_tune_keeps_a_rewrite_within_noise_where_undoing_only_the_slower_one_runs_fastest(
    tmp_path: Path, rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rewrite within the noise can add up to a faster whole: the identity product's removal timed as within
    noise (0.9993, noise 0.005) is kept where the model with only the slow Relu undone runs fastest. The timer is a
    cost model, so that the decision, not the machine, is tested: an Einsum costs 0.5, the identity product 0.001."""
    from graphopt.runtime import tune as tuning

    def cost(path: Path) -> float:
        ops = [n.op_type for n in onnx.load(str(path)).graph.node]
        return 1.0 + 0.5 * ("Einsum" in ops) + 0.001 * (ops.count("MatMul") == 2)

    def timed(paths: list[Path], level: str, threads: int, seconds: float) -> list[list[float]]:
        return [[cost(path)] * tuning.MIN_ROUNDS for path in paths]

    monkeypatch.setattr(tuning, "time_models", timed)
    source, out, report = identity_matmul(tmp_path / "m.onnx"), tmp_path / "out.onnx", tmp_path / "r.json"
    result = invoke(
        "run", source, "-o", out, "--report", report, "--tune", "--tune-level", "disable", "--no-runtime-guard"
    )
    assert result.exit_code == 0, result.stderr
    written = json.loads(report.read_text())
    jsonschema.validate(written, schema("report"))
    assert _decisions(written) == {"test-drop-identity-matmul": "kept", "test-slow-relu": "undone"}
    assert written["tune"]["final"]["kept"] == "tuned" and written["tune"]["final"]["undone"] == "slower"
    assert "tune: tuned output kept (only the slower rewrites undone), tuned / untuned 0.667" in result.stderr
    # the identity product gone, and no Einsum before the Relu
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["Relu", "Sigmoid", "MatMul"]
