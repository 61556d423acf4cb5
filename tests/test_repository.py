"""The repository's own habits: `make ci` is what CI runs, and the pre-commit hooks run the checks `make lint` runs,
with the project's tools."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_ci_runs_the_ci_script() -> None:
    # --no-print-directory: under `make test` (a make inside make) make would name the folder it enters
    planned = subprocess.run(
        ["make", "--no-print-directory", "-n", "ci"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert planned.stdout.splitlines() == ["bash .ci/run"]


def test_the_pre_commit_hooks_run_make_lints_checks_with_the_venvs_tools() -> None:
    hooks = dict(
        re.findall(r"- id: (\S+)\n(?:\s+\w+: .*\n)*?\s+entry: (.+)", (ROOT / ".pre-commit-config.yaml").read_text())
    )
    assert sorted(hooks) == ["mypy", "ruff", "ruff-format"]
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    for entry in hooks.values():
        tool, command = entry.split()[0], " ".join(entry.split()[:2]).replace(".venv/bin/", "")
        assert tool.startswith(".venv/bin/"), entry
        assert f"$(VENV)/bin/{command}" in lint, (entry, lint)
