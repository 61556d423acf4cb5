"""Determinism: one input and one config give byte-identical models and reports (timings aside).

Across repeated runs, across `-j` settings and across Python hash seeds: iteration order
over sets and string-keyed dicts differs between PYTHONHASHSEED values, so a pass that
names or orders things by such an iteration shows up as different bytes here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from graphopt.report import without_timings
from tests.cli_helpers import invoke
from tests.reliability import builders

BATCH = ["wide_ensemble", "tf_style_nhwc", "bert_fp16_weights"]


def comparable(report: dict[str, Any], out: Path) -> str:
    """The report without timings, with the output folder written as OUT."""
    return json.dumps(without_timings(report), sort_keys=True).replace(str(out), "OUT")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_repeated_runs_give_identical_bytes_and_reports(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    outputs = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        result = invoke("run", source, "-o", out / "model.onnx", "--json", "-q")
        assert result.exit_code == 0, result.stderr
        outputs.append((files(out), comparable(json.loads(result.stdout), out)))
    assert outputs[0] == outputs[1]


def test_batch_outputs_and_reports_do_not_depend_on_jobs(corpus_dir: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for name in BATCH:
        shutil.copy(corpus_dir / f"{name}.onnx", models)
    runs = []
    for jobs in (1, 2):
        out = tmp_path / f"out-j{jobs}"
        result = invoke("run", models, "-o", out, "-j", jobs, "--json", "-q")
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        assert [r["numerics"]["status"] for r in report["models"]] == ["passed"] * len(BATCH)
        runs.append((files(out), comparable(report, out)))
    assert sorted(runs[0][0]) == sorted(f"{name}.onnx" for name in BATCH)
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]


def test_outputs_do_not_depend_on_the_hash_seed(corpus_dir: Path, tmp_path: Path) -> None:
    runs = []
    for seed in ("0", "1"):
        out = tmp_path / f"seed{seed}"
        command = [sys.executable, "-c", "from graphopt.cli import main; main()", "run"]
        command += [str(corpus_dir / "bert_small.onnx"), "-o", str(out / "model.onnx"), "--no-check", "-q"]
        command += ["--report", str(out / "report.json")]
        done = subprocess.run(command, env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        report = json.loads((out / "report.json").read_text())
        runs.append(((out / "model.onnx").read_bytes(), comparable(report, out)))
    assert runs[0] == runs[1]
