"""Run models in onnxruntime and check that two models compute the same outputs.

Inputs are generated from the first model's graph inputs, seeded: symbolic dims are
bound to small values (each distinct name its own, so a pass that confuses two dims is
caught), float inputs are normal samples, integer inputs small non-negative ids (ones
when the name says mask), bools random. Initializers listed as inputs are not fed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

__all__ = ["assert_same_outputs", "make_feeds", "run_ort"]

ModelLike = str | os.PathLike[str] | bytes | onnx.ModelProto

# Values for symbolic dims, handed out in order of first appearance.
_DIM_VALUES = (2, 3, 4, 5)


def one_thread_options() -> ort.SessionOptions:
    """Session options on one thread: the suites run on every core at once (pytest -n), and more threads per
    session only spin."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return options


def _session(model: ModelLike) -> ort.InferenceSession:
    options = one_thread_options()
    # Compare our rewrite, not onnxruntime's: its own graph optimizations stay off.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_ort(model: ModelLike, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` (a path, serialized bytes or a ModelProto) on ``feeds``; outputs by name."""
    session = _session(model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def make_feeds(model: ModelLike, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input of ``model`` that is not an initializer."""
    proto = model if isinstance(model, onnx.ModelProto) else _load(model)
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in proto.graph.initializer}
    dims: dict[str, int] = {}
    feeds: dict[str, np.ndarray] = {}
    for value_info in proto.graph.input:
        if value_info.name in initializers:
            continue
        tensor_type = value_info.type.tensor_type
        shape = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            else:
                shape.append(dims.setdefault(dim.dim_param, _DIM_VALUES[len(dims) % len(_DIM_VALUES)]))
        feeds[value_info.name] = _sample(rng, tensor_type.elem_type, tuple(shape), value_info.name)
    return feeds


def _sample(rng: np.random.Generator, elem_type: int, shape: tuple[int, ...], name: str) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        if "mask" in name.lower():
            return np.ones(shape, dtype=dtype)
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _load(model: str | os.PathLike[str] | bytes) -> onnx.ModelProto:
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model), load_external_data=False)


def assert_same_outputs(
    original: ModelLike,
    optimized: ModelLike,
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> dict[str, Any]:
    """Run both models on the same inputs and assert every output matches (NaN equals NaN).

    Returns the outputs of the original model, for tests that look further.
    """
    feeds = make_feeds(original) if feeds is None else feeds
    expected = run_ort(original, feeds)
    actual = run_ort(optimized, feeds)
    assert list(actual) == list(expected), f"output names differ: {list(expected)} -> {list(actual)}"
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"output {name!r}: dtype {want.dtype} -> {got.dtype}"
        assert got.shape == want.shape, f"output {name!r}: shape {want.shape} -> {got.shape}"
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"output {name!r}")
    return expected
