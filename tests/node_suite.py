"""The ONNX backend node test suite as the tests use it: cases, runnable copies, feeds.

The suite stores some inputs and outputs as TensorProto or numpy scalars, which onnxruntime
does not take as feeds; they are converted here. Models onnxruntime cannot load (mostly
opsets newer than it supports, preview and training ops) are the callers' to skip.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from tests.numerics import one_thread_options


def cases() -> list[Any]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(collect_testcases(None))


def _as_feed(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list):
        return [_as_feed(v) for v in value]
    return value


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), one_thread_options(), providers=["CPUExecutionProvider"])


def feeds(case: Any, loaded: ort.InferenceSession) -> tuple[dict[str, Any], list[Any]]:
    """The first data set of ``case`` as onnxruntime feeds, and its expected outputs."""
    inputs, expected = case.data_sets[0]
    names = [i.name for i in loaded.get_inputs()]
    return dict(zip(names, [_as_feed(v) for v in inputs])), [_as_feed(v) for v in expected]
