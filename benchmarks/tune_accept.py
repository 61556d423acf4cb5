"""Acceptance runs of ``--tune`` (issue 37): the tuned output against the original and the peers.

    python benchmarks/tune_accept.py --level all                 # every export and corpus model
    python benchmarks/tune_accept.py --level disable --models bert_ts,resnet50 --json-out x.json

Per model and per target (the default pipeline and ``--target ort``), graphopt writes its
output twice, without and with ``--tune --tune-level LEVEL`` (1 thread, no check). The peers
write theirs, each in its own process (tools.py, the bench extras): at ``--level all``
onnxruntime's extended level, onnxscript's ``optimize_for_ort`` and onnxruntime's
transformers optimizer (the closest model type, MODEL_TYPES); at ``--level disable`` the
portable peers. Then one child times the original (twice: the noise floor), every graphopt
output and every peer output, interleaved in shuffled rounds on the check's inputs, with
tune.py's own timing (``time_models``); each figure is the median of per-round ratios with
half their interquartile range (``paired_ratio``). The load average is recorded per model.

The bar: tuned / best of (original, the peers) <= 1.02, and the untuned output not slower
than the original beyond the noise floor. Results are written per model as they come, so a
run stopped at ``--deadline`` keeps what it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report
from tools import ORT_PEERS, PORTABLE_PEERS, run_tool

from graphopt.runtime.tune import paired_ratio, time_models

EXPORTS = Path("/work/exports")
CORPUS = Path("/work/corpus")
BAR = 1.02
TARGETS = {"default": [], "ort": ["--target", "ort"]}
# onnxruntime's transformers optimizer type per model name prefix: the closest it has
# (decoders without their own type as gpt2; image models without attention as unet, whose
# fusions are Conv ones; models it has no type for as bert, its generic transformer).
MODEL_TYPES = {
    "bert": "bert",
    "gpt2": "gpt2",
    "llama": "gpt2",
    "vit": "vit",
    "t5": "t5",
    "whisper": "bart",
    "convnext": "unet",
    "resnet": "unet",
    "efficientnet": "unet",
    "inception": "unet",
    "tf_style": "unet",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", choices=["all", "disable"], default="all")
    ap.add_argument("--exports", type=Path, default=EXPORTS)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--models", default="", help="comma list of model names (file stems)")
    ap.add_argument("--targets", default="default,ort")
    ap.add_argument("--tune-budget", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of interleaved timing per model")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one tool may take on one model")
    ap.add_argument(
        "--flag",
        action="append",
        default=[],
        help="a graphopt option for both runs, in the --flag=--opt form (repeatable): --flag=--defer-growth",
    )
    ap.add_argument("--deadline", default="", help="HH:MM UTC: start no model after it")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/graphopt-tune-accept"))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="print the Markdown table of these results")
    args = ap.parse_args(argv)
    if args.json_out is None:
        args.json_out = report.ROOT / "bench-results" / f"tune_accept_{args.level}.json"
    return args


def models(args: argparse.Namespace) -> list[Path]:
    found = sorted(args.exports.glob("*.onnx")) + sorted(args.corpus.glob("*.onnx"))
    wanted = [m for m in args.models.split(",") if m]
    if wanted:
        found = [p for p in found if p.stem in wanted]
    return sorted(found, key=lambda p: p.stat().st_size)  # the small ones first: most models by the deadline


def model_type(name: str) -> str:
    return next((t for prefix, t in MODEL_TYPES.items() if name.startswith(prefix)), "bert")


def graphopt_run(src: Path, out: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    """graphopt run SRC -o OUT EXTRA in a fresh process: its report (or the error)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report_path = out.with_suffix(".json")
    cmd = [str(Path(sys.executable).parent / "graphopt"), "run", str(src), "-o", str(out), "--no-check"]
    cmd += ["--report", str(report_path), *extra]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_one_thread())
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    found = json.loads(report_path.read_text())
    entry = found["models"][0] if "models" in found else found
    return {"seconds": time.perf_counter() - start, "tune": entry.get("tune"), "output": str(out)}


def _one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def loads(path: Path, level: str) -> str | None:
    """Why onnxruntime cannot load and run ``path`` on the check's inputs at ``level`` (None: it can)."""
    result = time_models([path], level, 1, 0.0)
    return result if isinstance(result, str) else None


