"""The check's onnxruntime sessions: their options, their runs under the check's time limit, and
onnxruntime's refusals as one exception (check.py, judging.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from graphopt.errors import InputError
from graphopt.numerics.feeds import Feed
from graphopt.numerics.feeds import run as run_session
from graphopt.numerics.options import FIRST_RUN_SECONDS, TIME_FACTOR
from graphopt.numerics.ort_errors import first_line

__all__ = [
    "TIMEOUT_REMEDY",
    "Deadline",
    "OrtError",
    "Output",
    "as_numpy",
    "open_session",
    "seconds_text",
    "session_options",
]

# What a run gives for one output: an array, or for a sequence output a list of arrays.
Output = Feed


class OrtError(Exception):
    """onnxruntime refused: the message is the first line of its error."""


TIMEOUT_REMEDY = "--check-timeout SECONDS gives the check more time"


def seconds_text(seconds: float) -> str:
    return f"{round(seconds, 1):g}"


class Deadline:
    """The check's time limit from now (module docstring); ``run`` aborts a session run through
    RunOptions.terminate, and ``on_change(end, seconds)`` is told of each limit set."""

    def __init__(self, seconds: float | None, on_change: Callable[[float, float], None] | None) -> None:
        self.start = time.monotonic()
        self.on_change = on_change
        self.proportional = seconds is None
        self._limit(FIRST_RUN_SECONDS if seconds is None else seconds)

    def _limit(self, seconds: float) -> None:
        self.seconds, self.end = seconds, self.start + seconds
        if self.on_change is not None:
            self.on_change(self.end, seconds)

    def first_run_done(self) -> None:
        """The original has run once: a default limit becomes what that run took, TIME_FACTOR times."""
        if self.proportional:
            self.proportional = False
            self._limit(max(FIRST_RUN_SECONDS, TIME_FACTOR * (time.monotonic() - self.start)))

    def timed_out(self, doing: str) -> str:
        return f"timed out after {seconds_text(self.seconds)} s {doing}"

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def within(self, seconds: float, share: float = 1.0) -> Deadline:
        """A deadline ``seconds`` away, or at ``share`` of the time this one leaves if that comes first."""
        return Deadline(max(min(seconds, share * (self.end - time.monotonic())), 0.0), None)

    def run(self, session: ort.InferenceSession, feeds: Mapping[str, Feed]) -> list[Output]:
        if self.expired():
            raise TimeoutError
        options = ort.RunOptions()
        options.log_severity_level = 4
        timer = threading.Timer(max(0.0, self.end - time.monotonic()), lambda: setattr(options, "terminate", True))
        timer.start()
        try:
            return [as_numpy(out) for out in run_session(session, feeds, options)]
        except Exception as exc:
            if self.expired():
                raise TimeoutError from None
            raise OrtError(first_line(exc)) from None
        finally:
            timer.cancel()


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
