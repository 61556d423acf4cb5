"""Shared fixtures: the model corpus, built once per machine into a cache folder."""

from __future__ import annotations

import hashlib
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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


@pytest.fixture(autouse=True)
def _rngs_seeded_by_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test module's shared ``RNG`` starts afresh for each test, from a seed of the test's own id and the
    module's name (two modules' streams differ: a weight and an input drawn from two of them are not equal).

    One generator shared by a worker's tests drew what the tests before it in that worker left, and pytest-xdist
    hands tests out by load: a case was another model from run to run, and a bound that held for most draws failed
    one run in many (FastGelu's bias, a float16 norm's gamma, rmsnorm's quantized case). Now what a test draws as
    it runs is the same whatever ran before it; a renamed test draws anew. Draws at import (a table's perturbation
    constants) follow the order the modules are collected in, which a given command repeats."""
    seed = zlib.crc32(request.node.nodeid.encode())
    for name, module in list(sys.modules.items()):
        if name.startswith("tests.") and isinstance(getattr(module, "RNG", None), np.random.Generator):
            monkeypatch.setattr(module, "RNG", np.random.default_rng([seed, zlib.crc32(name.encode())]))
    yield


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
