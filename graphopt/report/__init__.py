"""The run report: JSON on disk or stdout, a rich view on stderr (see report/console.py).

The report's model is in report/model.py, filled by the parts of a run; this module writes
it, validates it against schemas/report.schema.json,
strips the timings when two reports are compared for determinism, adds up the totals of a
batch and merges the reports of the shards of one CI matrix.
"""

from __future__ import annotations

import json
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

    Raises ValueError, naming the reports, for what a CI matrix gets wrong: reports of two
    kinds, shards of different matrices, a shard given twice, a shard missing, and a model
    in two reports (which would count it twice).
    """
    kinds = {"check_optimized" if "check_optimized" in r else "models" for _, r in reports}
    if len(kinds) != 1:
        raise ValueError("cannot merge run reports with --check-optimized reports")
    (kind,) = kinds
    shards = _check_shards(reports)
    rows: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for name, report in reports:
        for row in report.get(kind, [report]):
            path = row["path"] if kind == "check_optimized" else row["input"]["path"]
            if path in seen:
                raise ValueError(f"{path} is in both {seen[path]} and {name}: each model once")
            seen[path] = name
            rows.append(row)
    rows.sort(key=lambda row: row["path"] if kind == "check_optimized" else row["input"]["path"])
    # Every shard of a folder run notes the same skipped files.
    skipped = {s["path"]: s for _, r in reports for s in r.get("skipped", [])}
    return {
        "graphopt_version": version,
        "shards": shards,
        kind: rows,
        "skipped": [skipped[p] for p in sorted(skipped)],
        "totals": totals(rows),
    }


def _check_shards(reports: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The shards of ``reports`` (i/n), all n of one matrix, each once; reports of unsharded
    runs may come beside them."""
    by_shard: dict[str, str] = {}
    counts: set[int] = set()
    for name, report in reports:
        shard = report.get("shard")
        if not shard:
            continue
        if shard in by_shard:
            raise ValueError(f"shard {shard} is given twice ({by_shard[shard]} and {name})")
        by_shard[shard] = name
        counts.add(int(shard.partition("/")[2]))
    if len(counts) > 1:
        listed = ", ".join(f"{shard} ({name})" for shard, name in by_shard.items())
        raise ValueError(f"the shards come from matrices of different sizes: {listed}")
    if counts:
        (count,) = counts
        missing = [f"{i}/{count}" for i in range(1, count + 1) if f"{i}/{count}" not in by_shard]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ValueError(f"shard {', '.join(missing)} {verb} missing (merge every shard of the matrix)")
    return sorted(by_shard, key=lambda shard: int(shard.partition("/")[0]))
