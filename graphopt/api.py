"""The Python API: everything the CLI does, a call away. Every entry point takes a path, an
``onnx.ModelProto`` or a graphopt model.

    import graphopt
    result = graphopt.optimize("model.onnx", output="model.opt.onnx")   # checked, then written
    print(result.numerics.status, result.report["summary"])

The file-to-file run the CLI makes (atomic writes, the numerics check, the report, the CI
gate, blame) lives beside this module, in :mod:`graphopt.runner`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from graphopt.errors import CheckFailed, InputError, PassError
from graphopt.io import from_onnx, load
from graphopt.io import save as save_model
from graphopt.ir import Model
from graphopt.ir.clone import Snapshot
from graphopt.ir.stats import model_stats
from graphopt.passes.base import PassContext
from graphopt.passes.pipeline import (
    PassRun,
    Pipeline,
    PipelineRun,
    default_pipeline,
    load_pipeline_config,
    pipeline_from_names,
    restore_model,
)
from graphopt.report.model import PipelineReport
from graphopt.settings import Settings

if TYPE_CHECKING:
    import onnx

    from graphopt.evaluate import Evaluator
    from graphopt.numerics.check import CheckResult
    from graphopt.numerics.options import CheckOptions
    from graphopt.runtime.guard import Rerun, RuntimeGuard, Undoable

    # Where a model comes from: a file (.onnx or a JSON graph), a ModelProto, or a graphopt model.
    ModelLike = Model | onnx.ModelProto | str | os.PathLike[str]

__all__ = [
    "Result",
    "as_onnx",
    "check",
    "diff",
    "input_layouts",
    "inspect",
    "load",
    "optimize",
    "pass_context",
    "resolve_pipeline",
    "resolve_settings",
    "run_pipeline",
    "save",
]


M = TypeVar("M", Model, "onnx.ModelProto")
logger = logging.getLogger(__name__)


@dataclass
class Result(Generic[M]):
    """An optimized model (an IR model, or a ModelProto when :func:`optimize` was given
    one) and the report of how it got there."""

    model: M
    pipeline_report: PipelineReport
    pipeline_run: PipelineRun
    # The numerics check of the optimized model against the given one (None: not asked for).
    numerics: CheckResult | None = None

    @property
    def report(self) -> dict[str, Any]:
        """The report's JSON form (pipeline, passes, failures, summary, seconds)."""
        return self.pipeline_report.to_json()


def resolve_pipeline(
    passes: str | Pipeline | None = None, config: str | os.PathLike[str] | None = None, max_steps: int | None = None
) -> Pipeline:
    if isinstance(passes, Pipeline):
        return passes
    if passes is not None and config is not None:
        raise InputError("give either --passes (a pass list) or --config (a file), not both")
    if config is not None:
        return load_pipeline_config(Path(config), max_steps=max_steps)
    if passes is not None:
        return pipeline_from_names(passes, max_steps=max_steps)
    return default_pipeline(max_steps)


def pass_context(settings: Settings | None = None) -> PassContext:
    """A pass context with the services that need io and onnxruntime (passes import neither)."""
    from graphopt.io.onnx_infer import infer_types
    from graphopt.io.opset import convert_opset

    return PassContext(
        settings or Settings(), onnx_types=infer_types, evaluator_factory=_evaluator, opset_converter=convert_opset
    )


def _evaluator() -> Evaluator:
    from graphopt.evaluate import Evaluator

    return Evaluator()


def resolve_settings(pipeline: Pipeline, overrides: Mapping[str, Any]) -> tuple[Pipeline, Settings]:
    """The run's settings: a config's [settings], then ``overrides`` (API keywords, CLI options),
    and a copy of ``pipeline`` with the pass knobs among them on its passes."""
    return pipeline.configure(overrides)


# A pass list ("shape-infer,cleanup"), a pipeline, or None for the default pipeline.
Passes = str | Pipeline | None


# The keywords are the implementation's (check, output, config, max_steps, strict, on_pass, run
# settings); the overloads only tell what a ModelProto or an IR model given gives back.
@overload
def optimize(model: onnx.ModelProto, passes: Passes = None, **options: Any) -> Result[onnx.ModelProto]: ...


@overload
def optimize(model: Model | str | os.PathLike[str], passes: Passes = None, **options: Any) -> Result[Model]: ...


