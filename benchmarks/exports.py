"""Node counts of graphopt's default pipeline against each peer on real PyTorch exports.

    python benchmarks/exports.py [--exports DIR] [--only NAME ...] [--tools T ...] [--refresh] [--check]

DIR (default ~/.cache/graphopt-exports, written by ../shared/exports/build.py) holds the
exports and their index.json. Every tool runs alone in a fresh process (benchmarks/tools.py)
on every export; the table gives graphopt's nodes, each peer's, the best portable peer's and
graphopt minus that best. Peers do not change between runs of graphopt, so their counts are
kept in ~/.cache/graphopt-bench/export-peers.json (per file, size and mtime) and rerun only
with ``--refresh``. With ``--check``, graphopt's output is also compared with the original in
onnxruntime (no graph optimizations on either side) at the index's two bindings, with the
inputs its feeds describe (token ids, padded attention masks, positions), independently of
graphopt's own check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import node_count
from tools import GRAPHOPT, PEERS, PORTABLE_PEERS, TOOLS, run_tool

EXPORTS = Path.home() / ".cache/graphopt-exports"
PEER_CACHE = Path.home() / ".cache/graphopt-bench/export-peers.json"
TIMEOUT_S = 900.0
# Worst relative L2 distance of any output for the check to pass (float32 reassociation only).
CHECK_RTOL = 1e-4
_DTYPES = {"int64": np.int64, "int32": np.int32, "float": np.float32, "float16": np.float16, "bool": np.bool_}


def index_feeds(entry: dict[str, Any], binding: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The inputs ``entry["feeds"][binding]`` describes (the kinds of ../shared/exports/build.py)."""
    rng = np.random.default_rng(seed)
    dtypes = {spec["name"]: _DTYPES[spec["dtype"]] for spec in entry["inputs"]}
    feeds = {}
    for name, spec in entry["feeds"][binding].items():
        shape, kind = spec["shape"], spec["kind"]
        if kind == "ids":
            array = rng.integers(3, spec["high"], shape)
        elif kind == "mask":
            array = np.ones(shape)
            pad = spec.get("pad", "")
            if pad and shape[0] > 1:
                width = int(pad[4:])
                if pad.startswith("tail"):
                    array[-1, -width:] = 0
                else:
                    array[-1, :width] = 0
        elif kind == "zeros":
            array = np.zeros(shape)
        elif kind == "positions":
            past = spec.get("past", 0)
            array = np.broadcast_to(np.arange(past, past + shape[1]), shape)
        else:
            array = rng.standard_normal(shape)
        feeds[name] = np.ascontiguousarray(array, dtype=dtypes[name])
    return feeds


def compare(entry: dict[str, Any], original: Path, optimized: Path) -> str:
    """ "passed" or the first output that differs, at each binding of the index."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    sessions = [
        ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in (original, optimized)
    ]
    for binding in range(len(entry["feeds"])):
        feeds = index_feeds(entry, binding)
        expected, actual = ({o.name: r for o, r in zip(s.get_outputs(), s.run(None, feeds))} for s in sessions)
        for name, want in expected.items():
            got = actual.get(name)
            if got is None or got.shape != want.shape:
                return f"binding {binding}: output {name} missing or of another shape"
            scale = float(np.linalg.norm(want.astype(np.float64))) or 1.0
            distance = float(np.linalg.norm(want.astype(np.float64) - got.astype(np.float64))) / scale
            if not distance <= CHECK_RTOL:
                return f"binding {binding}: output {name} relative L2 {distance:.2e}"
    return "passed"


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _count(tool: str, src: Path, work: Path) -> int | str:
    """The tool's node count on ``src`` (its output stays in ``work``), or its error."""
    out = work / f"{src.stem}.{tool}.onnx"
    run = run_tool(tool, src, out, timeout=TIMEOUT_S, check=False)
    if run.error is not None:
        return f"error: {run.error}"
    return node_count(out).total


def measure(
    exports: Path, names: list[str], tools: list[str], refresh: bool, check: bool, cache_path: Path = PEER_CACHE
) -> list[dict[str, Any]]:
    """One row per export: its original count and each tool's (peers' counts kept in ``cache_path``)."""
    index = json.loads((exports / "index.json").read_text())
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
            row |= {peer: cached[peer] for peer in PEERS if peer in cached}
            for tool in tools:
                if tool != GRAPHOPT and tool in cached and not refresh:
                    continue
                row[tool] = _count(tool, src, Path(tmp))
                out = Path(tmp) / f"{src.stem}.{tool}.onnx"
                if check and tool == GRAPHOPT and out.is_file():
                    row["check"] = compare(entry, src, out)
                for written in Path(tmp).iterdir():
                    written.unlink()
                if tool != GRAPHOPT:
                    cached[tool] = row[tool]
            cache[src.name] = cached
            cache_path.write_text(json.dumps(cache, indent=1))
            print(_line(row), flush=True)
            rows.append(row)
    return rows


def best_peer(row: dict[str, Any]) -> tuple[str, int] | None:
    """The portable peer with the fewest nodes on this row (the first in table order on a tie)."""
    counts = [(p, row[p]) for p in PORTABLE_PEERS if isinstance(row.get(p), int)]
    return min(counts, key=lambda item: item[1]) if counts else None


def _best(row: dict[str, Any]) -> int | None:
    best = best_peer(row)
    return best[1] if best else None


def _margin(row: dict[str, Any]) -> int | None:
    """graphopt's nodes minus the best portable peer's, when both are known."""
    best, ours = _best(row), row.get(GRAPHOPT)
    return ours - best if isinstance(ours, int) and best is not None else None


def _line(row: dict[str, Any]) -> str:
    cells = [f"{row['model']:<26}", f"{row['original']:>8}"]
    cells += [f"{row[t] if isinstance(row.get(t), int) else '-' if t not in row else 'err':>13}" for t in TOOLS]
    best, margin = _best(row), _margin(row)
    cells.append(f"{best if best is not None else '-':>6}")
    cells.append(f"{margin:>+6}" if margin is not None else f"{'-':>6}")
    if "check" in row:
        cells.append(f" {row['check']}")
    return " ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exports", type=Path, default=EXPORTS, help="the exports folder with its index.json")
    parser.add_argument("--only", nargs="*", default=[], help="model names or file stems to measure")
    parser.add_argument("--tools", nargs="*", default=TOOLS, help="tools to run (other peers: their cached counts)")
    parser.add_argument("--refresh", action="store_true", help="rerun the peers instead of reading their cache")
    parser.add_argument("--check", action="store_true", help="compare graphopt's output with the original")
    args = parser.parse_args()
    if not (args.exports / "index.json").is_file():
        print(f"no index.json in {args.exports}: build the exports first (../shared/exports/build.py)")
        return 2
    header = [f"{'model':<26}", f"{'original':>8}", *(f"{t:>13}" for t in TOOLS), f"{'best':>6}", f"{'ours-b':>6}"]
    print(" ".join(header), flush=True)
    rows = measure(args.exports, args.only, args.tools, args.refresh, args.check)
    errors = [(row["model"], t, row[t]) for row in rows for t in TOOLS if isinstance(row.get(t), str)]
    for model, tool, error in errors:
        print(f"{model} {tool}: {error}")
    above = [row["model"] for row in rows if _margin(row) is not None and _margin(row) > 0]
    print(f"graphopt above the best portable peer on {len(above)} of {len(rows)}: {', '.join(above) or 'none'}")
    failed = [row["model"] for row in rows if row.get("check", "passed") != "passed"]
    if args.check:
        print(f"numerics differ on {len(failed)} of {len(rows)}: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
