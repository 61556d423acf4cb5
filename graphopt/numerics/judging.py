"""The check's second and third criteria over its bindings (compare.py says what they judge): the
original run again with its rounding moved (noise.py), then evaluated in float32 (reference.py),
and where that distance cannot judge, the optimized model evaluated so too."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError

from graphopt.numerics.compare import (
    Criterion,
    OutputComparison,
    by_reference,
    compare_output,
    judge_by_reference,
    projection_spread,
    rejudge,
    relative_l2,
    second_chance,
)
from graphopt.numerics.feeds import Feed, relaid
from graphopt.numerics.inputs import Binding, ModelSpec
from graphopt.numerics.noise import DRAWS, Perturbation, self_noise
from graphopt.numerics.reference import float_reference
from graphopt.numerics.sessions import OrtError, Output, open_session, session_options

__all__ = ["Judged", "Runs", "judge_by_own_rounding"]


class Runs(Protocol):
    """What runs a session within the check's time limit (check.Deadline): outputs, or
    TimeoutError, or OrtError."""

    def run(self, session: ort.InferenceSession, feeds: Mapping[str, Feed]) -> list[Output]: ...


@dataclass(frozen=True)
class Judged:
    """The two model files a check judges, and how it runs them. ``memo``: a folder keeping the original's
    reruns (its own rounding's draws, its float reference), which later checks of the same original at the same
    inputs read back (the runner's retries judge one original against several outputs)."""

    original: Path
    optimized: Path
    layouts: Mapping[str, tuple[int, ...]]  # the optimized model's inputs in another layout (relaid)
    threads: int
    libraries: Sequence[str | os.PathLike[str]]
    memo: Path | None = None

    def recalled(self, key: str) -> tuple[bool, object]:
        """(True, what was kept under ``key``) or (False, None)."""
        path = None if self.memo is None else self.memo / f"{key}.pickle"
        if path is None or not path.is_file():
            return False, None
        return True, pickle.loads(path.read_bytes())

    def keep(self, key: str, found: object) -> None:
        if self.memo is not None:
            self.memo.mkdir(parents=True, exist_ok=True)
            (self.memo / f"{key}.pickle").write_bytes(pickle.dumps(found))


def judge_by_own_rounding(
    models: Judged,
    ran: list[tuple[Binding, dict[str, Feed], list[Output]]],
    done: list[list[OutputComparison]],
    produced: list[list[Output]],
    spec: ModelSpec,
    deadline: Runs,
    seed: int,
    room: int,
    on_phase: Callable[[str], None] | None,
) -> None:
    """The second criterion (compare.py, noise.py) for the outputs of ``done`` (each binding's)
    that failed the fixed limits on their figures: the original runs DRAWS more times at their bindings, its
    float data moved by rounding, and each such output is judged again against how far that
    moved it; an output that fails that too gets the third criterion (_judge_by_reference).
    Nothing runs when no output needs it."""
    retried = {number: [k for k, o in enumerate(b) if second_chance(o)] for number, b in enumerate(done)}
    retried = {number: outputs for number, outputs in retried.items() if outputs}
    if not retried:
        return
    precision = spec.compute_precision()
    perturbation: Perturbation | None = None  # read from the original where a draw is not in the memo
    draws: dict[int, list[list[Output]]] = {number: [] for number in retried}
    for draw in range(DRAWS):
        if on_phase is not None:
            on_phase(f"check: the original's own rounding, draw {draw + 1} of {DRAWS}")
        # A draw's perturbed feeds come from one generator in turn, so its runs depend on the bindings retried.
        key = f"draw-{seed}-{draw}-" + "-".join(map(str, retried))
        kept, found = models.recalled(key)
        if kept:
            for number, run in zip(retried, cast("list[list[Output]]", found), strict=False):
                draws[number].append(run)  # none where the draw did not run (kept as [])
            continue
        rng = np.random.default_rng([seed, 34, draw])
        perturbation = perturbation or Perturbation.of(models.original, precision, room)
        overrides = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in perturbation.draw(rng).items()}
        try:
            session = open_session(models.original, session_options(models.threads, models.libraries, overrides))
            ran_draw = [deadline.run(session, perturbation.feed(ran[number][1], rng)) for number in retried]
        except (OrtError, MemoryError):
            models.keep(key, [])
            continue  # a draw that does not run measures nothing; too few draws measure nothing
        except TimeoutError:
            break
        finally:
            session = None  # before its overrides
        models.keep(key, ran_draw)
        for number, run in zip(retried, ran_draw, strict=True):
            draws[number].append(run)
    for number, outputs in retried.items():
        binding = done[number]
        for k in outputs:
            noise, usable = self_noise(ran[number][2][k], [runs[k] for runs in draws[number]])
            rejudge(binding[k], noise, usable)
    _judge_by_reference(models, ran, done, produced, draws, deadline, on_phase)


def _judge_by_reference(
    models: Judged,
    ran: list[tuple[Binding, dict[str, Feed], list[Output]]],
    done: list[list[OutputComparison]],
    produced: list[list[Output]],
    draws: Mapping[int, list[list[Output]]],
    deadline: Runs,
    on_phase: Callable[[str], None] | None,
) -> None:
    """The third criterion (compare.py, reference.py) for the outputs that failed the second:
    the original with its float16 arithmetic and quantization evaluated in float32 runs at their
    bindings, and each such output passes when the optimized model's is no further from it than
    the original's, or one of the original's draws of its own rounding, is. Where that does not
    pass it, the optimized model's own float reference runs too (_float_programs)."""
    failing = {n: [k for k, o in enumerate(done[n]) if second_chance(o)] for n in draws}
    failing = {number: outputs for number, outputs in failing.items() if outputs}
    if not failing:
        return
    if on_phase is not None:
        on_phase("check: the original evaluated in float32")
    runs = _original_reference(models, {n: ran[n][1] for n in failing}, deadline)
    if runs is None:
        return  # no reference: the second criterion's verdict stands
    judged: dict[tuple[int, int], tuple[float, float, list[float]]] = {}
    spreads: dict[tuple[int, int], float] = {}
    for number, outputs in failing.items():
        for k in outputs:
            truth, before, after = runs[number][k], ran[number][2][k], produced[number][k]
            if not (isinstance(truth, np.ndarray) and isinstance(before, np.ndarray) and isinstance(after, np.ndarray)):
                continue  # a sequence never gets here: the fixed limits judge it element by element
            moved = [draw[k] for draw in draws[number]]
            reruns = [relative_l2(truth, m) for m in moved if isinstance(m, np.ndarray) and m.shape == truth.shape]
            judged[number, k] = relative_l2(truth, before), relative_l2(truth, after), reruns
            spreads[number, k] = projection_spread(truth, before, after)
    # The outputs the reference alone does not pass: the optimized model's float program may yet.
    unsettled = {
        key
        for key, (original, optimized, reruns) in judged.items()
        if not by_reference(original, optimized, reruns, done[key[0]][key[1]].self_noise)
    }
    programs = _float_programs(models, ran, runs, unsettled, deadline, on_phase) if unsettled else {}
    for (number, k), (original, optimized, reruns) in judged.items():
        judge_by_reference(done[number][k], original, optimized, reruns, programs.get((number, k)), spreads[number, k])


def _original_reference(
    models: Judged, feeds: Mapping[int, Mapping[str, Feed]], deadline: Runs
) -> dict[int, list[Output]] | None:
    """The original's float reference run at ``feeds``' bindings (_run_float_reference), as kept in the memo
    where an earlier check ran it there."""
    key = "reference-" + "-".join(map(str, feeds))
    kept, found = models.recalled(key)
    if kept:
        return cast("dict[int, list[Output]] | None", found)
    runs = _run_float_reference(models.original, feeds, models, deadline)
    models.keep(key, runs)
    return runs


def _run_float_reference(
    model: Path, feeds: Mapping[int, Mapping[str, Feed]], models: Judged, deadline: Runs
) -> dict[int, list[Output]] | None:
    """``model``'s float reference (reference.py) run on each of ``feeds``; None when it has
    none or it does not run."""
    try:
        reference = float_reference(onnx.load(str(model)))
    except (MemoryError, DecodeError, ValueError):
        return None
    if reference is None:
        return None
    try:
        session = open_session(reference.SerializeToString(), session_options(models.threads, models.libraries))
        return {number: deadline.run(session, feed) for number, feed in feeds.items()}
    except (OrtError, MemoryError, TimeoutError):
        return None


def _float_programs(
    models: Judged,
    ran: list[tuple[Binding, dict[str, Feed], list[Output]]],
    truths: Mapping[int, list[Output]],
    outputs: set[tuple[int, int]],
    deadline: Runs,
    on_phase: Callable[[str], None] | None,
) -> dict[tuple[int, int], OutputComparison]:
    """For each (binding, output) of ``outputs``: the optimized model's own float reference
    compared with the original's (``truths``) under the fixed float32 limits; empty when the
    optimized model has no float reference or it does not run."""
    if on_phase is not None:
        on_phase("check: the optimized model evaluated in float32")
    numbers = {number for number, _ in outputs}
    runs = _run_float_reference(
        models.optimized, {n: relaid(ran[n][1], models.layouts) for n in numbers}, models, deadline
    )
    if runs is None:
        return {}
    compared: dict[tuple[int, int], OutputComparison] = {}
    for number, k in outputs:
        truth, candidate = truths[number][k], runs[number][k]
        if isinstance(truth, np.ndarray) and isinstance(candidate, np.ndarray):
            compared[number, k] = compare_output("", truth, candidate, Criterion(), "float32")
    return compared
