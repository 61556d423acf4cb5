"""Shared fixtures: the model corpus, built once per machine into a cache folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every pipeline the tests run verifies the IR after each pass (graphopt/settings.py).
os.environ.setdefault("GRAPHOPT_VERIFY", "1")

CORPUS_BUILDER = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "build.py"
WORKSPACE_BUILDER = Path("/work/shared/corpus/build.py")
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
    override = os.environ.get("GRAPHOPT_CORPUS_BUILDER")
    if override:
        return Path(override)
    # A clone made elsewhere (CI, a temp dir) falls back to the workspace's shared folder.
    return next((p for p in (CORPUS_BUILDER, WORKSPACE_BUILDER) if p.is_file()), CORPUS_BUILDER)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The corpus folder ($GRAPHOPT_CORPUS or ~/.cache/graphopt-corpus), built if missing."""
    folder = Path(os.environ.get("GRAPHOPT_CORPUS", Path.home() / ".cache" / "graphopt-corpus"))
    if not all((folder / f"{name}.onnx").is_file() for name in CORPUS_MODELS):
        builder = _corpus_builder()
        if not builder.is_file():
            pytest.skip(f"corpus builder {builder} not found")
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(builder), "--out", str(folder)], check=True)
    return folder
