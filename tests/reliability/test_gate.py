"""The CI gate for model repositories: `graphopt run --check-optimized MODEL...`.

It exits 1 when a further run would still change a model (naming the passes that would),
0 when it would not, and writes nothing either way. One run must reach that fixpoint:
every corpus model, optimized once, passes the gate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import invoke
from tests.conftest import CORPUS_MODELS
from tests.reliability import builders
from tests.reliability.test_bad_input import snapshot


def gate(*models: Path) -> tuple[int, list[dict[str, object]]]:
    result = invoke("run", *models, "--check-optimized", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.exit_code, json.loads(result.stdout)["check_optimized"]


def test_gate_fails_before_and_passes_after_one_run_writing_nothing(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    before = snapshot(tmp_path)
    code, rows = gate(source)
    assert code == 1 and rows[0]["optimized"] is False
    assert "noop" in str(rows[0]["reason"]) and "cse" in str(rows[0]["reason"])  # the passes that would change it
    assert snapshot(tmp_path) == before
    out = tmp_path / "out" / "model.onnx"
    assert invoke("run", source, "-o", out, "-q").exit_code == 0
    assert gate(out) == (0, [{"path": str(out), "optimized": True, "reason": None}])
    assert gate(out, source)[0] == 1  # one model that is not optimized fails the whole gate


def test_gate_over_a_folder_and_a_config(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    builders.write(builders.base_model(), models, "a.onnx")
    builders.write(builders.zero_sized(), models, "b.onnx")
    code, rows = gate(models)
    assert code == 1 and len(rows) == 2
    dce_only = invoke("run", models, "--check-optimized", "--passes", "dce", "--json")
    assert dce_only.exit_code == 0, dce_only.stderr  # nothing dead in either model: dce would change nothing
    assert all(row["optimized"] for row in json.loads(dce_only.stdout)["check_optimized"])


@pytest.mark.parametrize("name", CORPUS_MODELS)
def test_corpus_model_reaches_the_fixpoint_in_one_run(corpus_dir: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / f"{name}.onnx"
    result = invoke("run", corpus_dir / f"{name}.onnx", "-o", out, "--no-check", "-q")
    assert result.exit_code == 0, result.stderr
    before = snapshot(tmp_path)
    code, rows = gate(out)
    assert code == 0, rows[0]["reason"]
    assert snapshot(tmp_path) == before
