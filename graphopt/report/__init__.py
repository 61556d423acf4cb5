"""The run report: JSON on disk or stdout, a rich view on stderr (see report/console.py).

The report's model is in report/model.py, filled by the parts of a run; this module writes
it, validates it against schemas/report.schema.json,
strips the timings when two reports are compared for determinism, adds up the totals of a
batch and merges the reports of the shards of one CI matrix.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphopt.files import atomic_write
from graphopt.report.model import totals

__all__ = ["dumps", "merge_reports", "totals", "without_timings", "write_report"]


def dumps(report: Any) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_report(report: Any, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(report).encode("utf-8")
    atomic_write(path, lambda out: out.write(text))


def without_timings(report: Any) -> Any:
    """The report with every timing removed: what must be identical between two runs."""
    if isinstance(report, dict):
        return {k: without_timings(v) for k, v in report.items() if k not in ("seconds",)}
    if isinstance(report, list):
        return [without_timings(v) for v in report]
    return report


def merge_reports(reports: Sequence[tuple[str, dict[str, Any]]], version: str) -> dict[str, Any]:
    """One report of several batch (or --check-optimized) reports, each given with its file
    name, rows sorted by path.

    Raises ValueError, naming the reports, for what a CI matrix gets wrong or a hand-made
    report claims: reports of two kinds, of another graphopt version than ``version``, of two
    pipelines, shards of different matrices, a shard given twice, a shard missing or out of
    range, a model in two reports (its paths compared normalized, ``./m.onnx`` is ``m.onnx``),
    which would count it twice, and a row whose status and exit code disagree.
    """
    kinds = {"check_optimized" if "check_optimized" in r else "models" for _, r in reports}
    if len(kinds) != 1:
        raise ValueError("cannot merge run reports with --check-optimized reports")
    (kind,) = kinds
    for name, report in reports:
        if report["graphopt_version"] != version:
            written = report["graphopt_version"]
            raise ValueError(
                f"{name} was written by graphopt {written!r}, this is {version}: merge with the same version"
            )
    shards = _check_shards(reports)
    rows: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    pipelines: dict[str, str] = {}
    for name, report in reports:
        for row in report.get(kind, [report]):
            path = row["path"] if kind == "check_optimized" else row["input"]["path"]
            disagreement = _outcome_disagreement(row)
            if disagreement is not None:
                raise ValueError(f"{name}: {path}: {disagreement}, as graphopt never reports")
            normalized = os.path.normpath(path)
            if normalized in seen:
                raise ValueError(f"{path} is in both {seen[normalized]} and {name}: each model once")
            seen[normalized] = name
            if "pipeline" in row:
                pipelines.setdefault(json.dumps(row["pipeline"], sort_keys=True), name)
            rows.append(row)
    if len(pipelines) > 1:
        first, second = list(pipelines.values())[:2]
        raise ValueError(f"{first} and {second} ran different pipelines: merge the shards of one run")
    rows.sort(key=lambda row: os.path.normpath(row["path"] if kind == "check_optimized" else row["input"]["path"]))
    # Every shard of a folder run notes the same skipped files.
    skipped = {s["path"]: s for _, r in reports for s in r.get("skipped", [])}
    return {
        "graphopt_version": version,
        "shards": shards,
        kind: rows,
        "skipped": [skipped[p] for p in sorted(skipped)],
        "totals": totals(rows),
    }


def _outcome_disagreement(row: dict[str, Any]) -> str | None:
    """How a row's outcome contradicts itself (a failure with exit code 0, an exit code no
    graphopt run has), or None; totals count failures by exit code, so the two must agree."""
    code = row.get("exit_code")
    if code is not None and code not in (0, 1, 2, 3):
        return f"exit code {code}"
    if "optimized" in row:  # a gate row has an exit code only when the model could not be read
        if code is not None and (code == 0 or row["optimized"]):
            return f"optimized {str(row['optimized']).lower()} with exit code {code}"
        return None
    numerics = (row.get("numerics") or {}).get("status")
    failed = row["status"] != "ok" or numerics == "failed"
    if failed != (code != 0):
        return (
            f"status {row['status']!r}"
            + (", numerics 'failed'" if numerics == "failed" else "")
            + f" with exit code {code}"
        )
    return None


# A shard as --shard writes it, i/n; 18 digits keep int() cheap and below any real matrix.
_SHARD = re.compile(r"([0-9]{1,18})/([0-9]{1,18})")


def _check_shards(reports: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The shards of ``reports`` (i/n with 1 <= i <= n), all n of one matrix, each once;
    reports of unsharded runs may come beside them."""
    by_shard: dict[str, str] = {}
    counts: set[int] = set()
    for name, report in reports:
        shard = report.get("shard")
        if not shard:
            continue
        found = _SHARD.fullmatch(shard)
        if found is None or not 1 <= int(found[1]) <= int(found[2]):
            raise ValueError(f"{name}: shard {shard!r} is not i/n with 1 <= i <= n")
        shard = f"{int(found[1])}/{int(found[2])}"  # 01/3 is 1/3
        if shard in by_shard:
            raise ValueError(f"shard {shard} is given twice ({by_shard[shard]} and {name})")
        by_shard[shard] = name
        counts.add(int(found[2]))
    if len(counts) > 1:
        listed = ", ".join(f"{shard} ({name})" for shard, name in by_shard.items())
        raise ValueError(f"the shards come from matrices of different sizes: {listed}")
    if counts:
        (count,) = counts
        if len(by_shard) < count:  # named without building the list: a report may claim 1/99999999999
            given = {int(shard.partition("/")[0]) for shard in by_shard}
            first = list(itertools.islice((i for i in range(1, count + 1) if i not in given), _MISSING_NAMED))
            missing = count - len(by_shard)
            listed = ", ".join(f"{i}/{count}" for i in first) + (
                f" and {missing - len(first)} more" if missing > len(first) else ""
            )
            verb = "is" if missing == 1 else "are"
            raise ValueError(f"shard {listed} {verb} missing (merge every shard of the matrix)")
    return sorted(by_shard, key=lambda shard: int(shard.partition("/")[0]))


# The missing shards a refusal names.
_MISSING_NAMED = 5
