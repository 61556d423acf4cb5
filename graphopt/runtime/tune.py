"""``--tune``: keep only the rewrites that measure faster on the user's onnxruntime.

graphopt decides with a static cost model; onnxruntime then fuses on its own, and what is
faster depends on its version, its level and the machine. Tuning times the candidates
there: each fuse rule that applied (a rule applied at many sites is one decision, timed once)
and the fold and unwind passes, each left out in turn as the runtime guard leaves a rewrite
out (guard.py: the pipeline reruns from the original without it). The models are timed in
one child process on the numerics check's inputs (its first binding), interleaved round by
round in a shuffled order, so a change of the machine's load falls on all of them; the
original against itself, timed among them, gives the noise floor.

A rewrite is kept when the output with it runs faster than the output without it by more
than the noise; the rest are undone. Decisions that give the same model are timed once. The
tuned model is then timed against the untuned output, beside the model with only the rewrites
that measured slower undone, and the faster of the two is kept when it is not slower than the
untuned output (``final["undone"]`` says which: "not faster" or "slower");
every decision goes into the report with its measured ratio (with / without) and spread. The
whole stays within ``tune_budget`` seconds: the candidates left when it runs out are kept
untimed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from graphopt.errors import InputError
from graphopt.ir import Model
from graphopt.ir.clone import Snapshot
from graphopt.passes.pipeline import PassRun, Pipeline, PipelineRun
from graphopt.runtime.guard import Rerun, Undoable, undoable, without

__all__ = ["Decision", "TuneOutcome", "candidates", "paired_ratio", "time_models", "tune"]

# The passes tuned whole besides the fuse rules (the cleanup passes only remove work).
TUNED_PASSES = frozenset({"fold", "unwind"})
# Rounds of the interleaved timing: at least, and at most. In each round every model runs
# REPEATS times in a row and its fastest counts, in an order drawn afresh: on a busy machine
# the scheduler takes the CPU away once in so many milliseconds, and a fixed order put that
# pause on the same model round after round.
MIN_ROUNDS, MAX_ROUNDS, REPEATS = 7, 200, 3
# The noise floor never goes below this ratio (half a percent).
MIN_NOISE = 0.005
# Where the untuned output is among the models timed (after the original's two sessions).
_OUTPUT = 2


@dataclass
class Decision:
    """One candidate: ``ratio`` = median over rounds of (time with it / time without it),
    ``spread`` half the interquartile range of those per-round ratios."""

    undoable: Undoable
    decision: Literal["kept", "undone", "not timed"]
    ratio: float | None = None
    spread: float | None = None
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {**self.undoable.as_dict(), "decision": self.decision}
        if self.ratio is not None:
            found |= {"ratio": round(self.ratio, 4), "spread": round(self.spread or 0.0, 4)}
        return found | {"reason": self.reason}


@dataclass
class TuneOutcome:
    """What tuning did: ``status`` "tuned" (``model``, ``run`` and ``pipeline`` are the tuned
    rerun's), "untuned" (nothing to undo, or the tuned model was not faster) or "not taken"
    (``reason``)."""

    status: str
    pipeline: Pipeline
    run: PipelineRun
    level: str
    threads: int
    model: Model | None = None
    reason: str = ""
    noise: float | None = None
    rounds: int = 0
    decisions: list[Decision] = field(default_factory=list)
    final: dict[str, Any] | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"status": self.status, "level": self.level, "threads": self.threads}
        if self.reason:
            found["reason"] = self.reason
        found |= {
            "noise": None if self.noise is None else round(self.noise, 4),
            "rounds": self.rounds,
            "decisions": [d.as_dict() for d in self.decisions],
            "final": self.final,
            "seconds": round(self.seconds, 6),
        }
        return found


class _Tuned(NamedTuple):
    """A tuned candidate: which rewrites it undid ("not faster" or "slower": ``units``) and its rerun."""

    undone: str
    units: list[Undoable]
    pipeline: Pipeline
    model: Model
    run: PipelineRun
    path: Path


def candidates(runs: Sequence[PassRun], undone: Sequence[Undoable]) -> list[Undoable]:
    """The rewrites tuning times: each fuse rule that applied, and the fold and unwind passes."""
    return [u for u in undoable(runs) if u not in undone and (u.rule is not None or u.pass_name in TUNED_PASSES)]


def tune(
    original: Snapshot,
    model: Model,
    run: PipelineRun,
    pipeline: Pipeline,
    rerun: Rerun,
    undone: Sequence[Undoable],
    *,
    level: str,
    threads: int,
    budget: float,
) -> TuneOutcome:
    """Tune the output ``model`` of ``run`` of ``pipeline``, which leaves out ``undone`` already
    (the runtime guard's); see the module docstring."""
    start = time.perf_counter()
    outcome = TuneOutcome("untuned", pipeline, run, level, threads)

    def left() -> float:
        return budget - (time.perf_counter() - start)

    with tempfile.TemporaryDirectory(prefix="graphopt-tune-") as folder:
        from graphopt.io import save
        from graphopt.io.onnx_write import digest

        def saved(name: str, found: Model) -> Path:
            path = Path(folder) / name / "model.onnx"
            save(found, path)
            return path

        # The original twice (its two sessions give the noise floor), then the output.
        first = saved("original", original.model())
        paths = [first, first, saved("output", model)]
        seen = {digest(model): _OUTPUT}
        timed: list[tuple[Undoable, int]] = []
        for index, unit in enumerate(candidates(run.runs, undone)):
            if left() < budget / 2:  # half the budget builds, the rest times
                outcome.decisions.append(Decision(unit, "not timed", reason="out of --tune-budget"))
                continue
            variant = original.model()
            rerun(without(pipeline, [unit]), variant)
            key = digest(variant)
            if key not in seen:
                seen[key] = len(paths)
                paths.append(saved(f"without-{index}", variant))
            timed.append((unit, seen[key]))
        if left() <= 0:  # the builds took it all
            outcome.decisions[:0] = [Decision(u, "not timed", reason="out of --tune-budget") for u, _ in timed]
            timed = []
        if not timed:
            outcome.seconds = time.perf_counter() - start
            return outcome
        times = time_models(paths, level, threads, max(left(), 0.0) * 0.6)
        if isinstance(times, str):
            outcome.status, outcome.reason = "not taken", times
            outcome.seconds = time.perf_counter() - start
            return outcome
        outcome.rounds = len(times[0])
        noise_ratio, noise_spread = paired_ratio(times[0], times[1])
        outcome.noise = noise = max(MIN_NOISE, abs(noise_ratio - 1) + noise_spread)
        dropped: list[Undoable] = []
        for unit, index in timed:
            ratio, spread = paired_ratio(times[_OUTPUT], times[index]) if index != _OUTPUT else (1.0, 0.0)
            faster = ratio < 1 - noise
            outcome.decisions.append(
                Decision(
                    unit,
                    "kept" if faster else "undone",
                    ratio,
                    spread,
                    "faster beyond noise" if faster else "not faster beyond noise",
                )
            )
            if not faster:
                dropped.append(unit)
        outcome.decisions.sort(key=lambda d: d.decision == "not timed")
        if not dropped:
            outcome.seconds = time.perf_counter() - start
            return outcome
        # The model with every rewrite not faster beyond noise undone, and the one with only those
        # that measured slower undone: rewrites each within the noise can add up to a faster whole
        # (segformer_ts_int4 at opset 23: every one undone 1.026 of the untuned time, the three
        # slower ones alone undone faster than it).
        slower = [d.undoable for d in outcome.decisions if d.decision == "undone" and (d.ratio or 0.0) > 1.0]
        choices = {"not faster": dropped, **({"slower": slower} if slower and len(slower) < len(dropped) else {})}
        built = []
        for which, chosen in choices.items():
            tuned_pipeline = without(pipeline, chosen)
            tuned = original.model()
            tuned_run = rerun(tuned_pipeline, tuned)
            built.append(_Tuned(which, chosen, tuned_pipeline, tuned, tuned_run, saved(f"tuned-{which}", tuned)))
        final = time_models([paths[_OUTPUT], *(t.path for t in built)], level, threads, max(left(), 0.0))
        if isinstance(final, str):
            outcome.status, outcome.reason = "not taken", final
        else:
            (ratio, spread), best = min(
                ((paired_ratio(final[index + 1], final[0]), t) for index, t in enumerate(built)),
                key=lambda timed: timed[0][0],
            )
            kept = ratio <= 1.0
            outcome.final = {
                "ratio": round(ratio, 4),
                "spread": round(spread, 4),
                "kept": "tuned" if kept else "untuned",
                "undone": best.undone,
            }
            if kept:
                outcome.status, outcome.model, outcome.run, outcome.pipeline = (
                    "tuned",
                    best.model,
                    best.run,
                    best.pipeline,
                )
                for decision in outcome.decisions:
                    if decision.decision == "undone" and decision.undoable not in best.units:
                        decision.decision = "kept"
                        decision.reason = (
                            "not faster beyond noise, nor slower: kept, as undoing the slower ones alone ran fastest"
                        )
    outcome.seconds = time.perf_counter() - start
    return outcome


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """The median of the per-round ratios a / b, and half their interquartile range."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if y > 0)
    if len(ratios) < 4:
        return statistics.median(ratios), 0.0
    quartiles = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), (quartiles[2] - quartiles[0]) / 2


def time_models(
    paths: list[Path], level: str, threads: int, seconds: float, dims: Mapping[str, int] | None = None
) -> list[list[float]] | str:
    """Per model, the seconds of each round's run, timed in a child process (or why not), on
    the check's first binding at which the first model runs (``dims`` fixes dims of it)."""
    from graphopt.numerics.isolated import run_isolated

    return run_isolated(_time_models, paths, level, threads, seconds, dict(dims or {}))


def _time_models(
    paths: list[Path], level: str, threads: int, seconds: float, dims: dict[str, int]
) -> list[list[float]] | str:
    import numpy as np
    import onnxruntime as ort

    from graphopt.numerics.feeds import run as run_session
    from graphopt.numerics.inputs import bind_dims, candidate_count, make_inputs, read_spec

    try:
        spec = read_spec(paths[0])
        bindings = [
            make_inputs(spec, bind_dims(spec, k, dims), np.random.default_rng(0)) for k in range(candidate_count())
        ]
    except (AssertionError, InputError) as err:
        return f"the check's inputs cannot be made: {err}"
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if level == "all" else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    try:
        sessions = [ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in paths]
    except Exception as err:  # onnxruntime refused a model: its message, in one line
        return f"onnxruntime cannot load a model: {' '.join(str(err).split())[:300]}"
    run_options = ort.RunOptions()
    feeds = next((f for f in bindings if _runs(sessions[0], f, run_options)), bindings[0])
    times: list[list[float]] = [[] for _ in sessions]
    try:
        for session in sessions:  # warm up: first runs allocate and pack
            run_session(session, feeds, run_options)
            run_session(session, feeds, run_options)
        end = time.perf_counter() + seconds
        order = np.random.default_rng(0)
        for round_ in range(MAX_ROUNDS):
            if round_ >= MIN_ROUNDS and time.perf_counter() > end:
                break
            for index in order.permutation(len(sessions)):
                runs = (_seconds(run_session, sessions[index], feeds, run_options) for _ in range(REPEATS))
                times[index].append(min(runs))
    except Exception as err:  # a model that does not run on the check's inputs (inputs relaid by unwind)
        return f"onnxruntime cannot run a model on the check's inputs: {' '.join(str(err).split())[:300]}"
    return times


def _runs(session: Any, feeds: Any, run_options: Any) -> bool:
    """Whether ``session`` runs on ``feeds``: the check's first binding at which the original runs
    is the one timed (a QDQ T5 encoder's quantized relative positions index out of their table
    past 16 tokens)."""
    from graphopt.numerics.feeds import run as run_session

    try:
        run_session(session, feeds, run_options)
    except Exception:  # onnxruntime's refusal of these inputs: the next binding is tried
        return False
    return True


def _seconds(run: Any, *args: Any) -> float:
    begin = time.perf_counter()
    run(*args)
    return time.perf_counter() - begin
