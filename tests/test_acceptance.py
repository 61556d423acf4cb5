"""The pipeline's acceptance: the ONNX node test suite and every corpus model.

The node suite: every model onnxruntime can run must still produce the suite's expected
outputs after the default pipeline. The corpus: every model optimizes, passes the numerics
check and gives a report that validates against schemas/report.schema.json.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphopt import io
from graphopt.api import optimize
from graphopt.runner import RunOptions, optimize_file
from graphopt.schemas import schema
from tests import node_suite
from tests.conftest import CORPUS_MODELS

ort.set_default_logger_severity(4)


def _close(expected: Any, actual: Any, rtol: float, atol: float) -> bool:
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(_close(e, a, rtol, atol) for e, a in zip(expected, actual))
        )
    if isinstance(expected, dict):
        return bool(expected == actual)
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.shape != actual.shape:
        return False
    if expected.dtype == object or expected.dtype.kind in "biuSU":
        return bool(expected.tolist() == actual.tolist())
    return bool(np.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True))


def _node_suite(tmp_path: Path) -> tuple[collections.Counter[str], list[str]]:
    counts: collections.Counter[str] = collections.Counter()
    broken: list[str] = []
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    for case in node_suite.cases():
        if not case.data_sets:
            counts["skipped: no test data"] += 1
            continue
        onnx.save(case.model, source)
        try:
            session = node_suite.session(source)
        except Exception:
            counts["skipped: onnxruntime cannot load the original"] += 1
            continue
        feeds, expected = node_suite.feeds(case, session)
        try:
            original = session.run(None, feeds)
        except Exception:
            counts["skipped: onnxruntime cannot run the original"] += 1
            continue
        if not all(_close(e, o, case.rtol * 10, case.atol * 10) for e, o in zip(expected, original)):
            counts["skipped: onnxruntime disagrees with the suite's expected outputs"] += 1
            continue
        result = optimize(io.load(source), check=False)
        if result.report["failures"]:
            broken.append(f"{case.name}: pass failed: {result.report['failures'][0]}")
        io.save(result.model, target)
        try:
            outputs = node_suite.session(target).run(None, feeds)
        except Exception as err:
            broken.append(f"{case.name}: the optimized model does not run: {str(err).splitlines()[0][:200]}")
            continue
        if all(_close(e, o, case.rtol * 10, case.atol * 10) for e, o in zip(expected, outputs)):
            counts["equal to the expected outputs"] += 1
        else:
            broken.append(f"{case.name}: outputs differ from the expected ones")
    return counts, broken


@pytest.mark.slow  # minutes on one worker; .ci/run runs the slow suite
def test_default_pipeline_on_the_node_suite(tmp_path: Path) -> None:
    counts, broken = _node_suite(tmp_path)
    print(dict(counts))
    assert not broken, broken[:20]
    assert counts["equal to the expected outputs"] > 1350


@pytest.mark.parametrize("name", CORPUS_MODELS)
def test_corpus_model_optimizes_checks_and_reports(corpus_dir: Path, tmp_path: Path, name: str) -> None:
    report, code = optimize_file(corpus_dir / f"{name}.onnx", RunOptions(output=tmp_path / f"{name}.onnx"))
    jsonschema.validate(report, schema("report"))
    assert code == 0, report["numerics"]
    assert report["failures"] == []
    assert report["numerics"]["status"] == "passed"
    assert report["summary"]["after"]["nodes"] <= report["summary"]["before"]["nodes"]
