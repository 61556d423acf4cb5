"""Shared fixtures: the model corpus, built once per machine into a cache folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.corpus import build as corpus

# Every pipeline the tests run verifies the IR after each pass (graphopt/settings.py).
os.environ.setdefault("GRAPHOPT_VERIFY", "1")

# CI (which sets CI) draws the same examples on every run, so a property fails every time
# or never, not one run in twenty; a run elsewhere draws new ones, and keeps a failure's
# example in .hypothesis to try first next time.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

CORPUS_MODELS = list(corpus.MODELS)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The corpus folder ($GRAPHOPT_CORPUS or ~/.cache/graphopt-corpus), built by tests/corpus/build.py when
    a model is missing or the builder changed since it wrote them (its hash is kept beside the models)."""
    folder = Path(os.environ.get("GRAPHOPT_CORPUS", Path.home() / ".cache" / "graphopt-corpus"))
    builder = hashlib.sha256(Path(corpus.__file__).read_bytes()).hexdigest()
    stamp = folder / ".builder-sha256"
    current = stamp.is_file() and stamp.read_text().strip() == builder
    corpus.build(folder, force=not current)
    if not current:
        stamp.write_text(builder + "\n")
    return folder
