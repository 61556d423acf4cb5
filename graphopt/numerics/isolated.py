"""The check in a child process: an onnxruntime crash becomes a result, not graphopt's end.

onnxruntime is C++; some valid models crash it outright (1.31 segfaults on a Split whose
middle output is omitted). In graphopt's own process that would kill the run with no
message and no documented exit code. Here the child runs :func:`check_models`; if it dies,
a second child runs the original against itself to find out which model crashed:

- the original crashes too: "not checked" (onnxruntime cannot run this model at all);
- only the optimized model crashes: "failed" (the optimization broke something).

The child confines its own memory to the check's budget before onnxruntime starts
(``confine``, see budget.py), so a model that allocates past it fails an allocation there
("not checked: ... ran out of the check's memory budget") instead of having the machine's
out-of-memory killer end whatever process it picks.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from graphopt.numerics.budget import DEFAULT_MEMORY_BUDGET
from graphopt.numerics.check import CheckResult, check_models

__all__ = ["check_models_isolated", "run_isolated"]

T = TypeVar("T")


def _child(
    connection: Connection, function: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]
) -> None:
    faulthandler.disable()  # the parent reports a crash in one line; no dump of this process's stack
    if options.pop(_RELAY, False):  # the child's progress goes to the parent's on_phase, through the pipe
        options["on_phase"] = lambda phase: connection.send((_PHASE, phase))
    try:
        connection.send((_DONE, function(*args, **options)))
    except BaseException as err:  # handed to the parent, which raises it there
        connection.send((_DONE, err))
    finally:
        connection.close()


_RELAY, _PHASE, _DONE = "_relay_phases", "phase", "done"


def run_isolated(function: Callable[..., T], *args: Any, **options: Any) -> T | str:
    """``function(*args, **options)`` in a child process: its result (its exception is raised
    here), or a description of how the child died. An ``on_phase`` option is called here,
    with what the child passes it."""
    on_phase = options.pop("on_phase", None)
    if on_phase is not None:
        options[_RELAY] = True
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(  # type: ignore[attr-defined]
        target=_child, args=(sender, function, args, options), daemon=True
    )
    process.start()
    sender.close()
    try:
        kind, outcome = receiver.recv()
        while kind == _PHASE:
            on_phase(outcome)
            kind, outcome = receiver.recv()
        received = True
    except EOFError:
        outcome, received = None, False
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


def check_models_isolated(
    original: str | os.PathLike[str], optimized: str | os.PathLike[str], **options: Any
) -> CheckResult:
    """:func:`check_models` (same arguments and errors), with onnxruntime crashes contained and
    the child's memory confined to the check's budget."""
    options["memory_budget"] = options.get("memory_budget") or DEFAULT_MEMORY_BUDGET
    options["confine"] = True  # in the child only, never in this process
    outcome = run_isolated(check_models, original, optimized, **options)
    if isinstance(outcome, CheckResult):
        return outcome
    # The original against itself: the layouts the optimized model's inputs take do not apply.
    alone = run_isolated(check_models, original, original, **{k: v for k, v in options.items() if k != "input_layouts"})
    if isinstance(alone, CheckResult) and alone.status == "passed":
        return CheckResult("failed", f"{outcome} running the optimized model", {})
    return CheckResult("not checked", f"{outcome} running the original model", {})
