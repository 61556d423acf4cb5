"""Prove with onnxruntime that an optimized model computes what the original did.

Both files are run by onnxruntime's CPU provider on the same seeded inputs at two or more
bindings of the dynamic dims (see inputs.py), then at the largest binding where the
original's runs so far predict it is cheap enough, and every output is compared (see
compare.py). Custom-op libraries the user names are registered in every session.

onnxruntime runs both models with its graph optimizations off (ORT_DISABLE_ALL): the original
is then evaluated op by op as written, and a difference can only come from graphopt's rewrite,
never from onnxruntime's own fusions, which have disagreed numerically between levels
(microsoft/onnxruntime #20321) and could rewrite both models alike and hide a bug. One intra-op
and one inter-op thread make every run repeatable.

The original runs first (all bindings), then its session is freed before the optimized one is
built, so only one model is resident at a time. An output the graph shows to be random (a
Random* op, Bernoulli, Multinomial or a Dropout whose training_mode is no constant false on its
path, see paths.py) is "not checked: nondeterministic (op X)", and the other outputs are judged
as usual; no run has to disagree for that. As a backstop for what the graph cannot show (a
custom op or model-local function that draws numbers), a model that calls such ops runs twice
at the first binding, and an output on which it disagrees with itself is not checked either.
Such an output never fails the check. Outcomes:

A bfloat16 original, on which onnxruntime's CPU provider runs no arithmetic, is checked on both
models' float32 programs (reference.py: the weights keep their bfloat16 values), its outputs
judged by its own precision: the fixed tolerance of float32, then its own rounding, the program's
weights and inputs moved by half a bfloat16 ulp. The report's criterion says so ("program").

- "not checked": onnxruntime cannot load the original, it fails at every binding tried, an
  input has a type the check cannot generate, time ran out before a comparison was made, or
  nothing was compared (every output empty or NaN in both models), or every output compared holds
  one value at every element of every binding of generated inputs (the inputs never reached what
  computes it, so a wrong rewrite there could not show; one such output among others, or at the
  inputs the user gave, is a note). Never "passed".
- "failed": the inputs or outputs of the two models differ in names or types, an output
  differs, or the optimized model cannot be loaded or run where the original could (a model
  that onnxruntime ran before optimizing and rejects after is a broken model, not an
  unverifiable one).
- "passed": every output of every binding that ran met the criterion (outputs that are not
  checked are named in the reason).

The check's time limit is ``timeout`` seconds (``--check-timeout``), or by default
TIME_FACTOR times what the original's first run took (reading the models, loading the original
and running it at the first binding), and at least FIRST_RUN_SECONDS, which is also what that
first run may take. onnxruntime stops a run when time is up (RunOptions.terminate, which its
Loop and Scan kernels also heed).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
from google.protobuf.message import DecodeError

from graphopt.errors import InputError
from graphopt.numerics.budget import DEFAULT_MEMORY_BUDGET, footprint, gigabytes
from graphopt.numerics.budget import confine as limit_memory  # the name ``confine`` is the option
from graphopt.numerics.compare import (
    ALLCLOSE,
    FIXED,
    FLOAT_PROGRAM,
    FLOAT_REFERENCE,
    OWN_ROUNDING,
    Criterion,
    OutputComparison,
    compare_output,
)
from graphopt.numerics.feeds import Feed, relaid
from graphopt.numerics.feeds import run as run_session
from graphopt.numerics.inputs import (
    Binding,
    ModelSpec,
    bind_dims,
    candidate_count,
    dim_keys,
    input_elements,
    largest_binding,
    load_npz,
    make_inputs,
    read_spec,
    run_cost,
)
from graphopt.numerics.judging import Judged, judge_by_own_rounding
from graphopt.numerics.options import FIRST_RUN_SECONDS, TIME_FACTOR, check_numbers
from graphopt.numerics.ort_errors import first_line
from graphopt.numerics.reference import float_programs
from graphopt.numerics.sessions import OrtError, Output, as_numpy, open_session, session_options

__all__ = [
    "LARGEST_SECONDS",
    "LARGEST_STOP_SECONDS",
    "TIMEOUT_REMEDY",
    "BindingResult",
    "CheckResult",
    "check_models",
    "json_ready",
    "session_options",
    "seconds_text",
]

Status = Literal["passed", "failed", "not checked"]

# What a check of a bfloat16 model compares (reference.py): onnxruntime's CPU provider runs no bfloat16 arithmetic.
FLOAT32_PROGRAMS = "the float32 programs of both models"


@dataclass
class BindingResult:
    dims: dict[str, int]
    outputs: list[OutputComparison]
    passed: bool  # no output failed (outputs not judged do not count)
    regimes: list[str] = field(default_factory=list)  # the input regimes of this binding (inputs.py)


@dataclass
class CheckResult:
    status: Status
    reason: str | None
    criterion: dict[str, Any]
    bindings: list[BindingResult] = field(default_factory=list)
    seconds: float = 0.0
    # Each binding at which the original did not run: its dims and why (onnxruntime's words).
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # A passed check's criterion: the last of FLOAT_PROGRAM, FLOAT_REFERENCE and OWN_ROUNDING
    # some output needed, else FIXED (ALLCLOSE with --atol/--rtol); None when nothing float was
    # judged or the check did not pass.
    passed_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite floats become the strings "nan", "inf" and "-inf"."""
        result: dict[str, Any] = json_ready(asdict(self))
        return result


