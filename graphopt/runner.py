"""File to file: what `graphopt run` does with one model on disk.

Load, optimize (:func:`graphopt.api.optimize`), write to a private staging folder, check
numerics there, and move the result into place only when everything passed; also the CI
gate (would the pipeline still change this model?) and blame (which pass broke numerics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from graphopt.api import Result, as_onnx, input_layouts, resolve_pipeline, resolve_settings, run_pipeline
from graphopt.errors import GraphoptError, InputError
from graphopt.files import commit, file_digest, folder_lock, is_staging, staging_folder
from graphopt.io import data_files, load_noting, save
from graphopt.io.json_io import is_sidecar_of
from graphopt.io.onnx_write import is_data_file_of
from graphopt.ir import Model
from graphopt.numerics.options import CheckOptions
from graphopt.passes.pipeline import Pipeline, default_pipeline
from graphopt.report import write_report
from graphopt.report.model import ModelReport
from graphopt.settings import Settings
from graphopt.writer import (
    check_model_output,
    check_report_output,
    readers,
    refuse_read_by_others,
    refuse_reserved,
    same_bytes,
    tensor_files_named_by,
)

if TYPE_CHECKING:
    from graphopt.cache import CachedResult, ResultCache

__all__ = [
    "RunOptions",
    "as_onnx",
    "blame",
    "default_output",
    "file_digest",
    "input_layouts",
    "is_optimized",
    "optimize_file",
]


@dataclass
class RunOptions:
    """How to run models file to file. The pipeline and its settings come resolved (once per
    run, at the edge: :meth:`resolve`), so no model parses or validates them again."""

    output: Path | None = None
    pipeline: Pipeline = field(default_factory=default_pipeline)
    # The run's settings: a config's [settings] under the API keywords and command-line options.
    settings: Settings = field(default_factory=Settings)
    # The pipeline's config file: a file the run reads, which no output may replace.
    config: Path | None = None
    check: bool = True
    numerics: CheckOptions = field(default_factory=CheckOptions)
    keep_failed: bool = False
    blame: bool = False
    strict: bool = False
    in_place: bool = False
    external_data: bool | None = None
    # Name the output's external data as the input's (model.onnx_data), not after its content.
    external_data_name: bool = False
    # The files the models of a folder run read, resolved, with the models that read them
    # (batch_reads()): no model's output may replace or remove another's.
    batch_reads: dict[Path, list[Path]] = field(default_factory=dict)
    # The paths (resolved) other files of the run are written under, with what each is: the
    # other models' outputs and kept weights, the files copied beside them. This model's
    # weights may take none of these names.
    reserved: dict[Path, str] = field(default_factory=dict)
    # The JSON report, committed with the model.
    report: Path | None = None
    # Results kept by input digest and options (--cache): an unchanged model is copied, not run.
    cache: ResultCache | None = None

    @classmethod
    def resolve(
        cls,
        passes: str | Pipeline | None = None,
        config: Path | None = None,
        max_steps: int | None = None,
        settings: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> RunOptions:
        """Options for a run of ``passes`` or ``config`` with ``settings`` (keywords of
        :class:`graphopt.settings.Settings` and pass knobs); a bad pipeline fails here, before any work."""
        pipeline, run_settings = resolve_settings(resolve_pipeline(passes, config, max_steps), settings or {})
        return cls(pipeline=pipeline, settings=run_settings, config=config, **options)

    def load(self, source: Path, **options: Any) -> Model:
        """Load ``source`` as the run's settings ask (independent dims), with io's ``options``."""
        return self.load_noting(source, **options)[0]

    def load_noting(self, source: Path, **options: Any) -> tuple[Model, list[str]]:
        """:meth:`load`, and the warnings loading gave."""
        return load_noting(source, independent_dims=self.settings.independent_dims, **options)


def default_output(path: Path) -> Path:
    return path.with_name(f"{path.stem}.opt{path.suffix or '.onnx'}")


def _file_entry(path: Path, data: Path | None, known: dict[str, str] | None = None) -> dict[str, Any]:
    """Path, sha256 and size of a model file and of its external data file; ``known``
    digests by file name (computed while writing) spare reading the files again."""
    known = known or {}

    def describe(file: Path) -> dict[str, Any]:
        digest = known.get(file.name) or file_digest(file)
        return {"path": str(file), "sha256": digest, "bytes": file.stat().st_size}

    entry = describe(path)
    if data is not None:
        entry["external_data"] = describe(data)
    return entry


def _optimize_with(
    model: Model,
    options: RunOptions,
    on_phase: Callable[[str], None] | None = None,
    stop_after: int | None = None,
    source: Path | None = None,
    save_output: Callable[[Model], Path | None] | None = None,
) -> Result:
    def pass_started(name: str, group: str | None, iteration: int) -> None:
        if on_phase is not None:
            on_phase(f"pass {name}" if group is None else f"pass {group}/{name} (round {iteration + 1})")

    return run_pipeline(
        model,
        options.pipeline,
        options.settings,
        strict=options.strict,
        on_pass_start=pass_started,
        stop_after=stop_after,
        original_file=source if source is not None and source.suffix.lower() != ".json" else None,
        save_output=save_output,
    )


def optimize_file(
    source: Path, options: RunOptions, on_phase: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], int]:
    """Optimize one file into ``options.output``; returns the report and the exit code.
    ``on_phase`` is told of each phase as it starts (load, each pass, save, the check and
    its runs of the models at each binding), for progress.

    The optimized model (and the report, with ``options.report``) is written to private
    staging folders beside the destinations, checked there, and committed only when
    everything passed: a failed run leaves no file behind (unless ``keep_failed``). See
    :func:`_commit` for what the commit guarantees.
    """
    source = Path(source)
    if options.in_place and options.output is None:
        # Through a symbolic link to the file it names: the link stays a link.
        output = source.resolve() if source.is_symlink() else source
        if output != source and _read_only(output):
            raise InputError(
                f"{source}: a link to the read-only {output} (a shared cache object?); --in-place does not write "
                "through it, as that would change every file linking there: write the result elsewhere with -o"
            )
    else:
        output = options.output or default_output(source)
    check_model_output(output)
    if output.resolve() == source.resolve() and not options.in_place:
        raise InputError(f"{output}: refusing to overwrite the input (use --in-place)")
    if options.report is not None:
        check_report_output(options.report, [source, output])
    tell = on_phase or (lambda phase: None)
    known: dict[str, str] = {}
    cache_key = None
    if options.cache is not None:
        named = sorted(tensor_files_named_by(source))
        tell(f"digest {source}")
        known = {location: file_digest(source.parent / location) for location in named} | {
            source.name: file_digest(source)
        }
        cache_key = options.cache.key(known, _decided_by(options, output))
        stored = options.cache.lookup(cache_key)
        if stored is not None:
            data = [source.parent / location for location in named]
            return _restore(source, output, stored, _reads(source, data, options), options, tell, cache_key)
    tell(f"load {source}")
    load_start = time.perf_counter()
    model, warnings = options.load_noting(source)
    load_seconds = time.perf_counter() - load_start
    data = data_files(model)
    # The input's digest is read beside the real work: hashing releases the GIL.
    onnx_data = data[0] if data and source.suffix.lower() != ".json" else None
    with ThreadPoolExecutor(max_workers=1) as hasher:
        input_entry = hasher.submit(_file_entry, source, onnx_data, {Path(k).name: v for k, v in known.items()})
        reads = _reads(source, data, options)
        kept_name = onnx_data.name if options.external_data_name and onnx_data is not None else None
        if kept_name is not None:  # found now, before any work; content-addressed names when committed
            kept, what = output.parent / kept_name, f"the weights of {output} (--external-data-name)"
            refuse_reserved([kept], {output.resolve(): f"the output model {output}", **_reserved(options)}, what)
            refuse_read_by_others([kept], what, ignoring=[output])
        loaded = (model, load_seconds, kept_name, warnings)
        return _optimize_file(source, output, loaded, reads, options, tell, input_entry, cache_key)


def _decided_by(options: RunOptions, output: Path) -> dict[str, Any]:
    """What of a run's options decides its output file and report: the pipeline, the settings,
    the check's options (a file they name by its digest) and how the output is written."""
    numerics = {
        name: _by_content(value) for name, value in dataclasses.asdict(options.numerics).items() if name != "required"
    }
    return {
        "pipeline": options.pipeline.describe(),
        "settings": dataclasses.asdict(options.settings),
        "check": options.check,
        "numerics": numerics,
        "output": {
            "name": output.name,
            "external_data": options.external_data,
            "external_data_name": options.external_data_name,
        },
    }


