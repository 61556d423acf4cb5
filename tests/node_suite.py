"""The ONNX backend node test suite as the tests use it: cases, runnable copies, feeds.

The suite stores some inputs and outputs as TensorProto or numpy scalars, which onnxruntime
does not take as feeds; they are converted here. Models onnxruntime cannot load (mostly
opsets newer than it supports, preview and training ops) are the callers' to skip.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from tests.numerics import one_thread_options

# onnx generates its node tests by running every op's reference code (20 s on one core), and each test process
# that asks for them would again: they are generated once per onnx and numpy version and kept in pytest's cache folder.
_CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "node-suite"


def cases() -> list[Any]:
    # The pickled arrays name numpy's modules, which moved between its major versions.
    cached = _CACHE / f"onnx-{onnx.__version__}-numpy-{np.__version__}.pickle"
    _CACHE.mkdir(parents=True, exist_ok=True)
    # The lock makes a second process wait for the first one's cases rather than generate them beside it.
    with open(_CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.exists():
            return list(pickle.loads(cached.read_bytes()))
        from onnx.backend.test.case.node import collect_testcases

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            generated = list(collect_testcases(None))
        partial = cached.with_suffix(f".{os.getpid()}")
        partial.write_bytes(pickle.dumps(generated, protocol=pickle.HIGHEST_PROTOCOL))
        partial.replace(cached)
        return generated


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