def optimize(
    model: ModelLike,
    passes: Passes = None,
    *,
    check: bool | CheckOptions = True,
    output: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    max_steps: int | None = None,
    strict: bool = False,
    on_pass: Callable[[PassRun], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **settings: Any,
) -> Result[Model] | Result[onnx.ModelProto]:
    """Optimize a model (a path, an ``onnx.ModelProto`` or a graphopt model, which is changed
    in place), check its numerics against the model given, and write it to ``output`` if given.

    The result's ``model`` is of the kind given: a new ModelProto for a ModelProto (the one
    given is left as it was), a graphopt model for a path or a graphopt model. ``numerics`` is
    the check (:class:`graphopt.numerics.check.CheckResult`): a failed check raises
    :class:`~graphopt.errors.CheckFailed` (its ``result`` is the check) and writes nothing;
    ``check=False`` skips it, a :class:`graphopt.numerics.options.CheckOptions` sets it up
    (dims, inputs, tolerances, limits). A ModelProto loaded without its external data
    (``load_external_data=False``) needs ``base_dir``, the folder of its file, where the
    weights are read from (never the working folder): InputError without it. ``on_pass`` is
    told of each pass execution as it ends (:class:`graphopt.passes.pipeline.PassRun`).

    ``settings`` are the run settings of :class:`graphopt.settings.Settings` (e.g.
    ``target="ort"``, ``independent_dims=True``) and pass knobs; they override a config's [settings].
    """
    pipeline, run_settings = resolve_settings(resolve_pipeline(passes, config, max_steps), settings)
    given_proto = not isinstance(model, (Model, str, os.PathLike))
    with tempfile.TemporaryDirectory(prefix="graphopt-") as scratch:
        original: Path | None = None
        if isinstance(model, (str, os.PathLike)):
            original = Path(model)
            model = load(original, independent_dims=run_settings.independent_dims)
        elif not isinstance(model, Model):
            model = from_onnx(model, independent_dims=run_settings.independent_dims, base_dir=base_dir)
        if check is not False and (original is None or original.suffix.lower() == ".json"):
            original = Path(scratch) / "original.onnx"  # before the pipeline changes the model
            save_model(model, original)
        # The runtime guard loads an ONNX original as it is (no second save of its weights), and
        # the output the check reads (saved once, for both).
        onnx_file = original if original is not None and original.suffix.lower() != ".json" else None
        optimized = Path(scratch) / "optimized.onnx"
        result = run_pipeline(
            model,
            pipeline,
            run_settings,
            strict=strict,
            on_pass=on_pass,
            original_file=onnx_file,
            save_output=None if check is False else lambda done: _saved_to(done, optimized),
        )
        if check is not False:
            assert original is not None
            result.numerics = _check_result(original, optimized, result, check)
    if output is not None:
        save_model(result.model, output)
    if given_proto:
        from graphopt.io.onnx_write import to_proto

        return Result(to_proto(result.model), result.pipeline_report, result.pipeline_run, result.numerics)
    return result


def input_layouts(runs: Sequence[PassRun]) -> dict[str, tuple[int, ...]]:
    """The layouts passes gave graph inputs (the ``relaid_inputs`` of their details, name ->
    {"layout": perm}), composed in run order: what the check feeds the optimized model."""
    layouts: dict[str, tuple[int, ...]] = {}
    for run in runs:
        for name, relaid in run.details.get("relaid_inputs", {}).items():
            earlier = layouts.get(name)
            layout = tuple(relaid["layout"])
            layouts[name] = layout if earlier is None else tuple(earlier[axis] for axis in layout)
    return layouts


def _saved_to(model: Model, path: Path) -> Path:
    save_model(model, path)
    return path


def _check_result(original: Path, optimized: Path, result: Result[Model], check: bool | CheckOptions) -> CheckResult:
    """The check of ``result``, saved to ``optimized``, against the model file ``original``;
    CheckFailed if the outputs differ."""
    from graphopt.numerics.isolated import check_models_isolated
    from graphopt.numerics.options import CheckOptions

    options = check if isinstance(check, CheckOptions) else CheckOptions()
    layouts = input_layouts(result.pipeline_run.runs)
    outcome = check_models_isolated(original, optimized, input_layouts=layouts, **options.arguments())
    if outcome.status == "failed" or (outcome.status == "not checked" and options.required):
        raise CheckFailed(f"numerics {outcome.status}: {outcome.reason}", outcome)
    return outcome


def run_pipeline(
    model: Model,
    pipeline: Pipeline,
    settings: Settings,
    *,
    strict: bool = False,
    on_pass: Callable[[PassRun], None] | None = None,
    on_pass_start: Callable[[str, str | None, int], None] | None = None,
    stop_after: int | None = None,
    original_file: Path | None = None,
    save_output: Callable[[Model], Path | None] | None = None,
) -> Result[Model]:
    """Run a resolved ``pipeline`` (:func:`resolve_pipeline`) with resolved ``settings``
    (:func:`resolve_settings`) on ``model`` in place: :func:`optimize` once its arguments are read.
    ``original_file``: the ONNX file ``model`` was loaded from, for the runtime guard to load.
    ``save_output(model)``: writes the output where the run keeps it, and returns the ONNX file
    written (or None): called once the pipeline is done, and again each time the runtime
    guard or tuning changes the model, so that its last call saved the result. The runtime
    guard takes its census of the output from that file rather than saving it again."""
    before = model_stats(model)
    start = time.perf_counter()
    if settings.tune and (settings.tune_budget <= 0 or settings.tune_threads < 0):
        raise InputError("--tune-budget must be positive and --tune-threads at least 0")
    guard = _runtime_guard(model, pipeline, settings, stop_after, original_file)
    original = None
    if settings.tune and stop_after is None:
        original = guard.original if guard is not None else Snapshot(model)
    run = pipeline.run(
        model, pass_context(settings), on_pass=on_pass, on_pass_start=on_pass_start, stop_after=stop_after
    )
    seconds = {"optimize": round(time.perf_counter() - start, 6)}
    saved = _Saved(save_output)
    guarded: dict[str, Any] | None = None
    tuned: dict[str, Any] | None = None
    undone: list[Undoable] = []
    if guard is not None:
        pipeline, run, guarded, undone = _guard(guard, model, run, pipeline, settings, saved)
        seconds["runtime_guard"] = guarded["seconds"]
    if original is not None:
        pipeline, run, tuned = _tune(original, model, run, pipeline, settings, undone, saved)
        seconds["tune"] = tuned["seconds"]
    failures = run.failure_records()
    if strict and failures:
        raise PassError(failures[0]["pass"], failures[0]["error"])
    if not saved.current:
        saved.save(model)
    report = PipelineReport(
        pipeline=pipeline.describe(),
        passes=[r.as_dict() for r in run.runs],
        failures=failures,
        summary={"before": before.as_dict(), "after": model_stats(model).as_dict()},
        seconds=seconds,
        runtime_guard=guarded,
        tune=tuned,
    )
    return Result(model, report, run)


class _Saved:
    """``save_output`` of :func:`run_pipeline`, and whether its last call saved the model as it is."""

    def __init__(self, save_output: Callable[[Model], Path | None] | None) -> None:
        self.save_output = save_output
        self.current = save_output is None

    def save(self, model: Model) -> Path | None:
        self.current = True
        return self.save_output(model) if self.save_output is not None else None

    def changed(self) -> None:
        self.current = self.save_output is None


def _runtime_guard(
    model: Model, pipeline: Pipeline, settings: Settings, stop_after: int | None, original_file: Path | None
) -> RuntimeGuard | None:
    """The runtime guard of this run, started (graphopt.runtime.guard): on the whole of the
    default pipeline unless --no-runtime-guard (a run stopped after some passes is blame's)."""
    if not settings.runtime_guard or stop_after is not None:
        return None
    from graphopt.runtime.guard import RuntimeGuard, guards

    return RuntimeGuard(model, original_file) if guards(pipeline) else None


def _guard(
    guard: RuntimeGuard, model: Model, run: PipelineRun, pipeline: Pipeline, settings: Settings, saved: _Saved
) -> tuple[Pipeline, PipelineRun, dict[str, Any], list[Undoable]]:
    """Finish the runtime guard: the rewrites that cost onnxruntime a fusion are undone, ``model``
    taking the rerun's result in place; its messages are logged (the report has them). The
    output is saved first (``saved``), the original's census running beside the save."""
    output_file = None
    if saved.save_output is not None:
        guard.start(model)
        output_file = saved.save(model)
    outcome = guard.finish(model, run, pipeline, _rerun(settings), output_file)
    if outcome.model is not None:
        restore_model(model, outcome.model)
        saved.changed()
    for line in outcome.messages():
        logger.info("%s", line)
    return outcome.pipeline, outcome.run, outcome.as_dict(), [u for u, _ in outcome.undone]


def _rerun(settings: Settings) -> Rerun:
    """How the guard and tuning rerun the pipeline: on a fresh model, with a fresh context."""

    def rerun(steps: Pipeline, fresh: Model) -> PipelineRun:
        return steps.run(fresh, pass_context(settings))

    return rerun


def _tune(
    original: Snapshot,
    model: Model,
    run: PipelineRun,
    pipeline: Pipeline,
    settings: Settings,
    undone: list[Undoable],
    saved: _Saved,
) -> tuple[Pipeline, PipelineRun, dict[str, Any]]:
    """--tune (graphopt.runtime.tune) after the runtime guard: ``model`` takes the tuned rerun's
    result in place when it is kept."""
    from graphopt.runtime.tune import tune

    outcome = tune(
        original,
        model,
        run,
        pipeline,
        _rerun(settings),
        undone,
        level=settings.tune_level,
        threads=settings.tune_threads,
        budget=settings.tune_budget,
    )
    if outcome.model is not None:
        restore_model(model, outcome.model)
        saved.changed()
    return outcome.pipeline, outcome.run, outcome.as_dict()


def check(
    original: ModelLike,
    optimized: ModelLike,
    *,
    raise_on_failure: bool = True,
    **options: Any,
) -> CheckResult:
    """Compare two models in onnxruntime (paths, ModelProtos or graphopt models); options as
    :func:`graphopt.numerics.check_models`.

    Returns the result ("passed", or "not checked" with the reason). When the outputs differ
    it raises :class:`~graphopt.errors.CheckFailed` (the result is on its ``result``), unless
    ``raise_on_failure=False`` asks for the result object instead. Two models whose inputs
    differ cannot be compared: :class:`~graphopt.errors.InputError`, as for unreadable files.
    An onnxruntime crash is contained in a child process and reported in the result.
    """
    from graphopt.numerics.isolated import check_models_isolated

    with tempfile.TemporaryDirectory(prefix="graphopt-") as scratch:
        files = [_as_file(model, Path(scratch) / name) for model, name in ((original, "a"), (optimized, "b"))]
        result = check_models_isolated(*files, refuse_other_inputs=True, **options)
    if result.status == "failed" and raise_on_failure:
        raise CheckFailed(f"{_named(optimized)}: numerics differ from {_named(original)}: {result.reason}", result)
    return result


def save(model: Model | onnx.ModelProto, path: str | os.PathLike[str], **options: Any) -> dict[str, str]:
    """Write a graphopt model or a ModelProto to ``path`` (.onnx or .json), atomically; options
    as :func:`graphopt.io.save` (``external_data``, ...). Returns the digests of the files written."""
    return save_model(model if isinstance(model, Model) else from_onnx(model), path, **options)


def inspect(model: ModelLike) -> dict[str, Any]:
    """What ``graphopt inspect`` shows of a model: inputs and outputs with dims, ops,
    parameters, opsets, and for a file the bytes of its files."""
    from graphopt.io import data_files
    from graphopt.report.inspection import inspect_model

    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        loaded = load(path)
        return inspect_model(loaded, str(path), sum(file.stat().st_size for file in [path, *data_files(loaded)]))
    return inspect_model(model if isinstance(model, Model) else from_onnx(model), _named(model))


def diff(a: ModelLike, b: ModelLike) -> dict[str, Any]:
    """What ``graphopt diff A B`` compares: signatures, op histograms with their change, the
    ops B has more of (fused), parameters, sizes, opsets."""
    from graphopt.report.diff import diff_inspections

    return diff_inspections(inspect(a), inspect(b))


def as_onnx(path: Path, workdir: Path) -> Path:
    """An ONNX file for onnxruntime: the path itself, or a conversion of a JSON graph into ``workdir``
    (one folder per model: two JSON graphs of one name must not convert onto each other)."""
    if path.suffix.lower() != ".json":
        return path
    converted = workdir / f"{path.stem}.onnx"
    save_model(load(path, opaque_ops="quiet"), converted)
    return converted


def _as_file(model: ModelLike, stem: Path) -> Path:
    """An ONNX file of ``model`` for onnxruntime: its own path (a JSON graph converted), or a copy
    written under ``stem``."""
    stem.mkdir()
    if isinstance(model, (str, os.PathLike)):
        return as_onnx(Path(model), stem)
    file = stem / "model.onnx"
    save(model, file)
    return file


def _named(model: ModelLike) -> str:
    """How a message names a model: its path, or what it is."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    return "the graphopt model" if isinstance(model, Model) else "the ModelProto"
