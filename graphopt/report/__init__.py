"""The run report: JSON on disk or stdout, a rich view on stderr (see report/console.py).

The report is assembled from what the other parts hand over (pass runs, model stats,
numerics); this module only writes it, validates it against schemas/report.schema.json,
strips the timings when two reports are compared for determinism, adds up the totals of a
batch and merges the reports of the shards of one CI matrix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graphopt.files import temporary_file

__all__ = ["dumps", "merge_reports", "totals", "without_timings", "write_report"]


def dumps(report: Any) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_report(report: Any, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = temporary_file(path.parent, path.name)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(dumps(report))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def without_timings(report: Any) -> Any:
    """The report with every timing removed: what must be identical between two runs."""
    if isinstance(report, dict):
        return {k: without_timings(v) for k, v in report.items() if k not in ("seconds",)}
    if isinstance(report, list):
        return [without_timings(v) for v in report]
    return report


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What a batch amounts to: models, failures (exit code other than 0), and the nodes and
    weight bytes before -> after of the models that were optimized (error rows have none)."""
    summaries = [row["summary"] for row in rows if "summary" in row]
    return {
        "models": len(rows),
        "failures": sum(1 for row in rows if _exit_code(row) != 0),
        "nodes": [sum(s[side]["nodes"] for s in summaries) for side in ("before", "after")],
        "initializer_bytes": [sum(s[side]["initializer_bytes"] for s in summaries) for side in ("before", "after")],
    }


def _exit_code(row: dict[str, Any]) -> int:
    if "optimized" in row:  # a --check-optimized row
        return int(row.get("exit_code", 0 if row["optimized"] else 1))
    return int(row.get("exit_code", 0))


def merge_reports(reports: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """One report of several batch (or --check-optimized) reports, rows sorted by path.

    Raises ValueError when the reports are not of one kind.
    """
    kinds = {"check_optimized" if "check_optimized" in r else "models" for r in reports}
    if len(kinds) != 1:
        raise ValueError("cannot merge run reports with --check-optimized reports")
    (kind,) = kinds
    rows = [row for report in reports for row in report.get(kind, [report])]
    rows.sort(key=lambda row: row["path"] if kind == "check_optimized" else row["input"]["path"])
    skipped = sorted((s for r in reports for s in r.get("skipped", [])), key=lambda s: s["path"])
    shards = sorted({r["shard"] for r in reports if r.get("shard")})
    return {"graphopt_version": version, "shards": shards, kind: rows, "skipped": skipped, "totals": totals(rows)}
