"""File to file: what `graphopt run` does with one model on disk.

Load, optimize (:func:`graphopt.api.optimize`), write to a private staging folder, check
numerics there, and move the result into place only when everything passed; also the CI
gate (would the pipeline still change this model?) and blame (which pass broke numerics).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt import __version__
from graphopt.api import Result, optimize
from graphopt.errors import InputError
from graphopt.io import load, save
from graphopt.ir import Model
from graphopt.passes.pipeline import PassRun

__all__ = ["RunOptions", "as_onnx", "blame", "default_output", "file_digest", "is_optimized", "optimize_file"]


@dataclass
class RunOptions:
    output: Path | None = None
    passes: str | None = None
    config: Path | None = None
    max_steps: int | None = None
    check: bool = True
    dims: dict[str, int] = field(default_factory=dict)
    inputs: Path | None = None
    atol: float | None = None
    rtol: float | None = None
    keep_failed: bool = False
    blame: bool = False
    strict: bool = False
    in_place: bool = False
    independent_dims: bool = False
    external_data: bool | None = None


def default_output(path: Path) -> Path:
    return path.with_name(f"{path.stem}.opt{path.suffix or '.onnx'}")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_entry(path: Path, known: dict[str, str] | None = None) -> dict[str, Any]:
    """Path, sha256 and size of a model file and its .data; ``known`` digests by file name
    (computed while writing) spare reading the files again."""
    known = known or {}

    def describe(file: Path) -> dict[str, Any]:
        digest = known.get(file.name) or file_digest(file)
        return {"path": str(file), "sha256": digest, "bytes": file.stat().st_size}

    entry = describe(path)
    data = path.with_name(path.name + ".data")
    if data.is_file():
        entry["external_data"] = describe(data)
    return entry


def as_onnx(path: Path, workdir: Path) -> Path:
    """An ONNX file for onnxruntime: the path itself, or a conversion of a JSON graph into ``workdir``
    (one folder per model: two JSON graphs of one name must not convert onto each other)."""
    if path.suffix.lower() != ".json":
        return path
    converted = workdir / f"{path.stem}.onnx"
    save(load(path, opaque_ops="quiet"), converted)
    return converted


def _optimize_with(
    model: Model,
    options: RunOptions,
    on_pass: Callable[[PassRun], None] | None = None,
    stop_after: int | None = None,
) -> Result:
    return optimize(
        model,
        options.passes,
        config=options.config,
        max_steps=options.max_steps,
        independent_dims=options.independent_dims,
        strict=options.strict,
        on_pass=on_pass,
        stop_after=stop_after,
    )


def optimize_file(
    source: Path, options: RunOptions, on_pass: Callable[[PassRun], None] | None = None
) -> tuple[dict[str, Any], int]:
    """Optimize one file into ``options.output``; returns the report and the exit code.

    The optimized model is written to a private temporary folder beside the destination,
    checked there, and moved into place only when everything passed: a failed run leaves
    no file behind (unless ``keep_failed``).
    """
    source = Path(source)
    output = options.output or (source if options.in_place else default_output(source))
    if output.resolve() == source.resolve() and not options.in_place:
        raise InputError(f"{output}: refusing to overwrite the input (use --in-place)")
    # The input's digest is read beside the real work: hashing releases the GIL.
    with ThreadPoolExecutor(max_workers=1) as hasher:
        input_entry = hasher.submit(_file_entry, source)
        return _optimize_file(source, output, options, on_pass, input_entry)


def _optimize_file(
    source: Path,
    output: Path,
    options: RunOptions,
    on_pass: Callable[[PassRun], None] | None,
    input_entry: Future[dict[str, Any]],
) -> tuple[dict[str, Any], int]:
    started = time.perf_counter()
    load_start = time.perf_counter()
    model = load(source, independent_dims=options.independent_dims)
    load_seconds = time.perf_counter() - load_start
    result = _optimize_with(model, options, on_pass)
    report: dict[str, Any] = {"graphopt_version": __version__, "input": None, **result.report}
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".graphopt-", dir=output.parent))
    exit_code = 0
    try:
        # The output and its sidecars (.data, .npy) alone in one folder: they move into place together.
        staged = workdir / "output" / output.name
        save_start = time.perf_counter()
        save_options: dict[str, Any] = {}
        if staged.suffix.lower() != ".json":
            save_options["external_data"] = options.external_data
        written = save(result.model, staged, **save_options)
        report["seconds"]["save"] = round(time.perf_counter() - save_start, 6)
        report["input"] = input_entry.result()
        report["seconds"]["load"] = round(load_seconds, 6)
        if options.check:
            check_start = time.perf_counter()
            from graphopt.check import check_models_isolated

            outcome = check_models_isolated(
                as_onnx(source, workdir / "original"),
                as_onnx(staged, workdir / "optimized"),
                dims=options.dims or None,
                inputs=options.inputs,
                atol=options.atol,
                rtol=options.rtol,
            )
            report["numerics"] = outcome.as_dict()
            report["seconds"]["check"] = round(time.perf_counter() - check_start, 6)
            if outcome.status == "failed":
                exit_code = 1
                if options.blame:
                    report["blame"] = blame(source, options, workdir)
        else:
            report["numerics"] = {"status": "skipped", "reason": "--no-check"}
        if exit_code == 0 or options.keep_failed:
            _move_into_place(staged, output)
            report["output"] = _file_entry(output, written)
            created = []
        else:
            report["output"] = None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for folder in created:  # innermost first; only the folders this run made, and only if empty
            with contextlib.suppress(OSError):
                folder.rmdir()
    report["seconds"]["total"] = round(time.perf_counter() - started, 6)
    report["status"] = "ok" if exit_code == 0 else "check failed"
    report["exit_code"] = exit_code
    return report, exit_code


def _move_into_place(staged: Path, output: Path) -> None:
    """Rename the staged model and its sidecars into place, all or none.

    Sidecars go first and the model last, so a reader never sees the new model with old
    weights. A destination that exists is first hard-linked into the staging folder, so a
    failure part way puts every file back; a ``.data`` beside the output that the new model
    does not use is removed with the same guarantee.
    """
    staging = staged.parent
    moves: list[tuple[Path | None, Path]] = [
        (p, output.parent / p.name) for p in sorted(staging.iterdir()) if p != staged
    ]
    moves.append((staged, output))
    stale = output.with_name(output.name + ".data")
    if stale.is_file() and not (staging / stale.name).exists():
        moves.insert(0, (None, stale))
    backups: list[tuple[Path, Path]] = []
    done: list[Path] = []
    try:
        for i, (source, target) in enumerate(moves):
            if target.is_file():
                backup = staging.parent / f"previous-{i}"
                try:
                    os.link(target, backup)
                except OSError:  # no hard links on this file system
                    shutil.copy2(target, backup)
                backups.append((backup, target))
            if source is None:
                target.unlink()
            else:
                os.replace(source, target)
                done.append(target)
    except BaseException:
        for target in done:
            target.unlink(missing_ok=True)
        for backup, target in backups:
            os.replace(backup, target)
        raise


def blame(source: Path, options: RunOptions, workdir: Path) -> dict[str, Any]:
    """Name the first pass execution that breaks numerics, then the first node that diverges.

    The pipeline stopped after k pass executions gives a model; k = 0 (the original) passes
    and k = all of them fails, so a bisection finds the first failing k in log2(n) reruns,
    assuming a prefix that broke numerics stays broken. The models at k - 1 (last good) and
    k (first bad) are then compared value by value (check.intermediates).
    """
    from graphopt.check import check_models_isolated
    from graphopt.check.intermediates import first_divergence
    from graphopt.check.isolated import run_isolated

    check_options: dict[str, Any] = {
        "dims": options.dims or None,
        "inputs": options.inputs,
        "atol": options.atol,
        "rtol": options.rtol,
    }
    reference = as_onnx(source, workdir / "original")
    runs = _optimize_with(load(source, independent_dims=options.independent_dims, opaque_ops="quiet"), options)
    total = len(runs.pipeline_run.runs)
    models: dict[int, Path] = {0: reference}

    def model_after(count: int) -> Path:
        if count not in models:
            model = load(source, independent_dims=options.independent_dims, opaque_ops="quiet")
            partial = _optimize_with(model, options, stop_after=count)
            models[count] = workdir / "blame" / f"after-{count}" / "model.onnx"
            save(partial.model, models[count])
        return models[count]

    good, bad, reruns = 0, total, 0
    while bad - good > 1:
        middle = (good + bad) // 2
        reruns += 1
        if check_models_isolated(reference, model_after(middle), **check_options).status == "failed":
            bad = middle
        else:
            good = middle
    if total == 0:
        return {"pass": None, "reruns": reruns, "reason": "the pipeline ran no pass"}
    culprit = runs.pipeline_run.runs[bad - 1]
    found: dict[str, Any] = {
        "pass": culprit.name,
        "execution": bad,
        "group": culprit.group,
        "iteration": culprit.iteration,
        "reruns": reruns,
        "executions": total,
    }
    divergence = run_isolated(
        first_divergence, model_after(good), model_after(bad), workdir / "blame" / "marked", **check_options
    )
    found["divergence"] = divergence if isinstance(divergence, dict) else {"node": None, "reason": divergence}
    return found


def is_optimized(source: Path, options: RunOptions) -> dict[str, Any]:
    """The CI gate: would the pipeline still change this model? Writes nothing."""
    from graphopt.io.onnx_io import digest

    model = load(source, independent_dims=options.independent_dims)
    before = digest(model)
    result = _optimize_with(model, options)
    after = digest(result.model)
    changed = [r["pass"] for r in result.report["passes"] if r["changed"]]
    optimized = before == after
    reason = None if optimized else "changed by " + ", ".join(dict.fromkeys(changed) or ["the pipeline"])
    return {"path": str(source), "optimized": optimized, "reason": reason}