def json_ready(value: Any) -> Any:
    """``value`` with non-finite floats as the strings "nan", "inf" and "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


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


def _dims_text(dims: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{name}={value}" for name, value in dims.items()) + "}"


def check_models(
    original: str | os.PathLike[str],
    optimized: str | os.PathLike[str],
    *,
    dims: dict[str, int] | None = None,
    inputs: str | os.PathLike[str] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    bindings: int = 2,
    timeout: float | None = None,
    threads: int = 1,
    refuse_other_inputs: bool = False,
    input_layouts: Mapping[str, Sequence[int]] | None = None,
    on_phase: Callable[[str], None] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    confine: bool = False,
    custom_op_libraries: Sequence[str | os.PathLike[str]] = (),
    on_deadline: Callable[[float, float], None] | None = None,
    memo: str | os.PathLike[str] | None = None,
    judged_as: str | os.PathLike[str] | None = None,
) -> CheckResult:
    """Run both model files in onnxruntime on the same inputs and compare every output.

    Args:
        original: the reference model file.
        optimized: the model file to judge.
        dims: values for named dynamic dims, used in every binding (``--dim NAME=VALUE``).
        inputs: an .npz of arrays by input name, fed as is for one binding.
        atol, rtol: switch to element-wise allclose (the other defaults to numpy's value).
        seed: the seed for the generated inputs.
        bindings: how many dim bindings to compare (each with its own data).
        timeout: seconds for the whole check (None: proportional to the original's first run,
            see the module docstring); a run in progress is aborted when they are up.
        threads: onnxruntime intra-op threads (1 keeps runs repeatable).
        refuse_other_inputs: two models whose inputs differ are bad input (comparing two
            arbitrary files), not a failed check (an optimization that changed the interface).
        input_layouts: inputs the optimized model takes in another layout, name -> perm (as
            the unwind pass reports the inputs it re-laid out): the optimized model is fed the
            original's data transposed by perm.
        on_phase: told as each model starts to run at each binding, for progress.
        memory_budget: bytes the check may use: a binding at which the original is estimated
            to need more (budget.py) is not run, and one that runs out of memory (MemoryError,
            or onnxruntime failing to allocate) is "not checked", never failed.
        confine: limit this process's memory to ``memory_budget`` before the estimate
            (budget.confine; for the check's child process, never the caller's), and the
            estimate's to less.
        on_deadline: told ``(end, seconds)`` of each time limit set, ``end`` on the
            time.monotonic clock (the parent of the check's process kills it past that).
        custom_op_libraries: shared libraries of onnxruntime custom ops, registered in every
            session (``--custom-op-library``).
        memo: a folder keeping the original's reruns at its bindings (its own rounding's draws,
            its float reference) for a later check of the same original with the same options
            to read back, not run again (judging.Judged).
        judged_as: the model whose precision each output is judged by, where ``original`` is
            its float32 program (a bfloat16 model's, which onnxruntime cannot run).

    Generated inputs are also compared at the largest binding (inputs.largest_binding),
    unless the original's runs at the smaller ones predict it would take over
    LARGEST_SECONDS there: then it is skipped with a note. Each model's run there stops
    after LARGEST_STOP_SECONDS; a timeout or a failure of the original there is a note, never
    the check's outcome.

    Raises:
        InputError: a tolerance or limit is out of its range (options.check_numbers), a file
            cannot be read, a custom-op library cannot be registered, the .npz does not fit
            the model, ``dims`` names a dim the model does not have, ``input_layouts`` names
            no input of the original or gives no permutation of its axes, or
            (``refuse_other_inputs``) the inputs differ.
    """
    started = time.perf_counter()
    check_numbers(atol=atol, rtol=rtol, memory_budget=memory_budget, timeout=timeout)
    deadline = Deadline(timeout, on_deadline)
    criterion = Criterion.make(atol, rtol)
    criterion_dict: dict[str, Any] = {
        **criterion.as_dict(),
        "seed": seed,
        "onnxruntime": ort.__version__,
        "graph_optimization_level": "ORT_DISABLE_ALL",
    }

    attempts: list[dict[str, Any]] = []

    def result(status: Status, reason: str | None, done: list[BindingResult] | None = None) -> CheckResult:
        if status == "not checked" and reason is not None:
            reason = _clipped(reason, NOT_CHECKED_REASON_LIMIT)
        seconds = time.perf_counter() - started
        by = _passed_by(done or []) if status == "passed" else None
        return CheckResult(status, reason, criterion_dict, done or [], seconds, attempts, by)

    original, optimized = Path(original), Path(optimized)
    spec_a, spec_b = read_spec(original), read_spec(optimized)
    precisions = read_spec(Path(judged_as)) if judged_as is not None else spec_a
    _check_dim_names(spec_a, dims or {})
    layouts = _check_layouts(spec_a, input_layouts or {})
    mismatch = _signature_mismatch(spec_a, spec_b)
    if mismatch and refuse_other_inputs and mismatch.startswith("inputs"):
        raise InputError(f"{original} and {optimized} cannot be compared: their {mismatch}")
    if mismatch:
        return result("failed", mismatch)
    feeds: Iterator[tuple[Binding, dict[str, Feed]]]
    if inputs is not None:
        arrays, npz_dims = load_npz(Path(inputs), spec_a.inputs)
        feeds, wanted = iter([(Binding(npz_dims, ["the given inputs"]), arrays)]), 1
    else:
        unsupported = next((r for r in (s.unsupported() for s in spec_a.inputs) if r), None)
        if unsupported:
            return result("not checked", f"{unsupported}; pass --inputs data.npz")
        feeds, wanted = _generated(spec_a, dims or {}, seed, bindings), max(1, bindings)
    out_of_memory = f"ran out of the check's memory budget of {gigabytes(memory_budget)} (--check-memory GB)"
    if confine:  # before the estimate, which counts against the budget too
        limit_memory(memory_budget)
    try:
        needs = footprint(original, bounded=confine)
    except (MemoryError, DecodeError):  # protobuf's parser says "Arena alloc failed"; read_spec read the file
        return result("not checked", f"estimating what the original model needs {out_of_memory}")
    over_budget = f"exceeds the check's memory budget of {gigabytes(memory_budget)} (--check-memory GB)"
    if needs.load_bytes > memory_budget:
        load = f"loading the original model needs about {gigabytes(needs.load_bytes)} (its constants, twice)"
        return result("not checked", f"{load}, which {over_budget}")
    options = session_options(threads, custom_op_libraries)
    try:
        session = open_session(original, options)
    except OrtError as exc:
        if _out_of_memory(str(exc)):
            return result("not checked", f"loading the original model {out_of_memory}")
        left = deadline.end - time.monotonic()
        if left <= 0:
            return result("not checked", deadline.timed_out("loading the original"))

        def on_programs(programs: tuple[Path, Path]) -> CheckResult:
            return check_models(
                *programs,
                dims=dims,
                inputs=inputs,
                atol=atol,
                rtol=rtol,
                seed=seed,
                bindings=bindings,
                timeout=left if timeout is not None else None,  # the rest of the time limit
                threads=threads,
                refuse_other_inputs=refuse_other_inputs,
                input_layouts=input_layouts,
                on_phase=on_phase,
                memory_budget=memory_budget,
                confine=confine,
                custom_op_libraries=custom_op_libraries,
                on_deadline=on_deadline,
                judged_as=original,
            )

        checked = _checked_as_float32_programs(original, optimized, exc, on_programs)
        if checked is not None:
            return checked
        return result("not checked", _unloadable(str(exc), bool(custom_op_libraries)))
    except MemoryError:
        return result("not checked", f"loading the original model {out_of_memory}")
    # Outputs the model declares empty (a dim 0): their shape is all there is to compare.
    empty = {o.name for o in session.get_outputs() if 0 in (o.shape or ())}
    ran: list[tuple[Binding, dict[str, Feed], list[Output]]] = []
    took: list[float] = []  # the original's CPU seconds at each binding of ``ran``
    largest: Binding | None = None
    skipped: list[str] = []
    # Outputs the graph shows to be random, and (the backstop, for ops the graph cannot show:
    # custom ops, model-local functions) those on which two runs disagree.
    unstable = {name for name in spec_a.outputs if name in spec_a.paths and spec_a.paths[name].random_ops}
    try:
        for binding, feed in feeds:
            estimate = needs.peak(binding.dims, feed)
            if estimate > memory_budget:
                attempts.append(
                    {"dims": binding.dims, "error": f"needs about {gigabytes(estimate)}, which {over_budget}"}
                )
                continue
            if on_phase is not None:
                on_phase(f"check: the original at {_dims_text(binding.dims)}")
            try:
                began = time.process_time()  # CPU time: what the run costs, whatever else the machine runs
                expected = deadline.run(session, feed)
                seconds = time.process_time() - began
                deadline.first_run_done()
                if not ran and spec_a.opaque:
                    again = deadline.run(session, feed)
                    unstable |= {n for n, a, b in zip(spec_a.outputs, expected, again) if not _identical(a, b)}
                ran.append((binding, feed, expected))
                took.append(seconds)
            except OrtError as exc:
                error = out_of_memory if _out_of_memory(str(exc)) else str(exc)
                attempts.append({"dims": binding.dims, "error": error})
                skipped.append(f"the original model failed at {_dims_text(binding.dims)}: {error}")
            except TimeoutError:
                where = f" at {_dims_text(binding.dims)}" if binding.dims else ""
                skipped.append(deadline.timed_out(f"running the original model{where}"))
                break
            if len(ran) == wanted:
                break
        if inputs is None and ran and not deadline.expired():
            chosen = _largest(spec_a, dims or {}, seed, ran, took, lambda b, f: needs.peak(b.dims, f) <= memory_budget)
            if isinstance(chosen, str):
                skipped.append(chosen)
            elif chosen is not None:
                if on_phase is not None:
                    on_phase(f"check: the original at {_dims_text(chosen[0].dims)}")
                try:
                    # A third of the time left at most: the optimized model still runs the others.
                    stop = deadline.within(LARGEST_STOP_SECONDS, share=1 / 3)
                    ran.append((*chosen, stop.run(session, chosen[1])))
                    largest = chosen[0]
                except (OrtError, TimeoutError) as exc:
                    what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
                    skipped.append(f"the original model {what} at {_largest_text(chosen[0])}")
    except MemoryError:  # running, or making the inputs of the next binding
        attempts.append({"dims": {}, "error": out_of_memory})
        skipped.append(f"the original model {out_of_memory}")
    del session
    if not ran:
        if not attempts:  # timed out before any binding ran
            return result("not checked", "; ".join([*skipped, TIMEOUT_REMEDY]))
        return result("not checked", _unrunnable(attempts, spec_a, inputs is not None, dims or {}))

    try:
        session = open_session(optimized, options)
    except MemoryError:
        return result("not checked", f"loading the optimized model {out_of_memory}")
    except OrtError as exc:
        if _out_of_memory(str(exc)):
            return result("not checked", f"loading the optimized model {out_of_memory}")
        return result("failed", f"onnxruntime cannot load the optimized model: {exc}")
    done: list[BindingResult] = []
    produced: list[list[Output]] = []  # the optimized model's outputs at each binding of ``done``
    failure: str | None = None
    compared = False  # an element that is not NaN in both models, in some output
    for binding, feed, expected in ran:
        if on_phase is not None:
            on_phase(f"check: the optimized model at {_dims_text(binding.dims)}")
        try:
            runs = deadline.within(LARGEST_STOP_SECONDS) if binding is largest else deadline
            actual = runs.run(session, relaid(feed, layouts))
            outputs = [
                _compare(name, a, b, criterion, spec_a, name in unstable)
                for name, a, b in zip(spec_a.outputs, expected, actual, strict=True)
            ]
        except OrtError as exc:
            if _out_of_memory(str(exc)):
                return result("not checked", f"the optimized model {out_of_memory}", done)
            failure = f"the optimized model failed to run at {_dims_text(binding.dims)}: {exc}"
            break
        except MemoryError:
            return result("not checked", f"the optimized model {out_of_memory}", done)
        except TimeoutError:
            if binding is largest:
                skipped.append(f"the optimized model timed out at {_largest_text(binding)}")
            break
        passed = all(o.passed is not False for o in outputs)
        done.append(BindingResult(binding.dims, outputs, passed, binding.regimes))
        produced.append(actual)
        compared = compared or any(
            name in empty or _comparable(a, b) for name, a, b in zip(spec_a.outputs, expected, actual)
        )
    del session
    if failure is None and not criterion.elementwise:
        room = max(0, memory_budget - needs.load_bytes)
        models = Judged(
            Path(original), Path(optimized), layouts, threads, custom_op_libraries, None if memo is None else Path(memo)
        )
        per_binding = [b.outputs for b in done]
        judge_by_own_rounding(models, ran, per_binding, produced, precisions, deadline, seed, room, on_phase)
        for judged in done:
            judged.passed = all(o.passed is not False for o in judged.outputs)

    notes = [f"output {name!r} {_nondeterministic(spec_a, name)}" for name in spec_a.outputs if name in unstable]
    notes += skipped
    if failure is None and any(not b.passed for b in done):
        failure = _first_failure(done)
    if failure is not None:
        return result("failed", "; ".join([failure, *notes]), done)
    if not done:
        timed_out = deadline.timed_out("running the optimized model")
        return result("not checked", "; ".join([timed_out, TIMEOUT_REMEDY, *notes]), done)
    if not any(o.passed for b in done for o in b.outputs) and unstable:
        return result("not checked", "; ".join(notes), done)
    if not compared:
        nothing = "nothing was compared: every output is empty or NaN in both models (inputs with no rows or all NaN?)"
        return result("not checked", "; ".join([nothing, *notes]), done)
    expected_runs = [expected for _, _, expected in ran[: len(done)]]
    constant = _constant_outputs(spec_a.outputs, expected_runs, unstable)
    compared_outputs = {  # the outputs compared somewhere: not random, and not empty or NaN in both models everywhere
        name
        for index, name in enumerate(spec_a.outputs)
        if name not in unstable and any(_comparable(a[index], b[index]) for a, b in zip(expected_runs, produced))
    }
    unreached = _UNREACHED + ("" if inputs is not None else _REACH_IT)  # given inputs are the user's to choose
    if inputs is None and compared_outputs and compared_outputs <= constant.keys():
        held = ", ".join(f"{name!r}: {value:g}" for name, value in constant.items())
        return result("not checked", "; ".join([f"{_CONSTANT_EVERYWHERE} ({held}){unreached}", *notes]), done)
    notes += [
        f"output {name!r} is {value:g} at every element of every binding{unreached}" for name, value in constant.items()
    ]
    regular = sum(1 for b in done if largest is None or b.dims is not largest.dims)
    if regular < wanted:
        notes.insert(0, f"{regular} of {wanted} bindings compared" + (" (timed out)" if deadline.expired() else ""))
    return result("passed", "; ".join(notes) or None, done)


# The largest binding runs where the original is predicted to take at most this many CPU
# seconds there (CPU time, so that a busy machine does not change the decision), and its
# inputs hold at most this many elements (making and comparing them costs time too).
LARGEST_SECONDS = 0.5
# A run at the largest binding that the prediction got wrong stops after this many seconds.
LARGEST_STOP_SECONDS = 10.0
LARGEST_ELEMENTS = 2**22


def _largest(
    spec: ModelSpec,
    fixed: Mapping[str, int],
    seed: int,
    ran: list[tuple[Binding, dict[str, Feed], list[Output]]],
    took: list[float],
    fits: Callable[[Binding, dict[str, Feed]], bool],
) -> tuple[Binding, dict[str, Feed]] | str | None:
    """The largest binding and its inputs; or why it is not run; or None where it is one of
    those that ran (a model without dynamic dims, or dims all fixed by --dim)."""
    binding = largest_binding(spec, fixed)
    if any(binding.dims == done.dims for done, _, _ in ran):
        return None
    elements = input_elements(spec, binding.dims)
    if elements > LARGEST_ELEMENTS:
        limit = f"the limit is {LARGEST_ELEMENTS}"
        return f"{_largest_text(binding)} not run: its inputs would hold {elements} elements ({limit})"
    # From the costliest binding that ran: the nearest, and past the first run's warm-up.
    seconds, nearest = max(
        ((t, done) for (done, _, _), t in zip(ran, took, strict=True)), key=lambda r: run_cost(spec, r[1].dims)
    )
    predicted = seconds * run_cost(spec, binding.dims) / max(run_cost(spec, nearest.dims), 1)
    if predicted > LARGEST_SECONDS:  # no figure in the note: the report stays the same from run to run
        over = f"predict over {LARGEST_SECONDS:g} s"
        return f"{_largest_text(binding)} not run: the original's runs at the smaller ones {over}"
    feed = make_inputs(spec, binding, np.random.default_rng([seed, candidate_count()]))
    if not fits(binding, feed):
        return f"{_largest_text(binding)} not run: it exceeds the check's memory budget (--check-memory GB)"
    return binding, feed


def _largest_text(binding: Binding) -> str:
    return f"the largest binding {_dims_text(binding.dims)}"


# What onnxruntime says of an op no library it knows registers.
_UNREGISTERED = re.compile(r"(\S+):(\S+)\(-?\d+\) is not a registered function/op")


def _checked_as_float32_programs(
    original: Path, optimized: Path, error: Exception, check: Callable[[tuple[Path, Path]], CheckResult]
) -> CheckResult | None:
    """``check`` of both models' float32 programs, where the original that onnxruntime cannot load
    holds bfloat16 (None where it holds none, or its program cannot be made: the original is then
    not checked). A program too large to make or save is not checked either."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            programs = float_programs(original, optimized, Path(folder))
        except (MemoryError, ValueError) as err:  # protobuf's 2 GB limit, or the check's memory budget
            reason = f"the float32 programs of the bfloat16 models could not be made ({first_line(err)})"
            return CheckResult("not checked", reason, {"program": FLOAT32_PROGRAMS})
        if programs is None:
            return None
        checked = check(programs)
    unrunnable = f"onnxruntime cannot run the bfloat16 original: {first_line(error)}"
    checked.criterion["program"] = f"{FLOAT32_PROGRAMS} ({unrunnable})"
    return checked


def _unloadable(error: str, libraries: bool) -> str:
    """Why the original does not load, with the next step where a custom op is what is missing."""
    reason = f"onnxruntime cannot load the original model: {error}"
    missing = _UNREGISTERED.search(error)
    if missing is None or missing[1] in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft"):
        return reason
    given = " (none of the libraries given registers it)" if libraries else ""
    return f"{reason}{given}; register the library of its {missing[1]} ops with --custom-op-library PATH"


# A "not checked" reason fits one line of a CI log; the report's attempts keep every detail.
NOT_CHECKED_REASON_LIMIT = 300
_ALLOCATION_FAILED = re.compile(r"bad_alloc|[Ff]ailed to allocate|[Oo]ut of memory|MemoryError")


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _out_of_memory(message: str) -> bool:
    return _ALLOCATION_FAILED.search(message) is not None


def _dim_option(key: str) -> str:
    """``--dim KEY=N`` as a shell takes it: an unnamed dim's ``input[axis]`` quoted."""
    return f"--dim '{key}=N'" if key.endswith("]") else f"--dim {key}=N"


def _unrunnable(attempts: list[dict[str, Any]], spec: ModelSpec, given: bool, fixed: Mapping[str, int]) -> str:
    """Why the original ran at no binding, with what the user can do about it, in one short line."""
    errors = list(dict.fromkeys(attempt["error"] for attempt in attempts))
    if given:
        return _clipped(f"the original model failed on --inputs: {errors[0]}", NOT_CHECKED_REASON_LIMIT)
    if all("memory budget" in error for error in errors):
        return f"the original model {errors[0]}"
    remedy = "; give inputs that fit with --inputs data.npz"
    # One key per group of equal dims, not those --dim fixed, the batch last: it seldom decides.
    keys = [k for k in dim_keys(spec) if spec.facts.group(k) == k and k not in fixed]
    keys.sort(key=lambda k: spec.facts.kinds.get(k) == "batch")
    if keys:
        shown = " ".join(_dim_option(key) for key in keys[:3]) + (" ..." if len(keys) > 3 else "")
        remedy = f"; bind the dims with {shown} or give inputs with --inputs data.npz"
    tried = len(attempts)
    head = f"the original model failed at {'the binding' if tried == 1 else f'all {tried} bindings'} tried: "
    tail = f" (and {len(errors) - 1} other errors)" if len(errors) > 1 else ""
    room = NOT_CHECKED_REASON_LIMIT - len(head) - len(tail) - len(remedy)
    return head + _clipped(errors[0], max(room, 40)) + tail + remedy


def _comparable(a: Output, b: Output) -> bool:
    """Whether ``a`` and ``b`` hold an element to compare, one not NaN in both: an empty output,
    or one that is NaN wherever the other is, says nothing of the optimization. (Outputs that
    differ in shape or length fail their comparison.)"""
    if isinstance(a, list) or isinstance(b, list):
        return not (isinstance(a, list) and isinstance(b, list)) or any(map(_comparable, a, b))
    if a.size == 0 or a.shape != b.shape or a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return a.size != 0
    return bool(np.any(~(np.isnan(a) & np.isnan(b))))


# An output that holds one value at every element of every binding: the inputs never reached what computes it (a
# 16-bit QDQ Llama's ids all 0 once gave logits 0 before and after a wrong fusion), so its comparison proves nothing.
# (An output the weights alone compute, broadcast to one value, looks the same; no model here has one.)
_CONSTANT_EVERYWHERE = "every output compared holds one value at every element of every binding"
_UNREACHED = ": the inputs did not reach what computes it, so the check cannot tell a wrong rewrite there"
_REACH_IT = " (pass --inputs data.npz with inputs that do)"


def _constant_outputs(names: Sequence[str], runs: Sequence[list[Output]], unstable: set[str]) -> dict[str, float]:
    """The numeric tensor outputs, by name, that hold one value at every element of every run (of more than one
    element in some run), with that value: a float one, or what is computed from one (an ArgMax of it)."""
    constant: dict[str, float] = {}
    for index, name in enumerate(names):
        arrays = [a for outputs in runs if isinstance(a := outputs[index], np.ndarray) and a.dtype.kind in "fiub"]
        if name in unstable or not arrays or len(arrays) < len(runs):
            continue
        value = arrays[0].flat[0] if arrays[0].size else math.nan
        if max(a.size for a in arrays) > 1 and all(a.size and np.all(a == value) for a in arrays):
            constant[name] = float(value)
    return constant


def _identical(a: Output, b: Output) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_identical, a, b))
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _nondeterministic(spec: ModelSpec, name: str) -> str:
    path = spec.paths.get(name)
    if path is not None and path.random_ops:
        return f"not checked: nondeterministic (op {', '.join(path.random_ops)})"
    return "not checked: nondeterministic (the original model disagrees with itself)"