def _by_content(value: Any) -> Any:
    if isinstance(value, Path):
        return file_digest(value)
    if isinstance(value, (tuple, list)):
        return [_by_content(v) for v in value]
    return value


def _reads(source: Path, data: list[Path], options: RunOptions) -> dict[Path, str]:
    """The files a run of ``source`` reads (``data``: its weights files), each with what it is
    to the user: no file the run writes or removes may be one of them."""
    reads = {source: "the input model", **{file: _TENSOR_DATA for file in data}}
    for file, read_by in options.batch_reads.items():
        others = [r for r in read_by if r.resolve() != source.resolve()]
        if others:  # over the input's own labels: --in-place may not replace what another model reads
            kind = "the input model" if file == others[0].resolve() else "the tensor data of"
            reads[file] = f"{kind} {others[0]}"
    if options.numerics.inputs is not None:
        reads[options.numerics.inputs] = "--inputs"
    if options.config is not None:
        reads[options.config] = "--config"
    return reads


def _reserved(options: RunOptions) -> dict[Path, str]:
    """What the run writes beside this model's own files (see RunOptions.reserved), the report included."""
    report = {options.report.resolve(): f"the --report {options.report}"} if options.report is not None else {}
    return {**options.reserved, **report}


def _read_only(path: Path) -> bool:
    """Whether no one may write ``path`` (root may, and still should not)."""
    with contextlib.suppress(OSError):
        return path.stat().st_mode & 0o222 == 0 or not os.access(path, os.W_OK)
    return False


