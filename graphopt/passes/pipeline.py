"""Pipelines: passes and groups run in order, each group repeated to a fixpoint.

A pipeline is read from a config (a TOML or JSON file, see schemas/pipeline.schema.json)
or from a comma list of names (``--passes shape-infer,cleanup``). A group's name may
stand for the group in a comma list. Every pass run is recorded for the report; a pass
that raises is rolled back (the IR is restored from a snapshot taken before it
ran) and the pipeline goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.errors import InputError, bounded
from graphopt.ir import GraphError, Model
from graphopt.ir.clone import Snapshot
from graphopt.ir.stats import ModelStats, model_stats
from graphopt.options import coerce, plain, type_name
from graphopt.passes.base import Failure, Knob, Pass, PassContext, PassResult, get_pass, pass_knobs
from graphopt.settings import SETTING_NAMES, Settings, settings_from

__all__ = [
    "DEFAULT_PIPELINE",
    "Group",
    "PassRun",
    "Pipeline",
    "PipelineRun",
    "Step",
    "load_pipeline_config",
    "pipeline_from_config",
    "pipeline_from_names",
    "restore_model",
]

DEFAULT_MAX_STEPS = 8
logger = logging.getLogger(__name__)


_CLEANUP = [{"pass": "noop"}, {"pass": "dce"}, {"pass": "cse"}]


def _simplify(fuse_options: dict[str, Any]) -> list[dict[str, Any]]:
    fuse = {"pass": "fuse", **({"options": fuse_options} if fuse_options else {})}
    return [{"pass": "const-cache"}, fuse, *_CLEANUP]


# The default pipeline: every pass that exists, in the order the design gives. The passes after
# the first simplify repeat as one group, settle, until none of them changes the model: a
# Transpose unwound exposes per-channel Mul/Add that fuse into Conv, the late fuse rules (run
# there only, after every other rewrite) make Gemms that fold batches, and shape-infer types
# what the rewrites made as a fresh inference would. So the output is a fixed point: a second
# run (and --check-optimized) changes nothing.
_SHAPE_INFER_AFRESH = {"pass": "shape-infer", "options": {"afresh": True}}
DEFAULT_PIPELINE: list[dict[str, Any]] = [
    {"pass": "shape-infer"},
    {"group": "cleanup", "steps": _CLEANUP},
    {"group": "simplify", "steps": _simplify({})},
    {
        "group": "settle",
        "steps": [{"pass": "fold"}, {"pass": "unwind"}, *_simplify({"late": True}), _SHAPE_INFER_AFRESH],
    },
    {"pass": "strip-value-info"},
]


@dataclass
class Group:
    name: str
    steps: list[Step]
    max_steps: int = DEFAULT_MAX_STEPS

    def describe(self) -> dict[str, Any]:
        return {"group": self.name, "max_steps": self.max_steps, "steps": [_describe(s) for s in self.steps]}


Step = Pass | Group


def _describe(step: Step) -> dict[str, Any]:
    if isinstance(step, Group):
        return step.describe()
    options = {k: plain(v) for k, v in vars(step.options).items()}
    return {"pass": step.name, **({"options": options} if options else {})}


@dataclass
class PassRun:
    """One execution of one pass, as the report shows it: ``error`` when the pass raised and was
    rolled back, ``failures`` for the parts of it undone alone (its other work stands)."""

    name: str
    group: str | None
    iteration: int
    seconds: float
    before: ModelStats
    after: ModelStats
    changed: bool
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    failures: list[Failure] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        ops = set(self.before.ops) | set(self.after.ops)
        delta = {op: self.after.ops.get(op, 0) - self.before.ops.get(op, 0) for op in sorted(ops)}
        record: dict[str, Any] = {
            "pass": self.name,
            "group": self.group,
            "iteration": self.iteration,
            "seconds": round(self.seconds, 6),
            "changed": self.changed,
            "nodes": [self.before.nodes, self.after.nodes],
            "initializers": [self.before.initializers, self.after.initializers],
            "bytes": [self.before.initializer_bytes, self.after.initializer_bytes],
            "op_delta": {op: d for op, d in delta.items() if d},
            "details": self.details,
        }
        if self.error is not None:
            record["error"] = self.error
        if self.failures:
            record["failures"] = [f.as_dict() for f in self.failures]
        return record


@dataclass
class PipelineRun:
    runs: list[PassRun] = field(default_factory=list)

    @property
    def failures(self) -> list[PassRun]:
        """The pass executions that raised (rolled back) or undid a part of their work."""
        return [r for r in self.runs if r.error is not None or r.failures]

    def failure_records(self) -> list[dict[str, str]]:
        """The report's failures in the order they first happened: ``pass`` and ``error``, and what
        names a part undone alone (a fuse rule's ``rule`` and ``node``). A pass that runs in every
        round of a group meets the same failure again: it is listed once."""
        records: list[dict[str, str]] = []
        for run in self.failures:
            found = [{"pass": run.name, "error": run.error}] if run.error is not None else []
            found += [{"pass": run.name, **f.as_dict()} for f in run.failures]
            records.extend(r for r in found if r not in records)
        return records


@dataclass
class Pipeline:
    steps: list[Step]
    # Run settings a config file gave (its [settings] table), checked by name and type.
    settings: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> list[dict[str, Any]]:
        return [_describe(s) for s in self.steps]

    def configure(self, overrides: Mapping[str, Any]) -> tuple[Pipeline, Settings]:
        """The run's settings from the config's [settings] and then ``overrides`` (API keywords,
        CLI options), and a copy of the pipeline on which the pass knobs among them set their
        option on every step of their pass. This pipeline is left as it was: options given to
        one run do not carry over to the next run of the same Pipeline object."""
        settings, knobs = split_settings({**self.settings, **overrides}, "settings")

        def configured(step: Step) -> Step:
            if isinstance(step, Group):
                return dataclasses.replace(step, steps=[configured(s) for s in step.steps])
            chosen = {knob.option: value for knob, value in knobs if knob.pass_name == step.name}
            if not chosen:
                return step
            copied = copy.copy(step)
            copied.options = dataclasses.replace(step.options, **chosen)
            return copied

        return dataclasses.replace(self, steps=[configured(s) for s in self.steps]), settings

    def _passes(self) -> list[Pass]:
        found: list[Pass] = []

        def walk(steps: Sequence[Step]) -> None:
            for step in steps:
                if isinstance(step, Group):
                    walk(step.steps)
                else:
                    found.append(step)

        walk(self.steps)
        return found

    def pass_names(self) -> list[str]:
        return [step.name for step in self._passes()]

    def run(
        self,
        model: Model,
        ctx: PassContext | None = None,
        *,
        on_pass: Callable[[PassRun], None] | None = None,
        on_pass_start: Callable[[str, str | None, int], None] | None = None,
        stop_after: int | None = None,
    ) -> PipelineRun:
        """Run every step on ``model`` in place. ``on_pass_start(pass, group, iteration)`` and
        ``on_pass(run)`` are told of each pass execution as it starts and ends; ``stop_after``
        ends the run after that many pass executions (used to find the first pass that broke
        numerics)."""
        execution = _Execution(model, ctx or PassContext(), on_pass, on_pass_start, stop_after)
        for step in self.steps:
            if isinstance(step, Group):
                execution.run_group(step)
            else:
                execution.run_pass(step, None, 0, None)
        return execution.record


class _Execution:
    """One run of a pipeline on one model: what has run (``record``), how many pass
    executions are left (``budget``: ``stop_after``) and the model's stats after the last
    pass (``current``, reused as the next pass's "before")."""

    def __init__(
        self,
        model: Model,
        ctx: PassContext,
        on_pass: Callable[[PassRun], None] | None,
        on_pass_start: Callable[[str, str | None, int], None] | None,
        stop_after: int | None,
    ) -> None:
        self.model, self.ctx = model, ctx
        self.on_pass, self.on_pass_start = on_pass, on_pass_start
        self.record = PipelineRun()
        self.budget = stop_after if stop_after is not None else sys.maxsize
        self.current = model_stats(model)

    def run_pass(self, step: Pass, group: str | None, iteration: int, snapshot: Snapshot | None) -> PassRun | None:
        """Run one pass; without a ``snapshot`` from the caller, take (and restore) one here."""
        if self.budget <= 0:
            return None
        self.budget -= 1
        model, before = self.model, self.current
        own_snapshot = Snapshot(model) if snapshot is None else None
        if self.on_pass_start is not None:
            self.on_pass_start(step.name, group, iteration)
        start = time.perf_counter()
        try:
            result = step.run(model, self.ctx)
            _check_result(model, result, self.ctx)
        except InputError:
            raise  # bad input a pass found (a model it cannot convert): the user's to fix, not a pass failure
        except Exception as err:  # a failing pass must not end the run: restore and report
            seconds = time.perf_counter() - start
            logger.debug("pass %s failed and was rolled back:\n%s", step.name, traceback.format_exc())
            if own_snapshot is not None:
                restore_model(model, own_snapshot)
            run = PassRun(
                step.name,
                group,
                iteration,
                seconds,
                before,
                before,
                False,
                error=bounded(f"{type(err).__name__}: {err}"),
                traceback=traceback.format_exc(),
            )
        else:
            seconds = time.perf_counter() - start
            self.current = model_stats(model)
            for failure in result.failures:
                logger.debug("pass %s: %s; undone alone:\n%s", step.name, failure.error, failure.traceback)
            run = PassRun(step.name, group, iteration, seconds, before, self.current, result.changed, result.details)
            if result.failures:
                run.failures, run.traceback = result.failures, result.failures[0].traceback
        self.record.runs.append(run)
        if self.on_pass is not None:
            self.on_pass(run)
        return run

    def run_group(self, group: Group) -> bool:
        changed_any = False
        for iteration in range(group.max_steps):
            changed = self._run_iteration(group, iteration)
            changed_any |= changed
            if not changed or self.budget <= 0:
                break
        return changed_any

    def _run_iteration(self, group: Group, iteration: int) -> bool:
        # One snapshot per iteration rather than per pass: when a pass fails, the
        # model goes back to the iteration's start and the passes that succeeded before it
        # run again (passes are deterministic), then the iteration carries on after it.
        model = self.model
        snapshot = Snapshot(model)
        failed: set[int] = set()
        changed = False
        for index, step in enumerate(group.steps):
            if isinstance(step, Group):
                changed |= self.run_group(step)
                continue
            run = self.run_pass(step, group.name, iteration, snapshot)
            if run is None:
                break
            if run.error is None:
                changed |= run.changed
                continue
            failed.add(index)
            restore_model(model, snapshot)  # a snapshot rebuilds as often as asked
            if not self._replay(group.steps[:index], failed):
                restore_model(model, snapshot)
                changed = False
            self.current = model_stats(model)
        return changed

    def _replay(self, steps: Sequence[Step], skip: set[int]) -> bool:
        try:
            for index, step in enumerate(steps):
                if index in skip:
                    continue
                if isinstance(step, Group):
                    Pipeline([step]).run(self.model, self.ctx)
                else:
                    step.run(self.model, self.ctx)
        except Exception:
            logger.debug("replaying the passes before a failed one failed:\n%s", traceback.format_exc())
            return False
        return True


class PassBrokeIR(Exception):
    """A pass left the IR invalid, or returned details that are not JSON."""


def _check_result(model: Model, result: PassResult, ctx: PassContext) -> None:
    """Catch a broken IR (with the verify setting) and non-JSON details at the pass that made them."""
    try:
        json.dumps(result.details, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise PassBrokeIR(f"its details are not JSON: {err}") from None
    if ctx.settings.verify:
        try:
            for graph in [model.graph, *(f.body for f in model.functions)]:
                graph.verify()
        except GraphError as err:
            raise PassBrokeIR(f"it left the IR invalid: {err}") from None


def restore_model(model: Model, snapshot: Snapshot | Model) -> None:
    """Make ``model`` (in place) the model ``snapshot`` was taken of, or another model."""
    restored = snapshot.model() if isinstance(snapshot, Snapshot) else snapshot
    for name in vars(restored):
        setattr(model, name, getattr(restored, name))


# -- building pipelines ---------------------------------------------------------------------


def _build_step(entry: Any, where: str) -> Step:
    if not isinstance(entry, Mapping):
        raise InputError(f"{where}: a step is a table with 'pass' or 'group', not {entry!r}")
    if "pass" in entry:
        extra = set(entry) - {"pass", "options"}
        if extra:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(extra))} in pass step")
        options = entry.get("options", {})
        if not isinstance(options, Mapping):
            raise InputError(f"{where}: 'options' must be a table")
        return get_pass(str(entry["pass"])).from_config(options)
    if "group" in entry:
        extra = set(entry) - {"group", "steps", "max_steps"}
        if extra:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(extra))} in group step")
        steps = entry.get("steps")
        if not isinstance(steps, list) or not steps:
            raise InputError(f"{where}: group {entry['group']!r} needs a non-empty 'steps' list")
        max_steps = entry.get("max_steps", DEFAULT_MAX_STEPS)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise InputError(f"{where}: max_steps must be a positive integer")
        name = str(entry["group"])
        return Group(name, [_build_step(s, f"{where}.{name}[{i}]") for i, s in enumerate(steps)], max_steps)
    raise InputError(f"{where}: a step needs 'pass' or 'group'")


