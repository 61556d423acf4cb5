"""The test suite's own determinism: what a test draws does not depend on the tests before it."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.passes import fuse_models


@pytest.mark.parametrize("draw", ["first", "second"])
def test_a_shared_rng_draws_from_the_tests_own_seed(request: pytest.FixtureRequest, draw: str) -> None:
    # the second case runs after the first in one worker: with one generator for both it drew what the first left
    seed = [zlib.crc32(request.node.nodeid.encode()), zlib.crc32(fuse_models.__name__.encode())]
    expected = np.random.default_rng(seed).standard_normal(4)
    np.testing.assert_array_equal(fuse_models.RNG.standard_normal(4), expected)