def _optimize_file(
    source: Path,
    output: Path,
    loaded: tuple[Model, float, str | None, list[str]],
    reads: dict[Path, str],
    options: RunOptions,
    tell: Callable[[str], None],
    input_entry: Future[dict[str, Any]],
    cache_key: str | None,
) -> tuple[dict[str, Any], int]:
    started = time.perf_counter()
    model, load_seconds, data_name, load_warnings = loaded

    def produce(workdir: Path, staged: Path) -> tuple[ModelReport, dict[str, str], int]:
        """Optimize the model, save it into ``staged`` and check it; the report, the digests
        of the files written and the exit code."""
        save_options: dict[str, Any] = {"content_addressed": data_name is None}
        if staged.suffix.lower() != ".json":
            # The input's external data stays external even when every weight was rewritten.
            had = source.suffix.lower() != ".json" and _TENSOR_DATA in reads.values()
            save_options["external_data"] = options.external_data if options.external_data is not None else had or None
            if data_name is not None:
                save_options["location"] = data_name
        written: dict[str, str] = {}
        save_seconds = 0.0
        # The original's reruns in the check, kept for the checks of this model's retries (below), which only a
        # run with fusions through Q/DQ may make.
        memo: Path | None = None

        def save_output(optimized: Model) -> Path | None:
            """Save the output into ``staged``, in place of an earlier save (the runtime guard
            takes its census from this file, and may then undo a rewrite)."""
            nonlocal written, save_seconds
            tell(f"save {output}")
            save_start = time.perf_counter()
            for earlier in staged.parent.iterdir():
                earlier.unlink()
            written = _writing(output, lambda: save(optimized, staged, **save_options))
            save_seconds += time.perf_counter() - save_start
            return staged if staged.suffix.lower() != ".json" else None

        def optimized_and_checked(model: Model) -> tuple[ModelReport, Result, str | None]:
            """The report of one optimization of ``model`` with its check, the pipeline's
            result, and the check's status (None: --no-check)."""
            nonlocal save_seconds, memo
            save_seconds = 0.0
            result = _optimize_with(model, options, tell, source=source, save_output=save_output)
            report = ModelReport(result.pipeline_report, warnings=load_warnings)
            seconds = report.run.seconds
            seconds["save"] = round(save_seconds, 6)
            seconds["load"] = round(load_seconds, 6)
            if not options.check:
                report.numerics = {"status": "skipped", "reason": "--no-check"}
                return report, result, None
            tell("check numerics")
            check_start = time.perf_counter()
            from graphopt.numerics import check_models_isolated

            original = as_onnx(source, workdir / "original")
            optimized = as_onnx(staged, workdir / "optimized")
            if memo is None and _fused_through_qdq(result):
                memo = Path(tempfile.mkdtemp(prefix="check-memo-", dir=workdir))
            outcome = check_models_isolated(
                original,
                optimized,
                input_layouts=input_layouts(result.pipeline_run.runs),
                on_phase=tell,
                memo=memo,
                **options.numerics.arguments(),
            )
            # onnxruntime names the files it loads: the user's names, not the staging folder's.
            named = {optimized: output, staged: output, original: source, workdir: output.parent}
            report.numerics = _renamed(outcome.as_dict(), {str(k): str(v) for k, v in named.items()})
            seconds["check"] = round(time.perf_counter() - check_start, 6)
            return report, result, outcome.status

        report, result, status = optimized_and_checked(model)
        from graphopt.passes.fuse.fuse_pass import keep_qdq_pairs

        fused = _fused_through_qdq(result)
        if status == "failed" and fused:
            # The fusions through Q/DQ compute in float what the original quantized; where the
            # check refuses that, the model is optimized again keeping the Q/DQ pairs of some
            # families' fusions (_withheld_search) until the check passes; the output says so, so
            # that a run on it decides the same (the output stays a fixed point).
            refused = (report.numerics or {}).get("reason")
            attempt_seconds = 0.0
            last = report

            def attempt(families: frozenset[str] | None) -> tuple[ModelReport, Result, str | None]:
                """The run again, the Q/DQ pairs of ``families``' fusions kept (None: every family's)."""
                nonlocal attempt_seconds, last
                attempt_seconds += last.run.seconds.get("total", 0.0) + last.run.seconds.get("check", 0.0)
                which = "fusing" if families is None else f"the {', '.join(sorted(families))} fusions"
                tell(f"check failed: optimize again without {which} through Q/DQ")
                reloaded = options.load(source, opaque_ops="quiet")  # its warnings were given
                keep_qdq_pairs(reloaded, None if families is None else sorted(families))
                outcome = optimized_and_checked(reloaded)
                last = outcome[0]
                return outcome

            withheld, (report, result, status) = _withheld_search(fused, report, attempt)
            families = sorted(fused) if withheld is None else sorted(withheld)
            report.through_qdq = {
                "withdrawn": sum(fused[name] for name in families),
                "families": families,
                "every_pair_kept": withheld is None,
                "refused": refused,
                "seconds": round(attempt_seconds, 6),
            }
        report.input = input_entry.result()
        if status == "failed":
            if options.blame:
                tell("blame: bisect the passes")
                report.blame = blame(source, options, workdir)
            return report, written, 1
        return report, written, 1 if status == "not checked" and options.numerics.required else 0

    return _write_out(source, output, reads, options, produce, started, (data_name, cache_key))