def _with_max_steps(steps: list[Step], max_steps: int | None) -> list[Step]:
    if max_steps is None:
        return steps
    for step in steps:
        if isinstance(step, Group):
            step.max_steps = max_steps
            _with_max_steps(step.steps, max_steps)
    return steps


def pipeline_from_config(config: Any, *, max_steps: int | None = None, where: str = "pipeline") -> Pipeline:
    if isinstance(config, Mapping):
        config = config.get("pipeline")
    if not isinstance(config, list) or not config:
        raise InputError(f"{where}: expected a non-empty 'pipeline' list of steps")
    steps = [_build_step(entry, f"{where}[{i}]") for i, entry in enumerate(config)]
    return Pipeline(_with_max_steps(steps, max_steps))


def split_settings(values: Mapping[str, Any], where: str) -> tuple[Settings, list[tuple[Knob, Any]]]:
    """Run settings and pass knobs (with their checked values) from one mapping; an unknown
    name or a mistyped value is bad input. Pass families load only when a name is no setting."""
    knobs = pass_knobs() if set(values) - SETTING_NAMES else {}
    chosen: list[tuple[Knob, Any]] = []
    for name, value in values.items():
        if name in SETTING_NAMES:
            continue
        knob = knobs.get(name)
        if knob is None:
            known = ", ".join(sorted(SETTING_NAMES | set(knobs)))
            raise InputError(f"{where}: unknown setting {name!r}; settings and pass knobs: {known}")
        fits, converted = coerce(knob.annotation, value)
        if not fits:
            raise InputError(f"{where}: {name!r} must be {type_name(knob.annotation)}, not {value!r}")
        chosen.append((knob, converted))
    return settings_from({k: v for k, v in values.items() if k in SETTING_NAMES}, where), chosen


