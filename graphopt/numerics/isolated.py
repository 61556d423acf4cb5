"""The check in a child process: an onnxruntime crash becomes a result, not graphopt's end.

onnxruntime is C++; some valid models crash it outright (1.31 segfaults on a Split whose
middle output is omitted). In graphopt's own process that would kill the run with no
message and no documented exit code. Here the child runs :func:`check_models`; if it dies,
a second child runs the original against itself to find out which model crashed:

- the original crashes too: "not checked" (onnxruntime cannot run this model at all);
- only the optimized model crashes: "failed" (the optimization broke something).

The child confines its own memory to the check's budget before it estimates what the
original needs (``confine``, see budget.py), so a model that allocates past it fails an allocation there
("not checked: ... ran out of the check's memory budget") instead of having the machine's
out-of-memory killer end whatever process it picks.

The child keeps to its own time limit (check.py's deadline, which stops onnxruntime between
and inside its kernels) and tells this process each deadline it sets; what it cannot stop in
time (a kernel that never looks at the flag, onnx's shape inference) is killed here
``GRACE_SECONDS`` past the deadline: "not checked: timed out". The child dies with its parent
(processes.py), so a graphopt killed or terminated leaves no check running.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from graphopt.numerics.budget import DEFAULT_MEMORY_BUDGET
from graphopt.numerics.check import TIMEOUT_REMEDY, CheckResult, check_models, seconds_text
from graphopt.processes import die_with_parent, ending_children_on_sigterm

__all__ = ["GRACE_SECONDS", "Isolated", "TimedOut", "check_models_isolated", "run_isolated", "start_isolated"]

# How long past the deadline it set itself a child may take to report before it is killed:
# onnxruntime stops a run at the deadline, then the child compares what ran and reports.
GRACE_SECONDS = 5.0

T = TypeVar("T")


class TimedOut(str):
    """How a child that overran its own deadline ended (killed), as :func:`run_isolated` describes it."""


def _child(
    connection: Connection,
    parent: int,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
) -> None:
    die_with_parent(parent)
    faulthandler.disable()  # the parent reports a crash in one line; no dump of this process's stack
    if options.pop(_RELAY, False):  # the child's progress goes to the parent's on_phase, through the pipe
        options["on_phase"] = lambda phase: connection.send((_PHASE, phase))
    if options.pop(_WATCH, False):
        options["on_deadline"] = lambda end, limit: connection.send((_DEADLINE, (end, limit)))
    try:
        connection.send((_DONE, function(*args, **options)))
    except BaseException as err:  # handed to the parent, which raises it there
        connection.send((_DONE, err))
    finally:
        connection.close()


_RELAY, _WATCH, _PHASE, _DEADLINE, _DONE = "_relay_phases", "_watch_deadline", "phase", "deadline", "done"


def run_isolated(function: Callable[..., T], *args: Any, watch_deadline: bool = False, **options: Any) -> T | str:
    """``function(*args, **options)`` in a child process: its result (its exception is raised
    here), or a description of how the child died. An ``on_phase`` option is called here,
    with what the child passes it. With ``watch_deadline``, ``function`` takes an
    ``on_deadline(end, seconds)`` option, to tell of each deadline it sets (``end`` on the
    time.monotonic clock, which both processes share); past ``end`` and GRACE_SECONDS the
    child is killed and the description is a :class:`TimedOut`."""
    return start_isolated(function, *args, watch_deadline=watch_deadline, **options).wait()


class Isolated(Generic[T]):
    """A function running in a child process (:func:`start_isolated`): :meth:`wait` for its
    outcome, or :meth:`cancel` it."""

    def __init__(self, process: Any, receiver: Connection, on_phase: Callable[[str], None] | None) -> None:
        self.process, self.receiver, self.on_phase = process, receiver, on_phase

    def wait(self) -> T | str:
        """As :func:`run_isolated` describes it."""
        process, receiver = self.process, self.receiver
        end: float | None = None
        limit = 0.0
        try:
            with ending_children_on_sigterm(lambda: [process]):
                kind = None
                while kind != _DONE:
                    wait = None if end is None else max(0.0, end + GRACE_SECONDS - time.monotonic())
                    if not receiver.poll(wait):
                        process.kill()
                        return TimedOut(f"timed out after {seconds_text(limit)} s (the check's process was killed)")
                    kind, outcome = receiver.recv()
                    if kind == _PHASE and self.on_phase is not None:
                        self.on_phase(outcome)
                    elif kind == _DEADLINE:
                        end, limit = outcome
            received = True
        except EOFError:
            outcome, received = None, False
        except BaseException:  # interrupted: the child must not outlive the wait for it
            process.kill()
            raise
        finally:
            receiver.close()
            process.join()
        if isinstance(outcome, BaseException):
            raise outcome
        if received:
            return outcome  # type: ignore[no-any-return]
        code = process.exitcode or 0
        if code < 0:
            return f"onnxruntime crashed with {signal.Signals(-code).name}"
        return f"the check's process ended with exit code {code}"

    def cancel(self) -> None:
        """End the child, its outcome unread."""
        self.process.kill()
        self.receiver.close()
        self.process.join()


def start_isolated(function: Callable[..., T], *args: Any, watch_deadline: bool = False, **options: Any) -> Isolated[T]:
    """Start ``function(*args, **options)`` in a child process and return at once (options as
    :func:`run_isolated`): the caller works on meanwhile and then waits for it."""
    on_phase = options.pop("on_phase", None)
    if on_phase is not None:
        options[_RELAY] = True
    options[_WATCH] = watch_deadline
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(  # type: ignore[attr-defined]
        target=_child, args=(sender, os.getpid(), function, args, options), daemon=True
    )
    process.start()
    sender.close()
    return Isolated(process, receiver, on_phase)


def check_models_isolated(
    original: str | os.PathLike[str], optimized: str | os.PathLike[str], **options: Any
) -> CheckResult:
    """:func:`check_models` (same arguments and errors), with onnxruntime crashes contained and
    the child's memory confined to the check's budget."""
    if options.get("memory_budget") is None:
        options["memory_budget"] = DEFAULT_MEMORY_BUDGET
    options["confine"] = True  # in the child only, never in this process
    outcome = run_isolated(check_models, original, optimized, watch_deadline=True, **options)
    if isinstance(outcome, CheckResult):
        return outcome
    if isinstance(outcome, TimedOut):  # the original alone would time out again
        return CheckResult("not checked", f"{outcome}; {TIMEOUT_REMEDY}", {})
    # The original against itself: the layouts the optimized model's inputs take do not apply.
    alone = run_isolated(
        check_models,
        original,
        original,
        watch_deadline=True,
        **{k: v for k, v in options.items() if k != "input_layouts"},
    )
    if isinstance(alone, CheckResult) and alone.status == "passed":
        return CheckResult("failed", f"{outcome} running the optimized model", {})
    return CheckResult("not checked", f"{outcome} running the original model", {})
