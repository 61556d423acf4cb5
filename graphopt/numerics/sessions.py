"""The check's onnxruntime sessions: their options, and onnxruntime's refusals as one exception
(check.py, judging.py; check.Deadline runs them within the check's time limit)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from graphopt.errors import InputError
from graphopt.numerics.feeds import Feed
from graphopt.numerics.ort_errors import first_line

__all__ = [
    "OrtError",
    "Output",
    "as_numpy",
    "open_session",
    "session_options",
]

# What a run gives for one output: an array, or for a sequence output a list of arrays.
Output = Feed


class OrtError(Exception):
    """onnxruntime refused: the message is the first line of its error."""


def as_numpy(output: Any) -> Output:
    """An output as an array; a sequence output as a list of arrays (its tensors may differ in
    shape, which one array cannot hold)."""
    if isinstance(output, list):
        return [np.asarray(item) for item in output]
    return np.asarray(output)


def session_options(
    threads: int,
    libraries: Sequence[str | os.PathLike[str]] = (),
    overrides: Mapping[str, ort.OrtValue] | None = None,
) -> ort.SessionOptions:
    """The options of every session the check creates: the model as written, repeatably, with
    the custom-op libraries the user gave (``--custom-op-library``) registered; ``overrides``
    replace initializers by name (noise.py) and must outlive the session, which reads their memory.

    Raises:
        InputError: onnxruntime cannot register a library.
    """
    options = ort.SessionOptions()
    for name, value in (overrides or {}).items():
        options.add_initializer(name, value)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Fatal only: a failing run is reported in the result, onnxruntime need not print it too.
    options.log_severity_level = 4
    for library in libraries:
        try:
            options.register_custom_ops_library(str(library))
        except Exception as exc:
            why = first_line(exc)
            raise InputError(f"--custom-op-library {library}: onnxruntime cannot register it: {why}") from None
    return options


def open_session(model: Path | bytes, options: ort.SessionOptions) -> ort.InferenceSession:
    try:
        # A path, not bytes, for a model file: external data then loads from beside the file.
        source = model if isinstance(model, bytes) else str(model)
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise OrtError(first_line(exc)) from None