Attempt = Callable[[frozenset[str] | None], tuple[ModelReport, Result, str | None]]


def _withheld_search(
    fused: Counter[str], refused: ModelReport, attempt: Attempt
) -> tuple[frozenset[str] | None, tuple[ModelReport, Result, str | None]]:
    """The first attempt the check does not refuse, of a run whose check refused its fusions
    through Q/DQ (``fused``: per rule family; ``refused``: that run's report), with the families
    whose Q/DQ pairs it keeps (None: every family's). ``attempt(families)`` optimizes again
    keeping those families' pairs. One family more at a time, fewest fusions first; where no one
    more is enough, the one whose attempt came nearest to the original's outputs stays withheld
    and the others are tried again beside it (two families refused together, as the norms and
    attentions of a model whose masks dequantize to NaN). The search keeps every family's pairs
    (``attempt(None)``) when one family is left to try, or when withholding one more brought no
    attempt nearer to the original than the run before. At most n + (n - 1) + ... + 2 attempts
    for n families, then that last one."""
    withheld: frozenset[str] = frozenset()
    distance = _distance(refused)
    while len(rest := sorted(set(fused) - withheld, key=lambda family: (fused[family], family))) > 1:
        nearest: tuple[tuple[int, float], str] | None = None
        for family in rest:
            outcome = attempt(withheld | {family})
            if outcome[2] != "failed":
                return withheld | {family}, outcome
            found = _distance(outcome[0])
            if nearest is None or found < nearest[0]:
                nearest = (found, family)
        if nearest is None or nearest[0] >= distance:
            break
        distance, withheld = nearest[0], withheld | {nearest[1]}
    return None, attempt(None)