def _settings_table(data: Any, where: str) -> dict[str, Any]:
    table = data.get("settings", {}) if isinstance(data, Mapping) else {}
    split_settings(table, f"{where}: settings")  # bad names and types fail before any work
    return dict(table)


def default_pipeline(max_steps: int | None = None) -> Pipeline:
    return pipeline_from_config(DEFAULT_PIPELINE, max_steps=max_steps)


def _default_groups() -> dict[str, dict[str, Any]]:
    """The default pipeline's groups by name; a name used twice (simplify) means its first."""
    return {entry["group"]: entry for entry in reversed(DEFAULT_PIPELINE) if "group" in entry}


def pipeline_from_names(names: str, *, max_steps: int | None = None) -> Pipeline:
    """``"shape-infer,cleanup,dce"``: pass names, or names of the default pipeline's groups."""
    groups = _default_groups()
    entries: list[Any] = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        entries.append(groups.get(name, {"pass": name}))
    if not entries:
        raise InputError("--passes: no pass names given")
    return pipeline_from_config(entries, max_steps=max_steps, where="--passes")


def load_pipeline_config(path: str | Path, *, max_steps: int | None = None) -> Pipeline:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - exercised on 3.10 only
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as err:
        raise InputError(f"{path}: not valid {path.suffix.lstrip('.').upper() or 'JSON'}: {err}") from None
    from graphopt.schemas import validate

    validate(data, "pipeline", str(path))
    pipeline = pipeline_from_config(data, max_steps=max_steps, where=str(path))
    pipeline.settings = _settings_table(data, str(path))
    return pipeline
