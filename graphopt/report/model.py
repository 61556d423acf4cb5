"""The report's model: what a run of one model, of many, and of the CI gate hands over.

Each part of a run fills its own fields (the pipeline: :class:`PipelineReport`; the file
run: the rest of :class:`ModelReport`; a folder run: :class:`FolderReport`), and
``to_json()`` gives the JSON form that is written, printed, merged and validated against
schemas/report.schema.json (the console views read that form too, as merge reads it from
files). Key order is part of the form: every report begins with ``graphopt_version``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.version import __version__

__all__ = ["FolderReport", "GateReport", "ModelReport", "PipelineReport", "error_row", "totals"]

Json = dict[str, Any]


@dataclass
class PipelineReport:
    """What the pipeline did to one model: its steps, each pass execution, the passes that
    failed (rolled back), the model's stats before and after, and the seconds it took."""

    pipeline: list[Json]
    passes: list[Json]
    failures: list[Json]
    summary: Json
    seconds: dict[str, float]
    # What the runtime guard found (graphopt.runtime.guard), when it ran.
    runtime_guard: Json | None = None
    # What --tune decided (graphopt.runtime.tune), when it ran.
    tune: Json | None = None

    def to_json(self) -> Json:
        found = {
            "pipeline": self.pipeline,
            "passes": self.passes,
            "failures": self.failures,
            "summary": self.summary,
            "seconds": dict(self.seconds),
        }
        if self.runtime_guard is not None:
            found["runtime_guard"] = self.runtime_guard
        if self.tune is not None:
            found["tune"] = self.tune
        return found


@dataclass
class ModelReport:
    """One model's file-to-file run: the pipeline's report, the input and output files
    (path, sha256, bytes; output None when nothing was written), the numerics check, the
    blame of a failed check, and the outcome. ``seconds`` gains load, save, check, total."""

    run: PipelineReport
    # What loading the input warned about (also on stderr): ops kept opaque, Q/DQ scales that lose their values.
    warnings: list[str] = field(default_factory=list)
    input: Json | None = None
    numerics: Json | None = None
    blame: Json | None = None
    # The fusions through Q/DQ a first attempt made and the check refused: the output is the
    # pipeline's without them (how many were withdrawn, the check's reason, the attempt's seconds).
    through_qdq: Json | None = None
    # --cache: whether the result came from the cache ("hit") or was put there ("stored"), and its key.
    cache: Json | None = None
    output: Json | None = None
    status: str = "ok"
    exit_code: int = 0

    @classmethod
    def from_json(cls, found: Json) -> ModelReport:
        """The report :meth:`to_json` gave (a stored result's, --cache)."""
        run = PipelineReport(**{name: found[name] for name in ("pipeline", "passes", "failures", "summary", "seconds")})
        kept = ("warnings", "input", "numerics", "blame", "through_qdq", "cache", "output", "status", "exit_code")
        return cls(run, **{name: found[name] for name in kept if name in found})

    def to_json(self) -> Json:
        found: Json = {"graphopt_version": __version__, "input": self.input, "warnings": self.warnings}
        found |= self.run.to_json()
        found["numerics"] = self.numerics
        if self.through_qdq is not None:
            found["through_qdq"] = self.through_qdq
        if self.blame is not None:
            found["blame"] = self.blame
        if self.cache is not None:
            found["cache"] = self.cache
        return found | {"output": self.output, "status": self.status, "exit_code": self.exit_code}


def error_row(source: Path, error: str, exit_code: int) -> Json:
    """The row of a model of a batch whose run ended in an error."""
    return {"input": {"path": str(source)}, "error": error, "status": "error", "exit_code": exit_code}


@dataclass
class FolderReport:
    """A run of many models: the shard of a CI matrix (i/n), the files left out (path and
    reason), one row per model (:class:`ModelReport` JSON, or :func:`error_row`), and totals."""

    shard: str | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    models: list[Json] = field(default_factory=list)

    def to_json(self) -> Json:
        return {
            "graphopt_version": __version__,
            "shard": self.shard,
            "skipped": self.skipped,
            "models": self.models,
            "totals": totals(self.models),
        }


@dataclass
class GateReport:
    """The CI gate (``--check-optimized``): a row per model (path, optimized, reason, and
    exit_code for a model that could not be read). ``batch`` adds the shard, the skipped
    files and the totals, as a folder run's report has them."""

    check_optimized: list[Json] = field(default_factory=list)
    batch: bool = True
    shard: str | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> Json:
        found: Json = {"graphopt_version": __version__}
        if self.batch:
            found |= {"shard": self.shard, "skipped": self.skipped}
        found["check_optimized"] = self.check_optimized
        if self.batch:
            found["totals"] = totals(self.check_optimized)
        return found

    @property
    def exit_code(self) -> int:
        return max((_exit_code(row) for row in self.check_optimized), default=0)


def totals(rows: list[Json]) -> Json:
    """What a batch amounts to: models, failures (exit code other than 0), models the numerics
    check could not verify (not_checked; a run's rows only, the gate checks no numerics), the
    models whose result came from the cache (cached, with --cache), and
    the nodes and weight bytes before -> after of the models that were optimized (error rows
    have none)."""
    summaries = [row["summary"] for row in rows if "summary" in row]
    counted: Json = {
        "models": len(rows),
        "failures": sum(1 for row in rows if _exit_code(row) != 0),
    }
    if not any("optimized" in row for row in rows):
        counted["not_checked"] = sum(1 for row in rows if row.get("numerics", {}).get("status") == "not checked")
    if any("cache" in row for row in rows):
        counted["cached"] = sum(1 for row in rows if row.get("cache", {}).get("status") == "hit")
    return counted | {
        "nodes": [sum(s[side]["nodes"] for s in summaries) for side in ("before", "after")],
        "initializer_bytes": [sum(s[side]["initializer_bytes"] for s in summaries) for side in ("before", "after")],
    }


def _exit_code(row: Json) -> int:
    if "optimized" in row:  # a --check-optimized row
        return int(row.get("exit_code", 0 if row["optimized"] else 1))
    return int(row.get("exit_code", 0))