def _distance(report: ModelReport) -> tuple[int, float]:
    """How far a refused output is from the original's: the outputs the check failed, then the
    worst relative L2 distance of any (a NaN the farthest)."""
    outputs = [o for binding in (report.numerics or {}).get("bindings", []) for o in binding.get("outputs", [])]
    failed = sum(1 for o in outputs if not o.get("passed", True))
    distances = [float(o.get("rel_l2") or 0.0) for o in outputs]
    return failed, max((d if d == d else math.inf for d in distances), default=math.inf)


def _fused_through_qdq(result: Result) -> Counter[str]:
    """The rewrites through Q/DQ pairs per rule family in ``result``'s fuse runs (none: no retry can follow)."""
    from graphopt.passes.fuse.fuse_pass import families_fused_through_qdq

    through: Counter[str] = Counter()
    for run in result.pipeline_run.runs:
        through.update(run.details.get("through_qdq", {}))
    return families_fused_through_qdq(through)


def _restore(
    source: Path,
    output: Path,
    stored: CachedResult,
    reads: dict[Path, str],
    options: RunOptions,
    tell: Callable[[str], None],
    cache_key: str,
) -> tuple[dict[str, Any], int]:
    """Commit a cached result as a run would its own: the stored files copied into staging,
    its report with this run's paths; the numerics were checked by the run that stored it."""
    started = time.perf_counter()
    tell(f"cache hit: {output}")
    was = stored.report
    paths = {was["input"]["path"]: str(source), was["output"]["path"]: str(output)}
    report = ModelReport.from_json(_renamed(was, paths))
    report.cache = {"status": "hit", "key": cache_key, "stored_seconds": was["seconds"].get("total", 0.0)}
    report.run.seconds = {}

    def produce(workdir: Path, staged: Path) -> tuple[ModelReport, dict[str, str], int]:
        def copy() -> None:  # the output's name is in the key: the stored files are named as this run's
            for name in stored.files:
                shutil.copyfile(stored.folder / name, staged.parent / name)

        _writing(output, copy)
        return report, stored.files, 0

    return _write_out(source, output, reads, options, produce, started, (None, None))


