"""Shared fixtures: the model corpus, built once per machine into a cache folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Every pipeline the tests run verifies the IR after each pass (graphopt/settings.py).
os.environ.setdefault("GRAPHOPT_VERIFY", "1")

# CI (which sets CI) draws the same examples on every run, so a property fails every time
# or never, not one run in twenty; a run elsewhere draws new ones, and keeps a failure's
# example in .hypothesis to try first next time.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# ../shared beside the repository's root; .ci/run points GRAPHOPT_CORPUS_BUILDER elsewhere when the clone is not there.
CORPUS_BUILDER = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "build.py"
CORPUS_MODELS = [
    "bert_small",
    "bert_fp16_weights",
    "gpt2_small",
    "inception_v1",
    "resnet50",
    "tf_style_nhwc",
    "wide_ensemble",
]


def _corpus_builder() -> Path:
    return Path(os.environ.get("GRAPHOPT_CORPUS_BUILDER") or CORPUS_BUILDER)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The corpus folder ($GRAPHOPT_CORPUS or ~/.cache/graphopt-corpus), built if missing."""
    folder = Path(os.environ.get("GRAPHOPT_CORPUS", Path.home() / ".cache" / "graphopt-corpus"))
    if not all((folder / f"{name}.onnx").is_file() for name in CORPUS_MODELS):
        builder = _corpus_builder()
        if not builder.is_file():
            message = f"corpus builder {builder} not found (set GRAPHOPT_CORPUS_BUILDER)"
            # CI must not go green by skipping every corpus test.
            if os.environ.get("GRAPHOPT_REQUIRE_CORPUS"):
                pytest.fail(message)
            pytest.skip(message)
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(builder), "--out", str(folder)], check=True)
    return folder