def measure_model(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    name = src.stem
    folder = args.work_dir / name
    entry: dict[str, Any] = {"model": name, "level": args.level, "flags": args.flag, "load_before": os.getloadavg()[0]}
    outputs: dict[str, Path] = {}
    for target in [t for t in args.targets.split(",") if t]:
        options = TARGETS[target] + args.flag
        untuned = graphopt_run(src, folder / f"graphopt_{target}.onnx", options, args.timeout)
        tuning = ["--tune", "--tune-level", args.level, "--tune-threads", "1", "--tune-budget", str(args.tune_budget)]
        tuned = graphopt_run(src, folder / f"graphopt_{target}_tuned_{args.level}.onnx", options + tuning, args.timeout)
        entry[target] = {"untuned": untuned, "tuned": tuned}
        for key, run in (("untuned", untuned), ("tuned", tuned)):
            if "output" in run:
                outputs[f"{target}_{key}"] = Path(run["output"])
    peers = ["ort_extended", *ORT_PEERS] if args.level == "all" else PORTABLE_PEERS
    entry["peers"] = {}
    for peer in peers:
        out = folder / f"{peer}.onnx"
        done = run_tool(peer, src, out, timeout=args.timeout, check=False, model_type=model_type(name))
        why = done.error or loads(out, args.level)
        entry["peers"][peer] = {"error": why} if why else {"seconds": done.seconds, "notes": done.notes}
        if not why:
            outputs[peer] = out
    # Outputs with the same bytes (--tune kept the untuned output) are timed once.
    unique: dict[str, Path] = {}
    timed_as = {
        key: unique.setdefault(hashlib.sha256(path.read_bytes()).hexdigest(), path) for key, path in outputs.items()
    }
    paths = list(unique.values())
    times = time_models([src, src, *paths], args.level, 1, args.seconds)
    entry["load_after"] = os.getloadavg()[0]
    if isinstance(times, str):
        entry["error"] = times
        return entry
    entry["rounds"] = len(times[0])
    noise, noise_spread = paired_ratio(times[1], times[0])
    entry["noise"] = {"ratio": noise, "spread": noise_spread}
    # Every figure is against the original (its first session): x / original per round.
    entry["ratios"] = {key: paired_ratio(times[2 + paths.index(path)], times[0]) for key, path in timed_as.items()}
    return entry


def summary(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target: tune time, tuned / original, the best peer and tuned / best (its spread)."""
    rows = []
    ratios = entry.get("ratios", {})
    floor = max(0.005, abs(entry.get("noise", {}).get("ratio", 1.0) - 1) + entry.get("noise", {}).get("spread", 0.0))
    for target in ("default", "ort"):
        if target not in entry:
            continue
        tuned = ratios.get(f"{target}_tuned")
        untuned = ratios.get(f"{target}_untuned")
        peers = {k: v for k, v in ratios.items() if k in entry.get("peers", {})}
        best_name, best = min([("original", (1.0, 0.0)), *peers.items()], key=lambda kv: kv[1][0])
        tune = (entry[target]["tuned"].get("tune") or {}) if isinstance(entry[target]["tuned"], dict) else {}
        row: dict[str, Any] = {
            "model": entry["model"],
            "target": target,
            "level": entry["level"],
            "tune_seconds": tune.get("seconds"),
            "tune_status": tune.get("status"),
            "tuned_vs_original": None if tuned is None else round(tuned[0], 4),
            "untuned_vs_original": None if untuned is None else round(untuned[0], 4),
            "best_peer": best_name,
            "best_vs_original": round(best[0], 4),
            "noise": round(floor, 4),
            "load": entry.get("load_before"),
            "rounds": entry.get("rounds"),
        }
        if tuned is not None:
            row["tuned_vs_best"] = round(tuned[0] / best[0], 4)
            row["spread"] = round(tuned[1] + best[1], 4)
            row["meets_bar"] = tuned[0] / best[0] <= BAR
        if untuned is not None:
            row["untuned_slower"] = untuned[0] > 1 + floor + untuned[1]
        rows.append(row)
    return rows


def table(files: list[Path]) -> str:
    """The Markdown table of the results in ``files`` (one row per model, target and level)."""
    lines = [
        "| model | target | level | tune s | tuned / original | untuned / original | best peer | tuned / best "
        "| spread | noise | rounds | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for file in files:
        for entry in json.loads(file.read_text()):
            for row in summary(entry):
                cells = [row["model"], row["target"], row["level"], _cell(row["tune_seconds"], 1)]
                cells += [_cell(row["tuned_vs_original"]), _cell(row["untuned_vs_original"]), row["best_peer"]]
                mark = "" if row.get("meets_bar", True) else " **miss**"
                cells += [_cell(row.get("tuned_vs_best")) + mark, _cell(row.get("spread")), _cell(row["noise"])]
                cells += [str(row.get("rounds", "—")), _cell(row["load"], 1)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    deadline = None
    if args.deadline:
        hour, minute = (int(x) for x in args.deadline.split(":"))
        deadline = datetime.now(UTC).replace(hour=hour, minute=minute, second=0)
    results: list[dict[str, Any]] = []
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    for src in models(args):
        if deadline is not None and datetime.now(UTC) > deadline:
            print(f"{src.stem}: not started, past the deadline", flush=True)
            continue
        start = time.perf_counter()
        entry = measure_model(src, args)
        entry["seconds"] = time.perf_counter() - start
        entry["summary"] = summary(entry)
        results.append(entry)
        args.json_out.write_text(json.dumps(results, indent=1, default=str))
        for row in entry["summary"]:
            print(json.dumps(row), flush=True)
        if "error" in entry:
            print(f"{src.stem}: {entry['error']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
