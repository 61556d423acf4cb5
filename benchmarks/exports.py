"""Node counts of graphopt's default pipeline against each peer on real PyTorch exports.

    python benchmarks/exports.py [--exports DIR] [--only NAME ...] [--tools T ...] [--refresh]

DIR (default ~/.cache/graphopt-exports, written by ../shared/exports/build.py) holds the
exports and their index.json. Every tool runs alone in a fresh process (benchmarks/tools.py)
on every export; the table gives graphopt's nodes, each peer's, the best portable peer's and
graphopt minus that best. Peers do not change between runs of graphopt, so their counts are
kept in ~/.cache/graphopt-bench/export-peers.json (per file, size and mtime) and rerun only
with ``--refresh``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import node_count
from tools import GRAPHOPT, PEERS, PORTABLE_PEERS, run_tool

EXPORTS = Path.home() / ".cache/graphopt-exports"
PEER_CACHE = Path.home() / ".cache/graphopt-bench/export-peers.json"
TIMEOUT_S = 900.0


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _count(tool: str, src: Path, work: Path) -> int | str:
    """The tool's node count on ``src``, or its error."""
    out = work / f"{src.stem}.{tool}.onnx"
    run = run_tool(tool, src, out, timeout=TIMEOUT_S, check=False)
    if run.error is not None:
        return f"error: {run.error}"
    return node_count(out).total


def measure(exports: Path, names: list[str], tools: list[str], refresh: bool) -> list[dict[str, Any]]:
    """One row per export: its original count and each tool's."""
    index = json.loads((exports / "index.json").read_text())
    cache_path = PEER_CACHE
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache: dict[str, Any] = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in index["models"]:
            src = exports / entry["file"]
            if names and entry["name"] not in names and src.stem not in names:
                continue
            row: dict[str, Any] = {"model": src.stem, "original": node_count(src).total}
            cached = cache.get(src.name, {})
            if cached.get("stamp") != _stamp(src):
                cached = {"stamp": _stamp(src)}
            for tool in tools:
                if tool != GRAPHOPT and tool in cached and not refresh:
                    row[tool] = cached[tool]
                    continue
                row[tool] = _count(tool, src, Path(tmp))
                (Path(tmp) / f"{src.stem}.{tool}.onnx").unlink(missing_ok=True)
                if tool != GRAPHOPT:
                    cached[tool] = row[tool]
            cache[src.name] = cached
            cache_path.write_text(json.dumps(cache, indent=1))
            print(_line(row, tools), flush=True)
            rows.append(row)
    return rows


def _best(row: dict[str, Any]) -> int | None:
    counts = [row[p] for p in PORTABLE_PEERS if isinstance(row.get(p), int)]
    return min(counts) if counts else None


def _line(row: dict[str, Any], tools: list[str]) -> str:
    cells = [f"{row['model']:<26}", f"{row['original']:>8}"]
    cells += [f"{row[t] if isinstance(row.get(t), int) else 'err':>13}" for t in tools]
    best, ours = _best(row), row.get(GRAPHOPT)
    cells.append(f"{best if best is not None else '-':>6}")
    cells.append(f"{ours - best:>+6}" if isinstance(ours, int) and best is not None else f"{'-':>6}")
    return " ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exports", type=Path, default=EXPORTS, help="the exports folder with its index.json")
    parser.add_argument("--only", nargs="*", default=[], help="model names or file stems to measure")
    parser.add_argument("--tools", nargs="*", default=[GRAPHOPT, *PEERS], help="tools to run")
    parser.add_argument("--refresh", action="store_true", help="rerun the peers instead of reading their cache")
    args = parser.parse_args()
    if not (args.exports / "index.json").is_file():
        print(f"no index.json in {args.exports}: build the exports first (../shared/exports/build.py)")
        return 2
    header = [f"{'model':<26}", f"{'original':>8}", *(f"{t:>13}" for t in args.tools), f"{'best':>6}", f"{'ours-b':>6}"]
    print(" ".join(header), flush=True)
    rows = measure(args.exports, args.only, args.tools, args.refresh)
    errors = [(row["model"], t, row[t]) for row in rows for t in args.tools if isinstance(row.get(t), str)]
    for model, tool, error in errors:
        print(f"{model} {tool}: {error}")
    above = [row["model"] for row in rows if isinstance(row.get(GRAPHOPT), int) and (_best(row) or 0) < row[GRAPHOPT]]
    print(f"graphopt above the best portable peer on {len(above)} of {len(rows)}: {', '.join(above) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