def _compare(
    name: str, a: Output, b: Output, criterion: Criterion, spec: ModelSpec, unstable: bool
) -> OutputComparison:
    path = spec.paths.get(name)
    comparison = compare_output(name, a, b, criterion, path.precision if path is not None else None)
    if unstable:
        comparison.passed = None
        comparison.reason = _nondeterministic(spec, name)
    return comparison


def _passed_by(done: list[BindingResult]) -> str | None:
    criteria = {output.criterion for binding in done for output in binding.outputs if output.passed}
    return next((c for c in (FLOAT_PROGRAM, FLOAT_REFERENCE, OWN_ROUNDING, FIXED, ALLCLOSE) if c in criteria), None)


def _generated(
    spec: ModelSpec, fixed: Mapping[str, int], seed: int, bindings: int
) -> Iterator[tuple[Binding, dict[str, Feed]]]:
    """Candidate bindings with their data: the requested number, then the fallbacks (at least three)."""
    for k in range(max(bindings, 1) + max(3, candidate_count() - bindings)):
        binding = bind_dims(spec, k, fixed)
        yield binding, make_inputs(spec, binding, np.random.default_rng([seed, k]))


def _check_dim_names(spec: ModelSpec, fixed: Mapping[str, int]) -> None:
    keys = dim_keys(spec)
    unknown = sorted(set(fixed) - set(keys))
    if unknown:
        have = ", ".join(keys) or "none"
        raise InputError(f"--dim {', '.join(unknown)}: the model has no such dynamic input dim (it has: {have})")