def _write_out(
    source: Path,
    output: Path,
    reads: dict[Path, str],
    options: RunOptions,
    produce: Callable[[Path, Path], tuple[ModelReport, dict[str, str], int]],
    started: float,
    naming: tuple[str | None, str | None],
) -> tuple[dict[str, Any], int]:
    """Stage the output (``produce`` writes and checks it, and gives the report), describe it
    in the report, store it in the cache (a run that passed, given a key) and commit it with
    the report; a failed run commits nothing unless ``keep_failed``. ``naming``: the weights
    file's kept name and the cache key."""
    data_name, cache_key = naming
    folders = [output.parent] + ([options.report.parent] if options.report is not None else [])
    created = [p for folder in folders for p in [folder, *folder.parents] if not p.exists()]
    try:
        with contextlib.ExitStack() as stack:
            staging = {folder.resolve(): _staging(stack, folder, output) for folder in folders}
            workdir = staging[output.parent.resolve()]
            # The output and its sidecars (.data, .npy) alone in one folder: they are committed together.
            staged = workdir / "output" / output.name
            staged.parent.mkdir(exist_ok=True)
            report, written, exit_code = produce(workdir, staged)
            seconds = report.run.seconds
            moves: list[tuple[Path, Path]] = []
            if exit_code == 0 or options.keep_failed:
                sidecars = sorted(p for p in staged.parent.iterdir() if p != staged)
                moves = [(p, output.parent / p.name) for p in sidecars] + [(staged, output)]
                weights = next((p for p in sidecars if p.suffix == ".data" or p.name == data_name), None)
                report.output = _file_entry(staged, weights, written)
                report.output["path"] = str(output)  # described before the commit, named as after it
                if weights is not None:
                    report.output["external_data"]["path"] = str(output.parent / weights.name)
            seconds["total"] = round(time.perf_counter() - started, 6)
            report.status = "ok" if exit_code == 0 else "check failed"
            report.exit_code = exit_code
            if exit_code == 0 and cache_key is not None and options.cache is not None:
                report.cache = {"status": "stored", "key": cache_key}
                stored = {key: value for key, value in report.to_json().items() if key != "cache"}
                options.cache.store(cache_key, [staged, *sidecars], written, stored)
            if options.report is not None:
                report_path = options.report
                staged_report = staging[report_path.parent.resolve()] / "report" / report_path.name
                _writing(report_path, lambda: write_report(report.to_json(), staged_report))
                moves.append((staged_report, report_path))
            _writing(output, lambda: _commit(source, output, moves, reads, options, workdir))
    finally:
        for folder in sorted(set(created), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # only the folders this run made, and only if left empty
                folder.rmdir()
    return report.to_json(), exit_code


def _renamed(found: Any, names: dict[str, str]) -> Any:
    """``found`` (a report part) with every path of ``names`` in its strings replaced, longest first."""
    if isinstance(found, dict):
        return {key: _renamed(value, names) for key, value in found.items()}
    if isinstance(found, list):
        return [_renamed(value, names) for value in found]
    if isinstance(found, str):
        for old in sorted(names, key=len, reverse=True):
            found = found.replace(old, names[old])
    return found


def _staging(stack: contextlib.ExitStack, folder: Path, output: Path) -> Path:
    """A staging folder in ``folder`` (made if missing) until ``stack`` closes; a folder that
    cannot be written is bad input."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return stack.enter_context(staging_folder(folder))
    except OSError as err:
        raise _write_error(err, output, f"cannot write into {folder}") from None


_T = TypeVar("_T")
_USER_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


def _writing(target: Path, write: Callable[[], _T]) -> _T:
    """Run ``write``; an OSError becomes one line naming ``target`` (never a staging path)."""
    try:
        return write()
    except OSError as err:
        raise _write_error(err, target, "cannot write it") from None


def _write_error(err: OSError, target: Path, what: str) -> GraphoptError:
    """Permissions, read-only file systems and a file where a folder should be are the
    user's to fix (exit 2); a full disk or an I/O error is not (exit 3). The message names
    ``target``, never a staging path."""
    named = err.filename is not None and not is_staging(Path(str(err.filename)))
    detail = f"{err.strerror or err}" + (f": {err.filename}" if named else "")
    error_type = InputError if err.errno in _USER_ERRNOS else GraphoptError
    return error_type(f"{target}: {what} ({detail})")


_TENSOR_DATA = "the input's tensor data"


def _commit(
    source: Path,
    output: Path,
    moves: list[tuple[Path, Path]],
    reads: dict[Path, str],
    options: RunOptions,
    backups: Path,
) -> None:
    """Put the staged files in place, holding a lock on each destination folder.

    - Before anything is written, every path the commit writes or removes is compared with
      every file the run reads, symbolic links resolved: a clash is bad input (only
      ``--in-place`` may replace the input and its weights).
    - External data (and a JSON graph's .npy sidecars) have content-addressed names, so
      the new weights never replace the files the old model reads: they go in first, the
      model is renamed over the old one (one atomic rename switches from the old set to
      the new), the report after it, and only then are the old model's weights removed.
      A kill at any moment leaves the old set or the new one, loadable; a failed rename
      puts back what was renamed.
    - Two runs writing into one folder take turns (the lock); each one's set is whole.
    """
    folders = sorted({t.parent.resolve() for _, t in moves})
    with contextlib.ExitStack() as locks:
        for folder in folders:
            locks.enter_context(folder_lock(folder, output))
        removals = _old_weights(output, moves)
        # Weights of this content already in place under their content-addressed name stay,
        # once their bytes are seen to be that content (a bad cache restore, a planted file).
        moves = [(s, t) for s, t in moves if not (_is_weights_of(output, t, hashed=True) and same_bytes(s, t))]
        _refuse_clashes(source, output, [t for _, t in moves], removals, reads, options)
        weights = [t for _, t in moves if t not in (output, options.report)]
        refuse_reserved(weights, _reserved(options), f"the weights of {output}")
        refuse_read_by_others(weights, f"the weights of {output}", ignoring=[output])
        if output.is_file():  # the new weights keep the permissions of the model they replace
            mode = output.stat().st_mode & 0o7777
            for staged, target in moves:
                if target not in (output, options.report):
                    os.chmod(staged, mode)
        # The old report goes before the new model comes: a kill between the two renames
        # leaves no report, never the old one beside the new model.
        commit(moves, backups, withdrawn=[options.report] if options.report is not None else [])
        for stale in removals:
            with contextlib.suppress(OSError):  # an old weights file left behind is harmless
                stale.unlink()


def batch_reads(sources: Sequence[Path]) -> dict[Path, list[Path]]:
    """The files the models of a folder run read (each model, its tensor data), resolved,
    with the models that read them; the tensor data files are the ones each model names,
    read without building the model (each is loaded once, by its own run)."""
    reads: dict[Path, list[Path]] = {}
    for source in sources:
        files = [source, *(source.parent / location for location in sorted(tensor_files_named_by(source)))]
        for file in files:
            reads.setdefault(file.resolve(), []).append(source)
    return reads


def _old_weights(output: Path, moves: list[tuple[Path, Path]]) -> list[Path]:
    """The tensor data files (external data, .npy sidecars) that the model at ``output``
    reads, that the new one does not, and that no other file in that folder reads, whatever
    its name: a renamed export may still read ``model.onnx.data``, a copy made with ``cp
    model.onnx model.onnx.bak`` the content-addressed weights."""
    if all(t != output for _, t in moves) or not output.is_file():
        return []
    new = {t.name for _, t in moves}
    folder = output.parent
    candidates = {
        p.resolve(): p
        for p in map(folder.joinpath, tensor_files_named_by(output))
        if _is_weights_of(output, p) and p.name not in new and p.is_file()
    }
    if candidates:
        kept = readers(folder, ignoring=[output])
        candidates = {path: file for path, file in candidates.items() if path not in kept}
    return sorted(candidates.values())


def _is_weights_of(output: Path, candidate: Path, *, hashed: bool = False) -> bool:
    """Whether ``candidate`` is named as the tensor data files of the model ``output`` are."""
    if output.suffix.lower() == ".json":
        return is_sidecar_of(output, candidate, hashed=hashed)
    return is_data_file_of(output, candidate, hashed=hashed)


def _refuse_clashes(
    source: Path, output: Path, writes: list[Path], removals: list[Path], reads: dict[Path, str], options: RunOptions
) -> None:
    resolved = {path.resolve(): what for path, what in reads.items()}
    replaceable = {"the input model", _TENSOR_DATA} if options.in_place else set()
    for target in [*writes, *removals]:
        what = resolved.get(target.resolve())
        if what is not None and what not in replaceable:
            verb = "remove" if target in removals else "replace"
            raise InputError(f"{target}: this run reads it ({what}) and would {verb} it; choose another output")
    parted = _TENSOR_DATA in reads.values() or any(t.parent == output.parent and t != output for t in writes)
    if options.in_place and source.is_symlink() and source.parent.resolve() != output.parent.resolve() and parted:
        raise InputError(
            f"{source}: --in-place through a link into another folder would part the model from its "
            "tensor data; run on the link's target instead"
        )


def blame(source: Path, options: RunOptions, workdir: Path) -> dict[str, Any]:
    """Name the first pass execution that breaks numerics, then the first node that diverges.

    The pipeline stopped after k pass executions gives a model; k = 0 (the original) passes
    and k = all of them fails, so a bisection finds the first failing k in log2(n) reruns,
    assuming a prefix that broke numerics stays broken. The models at k - 1 (last good) and
    k (first bad) are then compared value by value (check.intermediates).
    """
    from graphopt.numerics import check_models_isolated
    from graphopt.numerics.intermediates import first_divergence
    from graphopt.numerics.isolated import run_isolated

    reference = as_onnx(source, workdir / "original")
    runs = _optimize_with(options.load(source, opaque_ops="quiet"), options)
    total = len(runs.pipeline_run.runs)
    models: dict[int, Path] = {0: reference}

    def model_after(count: int) -> Path:
        if count not in models:
            model = options.load(source, opaque_ops="quiet")
            partial = _optimize_with(model, options, stop_after=count)
            models[count] = workdir / "blame" / f"after-{count}" / "model.onnx"
            save(partial.model, models[count])
        return models[count]

    good, bad, reruns = 0, total, 0
    while bad - good > 1:
        middle = (good + bad) // 2
        reruns += 1
        relaid = input_layouts(runs.pipeline_run.runs[:middle])
        if (
            check_models_isolated(
                reference,
                model_after(middle),
                input_layouts=relaid,
                **options.numerics.arguments(),
            ).status
            == "failed"
        ):
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
        first_divergence,
        model_after(good),
        model_after(bad),
        workdir / "blame" / "marked",
        options.numerics,
    )
    found["divergence"] = divergence if isinstance(divergence, dict) else {"node": None, "reason": divergence}
    return found


def is_optimized(source: Path, options: RunOptions) -> dict[str, Any]:
    """The CI gate: would the pipeline still change this model? Writes nothing."""
    from graphopt.io.onnx_write import digest

    model = options.load(source)
    before = digest(model)
    result = _optimize_with(model, options, source=source)
    after = digest(result.model)
    optimized = before == after
    return {"path": str(source), "optimized": optimized, "reason": None if optimized else _gain(result.report)}


def _gain(report: dict[str, Any]) -> str:
    """What the pipeline would still do to a model: the size of the gain and the passes that
    make it (the bookkeeping passes, which change only types or names, when no other does)."""
    from graphopt.report.console import size

    runs = [r for r in report["passes"] if r["changed"]]
    shrinking = [r for r in runs if r["op_delta"] or r["nodes"][0] != r["nodes"][1] or r["bytes"][0] != r["bytes"][1]]
    before, after = report["summary"]["before"], report["summary"]["after"]
    if not shrinking:
        names = ", ".join(dict.fromkeys(r["pass"] for r in runs)) or "the pipeline"
        return f"only types or names would change (by {names})"
    names = ", ".join(dict.fromkeys(r["pass"] for r in shrinking))
    return (
        f"nodes {before['nodes']} -> {after['nodes']},"
        f" weights {size(before['initializer_bytes'])} -> {size(after['initializer_bytes'])} (by {names})"
    )