def _check_layouts(spec: ModelSpec, layouts: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    ranks = {s.name: len(s.shape) if s.shape is not None else None for s in spec.inputs}
    checked: dict[str, tuple[int, ...]] = {}
    for name, perm in layouts.items():
        if name not in ranks:
            raise InputError(f"input layouts: the model has no input {name!r}")
        checked[name] = tuple(int(axis) for axis in perm)
        if ranks[name] is not None and sorted(checked[name]) != list(range(ranks[name] or 0)):
            raise InputError(f"input layouts: {list(perm)} is no permutation of the axes of input {name!r}")
    return checked


def _signature_mismatch(a: ModelSpec, b: ModelSpec) -> str | None:
    sig_a, sig_b = a.signature(), b.signature()
    if sig_a != sig_b:
        parts = []
        for name in sorted(set(sig_a) | set(sig_b)):
            ta, tb = sig_a.get(name, "absent"), sig_b.get(name, "absent")
            if ta != tb:
                parts.append(f"{name}: {ta} != {tb}")
        return "inputs differ: " + ", ".join(parts)
    if a.outputs != b.outputs:
        return f"outputs differ: {list(a.outputs)} != {list(b.outputs)}"
    return None


def _first_failure(done: list[BindingResult]) -> str:
    for binding in done:
        for output in binding.outputs:
            if output.passed is False:
                regimes = f" ({', '.join(binding.regimes)})" if binding.regimes else ""
                return f"output {output.name!r} at {_dims_text(binding.dims)}{regimes}: {output.reason}"
    raise AssertionError("no failing output")
